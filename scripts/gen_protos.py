#!/usr/bin/env python3
"""Regenerate the gRPC/protobuf code of the master from ``proto/*.proto``.

Usage (from the repository root, with grpcio-tools installed)::

    pip install 'grpcio-tools==1.75.1'   # the version the committed code was made with
    python scripts/gen_protos.py

Writes ``gdskv/master/_proto/<name>_pb2.py``, ``_pb2.pyi`` and ``_pb2_grpc.py``, and rewrites
the generated top-level imports (``import master_pb2``) into package imports.

The generated code checks the runtime versions it is loaded with: ``<name>_pb2.py`` needs a
protobuf runtime at least as new as the protoc bundled with grpcio-tools, and
``_pb2_grpc.py`` needs grpcio at least as new as grpcio-tools. ``pyproject.toml`` pins the
``grpcio`` and ``protobuf`` lower bounds to match; bump them together with the tools version.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "gdskv" / "master" / "_proto"
PACKAGE = "gdskv.master._proto"


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("gen_protos: install grpcio-tools first (pip install grpcio-tools)", file=sys.stderr)
        return 2
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        print(f"gen_protos: no .proto files in {PROTO_DIR}", file=sys.stderr)
        return 2
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        *(str(p) for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"gen_protos: protoc failed ({rc})", file=sys.stderr)
        return rc
    names = [p.stem for p in protos]
    pattern = re.compile(r"^import (%s)_pb2 as " % "|".join(map(re.escape, names)), re.MULTILINE)
    for path in OUT_DIR.glob("*_pb2*.py*"):
        text = path.read_text()
        fixed = pattern.sub(rf"from {PACKAGE} import \1_pb2 as ", text)
        if fixed != text:
            path.write_text(fixed)
    init = OUT_DIR / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC/protobuf code (scripts/gen_protos.py). Do not edit."""\n')
    for path in sorted(OUT_DIR.iterdir()):
        print(f"gen_protos: wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
