"""The options the engine connectors read, and the per-process store registry."""

from __future__ import annotations

import logging

import pytest

from gdskv.config import GiB, MiB
from gdskv.engine.attach import AttachConfig, acquire_store, release_store
from gdskv.errors import ConfigError


def test_options_from_an_extra_config_mapping(tmp_path):
    cfg = AttachConfig.from_mapping(
        {"path": str(tmp_path), "dram": "2GiB", "ssd": 0, "model_id": "m@1", "staging": "8MiB", "store_options": {"offload": "watermark"}}
    )
    assert (cfg.dram_bytes, cfg.ssd_bytes, cfg.staging_bytes) == (2 * GiB, 0, 8 * MiB)
    assert cfg.model_id == "m@1" and cfg.store_options == {"offload": "watermark"}
    assert AttachConfig.from_mapping({"path": "x", "backend_name": "gdskv"}, ignore=("backend_name",)).path == "x"


@pytest.mark.parametrize(
    "mapping, match",
    [
        (None, "path"),
        ({}, "path"),
        ({"path": "x", "colour": "red"}, "unknown gdskv connector option"),
        ({"path": "x", "dram": "lots"}, "dram"),
        ({"path": "x", "staging": 0}, "staging"),
        ({"path": "x", "model_id": ""}, "model_id"),
        ({"path": "x", "store_options": 3}, "store_options"),
        ("path=x", "mapping"),
    ],
)
def test_bad_options_are_config_errors(mapping, match):
    with pytest.raises(ConfigError, match=match):
        AttachConfig.from_mapping(mapping)


def test_one_store_per_directory_and_process(tmp_path):
    cfg = AttachConfig(path=str(tmp_path / "kv"), dram_bytes=4 * MiB, ssd_bytes=16 * MiB)
    a = acquire_store(cfg)
    b = acquire_store(AttachConfig(path=str(tmp_path / "kv" / "."), dram_bytes=4 * MiB, ssd_bytes=16 * MiB))
    assert a is b
    release_store(a)
    a.put("k", b"v")  # still open: one user left
    release_store(b)
    c = acquire_store(cfg)  # reopened after the last user closed it
    assert c is not a and c.get("k") == bytearray(b"v")
    release_store(c)
    release_store(None)


def test_a_store_that_cannot_open_is_none_and_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    caplog.set_level(logging.WARNING)
    assert acquire_store(AttachConfig(path=str(blocker / "kv"))) is None
    assert "serves without it" in caplog.text
