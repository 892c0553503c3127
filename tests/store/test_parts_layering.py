"""The store's parts know nothing of the Store: only gdskv/store/store.py composes them.

A part is given the lock, the tiers below it and a narrow host interface; it never imports
the store module nor reaches into a store object (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

import gdskv.store

STORE_PACKAGE = Path(gdskv.store.__file__).parent
PARTS = sorted(p for p in STORE_PACKAGE.glob("*.py") if p.name not in ("__init__.py", "store.py"))


@pytest.mark.parametrize("path", PARTS, ids=[p.name for p in PARTS])
def test_a_part_neither_imports_the_store_nor_reaches_into_one(path):
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {"gdskv.store.store", "gdskv.store.Store", "gdskv.Store"} & imported, path.name
    reach = [
        node.attr for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
        and node.value.attr in ("store", "_store") and node.attr.startswith("_")
    ]
    assert reach == [], f"{path.name} reads private attributes of a store: {reach}"


def test_the_parts_are_what_the_architecture_page_lists():
    assert {p.stem for p in PARTS} >= {"offloader", "hbm_front", "reads", "dram_room", "promoter", "activity", "listeners"}
