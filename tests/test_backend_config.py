"""The NVMe backends' configs: each validates its own options and builds its backend."""

import pytest

from gdskv.backend_config import (
    BACKEND_CONFIGS,
    BackendConfig,
    BucketConfig,
    FilePerKeyConfig,
    OffsetConfig,
    backend_config,
)
from gdskv.config import MiB
from gdskv.errors import ConfigError
from gdskv.tiers.backends import BACKENDS, BucketBackend, FilePerKeyBackend, OffsetBackend, make_backend


def test_the_registry_names_each_config_by_its_backend():
    assert sorted(BACKEND_CONFIGS) == sorted(BACKENDS)
    for name, cls in BACKEND_CONFIGS.items():
        assert cls.name == name == BACKENDS[name].name and issubclass(cls, BackendConfig)


@pytest.mark.parametrize(
    "cls, field, bad",
    [
        (BucketConfig, "capacity", -1),
        (BucketConfig, "capacity", "big"),
        (BucketConfig, "eviction", "random"),
        (OffsetConfig, "verify_on_open", "some"),
        (OffsetConfig, "window_bytes", -4096),
        (FilePerKeyConfig, "sync", "fsync"),
        (FilePerKeyConfig, "open_files", -1),
        (FilePerKeyConfig, "open_files", 1.5),
    ],
)
def test_each_config_refuses_a_bad_field_naming_it(cls, field, bad):
    with pytest.raises(ConfigError) as info:
        cls(**{field: bad})
    assert info.value.context["field"] == field


def test_choices_list_the_valid_ones():
    with pytest.raises(ConfigError, match="filesystem, file"):
        FilePerKeyConfig(sync="fsync")
    with pytest.raises(ConfigError, match="index, full"):
        BucketConfig(verify_on_open="all")


def test_by_name_an_unknown_backend_or_option_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        backend_config("tape")
    assert info.value.context["valid"] == "bucket, file_per_key, offset"
    with pytest.raises(ConfigError) as info:
        backend_config("bucket", sync="file")  # a file_per_key option
    assert info.value.context["got"] == "sync"
    assert info.value.context["valid"] == "capacity, eviction, verify_on_open"
    assert backend_config("offset", capacity="8MiB") == OffsetConfig(capacity=8 * MiB)


def test_each_config_builds_its_backend(tmp_path, direct_psync):
    bucket = BucketConfig(capacity="16MiB", eviction="lru").build(tmp_path / "b", direct_psync)
    offset = OffsetConfig(capacity=16 * MiB, window_bytes=4 * MiB).build(tmp_path / "o", direct_psync)
    files = FilePerKeyConfig(capacity=16 * MiB, sync="file", open_files=0).build(tmp_path / "f", direct_psync)
    try:
        assert isinstance(bucket, BucketBackend) and bucket.capacity == 16 * MiB
        assert isinstance(offset, OffsetBackend) and offset.window_bytes == 4 * MiB
        assert isinstance(files, FilePerKeyBackend) and files.sync == "file"
    finally:
        for backend in (bucket, offset, files):
            backend.close()


def test_make_backend_builds_through_the_config(tmp_path, direct_psync):
    backend = make_backend("file_per_key", tmp_path, direct_psync, capacity=8 * MiB, sync="file")
    try:
        assert isinstance(backend, FilePerKeyBackend) and backend.sync == "file"
    finally:
        backend.close()
    with pytest.raises(ConfigError):
        make_backend("offset", tmp_path, direct_psync, capacity=8 * MiB, sync="file")
