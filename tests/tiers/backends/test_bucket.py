"""The bucket backend's durability: sealing, recovery, superseded copies, removes,
bucket eviction under the cap, readers racing with eviction, check()."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import List

import pytest

from conftest import block
from gates import Gate
from gdskv.errors import IoError
from gdskv.gds.engine import IoFuture
from gdskv.gds.psync import PsyncEngine
from gdskv.tiers.backends.bucket import BucketBackend
from gdskv.tiers.backends.record import checksum, decode_index, record_size
from ondisk import disk_objects, flip, index_files, locate, torn_files

KiB = 1024


class Backends:
    """Opens backends over one directory, each recovered like a store would; closes them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.opened = []

    def open(self, capacity: int = 64 << 20, eviction: str = "fifo", verify_on_open: str = "index") -> BucketBackend:
        engine = PsyncEngine(2)
        backend = BucketBackend(self.root, engine, capacity=capacity, eviction=eviction, verify_on_open=verify_on_open)
        backend.report = backend.recover()
        self.opened.append((backend, engine))
        return backend

    def close_all(self) -> None:
        for backend, engine in self.opened:
            backend.close()
            engine.close()
        self.opened.clear()


@pytest.fixture
def backends(tmp_path):
    b = Backends(tmp_path)
    yield b
    b.close_all()


def write(backend: BucketBackend, values: dict) -> list:
    items = [(k.encode(), memoryview(v), checksum(k.encode(), v)) for k, v in values.items()]
    return backend.write(items)


def read(backend: BucketBackend, key: str):
    info = backend.lookup(key.encode())
    out = bytearray(info.size if info else 1)
    n = backend.read_batch([(key.encode(), memoryview(out))])[0]
    return None if n is None else bytes(out[:n])


def test_sealed_buckets_come_back_with_ids_and_sequences_continuing(backends):
    b = backends.open()
    write(b, {"a": block(1, 5000), "b": block(2, 70 * KiB)})
    write(b, {"c": block(3, 1)})
    seqs = {k: loc.entry.seq for k, loc in disk_objects(backends.root).items()}
    backends.close_all()
    b = backends.open()
    assert (b.report.objects, b.report.containers, b.report.dropped_torn, b.report.dropped_corrupt) == (3, 2, 0, 0)
    assert read(b, "a") == block(1, 5000) and read(b, "b") == block(2, 70 * KiB) and read(b, "c") == block(3, 1)
    write(b, {"d": block(4, 10)})
    d = locate(backends.root, "d")
    assert d.entry.seq > max(seqs.values())
    assert d.index.name > max(p.name for p in index_files(backends.root) if p != d.index)


def test_recovery_deletes_temporaries_and_unsealed_data_and_counts_them(backends):
    b = backends.open()
    write(b, {"a": block(1, 5000)})
    write(b, {"b": block(2, 5000)})
    backends.close_all()
    d = backends.root / "buckets"
    (d / "00000000000000ff.data.tmp").write_bytes(b"half a bucket")
    (d / "00000000000000fe.index.tmp").write_bytes(b"half an index")
    locate(backends.root, "b").index.unlink()  # b's bucket: data without index
    assert len(torn_files(backends.root)) == 3
    b = backends.open()
    assert b.report.dropped_torn == 3 and b.report.objects == 1
    assert torn_files(backends.root) == []
    assert read(b, "a") == block(1, 5000) and read(b, "b") is None


def test_crash_between_new_bucket_and_old_index_rewrite_keeps_the_newest_copy(backends):
    # Overwriting "k" seals the new copy first, then rewrites the old bucket's index without
    # it. A crash in between leaves both copies on disk: recovery must pick the newer one
    # (by sequence number) and finish the rewrite.
    b = backends.open()
    write(b, {"k": block(1, 8 * KiB), "mate": block(2, 8 * KiB)})
    old = locate(backends.root, "k")
    saved = old.index.read_bytes()
    b.remove(b"k")  # what an overwrite does first in the store
    write(b, {"k": block(3, 9 * KiB)})
    backends.close_all()
    old.index.write_bytes(saved)  # as if the rewrite never reached the disk
    assert {e.key for e in decode_index(saved)[2]} == {b"k", b"mate"}
    b = backends.open()
    assert read(b, "k") == block(3, 9 * KiB)
    assert read(b, "mate") == block(2, 8 * KiB)
    assert {e.key for e in decode_index(old.index.read_bytes())[2]} == {b"mate"}  # rewrite finished
    backends.close_all()
    b = backends.open()
    assert read(b, "k") == block(3, 9 * KiB) and b.report.objects == 2


def test_a_superseded_bucket_with_nothing_left_is_deleted_at_recovery(backends):
    b = backends.open()
    write(b, {"k": block(1, 100)})
    old = locate(backends.root, "k")
    saved_data, saved_index = old.data.read_bytes(), old.index.read_bytes()
    write(b, {"k": block(2, 200)})  # supersedes: the old bucket had only "k" and is deleted
    assert not old.index.exists() and not old.data.exists()
    backends.close_all()
    old.data.write_bytes(saved_data)
    old.index.write_bytes(saved_index)
    b = backends.open()
    assert read(b, "k") == block(2, 200) and b.report.containers == 1
    assert not old.index.exists() and not old.data.exists()


def test_remove_rewrites_the_index_and_deletes_an_emptied_bucket(backends):
    b = backends.open()
    write(b, {"a": block(1, 100), "b": block(2, 100)})
    loc = locate(backends.root, "a")
    assert b.remove(b"a") and not b.remove(b"a")
    assert {e.key for e in decode_index(loc.index.read_bytes())[2]} == {b"b"}
    assert b.remove(b"b")
    assert not loc.index.exists() and not loc.data.exists()
    backends.close_all()
    b = backends.open()
    assert b.report.objects == 0 and read(b, "a") is None and read(b, "b") is None


@pytest.mark.parametrize("eviction", ["fifo", "lru"])
def test_bucket_eviction_under_the_cap(backends, eviction):
    size = 60 * KiB
    rec = record_size(2, size)
    b = backends.open(capacity=3 * rec, eviction=eviction)
    for i in range(3):
        assert write(b, {f"k{i}": block(i, size)}) == []
    assert read(b, "k0") == block(0, size)  # under LRU, k0 is now the most recent
    evicted = write(b, {"k3": block(3, size)})
    victim = "k1" if eviction == "lru" else "k0"
    assert evicted == [victim.encode()]
    assert read(b, victim) is None
    assert b.used_bytes <= b.capacity and len(index_files(backends.root)) == 3
    for i in range(4):
        if f"k{i}" != victim:
            assert read(b, f"k{i}") == block(i, size)
    s = b.stats()
    assert s["buckets_evicted"] == 1 and s["objects_evicted"] == 1
    backends.close_all()
    b = backends.open(capacity=3 * rec, eviction=eviction)
    assert read(b, victim) is None and b.report.objects == 3


def test_a_write_that_evicts_writes_into_the_evicted_data_file(backends, tmp_path):
    """A full tier's steady state: the first evicted bucket's data file becomes the new
    bucket's, overwritten in place, cut or grown to the new bucket's size; what it held
    before never shows, and a reopen (verifying every record) finds exactly the live keys."""
    big, small = 60 * KiB, 5000
    b = backends.open(capacity=2 * record_size(2, big))
    write(b, {"k0": block(0, big)})
    write(b, {"k1": block(1, big)})
    os.link(locate(backends.root, "k0").data, tmp_path / "k0-file")  # a second name for k0's file
    assert write(b, {"k2": block(2, small)}) == [b"k0"]
    data = locate(backends.root, "k2").data.read_bytes()
    assert (tmp_path / "k0-file").read_bytes() == data and len(data) == record_size(2, small)  # k0's file, cut
    assert data[4096 + small :] == bytes(8192 - small)  # every byte of it rewritten, padding too
    os.link(locate(backends.root, "k1").data, tmp_path / "k1-file")
    assert write(b, {"k3": block(3, big), "k4": block(4, small)}) == [b"k1"]
    data = locate(backends.root, "k3").data.read_bytes()
    assert (tmp_path / "k1-file").read_bytes() == data and len(data) == record_size(2, big) + record_size(2, small)
    assert b.stats()["files_reused"] == 2
    expected = {"k2": block(2, small), "k3": block(3, big), "k4": block(4, small)}
    assert {k: read(b, k) for k in ("k0", "k1", *expected)} == {"k0": None, "k1": None, **expected}
    assert torn_files(backends.root) == [] and len(index_files(backends.root)) == 2
    backends.close_all()
    b = backends.open(capacity=2 * record_size(2, big), verify_on_open="full")
    assert (b.report.objects, b.report.dropped_corrupt, b.report.dropped_torn) == (3, 0, 0)
    assert {k: read(b, k) for k in ("k0", "k1", *expected)} == {"k0": None, "k1": None, **expected}


def test_a_write_that_evicts_only_buckets_in_use_writes_a_new_file(backends, tmp_path):
    size = 60 * KiB
    b = backends.open(capacity=record_size(2, size))
    write(b, {"k0": block(0, size)})
    os.link(locate(backends.root, "k0").data, tmp_path / "k0-file")
    before = (tmp_path / "k0-file").read_bytes()
    bucket = next(iter(b._buckets.values()))
    bucket.readers += 1  # as a read in flight holds it (the next test has a real one)
    try:
        assert write(b, {"k1": block(1, size)}) == [b"k0"]
    finally:
        bucket.readers -= 1
    assert b.stats()["files_reused"] == 0 and (tmp_path / "k0-file").read_bytes() == before  # untouched
    assert read(b, "k1") == block(1, size)


def test_a_read_in_flight_survives_the_eviction_of_its_bucket(backends):
    size = 60 * KiB
    b = backends.open(capacity=record_size(2, size))
    write(b, {"k0": block(0, size)})
    stem = locate(backends.root, "k0").data.name.split(".")[0]
    reads = b.engine.submit = Gate(b.engine.submit)  # reads go through submit(); writes through run()
    got = []
    reader = threading.Thread(target=lambda: got.append(read(b, "k0")))
    reader.start()
    reads.wait_reached()  # the reader holds k0's bucket pinned, its read not issued yet
    assert write(b, {"k1": block(1, size)}) == [b"k0"]  # evicts the bucket, files unlinked
    assert not any(p.name.startswith(stem) for p in (backends.root / "buckets").iterdir())
    reads.open()
    reader.join(10)
    assert got == [block(0, size)]  # read from the still-open descriptor
    assert read(b, "k0") is None and read(b, "k1") == block(1, size)


def test_a_read_in_flight_survives_close_and_keeps_its_replicas(backends):
    """close() while a read holds buckets pinned (a get racing Store.close()): the read
    finishes on descriptors closed only when it leaves, and no replica is dropped."""
    b = backends.open()
    write(b, {"a": block(1, 5000), "b": block(2, 5000)})
    write(b, {"solo": block(3, 5000)})
    reads = b.engine.submit = Gate(b.engine.submit)
    got = []
    outs = [memoryview(bytearray(5000)), memoryview(bytearray(5000))]
    reader = threading.Thread(target=lambda: got.append(b.read_batch([(b"a", outs[0]), (b"solo", outs[1])])))
    reader.start()
    reads.wait_reached()  # both buckets pinned, the reads not issued yet
    b.close()
    reads.open()
    reader.join(10)
    assert got == [[5000, 5000]] and bytes(outs[0]) == block(1, 5000) and bytes(outs[1]) == block(3, 5000)
    reopened = backends.open()
    assert sorted(reopened.keys()) == [b"a", b"b", b"solo"]


def test_a_read_that_fails_for_want_of_descriptors_keeps_the_replica(backends, monkeypatch):
    """EMFILE (or EBADF, ENOMEM...) says nothing of the replica: a miss, counted, kept."""
    import errno as errno_

    b = backends.open()
    write(b, {"a": block(1, 5000)})
    def refusing(requests):
        return IoFuture.failed(IoError("read failed: Too many open files", errno=errno_.EMFILE, path="x", offset=0))

    monkeypatch.setattr(b.engine, "submit", refusing)
    assert read(b, "a") is None and b.stats()["read_errors"] == 1
    monkeypatch.undo()
    assert read(b, "a") == block(1, 5000)
    assert sorted(backends.open().keys()) == [b"a"]


def test_a_read_into_an_unusable_buffer_keeps_the_replica(backends):
    b = backends.open()
    write(b, {"a": block(1, 5000)})
    assert b.read_batch([(b"a", memoryview(bytes(5000)))]) == [None]  # read-only: the caller's fault
    assert read(b, "a") == block(1, 5000)


def test_check_drops_only_what_is_corrupt(backends):
    b = backends.open()
    write(b, {"a": block(1, 5000), "b": block(2, 5000)})
    loc = locate(backends.root, "b")
    flip(loc.data, loc.entry.value_offset)
    assert b.check() == [b"b"]
    assert read(b, "a") == block(1, 5000) and read(b, "b") is None
    assert b.check() == []


def test_check_does_not_report_objects_removed_or_evicted_while_it_runs(backends, monkeypatch):
    from gdskv.tiers.backends.base import RecordReader

    b = backends.open()
    for i in range(4):
        write(b, {f"k{i}": block(i, 5000)})  # one bucket each
    real = RecordReader.verify

    def verify_after_a_concurrent_remove(reader, fd, path, start, entry):
        if entry.key == b"k1":
            b.remove(b"k1")  # its bucket is emptied: both files are deleted
            return "its bytes are gone"  # what a read of a deleted file would find
        return real(reader, fd, path, start, entry)

    monkeypatch.setattr(RecordReader, "verify", verify_after_a_concurrent_remove)
    assert b.check() == []
    assert b.stats()["corrupt_reads"] == 0
    assert [read(b, f"k{i}") for i in (0, 2, 3)] == [block(i, 5000) for i in (0, 2, 3)]


def test_a_failed_bucket_write_leaves_nothing_behind(backends, tmp_path):
    b = backends.open()
    write(b, {"a": block(1, 100)})
    real_run = b.engine.run

    def failing_run(requests):
        real_run(requests[:1])  # part of the bucket reaches the file, then the disk fails
        raise IoError("injected write failure", path="test")

    b.engine.run = failing_run
    with pytest.raises(IoError):
        write(b, {"b": block(2, 100), "c": block(3, 100)})
    assert torn_files(tmp_path) == [] and len(index_files(tmp_path)) == 1
    assert read(b, "b") is None and b.used_bytes == record_size(1, 100)
    b.engine.run = real_run
    write(b, {"b": block(2, 100)})
    assert read(b, "b") == block(2, 100)
    backends.close_all()
    b = backends.open()
    assert b.report.objects == 2 and b.report.dropped_torn == 0


def test_full_verification_at_open_drops_only_bad_records(backends):
    b = backends.open()
    write(b, {"a": block(1, 5000), "b": block(2, 5000), "c": block(3, 5000)})
    backends.close_all()
    loc = locate(backends.root, "b")
    flip(loc.data, loc.entry.value_offset + 4999)
    b = backends.open(verify_on_open="full")
    assert b.report.dropped_corrupt == 1 and b.report.objects == 2
    assert {e.key for e in decode_index(loc.index.read_bytes())[2]} == {b"a", b"c"}  # persisted
    backends.close_all()
    b = backends.open(verify_on_open="full")
    assert b.report.dropped_corrupt == 0 and b.report.objects == 2


def record_directory_fsyncs(monkeypatch) -> List[List[str]]:
    """Record what a directory held at each of the bucket backend's fsyncs of it (they
    still happen); returns the list the listings go into, oldest first."""
    from gdskv.tiers.backends import bucket as bucket_module
    from gdskv.tiers.backends import files as files_module

    real = files_module.fsync_dir
    listings: List[List[str]] = []

    def recording_fsync_dir(path):
        listings.append(sorted(os.listdir(path)))
        real(path)

    monkeypatch.setattr(files_module, "fsync_dir", recording_fsync_dir)
    monkeypatch.setattr(bucket_module, "fsync_dir", recording_fsync_dir)
    return listings


def test_removing_the_last_key_of_a_bucket_syncs_the_directory(backends, monkeypatch):
    # A remove is durable: deleting an emptied bucket's files must reach the disk (a
    # directory fsync after the unlinks) before remove() returns, as an index rewrite does.
    listings = record_directory_fsyncs(monkeypatch)
    b = backends.open()
    write(b, {"a": block(1, 100)})
    loc = locate(backends.root, "a")
    assert listings and loc.index.name in listings[-1]
    assert b.remove(b"a")
    assert loc.index.name not in listings[-1] and loc.data.name not in listings[-1]


def failing_index_writes(monkeypatch, count: int) -> None:
    """The next ``count`` index rewrites of the bucket backend fail with ENOSPC."""
    import errno

    import gdskv.tiers.backends.bucket as bucket_module

    real = bucket_module.write_file_atomic
    left = [count]

    def write_file_atomic(path, data, **kwargs):
        if left[0]:
            left[0] -= 1
            raise IoError(f"could not write {path.name}: No space left on device", path=str(path), errno=errno.ENOSPC)
        return real(path, data, **kwargs)

    monkeypatch.setattr(bucket_module, "write_file_atomic", write_file_atomic)


def test_a_remove_whose_index_rewrite_fails_changes_nothing(backends, monkeypatch):
    """The key stays, in memory as on disk: a retried remove finds it and makes it durable
    (before, the retry returned False and the key came back at the next open)."""
    b = backends.open()
    write(b, {"a": block(1, 100), "b": block(2, 100)})
    failing_index_writes(monkeypatch, 1)
    with pytest.raises(IoError):
        b.remove(b"a")
    assert read(b, "a") == block(1, 100)
    assert b.remove(b"a") and not b.remove(b"a")
    backends.close_all()
    b = backends.open()
    assert read(b, "a") is None and read(b, "b") == block(2, 100)


def test_an_older_index_that_cannot_be_rewritten_is_rewritten_before_a_remove(backends, monkeypatch):
    """An overwrite of "a" lands in a new bucket; rewriting the older bucket's index without
    "a" fails (the write still succeeds: the newer copy wins at recovery). A remove of "a"
    must rewrite that older index first, or the old value of "a" comes back at reopen."""
    b = backends.open()
    write(b, {"a": block(1, 100), "b": block(2, 100)})
    failing_index_writes(monkeypatch, 1)
    write(b, {"a": block(3, 100)})
    assert read(b, "a") == block(3, 100)
    assert b.remove(b"a")
    backends.close_all()
    b = backends.open()
    assert read(b, "a") is None and read(b, "b") == block(2, 100)


def test_an_older_index_that_cannot_be_rewritten_is_rewritten_before_an_eviction(backends, monkeypatch):
    """As above, but the newer bucket is evicted (LRU: the older one was read since): that
    must not leave the older copy of "a" listed as the newest on disk."""
    b = backends.open(capacity=64 * KiB, eviction="lru")
    write(b, {"a": block(1, 10_000), "b": block(2, 10_000)})  # 32 KiB with their head blocks
    failing_index_writes(monkeypatch, 1)
    write(b, {"a": block(3, 10_000)})  # 16 KiB
    assert read(b, "b") == block(2, 10_000)  # the older bucket is the most recently used
    assert write(b, {"c": block(4, 14_000)}) == [b"a"]  # 20 KiB: evicts "a"'s new bucket
    backends.close_all()
    b = backends.open(capacity=64 * KiB, eviction="lru")
    assert read(b, "a") is None and read(b, "b") == block(2, 10_000)


def test_removing_a_buckets_last_key_whose_directory_sync_fails_is_made_durable_by_the_next_remove(backends, monkeypatch):
    import errno

    import gdskv.tiers.backends.bucket as bucket_module

    b = backends.open()
    write(b, {"a": block(1, 100)})
    real = bucket_module.fsync_dir
    synced = []
    failing = [True]

    def fsync_dir(path):
        synced.append(str(path))
        if failing[0]:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(bucket_module, "fsync_dir", fsync_dir)
    with pytest.raises(IoError):
        b.remove(b"a")
    failing[0] = False
    synced.clear()
    assert not b.remove(b"a") and synced == [str(b.dir)]
    synced.clear()
    assert not b.remove(b"a") and synced == []


def test_a_remove_of_an_evicted_key_makes_the_evictions_unlinks_durable(backends, monkeypatch):
    """An eviction unlinks its victims' files before its write; a remove() of an evicted
    key is durable only once the directory is synced after those unlinks, also when the
    evicting write then fails (no sync of its own follows)."""
    listings = record_directory_fsyncs(monkeypatch)
    b = backends.open(capacity=200 * KiB)
    write(b, {"old": block(1, 64 * KiB)})
    old = locate(backends.root, "old")
    real_run = b.engine.run

    def failing_run(requests):
        raise IoError("injected write failure", path="test")

    b.engine.run = failing_run
    with pytest.raises(IoError):
        write(b, {"big": block(2, 150 * KiB)})  # evicts "old" first, then fails
    b.engine.run = real_run
    assert not old.index.exists() and all(old.index.name in listing for listing in listings)
    assert b.remove(b"old") is False
    assert listings and old.index.name not in listings[-1] and old.data.name not in listings[-1]


def test_a_corrupt_read_whose_drop_cannot_be_written_is_still_a_miss(backends, monkeypatch):
    """A record that fails its check is dropped by rewriting its bucket's index; when that
    rewrite fails, the read is a miss all the same (not an error), the other reads of the
    batch are served, and a later read drops the record."""
    b = backends.open()
    write(b, {"a": block(1, 5000), "b": block(2, 5000)})
    loc = locate(backends.root, "a")
    flip(loc.data, loc.entry.value_offset + 17)
    failing_index_writes(monkeypatch, 1)
    outs = [bytearray(5000), bytearray(5000)]
    assert b.read_batch([(b"a", memoryview(outs[0])), (b"b", memoryview(outs[1]))]) == [None, 5000]
    assert bytes(outs[1]) == block(2, 5000)
    assert b.lookup(b"a") is not None  # still listed: the drop could not be written
    assert read(b, "a") is None and b.lookup(b"a") is None  # dropped now
    backends.close_all()
    b = backends.open()
    assert read(b, "a") is None and read(b, "b") == block(2, 5000)
