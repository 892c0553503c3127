"""The old module paths of the engine adapters: engine configs name ``gdskv.engine.vllm`` and
``gdskv.engine.sglang``, which re-export the public names of :mod:`gdskv.connectors`.

Here neither engine is installed, so a fresh interpreter imports both paths with stand-ins
for the few engine names the adapters subclass at import time; the tests under
``tests/connectors/`` check the same against the real engines.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALIASES = {"gdskv.engine.vllm": "gdskv.connectors.vllm", "gdskv.engine.sglang": "gdskv.connectors.sglang"}

#: Stand-ins for the engine modules the adapters import, installed before either is imported.
STAND_INS = """
import enum, sys, types

def module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m

class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1

module("vllm")
module("vllm.distributed.kv_transfer.kv_connector.v1.base", KVConnectorBase_V1=type("KVConnectorBase_V1", (), {}),
       KVConnectorMetadata=type("KVConnectorMetadata", (), {}), KVConnectorRole=KVConnectorRole)
module("sglang")
module("sglang.srt.mem_cache.hicache_storage", HiCacheStorage=type("HiCacheStorage", (), {}),
       HiCacheStorageConfig=type("HiCacheStorageConfig", (), {}))
"""


def _all_of(path: Path) -> list:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no __all__")


def _path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


@pytest.mark.parametrize("old,new", sorted(ALIASES.items()))
def test_the_old_path_only_re_exports_the_new_module(old, new):
    tree = ast.parse(_path(old).read_text())
    doc = ast.get_docstring(tree)
    assert doc and new in doc, f"{old}'s docstring should name its new home {new}"
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    imports = [n for n in body if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in imports] == [new]
    assert sorted(a.name for a in imports[0].names) == sorted(_all_of(_path(new)))
    assert all(isinstance(n, (ast.ImportFrom, ast.Assign)) for n in body), f"{old} defines more than a re-export"
    assert _all_of(_path(old)) == _all_of(_path(new))


def test_importing_the_old_paths_gives_the_same_objects():
    code = STAND_INS + (
        "import importlib, json\n"
        f"pairs = {sorted(ALIASES.items())!r}\n"
        "out = {}\n"
        "for old, new in pairs:\n"
        "    o, n = importlib.import_module(old), importlib.import_module(new)\n"
        "    out[old] = {name: getattr(o, name) is getattr(n, name) for name in n.__all__}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same = json.loads(proc.stdout)
    assert same == {old: {name: True for name in _all_of(_path(new))} for old, new in ALIASES.items()}
