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
    assert {p.stem for p in PARTS} >= {"offloader", "hbm_front", "reads", "writes", "dram_room", "promoter", "activity", "listeners"}


#: The parts store.py constructs (DramTier and the null parts included).
CONSTRUCTED = {"Offloader", "Promoter", "HbmFront", "DramRoom", "TierReader", "Writer", "Activity", "DramTier", "Listeners"}


def _is_whole_config(node: ast.AST) -> bool:
    """``config`` or ``self.config``: the store's StoreConfig itself (not one of its fields)."""
    if isinstance(node, ast.Name):
        return node.id == "config"
    return isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) and node.value.id == "self"


def test_the_store_hands_no_part_its_whole_config():
    """Each part gets its component's config (the offloader: ``config.offloader``) or the
    values it needs, never the StoreConfig (docs/architecture.md)."""
    tree = ast.parse((STORE_PACKAGE / "store.py").read_text())
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CONSTRUCTED
    ]
    assert {"Offloader", "Promoter", "HbmFront", "DramRoom", "Writer"} <= {c.func.id for c in calls}  # the check sees them
    given = sorted(
        c.func.id for c in calls if any(_is_whole_config(a) for a in [*c.args, *(k.value for k in c.keywords)])
    )
    assert given == [], f"parts given the whole StoreConfig: {given}"
