"""The options the engine connectors read, and the per-process registry of embedded
stores (the other modes, with real node processes: test_attach_modes.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

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
    assert cfg.mode == "auto" and cfg.socket == str(tmp_path / "node.sock") and cfg.master is None
    node = AttachConfig.from_mapping({"path": "kv", "mode": "node", "socket": "/tmp/n.sock"})
    assert (node.mode, node.socket) == ("node", "/tmp/n.sock")
    cluster = AttachConfig.from_mapping({"path": str(tmp_path), "mode": "cluster", "master": "10.0.0.1:50051"})
    assert (cluster.mode, cluster.master) == ("cluster", "10.0.0.1:50051")
    assert AttachConfig.from_mapping({"path": "kv", "mode": "embedded"}).socket is None


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
        ({"path": "x", "store_options": {"colour": "red"}}, "unknown store option"),
        ({"path": "x", "store_options": {"eviction": ["lru"]}}, "numbers, strings or booleans"),
        ({"path": "x", "mode": "shared"}, "unknown gdskv mode"),
        ({"path": "x", "master": "h:1"}, "mode 'cluster'"),
        ({"path": "x", "mode": "cluster"}, "host:port"),
        ({"path": "x", "mode": "cluster", "master": "nohost"}, "host:port"),
        ({"path": "x", "mode": "cluster", "master": "h:99999"}, "host:port"),
        ({"path": "x", "mode": "embedded", "socket": "/tmp/s"}, "socket is an option"),
        ({"path": "/tmp/" + "d" * 100}, "at most 107"),
        ({"path": "x", "mode": "node", "socket": "/tmp/" + "s" * 103}, "set 'socket' to a shorter path"),
        ("path=x", "mapping"),
    ],
)
def test_bad_options_are_config_errors(mapping, match):
    with pytest.raises(ConfigError, match=match):
        AttachConfig.from_mapping(mapping)


def test_flags_reach_a_node_started_for_the_engine_on_its_command_line():
    from gdskv.engine.hostnode import NodeLink
    from gdskv.node.cli import parse_sets

    flags = {"hbm_promote": False, "dram_huge_pages": True}
    cfg = AttachConfig(path="x", mode="cluster", master="h:1", store_options=flags)
    argv = NodeLink(cfg).argv()
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets == ["hbm_promote=false", "dram_huge_pages=true"]
    assert parse_sets(sets) == flags  # what the node makes of them


def test_one_store_per_directory_and_process(tmp_path):
    cfg = AttachConfig(path=str(tmp_path / "kv"), mode="embedded", dram_bytes=4 * MiB, ssd_bytes=16 * MiB)
    a = acquire_store(cfg)
    b = acquire_store(AttachConfig(path=str(tmp_path / "kv" / "."), mode="embedded", dram_bytes=4 * MiB, ssd_bytes=16 * MiB))
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
    assert acquire_store(AttachConfig(path=str(blocker / "kv"), mode="embedded")) is None
    assert "serves without it" in caplog.text


def test_a_store_locked_by_another_process_names_it_and_the_modes_that_share(tmp_path, caplog):
    path = tmp_path / "kv"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import gdskv, sys; s = gdskv.open({str(path)!r}, dram='4MiB', ssd='16MiB'); print('open', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline() == "open\n"
        caplog.set_level(logging.WARNING)
        assert acquire_store(AttachConfig(path=str(path), mode="embedded"), role="vLLM scheduler") is None
    finally:
        holder.stdin.close()
        holder.wait(60)
    text = caplog.text
    assert f"process {os.getpid()} (vLLM scheduler)" in text
    assert f"process {holder.pid} has it open" in text
    assert "mode 'auto'" in text and "'node'" in text
