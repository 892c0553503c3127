"""The file-per-key backend: hash-named files, keys that cannot escape, recovery checks."""

from __future__ import annotations

import contextlib
import errno
import os
import resource

import pytest

from backend_io import items, read
from conftest import block
from gdskv.errors import IoError
from gdskv.tiers.backends.file_per_key import FilePerKeyBackend, file_name
from gdskv.tiers.backends.record import RECORD_HEADER, decode_head

MiB = 1 << 20

NASTY_KEYS = [
    b"../../../../etc/passwd",
    b"/absolute/path",
    b"a\x00b",
    b"..",
    b".",
    b"x" * 4096,
    "ключ/с/слешами".encode(),
    b"\xff\xfe\n\t",
]


def open_backend(root, direct_psync, **kw) -> FilePerKeyBackend:
    kw.setdefault("capacity", 16 * MiB)
    backend = FilePerKeyBackend(root, direct_psync, **kw)
    backend.recover()
    return backend


@pytest.fixture(params=["filesystem", "file"])
def sync(request) -> str:
    """Each of the backend's sync modes."""
    return request.param


def after_renames(backend, monkeypatch, wrap):
    """Patch the call a write of ``backend`` makes once its files are renamed into place
    (the directory fsyncs in "file" mode, the second syncfs in "filesystem" mode) with
    ``wrap(real)``; other calls of it pass through. For writes that evict nothing."""
    import itertools

    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    if backend.sync == "file":
        monkeypatch.setattr(fpk_sync, "fsync_dir", wrap(fpk_sync.fsync_dir))
        return
    real, calls = fpk_sync.syncfs, itertools.count(1)
    wrapped = wrap(real)
    monkeypatch.setattr(fpk_sync, "syncfs", lambda fd: wrapped(fd) if next(calls) % 2 == 0 else real(fd))


@contextlib.contextmanager
def overwrite_held_after_its_rename(backend, monkeypatch, key: bytes, value: bytes):
    """Run the body while a write of ``key`` on another thread is held just after it renamed
    its file into place and indexed it, at its directory fsyncs (or its second syncfs)."""
    import threading

    from gates import Gate

    gates = []
    after_renames(backend, monkeypatch, lambda real: gates.append(Gate(real)) or gates[0])
    writer = threading.Thread(target=lambda: backend.write(items({key: value})))
    writer.start()
    try:
        gates[0].wait_reached()
        yield
    finally:
        gates[0].open()
        writer.join(10)
    monkeypatch.undo()


def failing_for(path, real, code: int):
    """``real`` (a call whose first argument is a path), failing with errno ``code`` for
    ``path`` only."""

    def call(target, *args, **kwargs):
        if str(target) == str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real(target, *args, **kwargs)

    return call


@contextlib.contextmanager
def out_of_descriptors():
    """Run the body with this process at its descriptor limit: every open fails with EMFILE
    until something is closed. The limit is lowered and the rest taken by /dev/null."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog = []
    try:
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, highest + 32), hard))
        while True:
            try:
                hog.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        yield
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def all_files(root):
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]


def test_no_key_escapes_the_store_directory(tmp_path, direct_psync):
    store_dir = tmp_path / "store"
    backend = open_backend(store_dir, direct_psync)
    values = {key: block(i, 100 + i) for i, key in enumerate(NASTY_KEYS)}
    backend.write(items(values))
    files = all_files(tmp_path)
    assert len(files) == len(NASTY_KEYS)
    for path in files:
        rel = os.path.relpath(path, store_dir / "files")
        shard1, shard2, name = rel.split(os.sep)
        assert name.endswith(".rec") and name.startswith(shard1 + shard2) and len(name) == 32 + 4
    for key, value in values.items():
        assert backend.path_of(key).name == file_name(key)
        assert read(backend, key, len(value)) == value
    backend.close()
    again = open_backend(store_dir, direct_psync)
    assert sorted(again.keys()) == sorted(NASTY_KEYS)  # keys come from the file headers
    again.close()


def test_the_file_is_one_self_describing_record(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    value = block(1, 10_001)
    backend.write(items({b"inspect me": value}))
    raw = backend.path_of(b"inspect me").read_bytes()
    header = decode_head(raw)
    assert raw[RECORD_HEADER.size : RECORD_HEADER.size + header.key_len] == b"inspect me"
    assert raw[4096 : 4096 + len(value)] == value and header.value_len == len(value)
    assert len(raw) % 4096 == 0
    backend.close()


def test_recovery_drops_temporaries_and_files_that_lie(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"good": block(1, 5000), b"renamed": block(2, 5000), b"truncated": block(3, 9000)}))
    backend.close()
    good = backend.path_of(b"good")
    (good.parent / (good.name + ".tmp")).write_bytes(b"half a write")
    renamed = backend.path_of(b"renamed")
    os.rename(renamed, renamed.with_name("0" * 32 + ".rec"))  # its name no longer matches its key
    truncated = backend.path_of(b"truncated")
    os.truncate(truncated, 4096 + 100)
    notes = [good.parent / "notes.txt", tmp_path / "files" / "README", tmp_path / "files" / "mine" / "copy.rec.bak"]
    for path in notes:  # not the store's files: a person inspecting the store put them there
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"keep me")
    backup = tmp_path / "files" / "backup" / good.name  # a copy of a record, outside the tree
    backup.parent.mkdir()
    backup.write_bytes(good.read_bytes())
    os.utime(backup, (1, 1))
    notes.append(backup)
    again = FilePerKeyBackend(tmp_path, direct_psync, capacity=16 * MiB)
    report = again.recover()
    assert again.keys() == [b"good"]
    assert report.dropped_torn == 1 and report.dropped_corrupt == 2
    assert sorted(all_files(tmp_path / "files")) == sorted([str(good)] + [str(p) for p in notes])
    assert all(p.read_bytes() == b"keep me" for p in notes[:-1]) and os.stat(backup).st_mtime == 1
    again.close()


def test_a_record_file_that_cannot_be_read_at_open_fails_the_open_and_is_kept(tmp_path, direct_psync, monkeypatch):
    """EIO (or running out of descriptors) says nothing about the file: it is not deleted
    as corrupt, and the open fails with the path, so that a retry finds everything."""
    values = {f"k{i}".encode(): block(i, 3000) for i in range(8)}
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items(values))
    backend.close()
    failing = str(backend.path_of(b"k3"))
    monkeypatch.setattr(direct_psync, "open_file", failing_for(failing, direct_psync.open_file, errno.EIO))
    with pytest.raises(IoError) as info:
        open_backend(tmp_path, direct_psync)
    assert info.value.context["path"] == failing and info.value.context["errno"] == errno.EIO
    monkeypatch.undo()
    assert os.path.exists(failing)
    again = open_backend(tmp_path, direct_psync)
    assert all(read(again, key, 3000) == value for key, value in values.items())
    again.close()


def test_remove_unlinks_and_eviction_stays_under_the_cap(tmp_path, direct_psync, sync):
    """The records stay under the cap; in "filesystem" mode, spare files (evicted files kept
    for the next write) take at most one write's bytes more."""
    backend = open_backend(tmp_path, direct_psync, capacity=MiB, sync=sync)
    values = {f"f{i}".encode(): block(i, 100_000) for i in range(20)}  # ~2 MiB of records
    evicted = []
    for key, value in values.items():
        evicted += backend.write(items({key: value}))
    assert backend.used_bytes <= MiB and evicted[:2] == [b"f0", b"f1"]  # FIFO
    records = [f for f in all_files(tmp_path / "files") if f.endswith(".rec")]
    assert len(records) == len(backend)
    spares = set(all_files(tmp_path / "files")) - set(records)
    assert len(spares) == backend.stats()["spare_files"] == (sync == "filesystem")
    assert sum(os.path.getsize(f) for f in spares) == backend.stats()["spare_bytes"] <= 110_000
    assert backend.remove(b"f19") and not backend.remove(b"f19")
    assert not backend.path_of(b"f19").exists()
    backend.close()
    assert b"f19" not in open_backend(tmp_path, direct_psync, capacity=MiB)


def test_a_corrupt_file_is_a_miss_and_is_deleted(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(5, 30_000)}))
    path = backend.path_of(b"k")
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        f.write(b"\x00\x01\x02")
    assert read(backend, b"k", 30_000) is None
    assert backend.counters["corrupt_reads"] == 1 and not path.exists()
    backend.close()


def shard_dirs(root):
    return sorted(str(p.relative_to(root)) for p in root.glob("*/*") if p.is_dir())


def test_the_store_opens_with_its_whole_shard_tree_synced(tmp_path, direct_psync, monkeypatch):
    """All 16 x 16 shard directories exist once the store is open, and every directory that
    gained one was fsynced: a write never creates a directory."""
    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    synced = []
    real = fpk_sync.fsync_dir
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(str(path)), real(path)))
    backend = open_backend(tmp_path, direct_psync)
    root = tmp_path / "files"
    digits = "0123456789abcdef"
    assert shard_dirs(root) == [f"{a}/{b}" for a in digits for b in digits]
    parents = sorted([str(tmp_path), str(root)] + [str(root / a) for a in digits])
    assert sorted(synced) == parents
    synced.clear()
    backend.close()
    # An open that stopped between its mkdirs and their fsyncs left entries that may not be
    # durable: every open syncs the directories the tree hangs from again.
    backend = open_backend(tmp_path, direct_psync)
    assert sorted(synced) == parents
    backend.close()


def test_a_write_syncs_every_directory_whose_entries_it_changed(tmp_path, direct_psync, monkeypatch):
    """The file's shard directory; and when a shard directory was removed behind the store's
    back, the write makes it again and syncs the directories that gained one: otherwise a
    power loss could drop the shard (and the file in it) after the write was acknowledged."""
    import shutil

    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    backend = open_backend(tmp_path, direct_psync, sync="file")
    synced = []
    real = fpk_sync.fsync_dir
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(str(path)), real(path)))
    name = file_name(b"first")
    root = tmp_path / "files"
    backend.write(items({b"first": block(1, 5000)}))
    assert synced == [str(root / name[0] / name[1])]
    assert backend.path_of(b"first") == root / name[0] / name[1] / name
    synced.clear()
    shutil.rmtree(root / name[0])
    backend.write(items({b"first": block(2, 5000)}))
    assert set(synced) == {str(root), str(root / name[0]), str(root / name[0] / name[1])}
    assert read(backend, b"first", 5000) == block(2, 5000)
    backend.close()


def old_place(root, key):
    """Where the older layout kept the file of ``key``."""
    name = file_name(key)
    return root / "files" / name[0:2] / name[2:4] / name


def to_older_tree(root, backend, keys):
    """Move the files of ``keys`` to where the older layout kept them, as it wrote them."""
    for key in keys:
        old = old_place(root, key)
        old.parent.mkdir(parents=True, exist_ok=True)
        os.replace(backend.path_of(key), old)


def test_files_of_the_older_layout_move_into_place(tmp_path, direct_psync):
    """A store written with the ``<h[0:2]>/<h[2:4]>/`` tree of earlier versions opens with
    every object; its files are moved into the shard tree and the old directories go. A key
    found in both places keeps its newest file."""
    values = {f"k{i}".encode(): block(i, 3000 + i) for i in range(40)}
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items(values))
    stale = backend.path_of(b"k0").read_bytes()
    backend.write(items({b"k0": block(99, 1234)}))
    backend.close()
    root = tmp_path / "files"
    to_older_tree(tmp_path, backend, values)
    backend.path_of(b"k0").write_bytes(stale)  # an older copy of k0 in the new place

    backend = open_backend(tmp_path, direct_psync)
    assert len(backend) == len(values)
    for key, value in values.items():
        expected = block(99, 1234) if key == b"k0" else value
        assert read(backend, key, len(expected)) == expected
    digits = "0123456789abcdef"
    assert shard_dirs(root) == [f"{a}/{b}" for a in digits for b in digits]
    assert sorted(p.name for p in root.iterdir()) == list(digits)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.rec")) == sorted(
        f"{n[0]}/{n[1]}/{n}" for n in map(file_name, values)
    )
    backend.close()


def test_the_older_trees_empty_directories_go_even_with_nothing_to_move(tmp_path, direct_psync):
    """Left by a migration that stopped after its renames, or by an older store whose
    objects were all evicted: they go at the next open. Directories of no layout stay."""
    files = tmp_path / "files"
    for first, second in [("ab", "cd"), ("12", "34"), ("ff", "00")]:
        (files / first / second).mkdir(parents=True)
    mine = [files / "mine", files / "lost+found", files / "ab" / "notes"]
    for path in mine:
        path.mkdir(parents=True)
    backend = open_backend(tmp_path, direct_psync)
    assert sorted(p.name for p in files.iterdir()) == sorted(list("0123456789abcdef") + ["ab", "lost+found", "mine"])
    assert all(path.is_dir() for path in mine) and not (files / "ab" / "cd").exists()
    backend.close()


MOVE_CHILD = """
import os, signal, sys
from pathlib import Path
import gdskv.tiers.backends.file_per_key as fpk
from gdskv.gds import make_engine
root, step, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
done = [0]
def dying(real):
    def call(*args):
        done[0] += 1
        if done[0] > kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)
    return call
if step == "link":
    os.link = dying(os.link)
elif step == "unlink":
    os.unlink = dying(os.unlink)
else:
    Path.rmdir = dying(Path.rmdir)
backend = fpk.FilePerKeyBackend(Path(root), make_engine("psync", direct=True), capacity=64 << 20)
backend.recover()
print("recovered")
"""


def test_sigkill_while_the_older_trees_files_move_into_place(tmp_path, direct_psync):
    """An open that moves the files of the older tree into place is killed with SIGKILL
    after a given number of its links (three times), of its unlinks of the old names (twice),
    then while it removes the older tree's directories. No file is ever lost, and the next
    open finishes the job: every object is there with its own bytes, under one name, and the
    older tree is gone."""
    import signal
    import subprocess
    import sys

    values = {f"k{i}".encode(): block(i, 4096 + i % 7) for i in range(1200)}
    backend = open_backend(tmp_path, direct_psync, capacity=64 * MiB)
    keys = list(values)
    for start in range(0, len(keys), 100):
        backend.write(items({key: values[key] for key in keys[start : start + 100]}))
    backend.close()
    to_older_tree(tmp_path, backend, values)
    most_names = 0
    for step, kill_after in [("link", 0), ("link", 300), ("unlink", 150), ("link", 600), ("unlink", 100), ("rmdir", 40)]:
        proc = subprocess.run([sys.executable, "-c", MOVE_CHILD, str(tmp_path), step, str(kill_after)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
        records = list((tmp_path / "files").glob("*/*/*.rec"))
        assert {p.name for p in records} == {file_name(key) for key in values}  # under one name or two
        most_names = max(most_names, len(records))
    assert most_names > len(values)  # a kill between a link and its unlink left both names
    again = open_backend(tmp_path, direct_psync, capacity=64 * MiB, verify_on_open="full")
    assert sorted(again.keys()) == sorted(values)
    for key, value in values.items():
        assert read(again, key, len(value)) == value
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == list("0123456789abcdef")
    assert len(list((tmp_path / "files").glob("*/*/*.rec"))) == len(values)
    again.close()


def test_a_moved_file_is_durable_at_its_place_before_its_old_name_goes(tmp_path, direct_psync, monkeypatch):
    """Where a rename's two directory entries may reach the disk in either order (ext4
    without a journal), a power loss in the middle of a move could leave the file with no
    name. So its place's directory is fsynced before the old name is unlinked."""
    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    values = {f"k{i}".encode(): block(i, 3000) for i in range(20)}
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items(values))
    backend.close()
    to_older_tree(tmp_path, backend, values)
    events = []
    real_fsync_dir, real_unlink = fpk_sync.fsync_dir, os.unlink
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (events.append(("fsync", str(path))), real_fsync_dir(path)))
    monkeypatch.setattr(os, "unlink", lambda path, **kw: (events.append(("unlink", str(path))), real_unlink(path, **kw)))
    backend = open_backend(tmp_path, direct_psync)
    monkeypatch.undo()
    for key in values:
        place, old = backend.path_of(key), old_place(tmp_path, key)
        gone = events.index(("unlink", str(old)))
        assert ("fsync", str(place.parent)) in events[:gone]
        assert ("fsync", str(old.parent)) in events[gone:]
        assert read(backend, key, 3000) == values[key]
    backend.close()


def test_files_move_by_rename_where_the_filesystem_has_no_hard_links(tmp_path, direct_psync, monkeypatch):
    values = {f"k{i}".encode(): block(i, 3000) for i in range(10)}
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items(values))
    backend.close()
    to_older_tree(tmp_path, backend, values)

    def no_links(src, dst, **kw):
        raise OSError(errno.EPERM, "Operation not permitted", str(src))

    monkeypatch.setattr(os, "link", no_links)
    backend = open_backend(tmp_path, direct_psync)
    monkeypatch.undo()
    assert all(read(backend, key, 3000) == value for key, value in values.items())
    assert not any(old_place(tmp_path, key).exists() for key in values)
    backend.close()


def test_deleting_an_older_copy_of_a_key_is_made_durable(tmp_path, direct_psync, monkeypatch):
    """Otherwise a power loss after the key's removal could bring the older copy back."""
    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(1, 3000)}))
    older = backend.path_of(b"k").read_bytes()
    backend.write(items({b"k": block(2, 3000)}))
    backend.close()
    stale = old_place(tmp_path, b"k")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(older)
    synced = []
    real = fpk_sync.fsync_dir
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(str(path)), real(path)))
    backend = open_backend(tmp_path, direct_psync)
    assert not stale.exists() and str(stale.parent) in synced
    assert read(backend, b"k", 3000) == block(2, 3000)
    backend.close()


def test_writes_run_one_at_a_time(tmp_path, direct_psync, monkeypatch, sync):
    """A write held after its renames keeps a second write waiting: an eviction of one could
    otherwise take the other's new file, and two writes of a key would share its temporary
    name. Reads go on meanwhile and see the first write's value."""
    import threading

    from gates import Gate, still_waiting

    backend = open_backend(tmp_path, direct_psync, sync=sync)
    gates = []
    after_renames(backend, monkeypatch, lambda real: gates.append(Gate(real)) or gates[0])
    first = threading.Thread(target=lambda: backend.write(items({b"k": block(1, 5000)})))
    first.start()
    gate = gates[0]
    gate.wait_reached()
    second = still_waiting(lambda: backend.write(items({b"k": block(2, 5000), b"other": block(3, 100)})))
    try:
        assert b"other" not in backend.keys()
        assert read(backend, b"k", 5000) == block(1, 5000)  # indexed with its rename
    finally:
        gate.open()
        first.join(10)
        second.join(10)
    assert read(backend, b"k", 5000) == block(2, 5000) and read(backend, b"other", 100) == block(3, 100)
    backend.close()


def test_a_failed_write_that_made_a_shard_again_still_syncs_its_parents(tmp_path, direct_psync, monkeypatch):
    """The write that makes a removed shard directory again fails after the mkdir (its
    fdatasync: EIO). It fsyncs the directories that gained an entry before it raises, so
    the directory stays and later writes stop fsyncing ``files/`` for it."""
    import shutil

    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    backend = open_backend(tmp_path, direct_psync, sync="file")
    root = tmp_path / "files"
    name = file_name(b"first")
    shutil.rmtree(root / name[0])
    synced = []
    real_fsync_dir = fpk_sync.fsync_dir
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(str(path)), real_fsync_dir(path)))
    real_fdatasync = os.fdatasync

    def failing(fd):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(IoError):
        backend.write(items({b"first": block(1, 5000)}))
    monkeypatch.setattr(os, "fdatasync", real_fdatasync)
    assert (root / name[0] / name[1]).is_dir()
    assert str(root) in synced and str(root / name[0]) in synced
    other = next(k for k in (b"k%d" % i for i in range(100_000)) if file_name(k)[0] != name[0])
    synced.clear()
    backend.write(items({other: block(2, 5000)}))
    assert str(root) not in synced and str(root / name[0]) not in synced
    assert read(backend, other, 5000) == block(2, 5000) and read(backend, b"first", 5000) is None
    backend.close()


@pytest.mark.parametrize("open_files", [0, None], ids=["uncached", "cached"])
def test_a_read_during_an_overwrite_gets_the_new_value_and_drops_nothing(tmp_path, direct_psync, monkeypatch, open_files, sync):
    """An overwrite renames its file into place and indexes it in one hold of the lock, so
    a read never checks the new file against the old entry (before, that was a miss, and
    with the header unreadable the new file was deleted). During its directory fsyncs a
    read gets the new value, through the path or the new file's cached descriptor."""
    backend = open_backend(tmp_path, direct_psync, open_files=open_files, sync=sync)
    old, new = block(1, 10_000), block(2, 10_000)
    backend.write(items({b"k": old}))
    with overwrite_held_after_its_rename(backend, monkeypatch, b"k", new):
        assert read(backend, b"k", len(new)) == new
    assert read(backend, b"k", len(new)) == new and backend.counters["corrupt_reads"] == 0
    backend.close()


def test_a_file_that_cannot_be_opened_for_now_is_kept(tmp_path, direct_psync):
    """EMFILE (the process is at its descriptor limit) passes: the read is a miss counted in
    read_errors, but the intact file and its entry stay. Only a file that is gone (ENOENT)
    drops the replica."""
    backend = open_backend(tmp_path, direct_psync, open_files=0)  # every read opens its file
    value = block(1, 5000)
    backend.write(items({b"k": value}))
    path = backend.path_of(b"k")
    with out_of_descriptors():
        got = read(backend, b"k", len(value))
    assert got is None and backend.counters["read_errors"] == 1
    assert path.exists() and backend.keys() == [b"k"]
    assert read(backend, b"k", len(value)) == value
    os.unlink(path)  # really gone: a miss, and the replica is dropped
    assert read(backend, b"k", len(value)) is None
    assert backend.counters["read_errors"] == 2 and backend.keys() == []
    backend.close()


def test_check_racing_an_overwrite_never_drops_the_new_file(tmp_path, direct_psync, monkeypatch, sync):
    """check() reads files outside the lock. An overwrite renames its file into place before
    it updates the index; a check() in that window finds the new file against the old entry.
    It must not call it corrupt and unlink it: that file is the value the write is about to
    acknowledge."""
    backend = open_backend(tmp_path, direct_psync, sync=sync)
    old, new = block(1, 10_000), block(2, 10_000)
    backend.write(items({b"k": old, b"other": old}))
    with overwrite_held_after_its_rename(backend, monkeypatch, b"k", new):
        dropped = backend.check()
    assert dropped == [] and backend.counters["corrupt_reads"] == 0
    assert backend.path_of(b"k").exists() and read(backend, b"k", len(new)) == new
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert sorted(again.keys()) == [b"k", b"other"] and read(again, b"k", len(new)) == new
    again.close()


def test_the_evict_listener_hears_each_victim_before_its_file_goes(tmp_path, direct_psync):
    """Two-phase eviction (see base.py): the listener is called, with the lock held, with the
    keys a write evicts for room, while their files are still on disk."""
    backend = open_backend(tmp_path, direct_psync, capacity=MiB)
    heard = []

    def listener(keys):
        assert backend._lock.locked()
        heard.append([(key, backend.path_of(key).exists()) for key in keys])

    backend.evict_listener = listener
    evicted = []
    for i in range(20):
        evicted += backend.write(items({f"f{i}".encode(): block(i, 100_000)}))  # ~2 MiB of records
    assert evicted and [key for call in heard for key, _ in call] == evicted
    assert all(existed for call in heard for _, existed in call)
    assert not any(backend.path_of(key).exists() for key in evicted)
    assert backend.remove(b"f19") and backend.check() == []  # neither is an eviction
    assert [key for call in heard for key, _ in call] == evicted
    backend.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reads_use_the_descriptors_writes_kept_and_nothing_leaks(tmp_path, direct_psync):
    """A write keeps each new file's descriptor for reads (after the rename it is the
    record's file). Overwriting, removing or evicting a key closes its descriptor, and so
    does close(): no descriptor outlives its file or the backend."""
    before = open_fds()
    backend = open_backend(tmp_path, direct_psync, capacity=2 * MiB, open_files=64)
    baseline = open_fds()  # the backend's own (engine, threads)
    values = {f"k{i}".encode(): block(i, 50_000 + i) for i in range(10)}
    backend.write(items(values))
    assert open_fds() == baseline + 10
    for key, value in values.items():
        assert read(backend, key, len(value)) == value
    stats = backend.stats()
    assert (stats["open_files"], stats["open_file_hits"], stats["open_file_opens"]) == (10, 10, 0)

    values[b"k0"] = block(99, 70_000)
    backend.write(items({b"k0": values[b"k0"]}))  # the old file's descriptor goes
    assert open_fds() == baseline + 10 and read(backend, b"k0", 70_000) == values[b"k0"]
    assert backend.remove(b"k1") and open_fds() == baseline + 9
    evicted = backend.write(items({b"big": block(7, 1_800_000)}))  # evicts for room
    assert evicted and open_fds() == baseline + 9 - len(evicted) + 1
    for key in set(values) - set(evicted) - {b"k1"}:
        assert read(backend, key, len(values[key])) == values[key]
    backend.close()
    assert open_fds() == before


def test_at_most_open_files_descriptors_stay_open(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync, open_files=3)
    baseline = open_fds()
    values = {f"k{i}".encode(): block(i, 5000) for i in range(12)}
    backend.write(items(values))
    assert open_fds() == baseline + 3
    for key, value in values.items():  # most reads open their file, then keep it
        assert read(backend, key, len(value)) == value
        assert open_fds() == baseline + 3
    assert backend.stats()["open_file_opens"] >= 9
    backend.close()


def test_a_backend_out_of_descriptors_closes_its_cached_ones(tmp_path, direct_psync):
    """When the process hits its descriptor limit, the backend closes its idle cached descriptors
    and opens again: writes and reads go on, they only lose the cache."""
    backend = open_backend(tmp_path, direct_psync, open_files=1000)
    values = {f"k{i}".encode(): block(i, 5000) for i in range(40)}
    backend.write(items(values))
    with out_of_descriptors():
        values[b"new"] = block(77, 6000)
        backend.write(items({b"new": values[b"new"]}))
        assert backend.stats()["open_files"] == 1
        for key, value in values.items():
            assert read(backend, key, len(value)) == value
    backend.close()


@pytest.mark.parametrize("other_name", ["hard link", "symlink"])
def test_a_victims_file_with_another_name_is_not_reused(tmp_path, direct_psync, other_name):
    """A record file that is also a hard link elsewhere (a ``cp -al`` snapshot of the store)
    or a symlink to a file elsewhere keeps its bytes: the eviction unlinks the name instead
    of overwriting the file with another key's record."""
    from gdskv.tiers.backends.record import record_size

    size = 100_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size))
    backend.write(items({b"k0": block(0, size)}))
    path = backend.path_of(b"k0")
    elsewhere = tmp_path / "elsewhere"
    if other_name == "hard link":
        os.link(path, elsewhere)
    else:
        os.replace(path, elsewhere)
        os.symlink(elsewhere, path)
    before = elsewhere.read_bytes()
    assert backend.write(items({b"k1": block(1, size)})) == [b"k0"]
    assert backend.stats()["files_reused"] == 0 and elsewhere.read_bytes() == before
    assert read(backend, b"k1", size) == block(1, size)
    backend.close()


def test_a_write_that_evicts_writes_into_the_evicted_files(tmp_path, direct_psync):
    """A full tier's steady state: each victim's file becomes a new object's file,
    overwritten in place and cut or grown to its record's size; nothing of the old object
    shows, and a reopen that verifies every file finds exactly the live keys."""
    from gdskv.tiers.backends.record import record_size

    big, small = 300_000, 5000
    backend = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, big), sync="file")
    backend.write(items({b"k0": block(0, big)}))
    backend.write(items({b"k1": block(1, big)}))
    inodes = {key: os.stat(backend.path_of(key)).st_ino for key in (b"k0", b"k1")}
    values = {b"k2": block(2, small), b"k3": block(3, big + 70_000)}
    assert backend.write(items(values)) == [b"k0", b"k1"]
    assert backend.stats()["files_reused"] == 2
    for key, victim in ((b"k2", b"k0"), (b"k3", b"k1")):
        data = backend.path_of(key).read_bytes()
        assert os.stat(backend.path_of(key)).st_ino == inodes[victim]  # the same file, rewritten
        assert len(data) == record_size(len(key), len(values[key]))  # cut (k2) or grown (k3)
        assert data[4096 : 4096 + len(values[key])] == values[key]
        assert data[4096 + len(values[key]) :] == bytes(len(data) - 4096 - len(values[key]))
    assert sorted(n for n in all_files(tmp_path / "files")) == sorted(str(backend.path_of(k)) for k in values)
    for key, value in values.items():
        assert read(backend, key, len(value)) == value
    backend.close()
    again = open_backend(tmp_path, direct_psync, capacity=2 * record_size(2, big), verify_on_open="full")
    assert sorted(again.keys()) == sorted(values)
    for key, value in values.items():
        assert read(again, key, len(value)) == value
    again.close()


def test_a_file_being_read_is_not_reused(tmp_path, direct_psync, sync):
    """A victim with a read in flight keeps its file to that read (unlinked, not reused nor
    kept as a spare): the read returns the victim's bytes, and the new object gets a new
    file."""
    import threading

    from gates import Gate
    from gdskv.gds.engine import IoOp
    from gdskv.tiers.backends.record import record_size

    size = 100_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size), sync=sync)
    backend.write(items({b"k0": block(0, size)}))
    gate = backend.engine.submit = Gate(backend.engine.submit, when=lambda requests: requests[0].op is IoOp.READ)
    got = []
    reader = threading.Thread(target=lambda: got.append(read(backend, b"k0", size)))
    reader.start()
    try:
        gate.wait_reached()  # k0's descriptor is pinned by the read, not yet submitted
        assert backend.write(items({b"k1": block(1, size)})) == [b"k0"]
    finally:
        gate.open()
        reader.join(10)
    assert got == [block(0, size)] and backend.stats()["files_reused"] == backend.stats()["spare_files"] == 0
    assert read(backend, b"k1", size) == block(1, size) and backend.keys() == [b"k1"]
    backend.close()


@pytest.mark.timeout(120)
def test_sigkill_while_every_write_evicts_and_reuses_files(tmp_path, direct_psync, sync):
    """A child writes into a small tier, so that every batch evicts older objects and takes
    their files, and removes a key after each batch; it is killed with SIGKILL at seeded
    random points, six times on the same directory. Each reopen (verifying every file)
    finds only intact objects with their own bytes, no key that a remove() acknowledged,
    every key of the last batch acknowledged (but one whose remove() was cut short), and no
    temporary file left behind."""
    import json
    import random
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import uring_unavailable
    from file_per_key_child import value_of

    child = Path(__file__).with_name("file_per_key_child.py")
    capacity, per_batch = 8 * MiB, 8  # a batch is at most 1.6 MiB: one in flight never evicts the last
    removed: set = set()
    first = 0
    for run in range(6):
        rng = random.Random(run)
        options = {"path": str(tmp_path), "capacity": capacity, "per_batch": per_batch, "first": first,
                   "uring": not uring_unavailable() and run % 2 == 0, "sync": sync}
        proc = subprocess.Popen([sys.executable, str(child), json.dumps(options)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        kill_after, last_batch, lines, removing = rng.randrange(4, 14), None, [], None
        with proc:
            assert proc.stdout is not None
            for line in proc.stdout:  # to the end: lines the child wrote before it died count too
                lines.append(line.rstrip())
                word, *args = line.split()
                if word == "wrote":
                    last_batch = range(int(args[0]), int(args[1]) + 1)
                    kill_after -= 1
                elif word == "removing":
                    removing = int(args[0])  # until it returns, it may or may not have happened
                elif word == "removed":
                    removing = None
                    if args[1] == "True":
                        removed.add(int(args[0]))
                if kill_after == 0:
                    time.sleep(rng.uniform(0, 0.02))  # inside the next batch, at a seeded point
                    proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL and "Traceback" not in "\n".join(lines), lines
        assert last_batch is not None
        backend = FilePerKeyBackend(tmp_path, direct_psync, capacity=capacity, verify_on_open="full")
        assert backend.recover().dropped_corrupt == 0  # torn (temporary) files are expected
        keys = {int(k.decode()[1:]) for k in backend.keys()}
        assert not keys & removed, f"removed keys came back: {sorted(keys & removed)}"
        assert set(last_batch) - removed - {removing} <= keys, "an acknowledged batch is missing"
        for n in keys:
            assert read(backend, f"k{n}".encode(), len(value_of(n))) == value_of(n)
        assert not [f for f in all_files(tmp_path / "files") if f.endswith(".tmp")]
        assert backend.stats()["corrupt_reads"] == 0
        backend.close()
        first = last_batch[-1] + 1 + per_batch  # past the batch the kill cut short


def test_a_remove_between_an_overwrites_rename_and_its_index_wins(tmp_path, direct_psync, monkeypatch, sync):
    """An overwrite renames its file into place before it updates the index. A remove() in
    between finds the old entry and unlinks the path, which is the new file by then. The
    write must not index (and serve through its descriptor) a file that is gone: the
    remove came last, the key stays absent, in memory and after a reopen alike."""
    backend = open_backend(tmp_path, direct_psync, sync=sync)
    old, new = block(1, 10_000), block(2, 10_000)
    backend.write(items({b"k": old, b"other": old}))
    used = backend.used_bytes
    with overwrite_held_after_its_rename(backend, monkeypatch, b"k", new):
        assert backend.remove(b"k")
    assert backend.keys() == [b"other"] and read(backend, b"k", len(new)) is None
    assert backend.used_bytes == used // 2 and backend.stats()["open_files"] == 1
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert again.keys() == [b"other"]
    again.close()


def test_reusing_a_file_read_before_works_through_the_kvikio_engine(tmp_path, sync):
    """kvikio keeps a handle per descriptor and file: after a restart, a read opens an object
    read-only; a write that evicts it (or, in "filesystem" mode, the write after it) reuses
    that very file (and descriptor number) for writing."""
    from gds.test_kvikio_engine import GPU, fake_kvikio
    from gdskv.gds.kvikio_engine import KvikioEngine
    from gdskv.tiers.backends.record import record_size

    size = 100_000
    capacity = 2 * record_size(2, size)
    engine = KvikioEngine(device=GPU, kvikio_module=fake_kvikio(compat=True))
    backend = FilePerKeyBackend(tmp_path, engine, capacity=capacity, sync=sync)
    backend.recover()
    backend.write(items({b"k0": block(0, size), b"k1": block(1, size)}))
    backend.close()
    engine.close()
    engine = KvikioEngine(device=GPU, kvikio_module=fake_kvikio(compat=True))  # a restart
    backend = FilePerKeyBackend(tmp_path, engine, capacity=capacity, sync=sync)
    backend.recover()
    assert read(backend, b"k0", size) == block(0, size)
    assert backend.write(items({b"k2": block(2, size)})) == [b"k0"]
    if sync == "filesystem":  # k0's file is a spare now: the next write takes it
        assert backend.stats()["files_reused"] == 0
        assert backend.write(items({b"k3": block(3, size)})) == [b"k1"]
    assert backend.stats()["files_reused"] == 1
    live = [b"k2", b"k3"] if sync == "filesystem" else [b"k1", b"k2"]
    assert sorted(backend.keys()) == live and all(read(backend, k, size) == block(int(k[1:]), size) for k in live)
    backend.close()
    engine.close()


def test_a_write_that_fails_after_its_renames_indexes_what_they_put_in_place(tmp_path, direct_psync, monkeypatch, sync):
    """When a directory fsync (or the syncfs) fails after the files were renamed into
    place, the write fails, but the paths hold the new (synced) files: the index takes them,
    so reads serve what a reopen finds, and a retry overwrites them."""
    from gdskv.errors import IoError

    backend = open_backend(tmp_path, direct_psync, sync=sync)
    old, new = block(1, 10_000), block(2, 12_000)
    backend.write(items({b"k": old}))

    def failing(real):
        def call(target):
            raise OSError(errno.EIO, "Input/output error")
        return call

    after_renames(backend, monkeypatch, failing)
    with pytest.raises(IoError) as info:
        backend.write(items({b"k": new, b"n": old}))
    assert info.value.context["errno"] == errno.EIO and info.value.context["path"].startswith(str(tmp_path))
    monkeypatch.undo()
    assert sorted(backend.keys()) == [b"k", b"n"] and read(backend, b"k", len(new)) == new
    assert backend.used_bytes == sum(os.path.getsize(p) for p in all_files(tmp_path / "files"))
    backend.write(items({b"k": new}))  # the retry
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert sorted(again.keys()) == [b"k", b"n"] and read(again, b"k", len(new)) == new
    again.close()


def test_a_remove_whose_file_cannot_be_deleted_keeps_the_key(tmp_path, direct_psync, monkeypatch):
    """unlink fails (EPERM: an immutable directory, say): remove() raises IoError and the
    key stays, readable; before, it was forgotten and came back at the next open."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(1, 5000)}))
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", failing_for(backend.path_of(b"k"), real_unlink, errno.EPERM))
    with pytest.raises(IoError) as info:
        backend.remove(b"k")
    assert info.value.context["errno"] == errno.EPERM
    assert read(backend, b"k", 5000) == block(1, 5000)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert backend.remove(b"k") and not backend.remove(b"k")
    backend.close()
    again = open_backend(tmp_path, direct_psync)
    assert again.keys() == []
    again.close()


def test_check_out_of_descriptors_judges_nothing(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync, open_files=0)
    values = {f"k{i}".encode(): block(i, 3000) for i in range(6)}
    backend.write(items(values))
    with out_of_descriptors():
        assert backend.check() == []
    assert sorted(backend.keys()) == sorted(values) and all(backend.path_of(k).exists() for k in values)
    backend.close()


def test_an_eviction_whose_directory_fsync_fails_is_made_durable_by_the_next_remove(tmp_path, direct_psync, monkeypatch):
    """The victim is gone from the index at once; its directory's fsync failed, so the next
    remove() (of the victim, say, which finds it absent) fsyncs it before it returns, or
    raises while it cannot."""
    import gdskv.tiers.backends.file_per_key.sync as fpk_sync
    from gdskv.tiers.backends.record import record_size

    size = 50_000
    backend = open_backend(tmp_path, direct_psync, capacity=record_size(2, size), sync="file")
    backend.write(items({b"k0": block(0, size)}))
    victim_dir = str(backend.path_of(b"k0").parent)
    real = fpk_sync.fsync_dir
    failing = [True]
    synced = []

    def fsync_dir(path):
        synced.append(str(path))
        if str(path) == victim_dir and failing[0]:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(fpk_sync, "fsync_dir", fsync_dir)
    assert backend.write(items({b"k1": block(1, size)})) == [b"k0"]
    # k0's old name may still name its file after a crash: the write did not take that file
    assert backend.stats()["files_reused"] == 0 and read(backend, b"k1", size) == block(1, size)
    assert not [f for f in all_files(tmp_path / "files") if f.endswith(".tmp")]
    with pytest.raises(IoError):
        backend.remove(b"k0")
    failing[0] = False
    synced.clear()
    assert not backend.remove(b"k0") and victim_dir in synced
    synced.clear()
    assert not backend.remove(b"k0") and synced == []  # done: nothing pending any more
    backend.close()


def test_close_waits_for_the_write_in_progress(tmp_path, direct_psync, monkeypatch):
    """close() during a write: before, the write found its sync threads shut down, closed
    descriptors with writes in flight and left its reservation and temporary files."""
    import threading

    from gates import Gate, still_waiting

    backend = open_backend(tmp_path, direct_psync, sync="file")
    gate = Gate(os.fdatasync)  # the first file's sync: the others are still to be handed out
    monkeypatch.setattr(os, "fdatasync", gate)
    writer = threading.Thread(target=lambda: backend.write(items({f"k{i}".encode(): block(i, 5000) for i in range(8)})))
    writer.start()
    gate.wait_reached()
    closer = still_waiting(backend.close)
    gate.open()
    writer.join(10)
    closer.join(10)
    assert not closer.is_alive() and not list((tmp_path / "files").glob("*/*/*.tmp"))
    again = open_backend(tmp_path, direct_psync)
    assert len(again.keys()) == 8
    again.close()


def keys_in_one_shard(count: int):
    """``count`` keys whose files share a shard directory."""
    by_shard = {}
    for i in range(1_000_000):
        key = b"k%d" % i
        shard = by_shard.setdefault(file_name(key)[:2], [])
        shard.append(key)
        if len(shard) == count:
            return shard
    raise AssertionError("unreachable")


def test_a_directory_an_eviction_leaves_unsynced_during_a_remove_stays_for_the_next(tmp_path, direct_psync, monkeypatch):
    """A remove() fsyncs the pending directories; meanwhile an eviction's fsync of one of
    them fails. That directory must stay pending for the next remove(): before, the first
    remove() took it off the list after its own (earlier) fsync."""
    import threading

    import gdskv.tiers.backends.file_per_key.sync as fpk_sync
    from gdskv.tiers.backends.record import record_size

    victim, removed = keys_in_one_shard(2)
    size = record_size(len(victim), 100)
    backend = open_backend(tmp_path, direct_psync, capacity=2 * size, sync="file")
    backend.write(items({victim: block(1, 100)}))  # the oldest: the next write evicts it
    backend.write(items({removed: block(2, 100)}))
    shard = backend.path_of(victim).parent
    real = fpk_sync.fsync_dir
    remove_synced, eviction_done = threading.Event(), threading.Event()
    state = {"evicting": False}

    def fsync_dir(path):
        if state["evicting"] and path == shard:
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path)
        if path == shard and not remove_synced.is_set() and not state["evicting"]:
            remove_synced.set()  # the remove() has fsynced the shard; it pauses here
            eviction_done.wait(10)

    monkeypatch.setattr(fpk_sync, "fsync_dir", fsync_dir)
    remover = threading.Thread(target=lambda: backend.remove(removed))
    remover.start()
    assert remove_synced.wait(10)
    state["evicting"] = True
    filler = next(n for n in range(100, 1 << 20, 64) if record_size(6, n) == 2 * size)
    assert backend.write(items({b"filler": block(3, filler)})) == [victim]
    state["evicting"] = False
    eviction_done.set()
    remover.join(10)
    synced = []
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(path), real(path)))
    assert not backend.remove(victim) and shard in synced
    backend.close()


def test_directories_a_failed_write_could_not_sync_are_synced_once_by_the_next_write(tmp_path, direct_psync, monkeypatch):
    """The write that made a shard again fails, and so does its fsync of the directories that
    gained it: the next write fsyncs them, and the ones after it no longer do."""
    import shutil

    import gdskv.tiers.backends.file_per_key.sync as fpk_sync

    backend = open_backend(tmp_path, direct_psync, sync="file")
    root = tmp_path / "files"
    name = file_name(b"first")
    shutil.rmtree(root / name[0])
    real_fsync_dir, real_fdatasync = fpk_sync.fsync_dir, os.fdatasync
    monkeypatch.setattr(os, "fdatasync", failing_for_any(errno.EIO))
    monkeypatch.setattr(fpk_sync, "fsync_dir", failing_for_any(errno.EIO))
    with pytest.raises(IoError):
        backend.write(items({b"first": block(1, 5000)}))
    monkeypatch.setattr(os, "fdatasync", real_fdatasync)
    synced = []
    monkeypatch.setattr(fpk_sync, "fsync_dir", lambda path: (synced.append(str(path)), real_fsync_dir(path)))
    others = [k for k in (b"k%d" % i for i in range(100_000)) if file_name(k)[0] != name[0]][:2]
    backend.write(items({others[0]: block(2, 100)}))
    assert str(root) in synced
    synced.clear()
    backend.write(items({others[1]: block(3, 100)}))
    assert synced == [str(backend.path_of(others[1]).parent)]
    backend.close()


def failing_for_any(code: int):
    def call(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return call


def test_an_eviction_never_waits_behind_sync_jobs_that_wait_for_its_lock(tmp_path, direct_psync, monkeypatch):
    """A write evicts holding the lock and waits for its directory fsyncs. A remove() has
    filled the shared sync threads with fsyncs that, out of descriptors, wait for that lock
    to shed cached ones. The eviction's fsyncs must not queue behind them (a deadlock)."""
    import threading

    import gdskv.tiers.backends.file_per_key.sync as fpk_sync
    from gdskv.tiers.backends.record import record_size

    keys = [k for k in (b"old%d" % i for i in range(100_000))][:20]
    size = record_size(len(keys[0]), 100)
    backend = open_backend(tmp_path, direct_psync, capacity=20 * size, sync="file")
    backend.write(items({k: block(i, 100) for i, k in enumerate(keys)}))
    real = fpk_sync.fsync_dir
    shared_busy = threading.Semaphore(0)
    lock_taken = threading.Event()

    def fsync_dir(path):
        if threading.current_thread().name.startswith("gdskv-fsync_") and not lock_taken.is_set() and state["remove"]:
            shared_busy.release()
            lock_taken.wait(10)  # the write now holds the lock and evicts
            raise OSError(errno.EMFILE, "Too many open files", str(path))  # -> takes the lock to shed
        return real(path)

    state = {"remove": False}
    monkeypatch.setattr(fpk_sync, "fsync_dir", fsync_dir)
    with backend._lock:
        backend._pending_dirs.update(tmp_path / "files" / a / b for a in "0123456789abcdef" for b in "01")
    state["remove"] = True
    def remove():
        with contextlib.suppress(IoError):  # its fsyncs may fail (out of descriptors): not the point
            backend.remove(b"absent")

    remover = threading.Thread(target=remove, daemon=True)
    remover.start()
    for _ in range(fpk_sync.SYNC_THREADS):
        assert shared_busy.acquire(timeout=10)  # every shared sync thread is taken
    state["remove"] = False
    backend.evict_listener = lambda evicted: lock_taken.set()
    writer = threading.Thread(target=lambda: backend.write(items({b"new": block(99, 100 * 30)})), daemon=True)
    writer.start()
    writer.join(15)
    remover.join(15)
    assert not writer.is_alive() and not remover.is_alive()
    backend.close()


@contextlib.contextmanager
def immutable(path):
    """``chattr +i`` on ``path`` for the body (no unlink, no rename); skips where refused."""
    import subprocess

    try:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no chattr on this machine")
    if done.returncode != 0:
        pytest.skip(f"chattr +i refused here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("then", ["remove", "evict again"])
def test_an_evicted_file_that_cannot_be_deleted_never_comes_back(tmp_path, direct_psync, then):
    """An eviction that cannot delete its victim's file (here an immutable one: no unlink,
    no rename) remembers it. A remove() of the key deletes it (or raises while it cannot),
    and every later eviction tries again. Before, it was forgotten: remove() returned False
    at once, and the next open brought the removed key back."""
    backend = open_backend(tmp_path, direct_psync, capacity=MiB)
    backend.write(items({b"stuck": block(1, 100_000)}))
    path = backend.path_of(b"stuck")
    with immutable(path):
        for i in range(10):  # ~1 MiB more: "stuck", the oldest, is evicted
            backend.write(items({f"f{i}".encode(): block(10 + i, 100_000)}))
        assert b"stuck" not in backend.keys() and path.exists()
        assert backend.layout_stats()["undeleted_files"] == 1
        with pytest.raises(IoError):
            backend.remove(b"stuck")
    if then == "remove":
        assert not backend.remove(b"stuck")  # it was not stored; its file is gone now
    else:
        backend.write(items({b"more": block(99, 100_000)}))  # evicts again: tries it again
    assert not path.exists() and backend.layout_stats()["undeleted_files"] == 0
    backend.close()
    again = open_backend(tmp_path, direct_psync, capacity=MiB)
    assert b"stuck" not in again.keys()
    again.close()


def test_a_new_write_of_a_key_whose_old_file_could_not_be_deleted_replaces_it(tmp_path, direct_psync):
    """The key is written again (into room a remove made: no eviction, so no retry of the
    old file) and its rename replaces the old file: the file now at that path is the new
    value's, which a later eviction must not delete as the old one."""
    backend = open_backend(tmp_path, direct_psync, capacity=MiB)
    backend.write(items({b"stuck": block(1, 100_000)}))
    path = backend.path_of(b"stuck")
    with immutable(path):
        for i in range(10):
            backend.write(items({f"f{i}".encode(): block(10 + i, 100_000)}))
        assert backend.layout_stats()["undeleted_files"] == 1
    assert backend.remove(b"f9")
    assert backend.write(items({b"stuck": block(2, 100_000)})) == []  # renamed over the old file
    assert backend.layout_stats()["undeleted_files"] == 0
    assert backend.write(items({b"g": block(3, 100_000)}))  # an eviction: retries what is left
    assert path.exists() and read(backend, b"stuck", 100_000) == block(2, 100_000)
    backend.close()
    again = open_backend(tmp_path, direct_psync, capacity=MiB)
    assert read(again, b"stuck", 100_000) == block(2, 100_000)
    again.close()
