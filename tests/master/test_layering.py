"""Import rules and packaging of the master: it never imports the store side, ``import gdskv``
stays free of gRPC, and the generated code matches the runtime versions pyproject allows."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("gdskv.store", "gdskv.tiers", "gdskv.gds", "gdskv.node", "gdskv.client", "gdskv.transport")


def imported_modules(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.mark.parametrize("path", sorted((ROOT / "gdskv" / "master").rglob("*.py")), ids=lambda p: p.name)
def test_master_modules_never_import_the_store_side(path):
    bad = [m for m in imported_modules(path) if m.startswith(FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}"


def test_import_gdskv_does_not_import_grpc():
    code = "import gdskv, sys; print('grpc' in sys.modules, 'gdskv.client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def _lower_bound(requirement: str) -> tuple:
    return tuple(int(x) for x in re.search(r">=([0-9.]+)", requirement).group(1).split("."))


def test_generated_code_matches_the_pinned_runtime_versions():
    pyproject = (ROOT / "pyproject.toml").read_text()
    grpc_req = re.search(r'"(grpcio>=[^"]+)"', pyproject).group(1)
    proto_req = re.search(r'"(protobuf>=[^"]+)"', pyproject).group(1)
    proto_dir = ROOT / "gdskv" / "master" / "_proto"
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (proto_dir / "master_pb2_grpc.py").read_text()).group(1)
    pb_gen = re.search(r"Protobuf Python Version: ([0-9.]+)", (proto_dir / "master_pb2.py").read_text()).group(1)
    assert _lower_bound(grpc_req) == tuple(int(x) for x in grpc_gen.split(".")), (grpc_req, grpc_gen)
    assert _lower_bound(proto_req) == tuple(int(x) for x in pb_gen.split(".")), (proto_req, pb_gen)
    from gdskv.master._proto import master_pb2, master_pb2_grpc  # loads under the installed runtime

    assert master_pb2.DESCRIPTOR.package == "gdskv.master.v1"
    assert hasattr(master_pb2_grpc, "MasterStub")
