"""Concurrency: readers, writers, removes, the offloader and eviction at once; every read
verified byte-exact, no deadlock."""

from __future__ import annotations

import errno
import random
import struct
import threading
from typing import Optional

import numpy as np
import pytest

import gdskv
from conftest import block
from gates import Gate, still_waiting

KiB = 1024


def test_promotion_of_bytes_read_before_an_overwrite_does_not_serve_them(make_store):
    # A reader fetched the old value of "k" from SSD and is held just before promoting it
    # to DRAM. Meanwhile "k" is overwritten with a value of the same size, the new value is
    # offloaded and evicted from DRAM. Promoting the old bytes now would serve them from
    # DRAM under the new value's checksum.
    store = make_store(dram="1MiB", promote_after_reads=1, eviction="lru")
    old, new = block(1, 256 * KiB), block(2, 256 * KiB)

    def push_out_of_dram(tag):
        # Four more 256 KiB values fill the 1 MiB arena: the oldest entry goes to SSD only.
        for i in range(4):
            store.put(f"{tag}{i}", block(100 + i, 256 * KiB))
        store.flush()
        for i in range(4):
            store.remove(f"{tag}{i}")

    store.put("k", old)
    store.flush()
    push_out_of_dram("a")
    assert store.stats()["dram"]["objects"] == 0

    promoter = store.parts.promoter
    promote = promoter.read_seen = Gate(promoter.read_seen, lambda k, data: k == b"k")
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get("k")))
    reader.start()
    promote.wait_reached()
    store.put("k", new, overwrite=True)
    store.flush()
    push_out_of_dram("b")
    assert store.stats()["dram"]["objects"] == 0
    promote.open()
    reader.join(10)
    assert got == [old]  # the read itself began before the overwrite
    assert store.get("k") == new
    assert store.get("k") == new  # also once served from DRAM



def test_watermark_put_waiting_on_a_fragmented_arena_gets_room(make_store):
    # DRAM usage is below the low watermark, but removes left only 100 KiB holes: a 200 KiB
    # put fits nowhere, and every object is DRAM-only (nothing evictable yet). The waiting
    # put must make the offloader write cold objects so that evicting them makes room,
    # rather than time out with NoSpaceError.
    store = make_store(dram="1MiB", offload="watermark", put_timeout_s=10.0, promote_after_reads=0)
    values = {f"k{i}": block(i, 100 * KiB) for i in range(9)}  # 88% of DRAM: below high
    for key, value in values.items():
        store.put(key, value)
    for i in (1, 3, 5, 7):
        store.remove(f"k{i}")
        del values[f"k{i}"]
    assert store.stats()["offload"]["objects"] == 0
    big = block(99, 200 * KiB)
    store.put("big", big)
    values["big"] = big
    s = store.stats()
    assert s["puts"]["waited"] >= 1 and s["puts"]["no_space"] == 0
    assert s["offload"]["objects"] >= 1 and s["dram"]["dropped"] == 0
    for key, value in values.items():
        assert store.get(key) == value



@pytest.mark.parametrize("then", ["remove", "overwrite"])
def test_put_whose_key_is_removed_while_its_bytes_are_copied(make_store, then):
    # The copy of "a" into DRAM is held; meanwhile "a" is removed (or overwritten) and "b"
    # is put, and would be given the memory "a" was reserved. That memory must stay "a"'s
    # until its copy is over: "b" is never overwritten, and the put of "a" does not fail.
    store = make_store(dram="1MiB", ssd=0)
    va, vb = block(1, 256 * KiB), block(2, 256 * KiB)
    copy = store.parts.dram.write = Gate(store.parts.dram.write, lambda entry, value: entry.key == b"a")
    errors = []

    def put_a():
        try:
            store.put("a", va)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    writer = threading.Thread(target=put_a)
    writer.start()
    copy.wait_reached()
    if then == "remove":
        assert store.remove("a") is False  # not readable yet, but forgotten
    else:
        store.put("a", block(3, 1000), overwrite=True)
    store.put("b", vb)
    copy.open()
    writer.join(10)
    assert not errors
    assert store.get("b") == vb
    assert store.get("a") == (None if then == "remove" else block(3, 1000))
    expected_used = 256 * KiB + (0 if then == "remove" else 1024)
    assert store.stats()["dram"]["used_bytes"] == expected_used  # a's reservation was freed


# ---------------------------------------------------------------- the stress scenario

SIZES = [16, 1000, 4096, 10_000, 64 * KiB, 200 * KiB]
HEADER = struct.Struct("<QQ")  # key id, version: every value says what it is


def payload(kid: int, ver: int) -> bytes:
    size = SIZES[(kid * 7 + ver) % len(SIZES)]
    return HEADER.pack(kid, ver) + block(kid * 100_000 + ver, size - HEADER.size)


def verify_value(kid: int, data, versions: set) -> None:
    """``data`` read for key ``kid`` is, byte for byte, one version that was put under it."""
    got_kid, ver = HEADER.unpack_from(data)
    assert got_kid == kid, f"key {kid} served the value of key {got_kid}"
    assert ver in versions, f"key {kid} served version {ver}, never put"
    assert bytes(data) == payload(kid, ver), f"key {kid} version {ver} torn or mixed"


class Workload:
    """Writers own disjoint key ranges (put, overwrite, remove, and read their own keys
    back exactly); readers read every range with get, get_into and batch_get_into; a
    maintenance thread flushes and checks. Errors from any thread are collected."""

    def __init__(self, store, writers=3, readers=3, keys_per_writer=30, seed=0) -> None:
        self.store = store
        self.keys = keys_per_writer
        self.nwriters = writers
        self.versions = {kid: set() for kid in range(writers * keys_per_writer)}
        self.current: dict[int, Optional[int]] = {kid: None for kid in self.versions}
        self.errors: list = []
        self.stop = threading.Event()
        self.seed = seed
        self.reads_verified = 0
        self.writers_done = threading.Event()
        self.writers = [threading.Thread(target=self._guard, args=(self._writer, w), name=f"writer{w}") for w in range(writers)]
        self.readers = [threading.Thread(target=self._guard, args=(self._reader, r), name=f"reader{r}") for r in range(readers)]
        self.maintenance = threading.Thread(target=self._guard, args=(self._maintain, 0), name="maintenance")

    def _guard(self, fn, n) -> None:
        try:
            fn(n)
        except BaseException as exc:  # surfaced by run()
            self.errors.append((threading.current_thread().name, exc))
            self.stop.set()

    def _writer(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        mine = range(w * self.keys, (w + 1) * self.keys)
        for step in range(150):
            if self.stop.is_set():
                return
            kid = rng.choice(mine)
            key = f"k{kid}"
            op = rng.random()
            if op < 0.65:
                ver = step + 1
                self.versions[kid].add(ver)  # before the put: a reader may see it at once
                self.store.put(key, payload(kid, ver), overwrite=True)
                self.current[kid] = ver
            elif op < 0.8:
                assert self.store.remove(key) == (self.current[kid] is not None)
                self.current[kid] = None
            expected = self.current[kid]
            got = self.store.get(key)  # only this thread writes this key: exact
            if expected is None:
                assert got is None, f"{key} removed but read back"
            else:
                assert got is not None and bytes(got) == payload(kid, expected), f"{key} not its latest value"

    def _reader(self, r: int) -> None:
        rng = random.Random(self.seed * 1000 + 500 + r)
        big = bytearray(max(SIZES))
        while not self.writers_done.is_set() and not self.stop.is_set():
            kid = rng.randrange(len(self.versions))
            how = rng.random()
            if how < 0.3:
                got = self.store.get(f"k{kid}")
                if got is not None:
                    verify_value(kid, got, self.versions[kid])
                    self.reads_verified += 1
            elif how < 0.6:
                n = self.store.get_into(f"k{kid}", big)
                if n is not None:
                    verify_value(kid, memoryview(big)[:n], self.versions[kid])
                    self.reads_verified += 1
            else:
                kids = [rng.randrange(len(self.versions)) for _ in range(5)]
                outs = [np.empty(max(SIZES), dtype=np.uint8) for _ in kids]
                sizes = self.store.batch_get_into([f"k{k}" for k in kids], outs)
                for k, out, n in zip(kids, outs, sizes):
                    if n is not None:
                        verify_value(k, out[:n].tobytes(), self.versions[k])
                        self.reads_verified += 1

    def _maintain(self, _n: int) -> None:
        while not self.stop.is_set():
            self.store.flush()
            report = self.store.check()
            assert report.ok, f"check() under load reported {report.corrupt_keys}"

    def run(self) -> None:
        """Start everything; readers and maintenance run until the writers are done."""
        threads = [*self.writers, *self.readers, self.maintenance]
        for t in threads:
            t.start()
        for t in self.writers:
            t.join(60)
        self.writers_done.set()
        self.stop.set()
        for t in [*self.readers, self.maintenance]:
            t.join(60)
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, f"threads still running (deadlock?): {alive}"
        assert not self.errors, self.errors

    def verify_final(self, store) -> None:
        for kid, ver in self.current.items():
            got = store.get(f"k{kid}")
            if ver is None:
                assert got is None
            else:
                assert got is not None and bytes(got) == payload(kid, ver)
        assert len(store) == sum(v is not None for v in self.current.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eviction", ["lru", "fifo"])
@pytest.mark.parametrize("offload", ["eager", "watermark"])
def test_threads_put_get_and_remove_with_offload_and_eviction(make_store, tmp_path, eviction, offload):
    options = dict(
        dram="2MiB", ssd="64MiB", eviction=eviction, ssd_eviction=eviction, offload=offload,
        bucket_bytes=256 * KiB, bucket_max_age_s=0.005, promote_after_reads=2, put_timeout_s=30.0,
    )
    store = make_store(**options)
    work = Workload(store, seed={"lru": 1, "fifo": 2}[eviction] * 10 + {"eager": 1, "watermark": 2}[offload])
    work.run()
    work.verify_final(store)
    s = store.stats()
    assert work.reads_verified > 100
    assert s["dram"]["evicted"] > 0 and s["nvme"]["hits"] > 0 and s["offload"]["objects"] > 0
    assert s["dram"]["dropped"] == 0 and s["nvme"]["corrupt_reads"] == 0
    store.close()
    with gdskv.open(tmp_path / "store", **options) as reopened:
        work.verify_final(reopened)


# ---------------------------------------------------------------- puts, removes and close racing


def test_a_put_that_waited_for_room_looks_at_its_key_again(make_store):
    """A put waiting for DRAM room releases the lock; a put of the same key may commit
    meanwhile. The waiter must then see that key (here: KeyExistsError, its bytes differ),
    never list a second entry under it (the first would be orphaned: never freed, and
    written to SSD after a remove of the key)."""
    store = make_store(dram="1MiB", put_timeout_s=10)
    offload = store.parts.nvme.write = Gate(store.parts.nvme.write)  # the disk is slow
    for i in range(14):  # DRAM fills with values still being offloaded
        store.put(f"fill{i}", bytes([i]) * (64 * KiB))
    offload.wait_reached()
    errors = []

    def big():
        try:
            store.put("k", b"A" * (200 * KiB))
        except gdskv.GdskvError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=big)
    waiter.start()
    while store.stats()["puts"]["waited"] == 0:  # it waits for room
        pass
    store.put("k", b"B" * 1000)
    offload.open()
    waiter.join(10)
    assert [type(e) for e in errors] == [gdskv.KeyExistsError]
    assert store.get("k") == b"B" * 1000
    assert store.remove("k")
    for i in range(14):
        store.remove(f"fill{i}")
    store.flush()
    assert store.get("k") is None and store.stats()["dram"]["used_bytes"] == 0  # nothing orphaned


def test_an_overwrite_without_room_keeps_the_old_value(tmp_path):
    """The old copies of an overwritten key go only once the new value has room: a put that
    fails (DRAM full, the disk refusing writes) leaves the old value stored."""
    from gdskv.config import StoreConfig
    from gdskv.gds.faulty import FaultyEngine
    from gdskv.io_config import PsyncConfig

    cfg = StoreConfig(dram_bytes=1 << 20, ssd_bytes=64 << 20, put_timeout_s=0.3, bucket_max_age_s=0.01, offload_retry_s=0.05)
    faulty = FaultyEngine(PsyncConfig(threads=2).build())
    store = gdskv.Store(tmp_path / "store", cfg, engine=faulty)
    try:
        store.put("old", b"x" * 4096)
        store.flush()
        faulty.inject("enospc")
        i = 0
        with pytest.raises(gdskv.NoSpaceError):
            while True:  # DRAM fills with values that cannot go to SSD now
                store.put(f"fill{i}", bytes([i % 256]) * (64 * KiB))
                i += 1
        with pytest.raises(gdskv.NoSpaceError):
            store.put("old", b"y" * (128 * KiB), overwrite=True)
        assert store.get("old") == b"x" * 4096
        faulty.clear()
    finally:
        store.close()
    with gdskv.open(tmp_path / "store", dram="1MiB", ssd="64MiB") as reopened:
        assert reopened.get("old") == b"x" * 4096


def test_remove_waits_for_an_overwritten_value_being_written(make_store):
    """remove() after an overwrite: the old value's bucket may be in flight (its DRAM entry
    detached already). remove() returns only once the offloader took that copy back out."""
    store = make_store()
    store.put("k", b"A" * 10_000)
    offload = store.parts.nvme.write = Gate(store.parts.nvme.write, lambda items: any(k == b"k" for k, _, _ in items))
    offload.wait_reached()  # v1's bucket is being written
    store.put("k", b"B" * 10_000, overwrite=True)
    done = []
    remover = threading.Thread(target=lambda: done.append(store.remove("k")))
    remover.start()
    remover.join(0.3)
    assert remover.is_alive()  # waits for the write of the old value
    offload.open()
    remover.join(10)
    assert done == [True] and store.get("k") is None
    store.flush()
    assert b"k" not in store.parts.nvme.keys() and store.get("k") is None


def _remove_during_the_write_of(store, key: bytes, *, write_fails: bool, remove_fails: bool):
    """Start ``store.remove(key)`` while the bucket holding ``key`` is being written, then let
    the write land its records (and report an I/O error after it, once, with ``write_fails``: a
    failure after the files were in place, as a failed sync after renames). With
    ``remove_fails``, the backend's remove of ``key`` raises an I/O error once the records
    have landed. Returns what remove() returned or raised, and the switch that stops the
    backend's removes from failing."""
    backend = store.parts.nvme
    real_write, real_remove = backend.write, backend.remove
    landed = threading.Event()
    removes_fail = [remove_fails]

    def write(items):
        first = not landed.is_set()
        try:
            evicted = real_write(items)
        finally:
            landed.set()
        if write_fails and first:
            raise gdskv.IoError("injected: the sync after the records landed failed", errno=errno.EIO)
        return evicted

    def remove(k):
        if removes_fail[0] and k == key and landed.is_set():
            raise gdskv.IoError("injected: the index could not be rewritten", errno=errno.EIO)
        return real_remove(k)

    offload = backend.write = Gate(write, lambda items: any(k == key for k, _, _ in items))
    backend.remove = remove
    offload.wait_reached()  # the key's bucket is being written
    outcome = []

    def run():
        try:
            outcome.append(store.remove(key))
        except gdskv.GdskvError as exc:
            outcome.append(exc)

    remover = threading.Thread(target=run)
    remover.start()
    remover.join(0.3)
    assert remover.is_alive()  # waits for the write
    offload.open()
    remover.join(10)
    assert not remover.is_alive()
    return outcome[0], removes_fail


def test_remove_raises_while_the_copy_written_meanwhile_cannot_be_taken_back(make_store, tmp_path):
    """The offloader takes out the copy its write landed for a key removed meanwhile; where
    that fails, remove() tries again and raises if it fails again: never True while the key
    is still stored. Once the disk works again, a remove takes it out for good."""
    store = make_store(backend="bucket")
    store.put("k", b"A" * 10_000)
    got, removes_fail = _remove_during_the_write_of(store, b"k", write_fails=False, remove_fails=True)
    assert isinstance(got, gdskv.IoError) and "index could not be rewritten" in str(got)
    assert store.get("k") == b"A" * 10_000  # the failed remove left the key as it was, on SSD
    assert store.stats()["offload"]["stale_copies"] == 1
    removes_fail[0] = False
    assert store.remove("k") is True
    assert store.get("k") is None and store.stats()["offload"]["stale_copies"] == 0
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB", backend="bucket") as reopened:
        assert reopened.get("k") is None


@pytest.mark.parametrize("backend", ["bucket", "offset", "file_per_key"])
def test_remove_during_a_write_that_fails_after_landing_takes_the_copy_out(make_store, tmp_path, backend):
    """A write can fail after some of its records are in place (file_per_key's sync after
    its renames): the copy of a key removed meanwhile must not stay stored, now or after
    a reopen. The offloader takes it out before remove() returns."""
    store = make_store(backend=backend, offload_retry_s=0.05)
    store.put("k", b"A" * 10_000)
    got, _ = _remove_during_the_write_of(store, b"k", write_fails=True, remove_fails=False)
    assert got is True
    assert store.get("k") is None
    store.put("other", b"O" * 5000)
    store.flush()  # the offloader has recovered from the failed write
    assert b"k" not in store.parts.nvme.keys()
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB", backend=backend) as reopened:
        assert reopened.get("k") is None and reopened.get("other") == b"O" * 5000


def test_a_put_of_the_same_bytes_returns_once_they_are_readable(make_store):
    store = make_store()
    copy = store.parts.dram.write = Gate(store.parts.dram.write, lambda entry, value: entry.key == b"k")
    first = threading.Thread(target=lambda: store.put("k", b"V" * 5000))
    first.start()
    copy.wait_reached()
    got = []
    second = threading.Thread(target=lambda: got.append((store.put("k", b"V" * 5000), store.get("k"))))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waits for the first copy: "idempotent" only once readable
    copy.open()
    first.join(10)
    second.join(10)
    assert got == [(None, b"V" * 5000)]


@pytest.mark.parametrize("during", ["put", "get"])
def test_close_waits_for_puts_and_reads_in_progress(make_store, tmp_path, during):
    """close() takes no new put, but the puts copying into DRAM when it begins commit and are
    drained to SSD (an overwrite among them has removed the old value already), and reads
    copying out of DRAM finish before the arena is freed (never a bare ValueError, never a
    silent loss)."""
    store = make_store()
    store.put("here", b"H" * 5000)
    key = b"late" if during == "put" else b"here"
    if during == "put":
        gate = store.parts.dram.write = Gate(store.parts.dram.write, lambda entry, value: entry.key == key)
    else:
        gate = store.parts.dram.read_into = Gate(store.parts.dram.read_into, lambda entry, out: entry.key == key)
    outcome = []

    def work():
        try:
            outcome.append(store.put("late", b"L" * 5000) if during == "put" else store.get("here"))
        except gdskv.GdskvError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    gate.wait_reached()
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # waits for the copy
    gate.open()
    worker.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert outcome == ([None] if during == "put" else [b"H" * 5000])
    with pytest.raises(gdskv.StoreClosedError):
        store.put("after", b"A")
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as reopened:
        assert reopened.get("here") == b"H" * 5000
        assert reopened.get("late") == (b"L" * 5000 if during == "put" else None)


def test_an_overwrite_that_fails_to_remove_the_old_copy_gives_its_room_back(make_store, monkeypatch):
    store = make_store()
    store.put("k", b"A" * 4096)
    store.flush()
    used = store.stats()["dram"]["used_bytes"]

    def failing(key):
        raise gdskv.IoError("remove failed", path="x")

    monkeypatch.setattr(store.parts.nvme, "remove", failing)
    for _ in range(3):
        with pytest.raises(gdskv.IoError):
            store.put("k", b"B" * 4096, overwrite=True)
    assert store.stats()["dram"]["used_bytes"] <= used  # no reservation left behind (3 x 4 KiB before)
    monkeypatch.undo()
    assert store.get("k") == b"A" * 4096


def test_an_overwrite_caught_by_close_is_drained(make_store, tmp_path):
    """The old value went when the overwrite made room; close() lets the new one commit
    and writes it, so the key is never lost."""
    store = make_store()
    store.put("k", b"A" * 5000)
    store.flush()
    copy = store.parts.dram.write = Gate(store.parts.dram.write, lambda entry, value: entry.key == b"k")
    writer = threading.Thread(target=lambda: store.put("k", b"B" * 5000, overwrite=True))
    writer.start()
    copy.wait_reached()
    closer = still_waiting(store.close)
    copy.open()
    writer.join(10)
    closer.join(10)
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as reopened:
        assert reopened.get("k") == b"B" * 5000


def test_a_put_waiting_for_room_wakes_when_a_read_lets_go(make_store):
    """A put that finds DRAM full of what cannot be evicted now (a value being read through
    borrow()) waits; it goes on as soon as the read lets go, not when its put_timeout_s
    has passed (before, only a finished offload woke it)."""
    store = make_store(dram="1MiB", ssd=0, put_timeout_s=20)
    store.put("a", b"A" * (1 << 20))
    with store.borrow(["a"]):
        putting = still_waiting(lambda: store.put("b", b"B" * (1 << 20)))  # DRAM full, "a" pinned
    putting.join(5)  # well under put_timeout_s
    assert not putting.is_alive()
    assert store.get("b") == b"B" * (1 << 20) and store.get("a") is None  # "a" evicted for it
