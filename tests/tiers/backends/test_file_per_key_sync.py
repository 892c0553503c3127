"""The file-per-key backend's "filesystem" sync mode: one syncfs(2) after a batch's data,
one after its renames, and one after an eviction, in that order, and what a failure of each
leaves behind. (Crashes with SIGKILL run in both modes in test_file_per_key.py.)"""

from __future__ import annotations

import errno
import os

import pytest

import gdskv
import gdskv.tiers.backends.file_per_key as fpk
from backend_io import items, read
from conftest import block
from gdskv.errors import ConfigError, IoError
from gdskv.tiers.backends.file_per_key import FilePerKeyBackend
from gdskv.tiers.backends.files import syncfs
from gdskv.tiers.backends.record import record_size
from test_file_per_key import all_files, open_backend

MiB = 1 << 20


def record_events(backend, monkeypatch):
    """Patch the calls a write makes to sync, rename and submit I/O so that each one is
    appended to the returned list (as a name, or ("replace", final path)) before it runs."""
    events = []
    real_syncfs, real_replace, real_submit = fpk.syncfs, os.replace, backend.engine.submit
    real_fdatasync, real_fsync_dir = os.fdatasync, fpk.fsync_dir
    monkeypatch.setattr(fpk, "syncfs", lambda fd: (events.append("syncfs"), real_syncfs(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append("fdatasync"), real_fdatasync(fd))[1])
    monkeypatch.setattr(fpk, "fsync_dir", lambda path: (events.append("fsync_dir"), real_fsync_dir(path))[1])
    monkeypatch.setattr(backend.engine, "submit", lambda requests: (events.append("submit"), real_submit(requests))[1])
    return events


def test_a_write_syncs_the_filesystem_after_its_data_and_after_its_renames(tmp_path, direct_psync, monkeypatch):
    """The data of every file is durable before any rename names it, and the renames are
    durable before write() returns: two syncfs calls, no per-file syncs."""
    backend = open_backend(tmp_path, direct_psync)
    values = {f"k{i}".encode(): block(i, 5000 + i) for i in range(5)}
    events = record_events(backend, monkeypatch)
    backend.write(items(values))
    monkeypatch.undo()
    renames = [("replace", str(backend.path_of(key))) for key in values]
    first_sync = events.index("syncfs")  # after the data's writes, submitted in groups
    assert first_sync >= 1 and set(events[:first_sync]) == {"submit"}
    assert events[first_sync:] == ["syncfs", *renames, "syncfs"]
    assert backend.stats()["sync"] == "filesystem"
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert all(read(again, key, len(value)) == value for key, value in values.items())
    again.close()


def test_a_write_that_evicts_syncs_the_evictions_before_it_writes_into_reused_files(tmp_path, direct_psync, monkeypatch):
    """The victims' files are renamed to the write's temporary names; that is made durable
    (so a remove() that finds a victim gone may return at once, and no victim's name still
    names a file that takes new bytes) before any data is submitted."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    events = record_events(backend, monkeypatch)
    assert backend.write(items({b"k2": block(2, size)})) == [b"k0"]
    monkeypatch.undo()
    final = str(backend.path_of(b"k2"))
    moved = ("replace", final + ".tmp")  # the victim's file, to the new object's temporary name
    assert events == [moved, "syncfs", "submit", "syncfs", ("replace", final), "syncfs"]
    assert backend.stats()["files_reused"] == 1
    backend.close()


def test_a_failed_syncfs_before_the_renames_changes_nothing(tmp_path, direct_psync, monkeypatch):
    """The first syncfs fails (EIO): write() raises IoError with the store's path, nothing
    was renamed, no temporary file is left, the old value stays readable (and after a
    reopen), and the next write goes through."""
    backend = open_backend(tmp_path, direct_psync)
    old = block(1, 10_000)
    backend.write(items({b"k": old}))
    used = backend.used_bytes

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fpk, "syncfs", failing)
    with pytest.raises(IoError) as info:
        backend.write(items({b"k": block(2, 12_000), b"new": block(3, 100)}))
    monkeypatch.undo()
    assert info.value.context["errno"] == errno.EIO and info.value.context["path"] == str(tmp_path / "files")
    assert backend.keys() == [b"k"] and read(backend, b"k", len(old)) == old and backend.used_bytes == used
    assert not [f for f in all_files(tmp_path / "files") if f.endswith(".tmp")]
    backend.write(items({b"new": block(3, 100)}))
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert sorted(again.keys()) == [b"k", b"new"] and read(again, b"k", len(old)) == old
    again.close()


def test_an_eviction_whose_syncfs_fails_is_made_durable_by_the_next_remove(tmp_path, direct_psync, monkeypatch):
    """The eviction's syncfs fails: the victim is gone from the index at once, and its
    directory is fsynced by the next remove() (of the victim, say, which finds it absent)."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    victim_dir = str(backend.path_of(b"k0").parent)
    real_syncfs, real_fsync_dir = fpk.syncfs, fpk.fsync_dir
    calls = []

    def failing_first(fd):
        calls.append(fd)
        if len(calls) == 1:  # the eviction's
            raise OSError(errno.EIO, "Input/output error")
        real_syncfs(fd)

    monkeypatch.setattr(fpk, "syncfs", failing_first)
    assert backend.write(items({b"k1": block(1, size)})) == [b"k0"]
    assert len(calls) == 3  # the eviction's, then the write's two
    synced = []
    monkeypatch.setattr(fpk, "fsync_dir", lambda path: (synced.append(str(path)), real_fsync_dir(path)))
    assert not backend.remove(b"k0") and victim_dir in synced
    synced.clear()
    assert not backend.remove(b"k0") and synced == []  # done: nothing pending any more
    backend.close()


def test_the_sync_descriptor_is_closed_with_the_backend(tmp_path, direct_psync):
    before = set(os.listdir("/proc/self/fd"))
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(1, 5000)}))
    backend.close()
    assert set(os.listdir("/proc/self/fd")) == before


def test_without_syncfs_the_backend_syncs_file_by_file(tmp_path, direct_psync, monkeypatch, caplog):
    monkeypatch.setattr(fpk, "syncfs_available", lambda: False)
    with caplog.at_level("INFO", logger=fpk.__name__):
        backend = open_backend(tmp_path, direct_psync)
    assert backend.sync == "file" and backend.stats()["sync"] == "file"
    assert "syncfs is not available" in caplog.text
    events = record_events(backend, monkeypatch)
    backend.write(items({b"k": block(1, 5000)}))
    assert "syncfs" not in events and {"fdatasync", "fsync_dir"} <= set(events)
    backend.close()


def test_an_unknown_sync_mode_is_a_config_error(tmp_path, direct_psync):
    with pytest.raises(ConfigError) as info:
        FilePerKeyBackend(tmp_path, direct_psync, capacity=MiB, sync="never")
    assert info.value.context["valid"] == "filesystem, file"
    assert not (tmp_path / "files").exists()


def test_the_store_passes_its_sync_mode_to_the_backend(tmp_path, monkeypatch):
    with gdskv.open(tmp_path / "a", dram="16MiB", ssd="16MiB", backend="file_per_key") as store:
        assert store.stats()["nvme"]["sync"] == "filesystem"
    with gdskv.open(tmp_path / "b", dram="16MiB", ssd="16MiB", backend="file_per_key", file_per_key_sync="file") as store:
        assert store.stats()["nvme"]["sync"] == "file"
    with pytest.raises(ConfigError):
        gdskv.open(tmp_path / "c", dram="16MiB", ssd="16MiB", backend="file_per_key", file_per_key_sync="fsync")
    assert not (tmp_path / "c").exists()


def test_syncfs_reports_errors(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syncfs(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        syncfs(fd)  # closed
    assert info.value.errno == errno.EBADF
