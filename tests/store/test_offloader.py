"""The offloader on its own (gdskv/store/offloader.py): a real DRAM tier, an in-memory
backend that records what it is given, and a host that records what it is told. No store:
it is configured by an OffloaderConfig and the NVMe tier's byte cap alone.

The store-level behaviour (durability, back-pressure, races with removes) is tested through
the store in tests/store/ and tests/store/test_concurrency.py; these tests pin down the
component's contract: what it writes when, what it tells its host, and its null form.
"""

import threading
import time
from typing import Callable, List

import pytest

from gdskv.config import KiB, MiB
from gdskv.errors import IoError, TimedOutError
from gdskv.offload_config import OffloaderConfig
from gdskv.store.offloader import NullOffloader, Offloader
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.dram import DramTier, SsdState
from gdskv.tiers.policies import make_policy


class MemoryBackend:
    """The part of the backend interface the offloader uses, in memory."""

    def __init__(self) -> None:
        self.objects: dict = {}
        self.batches: List[List[bytes]] = []
        self.removed: List[bytes] = []
        self.fail_next = 0
        self.gate = threading.Event()
        self.gate.set()

    def write(self, items):
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next -= 1
            raise IoError("disk says no", errno=5)
        self.batches.append([k for k, _, _ in items])
        for k, view, crc in items:
            self.objects[k] = (bytes(view), crc)
        return []

    def remove(self, key: bytes) -> bool:
        self.removed.append(key)
        return self.objects.pop(key, None) is not None


class RecordingHost:
    def __init__(self, dram: DramTier) -> None:
        self.dram = dram
        self.written: List[bytes] = []
        self.write_ends = 0
        self.room_waiters = 0

    def waiting_for_room(self) -> int:
        return self.room_waiters

    def evict_until(self, until: Callable[[], bool]) -> bool:
        while not until():
            victim = next(self.dram.victims(lambda e: e.ssd is SsdState.ON_SSD), None)
            if victim is None:
                return False
            self.dram.detach(victim)
        return True

    def on_written(self, entries) -> None:
        self.written.extend(e.key for e in entries)

    def on_write_ended(self) -> None:
        self.write_ends += 1


@pytest.fixture
def parts():
    lock = threading.RLock()
    cond = threading.Condition(lock)
    dram = DramTier(4 * MiB, make_policy("lru"), huge_pages=False)
    backend = MemoryBackend()
    host = RecordingHost(dram)
    made = []

    def make(ssd_bytes=64 * MiB, **fields):
        offloader = Offloader(OffloaderConfig(**fields), dram, backend, host, ssd_bytes=ssd_bytes, cond=cond)
        offloader.start()
        made.append(offloader)
        return offloader

    yield make, dram, backend, host, cond
    for offloader in made:
        with cond:
            offloader.stop()
        offloader.join()
    dram.close()


def committed(dram: DramTier, key: bytes, size: int, byte: int = 1):
    entry = dram.reserve(key, size, 0)
    value = bytes([byte]) * size
    dram.write(entry, memoryview(value))
    entry.crc = checksum(key, memoryview(value))
    dram.written(entry)
    dram.commit(entry)
    return entry


def test_eager_offload_writes_a_full_batch_at_once_and_tells_the_host(parts):
    make, dram, backend, host, cond = parts
    offloader = make(bucket_bytes=MiB, bucket_max_keys=2, bucket_max_age_s=60.0)
    with cond:
        entries = [committed(dram, f"k{i}".encode(), 32 * KiB) for i in range(2)]
        for entry in entries:
            offloader.on_committed(entry)  # the second fills the batch: due at once
        deadline = time.monotonic() + 10
        while offloader.stats()["objects"] < 2 and time.monotonic() < deadline:
            cond.wait(0.01)  # (no flush: one would make a partial batch due too)
        assert backend.batches == [[b"k0", b"k1"]]
        assert host.written == [b"k0", b"k1"] and host.write_ends == 1
        assert all(e.ssd is SsdState.ON_SSD and offloader.evictable(e) for e in entries)
        assert offloader.stats()["objects"] == 2 and offloader.stats()["queued"] == 0


def test_a_partial_batch_waits_for_its_age_unless_someone_waits_for_it(parts):
    make, dram, backend, host, cond = parts
    offloader = make(bucket_bytes=MiB, bucket_max_age_s=60.0)
    with cond:
        offloader.on_committed(committed(dram, b"k", 4 * KiB))
        cond.wait(0.2)
        assert backend.batches == []  # not full, not old: not due
        offloader.flush(time.monotonic() + 10, check=lambda: None)  # a flush waits: due now
        assert backend.batches == [[b"k"]]


def test_a_failed_batch_stays_queued_at_the_front_pauses_and_is_retried(parts):
    make, dram, backend, host, cond = parts
    offloader = make(bucket_bytes=MiB, offload_retry_s=0.05)
    backend.fail_next = 1
    with cond:
        entry = committed(dram, b"k", 4 * KiB)
        offloader.on_committed(entry)
        with pytest.raises(IoError):
            offloader.flush(time.monotonic() + 10, check=lambda: None)
        assert entry.ssd is SsdState.PENDING and not offloader.evictable(entry)
        assert offloader.failures == 1 and host.write_ends == 1
        offloader.flush(time.monotonic() + 10, check=lambda: None)  # the retry after the pause
        assert backend.batches == [[b"k"]] and entry.ssd is SsdState.ON_SSD
        assert offloader.error is None


def test_a_value_removed_while_its_batch_is_written_is_taken_back_out(parts):
    make, dram, backend, host, cond = parts
    offloader = make(bucket_bytes=MiB)
    backend.gate.clear()  # the disk is slow
    with cond:
        entry = committed(dram, b"k", 4 * KiB)
        offloader.on_committed(entry)
        cond.notify_all()
    deadline = time.monotonic() + 10
    while offloader.stats()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with cond:
        dram.detach(entry)  # removed while written
        backend.gate.set()
        offloader.await_not_in_flight(b"k")
        assert b"k" in backend.removed and b"k" not in backend.objects
        assert host.written == []  # a removed value is not reported as stored


def test_watermark_offload_queues_the_coldest_above_the_high_watermark(parts):
    make, dram, backend, host, cond = parts
    offloader = make(policy="watermark", high_watermark=0.5, low_watermark=0.25, bucket_bytes=4 * MiB)
    with cond:
        entries = [committed(dram, f"k{i}".encode(), 512 * KiB, i) for i in range(5)]  # 2.5 of 4 MiB
        for entry in entries:
            offloader.on_committed(entry)
        offloader.flush(time.monotonic() + 10, check=lambda: None)
        written = [k for batch in backend.batches for k in batch]
        assert written[:2] == [b"k0", b"k1"]  # the coldest first
        assert dram.used <= 0.25 * dram.capacity  # evicted down to the low watermark once written


def test_a_batch_takes_at_most_a_quarter_of_the_ssd_bytes_it_is_given(parts):
    make, dram, backend, host, cond = parts
    offloader = make(ssd_bytes=4 * MiB, bucket_bytes=4 * MiB, bucket_max_age_s=60.0)  # a batch: 1 MiB of records
    with cond:
        for i in range(3):  # a record (512 KiB and its header) is over half of a batch
            offloader.on_committed(committed(dram, f"k{i}".encode(), 512 * KiB))
        offloader.flush(time.monotonic() + 10, check=lambda: None)
        assert backend.batches == [[b"k0"], [b"k1"], [b"k2"]]
        assert offloader.config == OffloaderConfig(bucket_bytes=4 * MiB, bucket_max_age_s=60.0)


def test_a_flush_past_its_deadline_is_a_timeout(parts):
    make, dram, backend, host, cond = parts
    offloader = make(bucket_bytes=MiB)
    backend.gate.clear()
    try:
        with cond:
            offloader.on_committed(committed(dram, b"k", 4 * KiB))
            with pytest.raises(TimedOutError):
                offloader.flush(time.monotonic() + 0.05, check=lambda: None)
    finally:
        backend.gate.set()


def test_the_null_offloader_queues_nothing_and_lets_everything_be_evicted(parts):
    _, dram, _, _, _ = parts
    null = NullOffloader()
    entry = committed(dram, b"k", 4 * KiB)
    null.on_committed(entry)
    assert entry.ssd is SsdState.NONE and null.evictable(entry)
    assert null.queued() == 0 and null.unsaved() == 0 and null.stats() is None
    assert null.wait_drained(3, check=lambda: None) is None
