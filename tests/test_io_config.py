"""The I/O engines' configs: each validates its own options and builds its engine."""

import dataclasses
import inspect

import pytest

from conftest import uring_unavailable
from gdskv.errors import ConfigError
from gdskv.gds import ENGINES, make_engine
from gdskv.io_config import (
    ENGINE_CONFIGS,
    MAX_IO_DEPTH,
    AutoConfig,
    EngineConfig,
    KvikioConfig,
    PsyncConfig,
    UringConfig,
    engine_config,
)


def test_the_registry_names_each_config_by_its_engine():
    assert ENGINES is ENGINE_CONFIGS
    assert sorted(ENGINE_CONFIGS) == ["auto", "kvikio", "psync", "uring"]
    for name, cls in ENGINE_CONFIGS.items():
        assert cls.name == name and issubclass(cls, EngineConfig)


def test_each_engine_takes_only_its_own_options():
    fields = {name: sorted(f.name for f in dataclasses.fields(cls)) for name, cls in ENGINE_CONFIGS.items()}
    assert fields == {
        "auto": ["depth", "direct", "read_inflight_bytes", "threads"],
        "kvikio": ["direct", "threads"],
        "psync": ["direct", "threads"],
        "uring": ["depth", "direct", "read_inflight_bytes"],
    }


def test_defaults_agree_with_the_engines():
    from gdskv.gds.psync import PsyncEngine
    from gdskv.gds.ring import READ_INFLIGHT_BYTES
    from gdskv.gds.uring import DEPTH

    assert PsyncConfig().threads == inspect.signature(PsyncEngine).parameters["threads"].default
    assert UringConfig().depth == AutoConfig().depth == DEPTH
    assert UringConfig().read_inflight_bytes == AutoConfig().read_inflight_bytes == READ_INFLIGHT_BYTES


@pytest.mark.parametrize(
    "cls, field, bad",
    [
        (PsyncConfig, "threads", 0),
        (PsyncConfig, "threads", 2.0),
        (PsyncConfig, "threads", 1025),
        (PsyncConfig, "direct", "yes"),
        (KvikioConfig, "threads", -1),
        (UringConfig, "depth", 0),
        (UringConfig, "depth", MAX_IO_DEPTH + 1),
        (UringConfig, "read_inflight_bytes", 0),
        (UringConfig, "read_inflight_bytes", "lots"),
        (AutoConfig, "threads", True),
        (AutoConfig, "depth", None),
        (AutoConfig, "read_inflight_bytes", -4096),
    ],
)
def test_each_config_refuses_a_bad_field_naming_it(cls, field, bad):
    with pytest.raises(ConfigError) as info:
        cls(**{field: bad})
    assert info.value.context["field"] == field


def test_sizes_are_parsed():
    assert UringConfig(read_inflight_bytes="2MiB").read_inflight_bytes == 2 << 20


def test_configs_are_frozen_and_keyword_only():
    cfg = PsyncConfig(threads=2)
    with pytest.raises(Exception):
        cfg.threads = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        PsyncConfig(2)  # type: ignore[misc]


def test_by_name_an_unknown_engine_or_option_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        engine_config("spdk")
    assert info.value.context["valid"] == "auto, kvikio, psync, uring"
    with pytest.raises(ConfigError) as info:
        engine_config("psync", depth=8)  # a uring option
    assert info.value.context["got"] == "depth" and info.value.context["valid"] == "direct, threads"
    assert engine_config("uring", depth=8) == UringConfig(depth=8)


def test_psync_builds_its_engine(tmp_path):
    with PsyncConfig(threads=2, direct=False).build(tmp_path) as engine:
        assert engine.describe()["name"] == "psync" and engine.threads == 2 and not engine.direct
    with make_engine("psync", threads=3) as engine:
        assert engine.threads == 3


def test_uring_builds_its_engine(tmp_path):
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    with UringConfig(depth=8, read_inflight_bytes="1MiB").build(tmp_path) as engine:
        assert (engine.name, engine.depth, engine.read_inflight_bytes) == ("uring", 8, 1 << 20)


def test_auto_chooses_an_engine_with_its_options_and_says_why(tmp_path):
    chosen, reason = AutoConfig(threads=3, depth=8).choose(tmp_path)
    assert chosen in (PsyncConfig(threads=3, direct=chosen.direct), UringConfig(depth=8, direct=chosen.direct))
    assert ("io_uring available" in reason) == (chosen.name == "uring")
    with AutoConfig(threads=3, depth=8).build(tmp_path) as engine:
        assert engine.name == chosen.name and engine.reason == reason
