"""Recovery: what a reopened store serves must match a record of what must remain."""

from __future__ import annotations

import random
import threading

import pytest

import gdskv
from conftest import block
from gdskv.errors import IoError
from gates import After, Gate
from ondisk import disk_objects

KiB = 1024


def test_remove_of_a_key_whose_bucket_is_being_written_is_durable_on_return(make_store, tmp_path):
    # The offloader is held inside the write of the bucket that holds "k" (first gate), then
    # just after that bucket is sealed and indexed (second gate). A remove() that returned
    # while the write was under way must not leave "k" readable or in an index on disk.
    store = make_store(bucket_max_age_s=0.001)
    backend = store.parts.nvme
    writing = backend.engine.run = Gate(backend.engine.run)
    sealed = backend.write = After(backend.write)
    value = block(1, 64 * KiB)
    store.put("k", value)
    writing.wait_reached()

    result = []
    returned = threading.Event()
    remover = threading.Thread(target=lambda: (result.append(store.remove("k")), returned.set()))
    remover.start()
    returned.wait(0.5)  # a remove that does not wait for the write returns in this time
    writing.open()
    sealed.wait_reached()
    early = None
    if returned.is_set():
        early = (store.get("k"), b"k" in disk_objects(tmp_path / "store"))
    sealed.open()
    remover.join(10)
    if early is not None:
        assert early[0] is None, "removed key served from the bucket sealed after the remove"
        assert not early[1], "removed key is in an index on disk"
    assert result == [True]
    assert store.get("k") is None and b"k" not in disk_objects(tmp_path / "store")
    store.close()
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as reopened:
        assert reopened.get("k") is None and len(reopened) == 0


# ---------------------------------------------------------------- the reopen loop

SIZES = [1, 100, 4096, 4097, 20_000, 65_536, 150_000]


class Record:
    """What a store must hold. ``must``: present and byte-exact. ``maybe``: byte-exact if
    present, but may be gone (not yet durable at a crash-like close, or evicted by the SSD
    cap). ``gone``: removed, or seen absent once: must stay absent until put again."""

    def __init__(self) -> None:
        self.must: dict[str, bytes] = {}
        self.maybe: dict[str, bytes] = {}
        self.gone: set[str] = set()
        self.unsynced: set[str] = set()  # put since the last point that made them durable

    def put(self, key: str, value: bytes, *, certain: bool) -> None:
        self.maybe.pop(key, None)
        self.must.pop(key, None)
        (self.must if certain else self.maybe)[key] = value
        self.gone.discard(key)
        self.unsynced.add(key)

    def remove(self, key: str) -> None:
        self.must.pop(key, None)
        self.maybe.pop(key, None)
        self.gone.add(key)
        self.unsynced.discard(key)

    def value(self, key: str) -> bytes:
        return self.must[key] if key in self.must else self.maybe[key]

    def live(self) -> list[str]:
        return sorted([*self.must, *self.maybe])

    def loosen(self, keys) -> None:
        """``keys`` may have been lost (not durable, or evicted): byte-exact if present."""
        for key in keys:
            if key in self.must:
                self.maybe[key] = self.must.pop(key)


def verify_store(store, record: Record, rng: random.Random, capped: bool = False) -> int:
    """Check every key of ``record`` through get, get_into and batch_get_into (chosen at
    random); collapse ``maybe`` keys seen absent into ``gone``. Returns how many were."""
    keys = record.live()
    rng.shuffle(keys)
    batch = keys[: len(keys) // 3]
    outs = [bytearray(len(record.value(k)) + rng.choice([0, 0, 5])) for k in batch]
    results = dict(zip(batch, store.batch_get_into(batch, outs) if batch else []))
    seen = {}
    for key, out in zip(batch, outs):
        n = results[key]
        seen[key] = None if n is None else bytes(out[:n])
    for key in keys[len(batch):]:
        if rng.random() < 0.5:
            seen[key] = store.get(key)
        else:
            out = bytearray(len(record.value(key)))
            n = store.get_into(key, out)
            seen[key] = None if n is None else bytes(out[:n])
    lost = 0
    for key in keys:
        got = seen[key]
        if key in record.must:
            assert got is not None, f"{key} must be present"
        if got is not None:
            assert got == record.value(key), f"{key} read back wrong"
        elif key in record.maybe:
            record.remove(key)  # absent now: it stays absent
            lost += 1
    for key in sorted(record.gone):
        assert store.get(key) is None, f"{key} came back"
    assert not any(store.batch_exists(sorted(record.gone)))
    if capped:  # the offloader may evict more in the background meanwhile
        assert len(store) <= len(record.live())
    else:
        assert len(store) == len(record.live())
    return lost


def run_reopen_loop(path, seed: int, *, reopens: int = 30, ssd_capped: bool = False, **options) -> dict:
    """Reopen the store ``reopens`` times with seeded random puts, overwrites, removes,
    flushes and closes (with and without drain) in between; verify after each reopen and
    before each close. Returns totals for the caller's sanity checks."""
    rng = random.Random(seed)
    record = Record()
    totals = {"present_after_reopen": 0, "lost": 0, "nvme_hits": 0, "removed": 0}
    eager = options.get("offload", "eager") == "eager"
    serial = 0
    for it in range(reopens):
        with gdskv.open(path, **options) as store:
            assert store.recovery.dropped_torn == 0 and store.recovery.dropped_corrupt == 0
            totals["lost"] += verify_store(store, record, rng, ssd_capped)
            present = len(record.live())
            assert store.recovery.objects == present  # all of it came from SSD
            totals["present_after_reopen"] += present
            for _ in range(rng.randint(4, 12)):
                op = rng.random()
                live = record.live()
                if op < 0.5 or not live:
                    key, serial = f"k{serial}", serial + 1
                    value = block(seed * 100_000 + serial, rng.choice(SIZES))
                    store.put(key, value)
                    record.put(key, value, certain=not ssd_capped)
                elif op < 0.65:
                    key = rng.choice(live)
                    serial += 1
                    value = block(seed * 100_000 + serial, rng.choice(SIZES))
                    store.put(key, value, overwrite=True)
                    record.put(key, value, certain=not ssd_capped)
                elif op < 0.7 and record.must:
                    key = rng.choice(sorted(record.must))
                    store.put(key, record.must[key])  # same bytes: a no-op
                elif op < 0.75 and record.gone:
                    key = rng.choice(sorted(record.gone))
                    serial += 1
                    value = block(seed * 100_000 + serial, rng.choice(SIZES))
                    store.put(key, value)  # a removed key may be used again
                    record.put(key, value, certain=not ssd_capped)
                elif op < 0.92:
                    key = rng.choice(live)
                    was_certain = key in record.must
                    removed = store.remove(key)
                    assert removed or not was_certain, f"remove({key}) found nothing"
                    record.remove(key)
                    totals["removed"] += 1
                else:
                    if eager:
                        store.flush()
                        record.unsynced.clear()
            totals["lost"] += verify_store(store, record, rng, ssd_capped)
            totals["nvme_hits"] += store.stats()["nvme"]["hits"]
            if rng.random() < 0.2:
                # A close that does not write DRAM-only objects: what was not durable yet
                # may be lost (never wrong).
                record.loosen(record.unsynced)
                store.close(drain=False)
            record.unsynced.clear()
    return totals


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eviction", ["lru", "fifo"])
@pytest.mark.parametrize("offload", ["eager", "watermark"])
def test_reopen_loop_matches_the_record(tmp_path, eviction, offload):
    seed = {"lru": 1, "fifo": 2}[eviction] * 10 + {"eager": 1, "watermark": 2}[offload]
    totals = run_reopen_loop(
        tmp_path / "store", seed,
        dram="1MiB", ssd="64MiB", eviction=eviction, ssd_eviction=eviction, offload=offload,
        bucket_bytes=256 * KiB, bucket_max_age_s=0.01, promote_after_reads=1,
    )
    assert totals["present_after_reopen"] > 100 and totals["removed"] > 10
    assert totals["nvme_hits"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ssd_eviction", ["lru", "fifo"])
@pytest.mark.parametrize("offload", ["eager", "watermark"])
def test_reopen_loop_with_the_ssd_cap_evicting_buckets(tmp_path, ssd_eviction, offload):
    # An SSD tier of 1 MiB: buckets are evicted all the time. Evicted keys may be absent,
    # but a present key is always its latest value, and removed keys never come back.
    seed = {"lru": 3, "fifo": 4}[ssd_eviction] * 10 + {"eager": 1, "watermark": 2}[offload]
    totals = run_reopen_loop(
        tmp_path / "store", seed, ssd_capped=True,
        dram="1MiB", ssd="1MiB", ssd_eviction=ssd_eviction, offload=offload,
        bucket_bytes=256 * KiB, bucket_max_age_s=0.01, promote_after_reads=1,
    )
    assert totals["lost"] > 10 and totals["present_after_reopen"] > 30


def test_offloader_survives_a_failure_to_remove_a_stale_copy(tmp_path):
    # "k" is overwritten while its old value is being written to SSD; once that write is
    # done the offloader takes the stale copy back out, and here that fails (an injected
    # I/O error, as from a full disk rewriting an index). The offloader must live on: the
    # new value still reaches SSD, flush() and close() return, a reopen serves the new value.
    store = gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB", bucket_max_age_s=0.001)
    try:
        backend = store.parts.nvme
        writing = backend.engine.run = Gate(backend.engine.run)
        real_remove = backend.remove
        failures = []

        def remove_failing_once(key):
            if not failures:
                failures.append(key)
                raise IoError("injected: index rewrite failed", path=str(tmp_path))
            return real_remove(key)

        old, new = block(1, 64 * KiB), block(2, 32 * KiB)
        store.put("k", old)
        writing.wait_reached()  # the old value is being written
        store.put("k", new, overwrite=True)
        backend.remove = remove_failing_once
        writing.open()
        store.flush(timeout=10)
        assert failures == [b"k"]
        assert store.get("k") == new
        assert store.stats()["offload"]["objects"] == 2
        store.close()
    finally:
        store.close(drain=False)  # a no-op after close(); never waits on a dead offloader
    with gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB") as reopened:
        assert reopened.get("k") == new and len(reopened) == 1
