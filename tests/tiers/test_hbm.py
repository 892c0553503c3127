"""The HBM tier's logic on a host stand-in for device memory: placement, eviction into a
host sink (readable while the copy is in flight), promotion order, accounting."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gdskv.errors import GdskvError, InvalidValueError, NoSpaceError, StoreClosedError
from gdskv.tiers.backends.record import checksum
from gdskv.tiers.devpool import HostStandInPool
from gdskv.tiers.dram import DramTier
from gdskv.tiers.hbm import DramSink, HbmState, HbmTier, HostSink
from gdskv.tiers.policies import make_policy
from tests.conftest import block

KB = 1024


class DictSink(HostSink):
    """Records what the tier publishes and abandons; can refuse reservations."""

    def __init__(self) -> None:
        self.published: dict[bytes, bytes] = {}
        self.abandoned: list[bytes] = []
        self.refuse = False

    def reserve(self, key, size):
        return None if self.refuse else memoryview(bytearray(size))

    def complete(self, key, buffer, ok):
        if ok:
            self.published[key] = bytes(buffer)
        else:
            self.abandoned.append(key)


def arr(seed: int, size: int) -> np.ndarray:
    return np.frombuffer(block(seed, size), dtype=np.uint8).copy()


def read(tier: HbmTier, key: bytes, size: int):
    out = np.zeros(size, dtype=np.uint8)
    n = tier.get_into(key, out)
    return None if n is None else out[:n].tobytes()


@pytest.fixture
def gated():
    gate = threading.Event()
    sink = DictSink()
    tier = HbmTier(HostStandInPool(64 * KB, gate=gate), sink, policy="lru", put_timeout_s=5)
    yield tier, sink, gate
    gate.set()
    tier.close()


def test_put_get_roundtrip_and_accounting():
    tier = HbmTier(HostStandInPool(64 * KB), DictSink())
    tier.put(b"a", arr(1, 1000))
    assert read(tier, b"a", 1000) == block(1, 1000)
    assert tier.used == 1024  # rounded to 256 B
    assert read(tier, b"zz", 10) is None
    tier.put(b"a", arr(2, 300))  # overwrite frees the old extent
    assert read(tier, b"a", 300) == block(2, 300) and tier.used == 512
    assert tier.remove(b"a") and not tier.remove(b"a")
    assert tier.used == 0 and tier.allocator.free_extents == 1
    s = tier.stats()
    assert (s["hits"], s["misses"], s["puts"], s["pool"]) == (2, 1, 2, "host-standin")
    tier.close()


def test_a_hit_into_host_memory_copies_outside_the_lock_from_a_pinned_entry():
    pool = HostStandInPool(64 * KB)
    tier = HbmTier(pool, DictSink())
    tier.put(b"a", arr(1, 4096))
    entered, release = threading.Event(), threading.Event()
    plain = pool.read_into

    def slow(offset, size, dst):
        entered.set()
        release.wait(5)
        plain(offset, size, dst)

    pool.read_into = slow
    got = []
    reader = threading.Thread(target=lambda: got.append(read(tier, b"a", 4096)))
    reader.start()
    assert entered.wait(5)
    pool.read_into = plain
    assert tier.remove(b"a")  # the lock is free while the copy runs...
    tier.put(b"b", arr(2, 4096))  # ...and a's bytes stay a's until it is done
    assert reader.is_alive()
    release.set()
    reader.join(5)
    assert got == [block(1, 4096)] and read(tier, b"b", 4096) == block(2, 4096)
    assert tier.used == 4096  # a's bytes were freed once the reader let go
    tier.close()


def test_eviction_keeps_object_readable_until_host_copy_completes(gated):
    tier, sink, gate = gated
    for i in range(4):
        tier.put(b"k%d" % i, arr(i, 16 * KB))
    assert tier.used == 64 * KB
    started = tier.evict(1)
    assert started == 16 * KB
    assert tier.state(b"k0") is HbmState.EVICTING
    # Copy held back by the gate: still served from HBM, not yet published.
    assert read(tier, b"k0", 16 * KB) == block(0, 16 * KB)
    assert tier.poll() == 0 and b"k0" not in sink.published
    assert tier.used == 64 * KB  # the device bytes are not freed yet
    gate.set()
    tier.drain()
    assert sink.published[b"k0"] == block(0, 16 * KB)
    assert not tier.contains(b"k0") and tier.used == 48 * KB
    assert tier.stats()["evictions"] == 1


def test_put_that_does_not_fit_evicts_lru_first(gated):
    tier, sink, gate = gated
    for i in range(4):
        tier.put(b"k%d" % i, arr(i, 16 * KB))
    read(tier, b"k0", 16 * KB)  # k0 is now most recently used: k1 goes first
    gate.set()
    tier.put(b"new", arr(9, 16 * KB))
    tier.drain()
    assert list(sink.published) == [b"k1"]
    assert read(tier, b"new", 16 * KB) == block(9, 16 * KB)
    assert tier.contains(b"k0") and not tier.contains(b"k1")


def test_fifo_ignores_reads():
    sink = DictSink()
    tier = HbmTier(HostStandInPool(32 * KB), sink, policy="fifo")
    tier.put(b"a", arr(1, 16 * KB))
    tier.put(b"b", arr(2, 16 * KB))
    read(tier, b"a", 16 * KB)
    tier.put(b"c", arr(3, 16 * KB))
    tier.drain()
    assert list(sink.published) == [b"a"]
    tier.close()


def test_remove_during_eviction_abandons_the_host_copy(gated):
    tier, sink, gate = gated
    tier.put(b"a", arr(1, 16 * KB))
    tier.evict(1)
    assert tier.remove(b"a")
    assert read(tier, b"a", 16) is None
    gate.set()
    tier.drain()
    assert sink.abandoned == [b"a"] and b"a" not in sink.published
    assert tier.used == 0
    assert tier.stats()["evictions_abandoned"] == 1


def test_overwrite_during_eviction_publishes_nothing_stale(gated):
    tier, sink, gate = gated
    tier.put(b"a", arr(1, 8 * KB))
    tier.evict(1)
    tier.put(b"a", arr(2, 8 * KB))
    gate.set()
    tier.drain()
    assert b"a" not in sink.published and sink.abandoned == [b"a"]
    assert read(tier, b"a", 8 * KB) == block(2, 8 * KB)
    assert tier.used == 8 * KB


def test_full_sink_means_no_space_not_data_loss():
    sink = DictSink()
    sink.refuse = True
    tier = HbmTier(HostStandInPool(16 * KB), sink, put_timeout_s=0.05)
    tier.put(b"a", arr(1, 16 * KB))
    with pytest.raises(NoSpaceError) as info:
        tier.put(b"b", arr(2, 4 * KB))
    assert info.value.context["key"] == b"b"
    assert read(tier, b"a", 16 * KB) == block(1, 16 * KB)
    assert tier.stats()["sink_full"] >= 1
    tier.close()


def test_bad_values_are_clear_errors():
    tier = HbmTier(HostStandInPool(16 * KB), DictSink())
    with pytest.raises(GdskvError) as info:
        tier.put(b"big", arr(1, 32 * KB))
    assert info.value.context["capacity"] == 16 * KB
    tier.put(b"ok", arr(2, 4 * KB))
    with pytest.raises(InvalidValueError) as small:
        tier.get_into(b"ok", bytearray(100))
    assert small.value.context["size"] == 4 * KB
    tier.remove(b"ok")
    with pytest.raises(InvalidValueError):
        tier.put(b"x", object())
    with pytest.raises(InvalidValueError):
        tier.put(b"x", np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    assert tier.used == 0
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.get_into(b"x", bytearray(4))


def test_eviction_into_the_dram_tier():
    dram = DramTier(64 * KB, make_policy("lru"))
    lock = threading.Lock()
    published = []
    tier = HbmTier(HostStandInPool(16 * KB), DramSink(dram, lock, on_published=lambda e: published.append(e.key)))
    tier.put(b"a", arr(1, 16 * KB))
    tier.put(b"b", arr(2, 16 * KB))  # pushes a into DRAM
    tier.drain()
    assert published == [b"a"]
    outs = [np.zeros(16 * KB, dtype=np.uint8), np.zeros(16 * KB, dtype=np.uint8)]
    assert tier.batch_get_into([b"a", b"b"], outs) == [None, 16 * KB]
    assert outs[1].tobytes() == block(2, 16 * KB)
    with pytest.raises(InvalidValueError):
        tier.batch_get_into([b"a"], [])
    entry = dram.readable(b"a")
    assert entry is not None and bytes(dram.view(entry)) == block(1, 16 * KB)
    assert entry.crc == checksum(b"a", memoryview(block(1, 16 * KB)))
    assert dram.used == 16 * KB
    tier.remove(b"b")
    tier.close()
    dram.close()


def test_torch_cpu_tensors_are_accepted_by_the_standin():
    torch = pytest.importorskip("torch")
    tier = HbmTier(HostStandInPool(16 * KB), DictSink())
    value = torch.arange(1024, dtype=torch.float32)
    tier.put(b"t", value)
    out = torch.zeros(1024, dtype=torch.float32)
    assert tier.get_into(b"t", out) == 4096
    assert torch.equal(out, value)
    tier.close()


@pytest.mark.gpu
def test_cuda_pool_put_hit_and_eviction_to_dram():
    torch = pytest.importorskip("torch")
    from gdskv.tiers.devpool import TorchCudaPool

    dram = DramTier(8 << 20, make_policy("lru"))
    lock = threading.Lock()
    pool = TorchCudaPool(4 << 20)
    pool.pin(memoryview(dram.arena))
    tier = HbmTier(pool, DramSink(dram, lock))
    values = [torch.randint(0, 255, (2 << 20,), dtype=torch.uint8, device="cuda") for _ in range(3)]
    tier.put(b"a", values[0])
    tier.put(b"b", values[1])
    out = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    assert tier.get_into(b"a", out) == 2 << 20 and torch.equal(out, values[0])
    tier.put(b"c", values[2])  # evicts b (a was read last)
    tier.drain()
    entry = dram.readable(b"b")
    assert entry is not None
    assert bytes(dram.view(entry)) == bytes(values[1].cpu().numpy())
    assert tier.get_into(b"c", out) == 2 << 20 and torch.equal(out, values[2])
    tier.close()
    dram.close()


class SlowWritePool(HostStandInPool):
    """Holds the first write until ``release`` is set, to interleave two puts of one key."""

    def __init__(self, nbytes):
        super().__init__(nbytes)
        self.entered, self.release = threading.Event(), threading.Event()
        self._first = True

    def write(self, offset, src):
        if self._first:
            self._first = False
            self.entered.set()
            self.release.wait(10)
        super().write(offset, src)


def test_concurrent_puts_of_one_key_leave_one_entry():
    pool = SlowWritePool(64 * KB)
    tier = HbmTier(pool, DictSink())
    slow = threading.Thread(target=tier.put, args=(b"k", arr(1, 8 * KB)))
    slow.start()
    assert pool.entered.wait(10)
    tier.put(b"k", arr(2, 8 * KB))  # finishes while the first put is still copying
    pool.release.set()
    slow.join(10)
    assert read(tier, b"k", 8 * KB) == block(1, 8 * KB)  # the last put to finish wins
    assert tier.used == 8 * KB and tier.stats()["objects"] == 1
    tier.close()


@pytest.mark.gpu
def test_cuda_pool_takes_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    from gdskv.tiers.devpool import TorchCudaPool

    tier = HbmTier(TorchCudaPool(1 << 20), DictSink())
    value = cupy.arange(4096, dtype=cupy.float32)
    tier.put(b"c", value)
    out = cupy.zeros(4096, dtype=cupy.float32)
    assert tier.get_into(b"c", out) == 16384
    cupy.cuda.runtime.deviceSynchronize()
    assert bool((out == value).all())
    tier.close()


def test_a_keep_check_that_raises_gives_the_reserved_space_back():
    """``keep`` raising (an interrupt landing in it, say) just before registration: the
    exception propagates, nothing is registered, and the space reserved is free again."""
    tier = HbmTier(HostStandInPool(64 * 1024), DictSink())

    def keep():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tier.put(b"k", np.zeros(16 * 1024, np.uint8), evict=False, keep=keep)
    assert b"k" not in tier.entries and tier.used == 0
    assert tier.put(b"k", np.zeros(64 * 1024, np.uint8), evict=False)  # all of it


def test_an_overwrite_that_finds_no_room_keeps_the_old_value():
    """The old value of the key stays until the new one has room: a put that raises
    NoSpaceError leaves it readable (before, it was detached first and lost)."""
    sink = DictSink()
    sink.refuse = True
    tier = HbmTier(HostStandInPool(16 * KB), sink, put_timeout_s=0.05)
    tier.put(b"a", arr(1, 8 * KB))
    tier.put(b"b", arr(2, 8 * KB))
    with pytest.raises(NoSpaceError):
        tier.put(b"a", arr(3, 12 * KB))
    assert read(tier, b"a", 8 * KB) == block(1, 8 * KB)
    assert tier.used == 16 * KB
    tier.close()


def test_on_room_runs_once_room_is_reserved_and_a_raise_gives_it_back():
    tier = HbmTier(HostStandInPool(16 * KB), DictSink())
    seen = []
    tier.put(b"a", arr(1, 8 * KB), on_room=lambda: seen.append(tier.used))
    assert seen == [8 * KB] and read(tier, b"a", 8 * KB) == block(1, 8 * KB)

    def refuse():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        tier.put(b"b", arr(2, 8 * KB), on_room=refuse)
    assert read(tier, b"b", 8 * KB) is None and tier.used == 8 * KB
    tier.close()


@pytest.mark.parametrize("sizes", [(8 * KB, 8 * KB), (16 * KB, 16 * KB), (8 * KB, 4 * KB)], ids=["beside another", "alone", "smaller"])
def test_an_overwrite_in_a_full_pool_takes_the_old_values_room(sizes):
    """Nothing can leave HBM (the sink refuses), yet a new value of a key fits in its old
    value's room: it takes it, and no other object is evicted for it."""
    old_size, new_size = sizes
    sink = DictSink()
    sink.refuse = True
    tier = HbmTier(HostStandInPool(16 * KB), sink, put_timeout_s=0.05)
    tier.put(b"a", arr(1, old_size))
    if old_size < 16 * KB:
        tier.put(b"b", arr(2, 16 * KB - old_size))
    assert tier.put(b"a", arr(3, new_size))
    assert read(tier, b"a", new_size) == block(3, new_size)
    if old_size < 16 * KB:
        assert read(tier, b"b", 16 * KB - old_size) == block(2, 16 * KB - old_size)
    assert tier.stats()["evictions"] == 0 and tier.used == tier.allocator.rounded(new_size) + 16 * KB - old_size
    tier.close()
