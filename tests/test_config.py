"""StoreConfig validation, size parsing and environment overrides."""

import pytest

import gdskv
from gdskv.config import GiB, KiB, MiB, StoreConfig, env_overrides, format_size, parse_size
from gdskv.errors import ConfigError


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
