"""The file-per-key backend's "filesystem" sync mode: one syncfs(2) after a batch's data and
one after its renames, the spare files evictions leave to the next write, removes during an
eviction, and what each failure leaves behind. (Crashes with SIGKILL run in both modes in
test_file_per_key.py.)"""

from __future__ import annotations

import errno
import os

import pytest

import gdskv
import gdskv.tiers.backends.file_per_key.backend as fpk_backend
import gdskv.tiers.backends.file_per_key.sync as fpk_sync
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
    real_syncfs, real_replace, real_submit = fpk_sync.syncfs, os.replace, backend.engine.submit
    real_fdatasync, real_fsync, real_fsync_dir = os.fdatasync, os.fsync, fpk_sync.fsync_dir
    monkeypatch.setattr(fpk_sync, "syncfs", lambda fd: (events.append("syncfs"), real_syncfs(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append("fdatasync"), real_fdatasync(fd))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (events.append("fsync_dir"), real_fsync_dir(path))[1])
    monkeypatch.setattr(backend.engine, "submit", lambda requests: (events.append("submit"), real_submit(requests))[1])
    return events


def test_a_write_syncs_the_filesystem_after_its_data_and_after_its_renames(tmp_path, direct_psync, monkeypatch):
    """The data of every file is durable before any rename names it, and the renames are
    durable before write() returns: two syncfs calls, each followed by an fsync of the
    store directory (a cache flush after every block the syncfs wrote), no per-file syncs."""
    backend = open_backend(tmp_path, direct_psync)
    values = {f"k{i}".encode(): block(i, 5000 + i) for i in range(5)}
    events = record_events(backend, monkeypatch)
    backend.write(items(values))
    monkeypatch.undo()
    renames = [("replace", str(backend.path_of(key))) for key in values]
    first_sync = events.index("syncfs")  # after the data's writes, submitted in groups
    assert first_sync >= 1 and set(events[:first_sync]) == {"submit"}
    assert events[first_sync:] == ["syncfs", "fsync", *renames, "syncfs", "fsync"]
    assert backend.stats()["sync"] == "filesystem"
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert all(read(again, key, len(value)) == value for key, value in values.items())
    again.close()


def spare_of(backend, victim: bytes, n: int) -> str:
    """The name the ``n``-th spare file gets, ``victim``'s file renamed in its directory."""
    return f"{backend.path_of(victim).parent}/spare-{n}.tmp"


def test_evicted_files_become_spares_that_the_next_write_overwrites(tmp_path, direct_psync, monkeypatch):
    """A write's victims are renamed to spare names once its data is submitted (the device
    works meanwhile), and not synced on their own: the write's syncfs covers them. The next
    write, after that syncfs, overwrites a spare in place as its new object's file, cut or
    grown to size, so no file is created. Spares go at close, and at open without counting
    as torn writes."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    inode = os.stat(backend.path_of(b"k0")).st_ino
    events = record_events(backend, monkeypatch)
    assert backend.write(items({b"k2": block(2, size)})) == [b"k0"]
    spared = ("replace", spare_of(backend, b"k0", 0))
    assert events == ["submit", spared, "syncfs", "fsync", ("replace", str(backend.path_of(b"k2"))), "syncfs", "fsync"]
    assert backend.stats()["spare_files"] == 1 and backend.stats()["files_reused"] == 0
    events.clear()
    cut = block(3, size - 9000)
    assert backend.write(items({b"k3": cut})) == [b"k1"]  # into k0's file
    spared = ("replace", spare_of(backend, b"k1", 1))
    assert events == ["submit", spared, "syncfs", "fsync", ("replace", str(backend.path_of(b"k3"))), "syncfs", "fsync"]
    monkeypatch.undo()
    assert backend.stats()["files_reused"] == 1 and os.stat(backend.path_of(b"k3")).st_ino == inode
    assert os.path.getsize(backend.path_of(b"k3")) == record_size(2, len(cut))
    assert read(backend, b"k3", len(cut)) == cut and read(backend, b"k2", size) == block(2, size)
    assert os.path.exists(spare_of(backend, b"k1", 1))
    backend.close()
    assert not os.path.exists(spare_of(backend, b"k1", 1))
    spare = spare_of(backend, b"k3", 7)  # as a crash leaves one
    with open(spare, "wb") as f:
        f.write(block(7, size))
    again = FilePerKeyBackend(tmp_path, direct_psync, capacity=2 * record_size(2, size), verify_on_open="full")
    report = again.recover()
    assert not os.path.exists(spare) and report.dropped_torn == report.dropped_corrupt == 0
    assert sorted(again.keys()) == [b"k2", b"k3"]
    again.close()


def test_a_spare_is_overwritten_only_after_a_syncfs_made_its_rename_durable(tmp_path, direct_psync, monkeypatch):
    """The write that made spares fails at its first syncfs: they are not ready, so the next
    write creates its file instead; its syncfs makes them ready, and the write after it
    takes one."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    real = fpk_sync.syncfs

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fpk_sync, "syncfs", failing)
    with pytest.raises(IoError):
        backend.write(items({b"k2": block(2, size)}))  # evicts k0, whose file is a spare now
    monkeypatch.setattr(fpk_sync, "syncfs", real)
    assert backend.stats()["spare_files"] == 1
    backend.write(items({b"k3": block(3, size)}))
    assert backend.stats()["files_reused"] == 0
    backend.write(items({b"k4": block(4, size)}))
    assert backend.stats()["files_reused"] == 1
    assert sorted(backend.keys()) == [b"k3", b"k4"] and read(backend, b"k4", size) == block(4, size)
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

    monkeypatch.setattr(fpk_sync, "syncfs", failing)
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


def test_a_remove_before_the_writes_syncfs_makes_its_evictions_durable(tmp_path, direct_psync, monkeypatch):
    """An eviction is made durable by the write's first syncfs. A remove() that comes before
    it (of the victim, say, which it finds absent) fsyncs the victim's directory itself
    before it returns, so the victim cannot come back after a crash; once the syncfs is done,
    removes sync nothing for it any more."""
    import threading

    from gates import Gate

    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    victim_dir = str(backend.path_of(b"k0").parent)
    gate = Gate(fpk_sync.syncfs)  # the write's first syncfs
    monkeypatch.setattr(fpk_sync, "syncfs", gate)
    real_fsync_dir = fpk_sync.fsync_dir
    synced = []
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(str(path)), real_fsync_dir(path))[1])
    writer = threading.Thread(target=lambda: backend.write(items({b"k1": block(1, size)})))
    writer.start()
    try:
        gate.wait_reached()
        assert not backend.remove(b"k0") and victim_dir in synced
    finally:
        gate.open()
        writer.join(10)
    assert backend.keys() == [b"k1"]
    synced.clear()
    assert not backend.remove(b"k0") and synced == []
    assert backend.write(items({b"k2": block(2, size)})) == [b"k1"]  # no remove() during it
    assert not backend.remove(b"k1") and synced == []  # its syncfs covered the eviction
    backend.close()


def test_the_sync_descriptor_is_closed_with_the_backend(tmp_path, direct_psync):
    before = set(os.listdir("/proc/self/fd"))
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(1, 5000)}))
    backend.close()
    assert set(os.listdir("/proc/self/fd")) == before


def test_without_syncfs_the_backend_syncs_file_by_file(tmp_path, direct_psync, monkeypatch, caplog):
    monkeypatch.setattr(fpk_sync, "syncfs_available", lambda: False)
    with caplog.at_level("INFO", logger=fpk_sync.__name__):
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


def spares_on_disk(root):
    return sorted(str(p) for p in (root / "files").glob("*/*/spare-*.tmp"))


def test_a_remove_beside_another_remove_still_waits_for_the_eviction_to_be_durable(tmp_path, direct_psync, monkeypatch):
    """Two victims of one eviction, removed by two remove()s while the evicting write waits
    at its first syncfs. The second remove() must not count on the first one's fsyncs, still
    running: before, the first took the pending directories off the list, and the second
    returned False before anything had made its victim's eviction durable."""
    import threading

    from gates import Gate
    from test_file_per_key import keys_in_one_shard

    a, b = keys_in_one_shard(2)
    size = record_size(len(a), 1000)
    backend = open_backend(tmp_path, direct_psync, capacity=2 * size)
    backend.write(items({a: block(1, 1000), b: block(2, 1000)}))
    shard = str(backend.path_of(a).parent)
    durable = []  # syncs that ended
    real_syncfs, real_fsync_dir = fpk_sync.syncfs, fpk_sync.fsync_dir
    write_gate = Gate(lambda fd: (real_syncfs(fd), durable.append("syncfs")))
    monkeypatch.setattr(fpk_sync, "syncfs", write_gate)
    remove_gate = Gate(lambda path: (real_fsync_dir(path), durable.append(str(path))))  # the first remove's fsync
    monkeypatch.setattr(fpk_sync, "fsync_dir", remove_gate)
    writer = threading.Thread(target=lambda: backend.write(items({b"x1": block(3, 1000), b"x2": block(4, 1000)})))
    writer.start()
    write_gate.wait_reached()  # a and b evicted, nothing synced yet
    first = threading.Thread(target=lambda: backend.remove(a))
    first.start()
    remove_gate.wait_reached()
    second = threading.Thread(target=lambda: (backend.remove(b), durable.append("second returned")))
    second.start()
    try:
        second.join(0.5)
        assert second.is_alive() or durable.index("second returned") > durable.index(shard)
    finally:
        remove_gate.open()
        write_gate.open()
        for thread in (first, second, writer):
            thread.join(10)
    assert durable.index("second returned") > durable.index(shard)
    backend.close()


def test_a_write_whose_eviction_fails_leaves_its_spares_to_the_next(tmp_path, direct_psync):
    """The evict listener raises, so the write fails before any file goes: the ready spare
    it was about to take stays listed (and is taken by the next write); before, it left the
    list but not the disk, and close() left it behind."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    assert backend.write(items({b"k2": block(2, size)})) == [b"k0"]  # k0's file: a ready spare

    def listener(keys):
        raise RuntimeError("listener failed")

    backend.evict_listener = listener
    with pytest.raises(RuntimeError):
        backend.write(items({b"k3": block(3, size)}))
    backend.evict_listener = None
    assert sorted(backend.keys()) == [b"k1", b"k2"]
    assert backend.stats()["spare_files"] == len(spares_on_disk(tmp_path)) == 1
    assert backend.write(items({b"k3": block(3, size)})) == [b"k1"]
    assert backend.stats()["files_reused"] == 1 and read(backend, b"k3", size) == block(3, size)
    assert backend.stats()["spare_files"] == len(spares_on_disk(tmp_path)) == 1
    backend.close()
    assert spares_on_disk(tmp_path) == []


def test_a_write_that_fails_after_taking_a_spare_deletes_it(tmp_path, direct_psync, monkeypatch):
    """The write took a ready spare and fails at its first syncfs: the spare it wrote into is
    deleted, the records on disk are what the index counts, and the next write works."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    backend.write(items({b"k2": block(2, size)}))  # k0's file: a ready spare
    taken = spares_on_disk(tmp_path)

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fpk_sync, "syncfs", failing)
    with pytest.raises(IoError):
        backend.write(items({b"k3": block(3, size)}))  # takes k0's spare, evicts k1
    monkeypatch.undo()
    assert backend.stats()["files_reused"] == 0  # no record came of it
    assert not set(taken) & set(spares_on_disk(tmp_path))
    assert backend.stats()["spare_files"] == len(spares_on_disk(tmp_path))
    records = [f for f in all_files(tmp_path / "files") if f.endswith(".rec")]
    assert backend.used_bytes == sum(os.path.getsize(f) for f in records)
    backend.write(items({b"k3": block(3, size)}))
    assert read(backend, b"k3", size) == block(3, size)
    backend.close()


def test_a_spare_deleted_behind_the_stores_back_is_replaced_by_a_new_file(tmp_path, direct_psync):
    import shutil

    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    backend.write(items({b"k2": block(2, size)}))  # k0's file: a ready spare
    (spare,) = spares_on_disk(tmp_path)
    shutil.rmtree(os.path.dirname(os.path.dirname(spare)))  # its shard, with it
    assert backend.write(items({b"k3": block(3, size)})) == [b"k1"]
    assert backend.stats()["files_reused"] == 0
    assert read(backend, b"k3", size) == block(3, size) and read(backend, b"k2", size) == block(2, size)
    backend.close()
    again = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    assert sorted(again.keys()) == [b"k2", b"k3"]
    again.close()


def test_a_failed_evicting_write_still_makes_its_evictions_durable(tmp_path, direct_psync, monkeypatch):
    """The write that evicted k0 fails before its first syncfs: before it raises, it fsyncs
    the victims' directories (best effort), so the eviction a later lookup() shows (k0
    absent) holds after a crash; a later remove() has nothing left to sync."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    shard = str(backend.path_of(b"k0").parent)
    synced = []
    real_fsync_dir = fpk_sync.fsync_dir
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (real_fsync_dir(path), synced.append(str(path)))[0])

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fpk_sync, "syncfs", failing)
    with pytest.raises(IoError):
        backend.write(items({b"k1": block(1, size)}))
    assert backend.lookup(b"k0") is None and shard in synced
    synced.clear()
    assert not backend.remove(b"k0") and synced == []
    monkeypatch.undo()
    backend.close()


def test_a_spare_renamed_into_a_removed_shard_makes_the_shard_again(tmp_path, direct_psync):
    """A spare lives in its victim's shard. When the new object's shard directory was
    removed behind the store's back, the write makes it again at the rename, as a write that
    creates its file does (before, the rename failed, and so did every retry, each taking the
    next spare)."""
    import shutil

    from gdskv.tiers.backends.file_per_key import file_name

    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    backend.write(items({b"k2": block(2, size)}))  # k0's file: a ready spare
    taken = {file_name(k)[:2] for k in (b"k0", b"k1", b"k2")}
    new = next(k for k in (b"n%d" % i for i in range(10_000)) if file_name(k)[:2] not in taken)
    shutil.rmtree(backend.path_of(new).parent)
    assert backend.write(items({new: block(3, size)})) == [b"k1"]
    assert backend.stats()["files_reused"] == 1 and read(backend, new, size) == block(3, size)
    backend.close()
    again = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, size))
    assert sorted(again.keys()) == sorted([b"k2", new])
    again.close()


def test_a_pending_directory_removed_behind_the_stores_back_has_nothing_to_sync(tmp_path, direct_psync, monkeypatch):
    """An eviction's directory stays pending (its write failed before its syncfs); then the
    shard is removed behind the store's back. A remove() finds nothing to fsync there and
    returns: before, every remove() raised (ENOENT) until a write's syncfs settled it."""
    import shutil

    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    shard = backend.path_of(b"k0").parent

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fpk_sync, "syncfs", failing)
    monkeypatch.setattr(fpk_sync, "fsync_dir", failing)
    with pytest.raises(IoError):
        backend.write(items({b"k1": block(1, size)}))  # evicts k0; nothing could sync
    monkeypatch.undo()
    shutil.rmtree(shard)
    assert not backend.remove(b"k0")
    backend.close()


def test_a_remove_of_a_victim_whose_file_the_write_has_not_handled_yet_deletes_it(tmp_path, direct_psync, monkeypatch):
    """The write has evicted k0 but not yet made its file a spare (it does that once its own
    writes are submitted). A remove() of k0 then deletes the file itself and fsyncs its
    directory before it returns False; the write makes no spare of it."""
    import threading

    from gates import Gate

    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    victim = backend.path_of(b"k0")
    gate = Gate(backend.engine.submit)  # the write's first submit: k0 evicted, its file untouched
    monkeypatch.setattr(backend.engine, "submit", gate)
    real_fsync_dir = fpk_sync.fsync_dir
    synced = []
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (real_fsync_dir(path), synced.append(str(path)))[0])
    writer = threading.Thread(target=lambda: backend.write(items({b"k1": block(1, size)})))
    writer.start()
    try:
        gate.wait_reached()
        assert victim.exists()
        assert not backend.remove(b"k0")
        assert not victim.exists() and str(victim.parent) in synced
    finally:
        gate.open()
        writer.join(10)
    monkeypatch.undo()
    assert backend.keys() == [b"k1"] and backend.stats()["spare_files"] == 0
    assert spares_on_disk(tmp_path) == []
    backend.close()


def test_a_spare_made_after_a_remove_settled_its_directory_is_synced_by_the_next_remove(tmp_path, direct_psync, monkeypatch):
    """A remove() of another key fsyncs the victim's directory before the write has made the
    victim's file a spare; the rename to the spare name comes after. A remove() of the
    victim before the write's syncfs must fsync that directory again: the rename is a change
    the first fsync did not cover."""
    import threading

    from gates import Gate
    from test_file_per_key import keys_in_one_shard

    victim, other = keys_in_one_shard(2)
    size = record_size(len(victim), 1000)
    backend = open_backend(tmp_path, direct_psync, capacity=2 * size)
    backend.write(items({victim: block(1, 1000)}))
    backend.write(items({other: block(2, 1000)}))
    shard = str(backend.path_of(victim).parent)
    submit_gate = Gate(backend.engine.submit)
    monkeypatch.setattr(backend.engine, "submit", submit_gate)
    sync_gate = Gate(fpk_sync.syncfs)
    monkeypatch.setattr(fpk_sync, "syncfs", sync_gate)
    real_fsync_dir = fpk_sync.fsync_dir
    synced = []
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (real_fsync_dir(path), synced.append(str(path)))[0])
    writer = threading.Thread(target=lambda: backend.write(items({b"new": block(3, 1000)})))
    writer.start()
    try:
        submit_gate.wait_reached()  # the victim evicted; its file not yet a spare
        assert backend.remove(other) and shard in synced
        submit_gate.open()
        sync_gate.wait_reached()  # its file is a spare now; the write's syncfs not yet done
        assert backend.stats()["spare_files"] == 1
        synced.clear()
        assert not backend.remove(victim) and shard in synced
    finally:
        submit_gate.open()
        sync_gate.open()
        writer.join(10)
    monkeypatch.undo()
    assert backend.keys() == [b"new"]
    backend.close()


def test_a_write_that_fails_before_its_first_request_settles_its_evictions(tmp_path, direct_psync, monkeypatch):
    """The header memory cannot be had (MemoryError) after the write evicted k0: the victim's
    file is still handled (a spare, deleted at close), the reservation is given back, and
    k0, which the evict listener heard of, does not come back at the next open."""
    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    heard = []
    backend.evict_listener = heard.extend

    def no_memory(key_lengths):
        raise MemoryError("no memory for the header blocks")

    monkeypatch.setattr(fpk_backend, "HeadBlocks", no_memory)
    with pytest.raises(MemoryError):
        backend.write(items({b"k1": block(1, size)}))
    monkeypatch.undo()
    assert heard == [b"k0"] and backend.keys() == [] and backend.used_bytes == 0
    assert not backend.path_of(b"k0").exists()
    backend.close()
    again = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    assert again.keys() == []
    again.close()
