"""Every program in examples/ runs and reports success."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def test_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"quickstart", "kv_blocks_numpy", "watermark_offload"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_main_succeeds(path, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out.strip()
    assert (tmp_path / "store" / "gdskv.json").exists()  # it used the directory it was given
