"""StoreConfig validation, size parsing, environment overrides, and how the flat fields map
onto the config of each component."""

import ast
from pathlib import Path

import pytest

import gdskv
from gdskv.backend_config import BucketConfig, FilePerKeyConfig, OffsetConfig
from gdskv.config import GiB, KiB, MiB, StoreConfig, env_overrides, format_size, parse_size
from gdskv.errors import ConfigError
from gdskv.io_config import AutoConfig, KvikioConfig, PsyncConfig, UringConfig
from gdskv.offload_config import OffloaderConfig


@pytest.mark.parametrize(
    "text,expected",
    [("4096", 4096), ("8GiB", 8 * GiB), ("512 MiB", 512 * MiB), ("1.5KiB", 1536), ("2GB", 2 * 10**9), (7, 7), ("0", 0)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1", "GiB", -5, True, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad, field="dram")


def test_format_size():
    assert format_size(3 * GiB) == "3.0 GiB"
    assert format_size(512) == "512 B"
    assert format_size(2 * KiB) == "2.0 KiB"


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"eviction": "random"}, "lru, fifo"),
        ({"offload": "lazy"}, "eager, watermark"),
        ({"backend": "rocksdb"}, "valid"),
        ({"io_engine": "spdk"}, "valid"),
        ({"file_per_key_sync": "fsync"}, "filesystem, file"),
        ({"low_watermark": 0.95, "high_watermark": 0.9}, "watermarks"),
        ({"dram_bytes": 0}, "at least 64 bytes"),
        ({"io_threads": 0}, "positive"),
        ({"bucket_max_age_s": 0}, "positive"),
        ({"ssd_bytes": -1}, "non-negative"),
    ],
)
def test_invalid_config_is_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        StoreConfig(**fields)


def test_config_is_frozen_and_keyword_only():
    cfg = StoreConfig(dram_bytes="1GiB")
    assert cfg.dram_bytes == GiB
    with pytest.raises(Exception):
        cfg.dram_bytes = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        StoreConfig(1)  # type: ignore[misc]


def test_env_overrides_and_precedence(tmp_path, monkeypatch):
    env = {"GDSKV_DRAM": "8MiB", "GDSKV_OFFLOAD": "watermark", "GDSKV_IO_THREADS": "2"}
    assert env_overrides(env) == {"dram_bytes": 8 * MiB, "offload": "watermark", "io_threads": 2}
    assert env_overrides({"GDSKV_FILE_PER_KEY_SYNC": "file"}) == {"file_per_key_sync": "file"}
    with pytest.raises(ConfigError):
        env_overrides({"GDSKV_IO_THREADS": "many"})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with gdskv.open(tmp_path / "s", ssd="16MiB") as store:
        assert store.config.dram_bytes == 8 * MiB and store.config.offload == "watermark"
    with gdskv.open(tmp_path / "s", dram="4MiB", ssd="16MiB") as store:
        assert store.config.dram_bytes == 4 * MiB  # explicit beats the environment


def test_open_rejects_unknown_option(tmp_path):
    with pytest.raises(ConfigError, match="unknown store option"):
        gdskv.open(tmp_path / "s", dram="4MiB", colour="blue")


@pytest.mark.parametrize(
    "field, bad",
    [
        ("dram_bytes", 1),
        ("dram_bytes", 63),
        ("high_watermark", "0.9"),
        ("high_watermark", float("nan")),
        ("put_timeout_s", None),
        ("put_timeout_s", float("nan")),
        ("put_timeout_s", float("inf")),
        ("bucket_max_age_s", "1"),
        ("bucket_max_age_s", float("nan")),
        ("offload_retry_s", None),
        ("promote_after_reads", None),
        ("promote_after_reads", 1.5),
        ("promote_after_reads", True),
    ],
)
def test_numbers_of_the_wrong_type_or_not_finite_are_config_errors(field, bad):
    with pytest.raises(ConfigError) as info:
        StoreConfig(**{field: bad})
    assert info.value.context["field"] == field


def test_a_dram_tier_larger_than_the_machine_can_map_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        gdskv.open(tmp_path / "s", dram="1000TiB", ssd=0)
    assert "DRAM arena" in str(info.value)


# ------------------------------------------------------------------ the component configs


def test_the_defaults_are_those_of_each_component_config():
    cfg = StoreConfig()
    assert cfg.offloader == OffloaderConfig()
    assert cfg.io == AutoConfig()
    assert cfg.nvme_backend == BucketConfig()


def test_flat_fields_map_onto_the_component_configs():
    cfg = StoreConfig(
        offload="watermark", high_watermark=0.8, low_watermark=0.5, bucket_bytes="1MiB", bucket_max_keys=7,
        bucket_max_age_s=0.5, offload_retry_s=2.0, io_engine="uring", io_depth=8, io_read_inflight_bytes="2MiB",
        io_threads=3, direct_io=False, backend="file_per_key", ssd_bytes="8MiB", ssd_eviction="lru",
        verify_on_open="full", file_per_key_sync="file",
    )
    assert cfg.offloader == OffloaderConfig(
        policy="watermark", high_watermark=0.8, low_watermark=0.5, bucket_bytes=MiB, bucket_max_keys=7,
        bucket_max_age_s=0.5, offload_retry_s=2.0,
    )
    assert cfg.io == UringConfig(depth=8, read_inflight_bytes=2 * MiB, direct=False)  # uring has no threads
    assert cfg.nvme_backend == FilePerKeyConfig(capacity=8 * MiB, eviction="lru", verify_on_open="full", sync="file")
    # sizes parsed by the component read back as bytes on the flat fields too
    assert (cfg.bucket_bytes, cfg.ssd_bytes, cfg.io_read_inflight_bytes) == (MiB, 8 * MiB, 2 * MiB)
    assert StoreConfig(io_engine="psync", io_threads=3).io == PsyncConfig(threads=3)
    assert StoreConfig(io_engine="kvikio", io_threads=3).io == KvikioConfig(threads=3)
    assert StoreConfig(backend="offset", ssd_bytes=MiB).nvme_backend == OffsetConfig(capacity=MiB)


def test_replace_rebuilds_the_component_configs():
    cfg = StoreConfig(io_engine="psync").replace(io_engine="uring", backend="offset", offload="watermark")
    assert isinstance(cfg.io, UringConfig) and isinstance(cfg.nvme_backend, OffsetConfig)
    assert cfg.offloader.policy == "watermark"
    assert cfg == StoreConfig(io_engine="uring", backend="offset", offload="watermark")


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"offload": "lazy"}, "offload"),
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"bucket_bytes": "lots"}, "bucket_bytes"),
        ({"bucket_max_keys": 0}, "bucket_max_keys"),
        ({"offload_retry_s": -1.0}, "offload_retry_s"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": 5000}, "io_threads"),
        ({"io_depth": 1 << 20}, "io_depth"),
        ({"io_read_inflight_bytes": "zz"}, "io_read_inflight_bytes"),
        ({"direct_io": 1}, "direct_io"),
        ({"ssd_bytes": "huge"}, "ssd_bytes"),
        ({"ssd_eviction": "random"}, "ssd_eviction"),
        ({"verify_on_open": "some"}, "verify_on_open"),
        ({"file_per_key_sync": "fsync", "backend": "file_per_key"}, "file_per_key_sync"),
        ({"backend": "tape"}, "backend"),
        ({"io_engine": "spdk"}, "io_engine"),
        ({"eviction": "random"}, "eviction"),
    ],
)
def test_a_component_error_names_the_flat_field(fields, field):
    with pytest.raises(ConfigError) as info:
        StoreConfig(**fields)
    assert info.value.context["field"] == field


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"io_engine": "psync", "io_depth": 0}, "io_depth"),
        ({"io_engine": "psync", "io_read_inflight_bytes": 0}, "io_read_inflight_bytes"),
        ({"io_engine": "uring", "io_threads": 0}, "io_threads"),
        ({"backend": "bucket", "file_per_key_sync": "fsync"}, "file_per_key_sync"),
    ],
)
def test_an_option_of_a_component_not_chosen_is_still_checked(fields, field):
    """A bad GDSKV_IO_DEPTH is refused even while psync runs: switching engines later does
    not turn a silent setting into an error."""
    with pytest.raises(ConfigError) as info:
        StoreConfig(**fields)
    assert info.value.context["field"] == field


def test_open_keywords_and_environment_reach_the_component_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_FILE_PER_KEY_SYNC", "file")
    monkeypatch.setenv("GDSKV_IO_THREADS", "2")
    with gdskv.open(tmp_path / "s", dram="1MiB", ssd="8MiB", backend="file_per_key", io_engine="psync", bucket_max_keys=5) as store:
        assert store.config.nvme_backend == FilePerKeyConfig(capacity=8 * MiB, sync="file")
        assert store.config.io == PsyncConfig(threads=2)
        assert store.config.offloader.bucket_max_keys == 5
        assert store.parts.offloader.config is store.config.offloader
        stats = store.stats()
    assert stats["nvme"]["sync"] == "file" and stats["io_engine"]["threads"] == 2
    with pytest.raises(ConfigError) as info:
        gdskv.open(tmp_path / "t", dram="1MiB", ssd="8MiB", io_threads=0)
    assert info.value.context["field"] == "io_threads"


def test_command_line_flags_reach_the_component_configs(tmp_path, monkeypatch):
    from gdskv import cli

    monkeypatch.setenv("GDSKV_BACKEND", "bucket")  # restored after the test
    monkeypatch.setenv("GDSKV_IO_ENGINE", "auto")
    cli.apply_store_options(cli.build_parser().parse_args(["--backend", "offset", "--io-engine", "psync", "demo"]))
    with gdskv.open(tmp_path / "s", dram="1MiB", ssd="8MiB") as store:
        assert isinstance(store.config.nvme_backend, OffsetConfig) and isinstance(store.config.io, PsyncConfig)


def test_a_backend_option_reaches_its_backend_without_the_store_naming_it(tmp_path):
    """file_per_key's sync mode goes through its config: the store builds whatever backend
    config.nvme_backend is, and names no backend or backend option."""
    import inspect

    from gdskv.store import Store

    with gdskv.open(tmp_path / "s", dram="1MiB", ssd="8MiB", backend="file_per_key", file_per_key_sync="file") as store:
        assert store.stats()["nvme"]["sync"] == "file"
    source = inspect.getsource(Store.__init__)
    assert "nvme_backend.build(" in source
    assert "file_per_key" not in source and "sync" not in source and "make_backend" not in source


def _top_level_imports(path):
    """The gdskv modules ``path`` imports at module level (not under TYPE_CHECKING, not in a
    function)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("gdskv"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gdskv"):
            yield node.module


CONFIG_MODULES = ("config", "config_fields", "io_config", "backend_config", "offload_config")


@pytest.mark.parametrize("name", CONFIG_MODULES)
def test_config_modules_import_only_config_modules(name):
    """The configs sit below every component: they import no engine, backend or store (their
    build() imports the component it builds when called)."""
    root = Path(gdskv.__file__).parent
    allowed = {"gdskv.errors"} | {f"gdskv.{m}" for m in CONFIG_MODULES}
    assert set(_top_level_imports(root / f"{name}.py")) <= allowed
