"""Engine and backend names: the config's lists, the registries, env and command line agree."""

from __future__ import annotations

import argparse

import pytest

import gdskv
from conftest import uring_unavailable
from gdskv import cli
from gdskv.config import BACKENDS, IO_ENGINES, StoreConfig, env_overrides
from gdskv.gds import ENGINES, make_engine
from gdskv.tiers.backends import BACKENDS as BACKEND_REGISTRY
from gdskv.tiers.backends import make_backend


def test_config_names_match_the_registries():
    assert sorted(IO_ENGINES) == sorted(ENGINES)
    assert sorted(BACKENDS) == sorted(BACKEND_REGISTRY)


def test_every_registered_name_is_accepted_by_the_config():
    for name in ENGINES:
        assert StoreConfig(io_engine=name).io_engine == name
    for name in BACKEND_REGISTRY:
        assert StoreConfig(backend=name).backend == name


def test_unknown_names_list_the_valid_ones(tmp_path):
    with pytest.raises(gdskv.ConfigError) as info:
        make_engine("spdk")
    assert info.value.context["valid"] == "auto, kvikio, psync, uring"
    with pytest.raises(gdskv.ConfigError) as info:
        make_backend("tape", tmp_path, None, capacity=1)
    assert info.value.context["valid"] == "bucket, file_per_key, offset"
    with pytest.raises(gdskv.ConfigError):
        StoreConfig(io_engine="spdk")


def test_environment_sets_backend_engine_depth_and_direct_io():
    env = {"GDSKV_BACKEND": "offset", "GDSKV_IO_ENGINE": "psync", "GDSKV_IO_DEPTH": "128", "GDSKV_DIRECT_IO": "off"}
    fields = env_overrides(env)
    assert fields == {"backend": "offset", "io_engine": "psync", "io_depth": 128, "direct_io": False}
    cfg = StoreConfig().replace(**fields)
    assert (cfg.backend, cfg.io_engine, cfg.io_depth, cfg.direct_io) == ("offset", "psync", 128, False)
    with pytest.raises(gdskv.ConfigError) as info:
        env_overrides({"GDSKV_DIRECT_IO": "maybe"})
    assert info.value.context["field"] == "GDSKV_DIRECT_IO"
    with pytest.raises(gdskv.ConfigError):
        StoreConfig(io_depth=0)


def test_the_cap_on_large_reads_in_flight_reaches_the_engine(tmp_path, monkeypatch):
    assert env_overrides({"GDSKV_IO_READ_INFLIGHT": "2MiB"}) == {"io_read_inflight_bytes": 2 << 20}
    with pytest.raises(gdskv.ConfigError):
        StoreConfig(io_read_inflight_bytes=0)
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    monkeypatch.setenv("GDSKV_IO_READ_INFLIGHT", "2MiB")
    with gdskv.open(tmp_path / "s", dram="1MiB", ssd="8MiB", io_engine="uring") as store:
        assert store.stats()["io_engine"]["read_inflight_bytes"] == 2 << 20
    monkeypatch.delenv("GDSKV_IO_READ_INFLIGHT")
    with gdskv.open(tmp_path / "u", dram="1MiB", ssd="8MiB", io_engine="uring") as store:
        assert store.stats()["io_engine"]["read_inflight_bytes"] == 4 << 20


def test_environment_reaches_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_BACKEND", "file_per_key")
    monkeypatch.setenv("GDSKV_IO_ENGINE", "psync")
    with gdskv.open(tmp_path / "s", dram="1MiB", ssd="8MiB") as store:
        stats = store.stats()
    assert stats["nvme"]["backend"] == "file_per_key" and stats["io_engine"]["name"] == "psync"


def test_command_line_options_set_the_store_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GDSKV_BACKEND", "bucket")  # restored after the test
    monkeypatch.setenv("GDSKV_IO_ENGINE", "auto")
    args = cli.build_parser().parse_args(["--backend", "offset", "--io-engine", "psync", "demo"])
    cli.apply_store_options(args)
    with gdskv.open(tmp_path / "s", dram="1MiB", ssd="8MiB") as store:
        stats = store.stats()
    assert stats["nvme"]["backend"] == "offset" and stats["io_engine"]["name"] == "psync"


def test_command_line_rejects_unknown_names(capsys):
    assert cli.main(["--io-engine", "spdk", "demo"]) == 2
    err = capsys.readouterr().err
    assert "unknown io engine" in err and "uring" in err
    with pytest.raises(gdskv.ConfigError):
        cli.apply_store_options(argparse.Namespace(backend="tape", io_engine=None))
