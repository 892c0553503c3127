"""The read path every backend shares (``StorageBackend.read_batch``), on every engine with
O_DIRECT: batches of several submission groups, small and unaligned values, misses,
corruption and too-small outputs in a later group, and engines that report the wrong size."""

from __future__ import annotations

import mmap
import os
from typing import List

import pytest

from backend_io import every_backend, items, value_location  # noqa: F401 - every_backend: a fixture
from conftest import block
from gdskv.config import BACKENDS
from gdskv.errors import InvalidValueError
from gdskv.tiers.backends.record import checksum
from gdskv.gds.engine import IoEngine, IoFuture, IoOp
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.base import READ_GROUP

KiB = 1024
# Small values (the uring engine's small-read path), a value across a block boundary of
# its record and one larger than a small read: each size recurs across the groups.
SIZES = (4 * KiB, 100, 4 * KiB + 1, 20 * KiB, 1)


@pytest.fixture
def backend(every_backend):
    return every_backend


def values(count: int) -> dict:
    return {f"key-{i}".encode(): block(i, SIZES[i % len(SIZES)]) for i in range(count)}


def outs_64_past_a_page(sizes: List[int]) -> List[memoryview]:
    """One output per size, each 64 bytes past a page boundary (as numpy arrays often are)
    and 100 bytes longer than asked."""
    stride = -(-(max(sizes) + 164) // 4096) * 4096
    area = memoryview(mmap.mmap(-1, stride * len(sizes)))
    return [area[i * stride + 64 : i * stride + 64 + n + 100] for i, n in enumerate(sizes)]


def nothing_pinned(be) -> bool:
    """No read of ``be`` holds anything any more."""
    if be.name == "bucket":
        return all(b.readers == 0 for b in be._buckets.values())
    if be.name == "offset":
        return not be._pins
    return True  # file_per_key: checked through the open descriptors


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_batch_of_several_groups_reads_every_value_and_misses_the_absent(backend):
    stored = values(3 * READ_GROUP + 3)
    backend.write(items(stored))
    keys = list(stored)
    keys[4:4] = [b"absent-1"]
    keys.insert(2 * READ_GROUP + 1, b"absent-2")
    sizes = [len(stored.get(k, b"x")) for k in keys]
    outs = outs_64_past_a_page(sizes)
    got = backend.read_batch(list(zip(keys, outs)))
    assert got == [len(stored[k]) if k in stored else None for k in keys]
    for k, out in zip(keys, outs):
        if k in stored:
            assert bytes(out[: len(stored[k])]) == stored[k]


def test_a_corrupt_value_in_a_later_group_is_a_miss_and_is_dropped(backend):
    stored = values(2 * READ_GROUP + 2)
    backend.write(items(stored))
    keys = list(stored)
    bad = keys[2 * READ_GROUP]
    path, offset = value_location(backend, bad)
    with open(path, "r+b") as f:
        f.seek(offset + len(stored[bad]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    outs = outs_64_past_a_page([len(stored[k]) for k in keys])
    verified = []

    def on_verified(i, size, crc):  # each good read, once, with its bytes already in place
        assert bytes(outs[i][:size]) == stored[keys[i]] and crc == checksum(keys[i], stored[keys[i]])
        verified.append((i, size))

    got = backend.read_batch(list(zip(keys, outs)), on_verified)
    assert got == [None if k == bad else len(stored[k]) for k in keys]
    assert sorted(verified) == [(i, n) for i, n in enumerate(got) if n is not None]
    assert all(bytes(o[: len(stored[k])]) == stored[k] for k, o in zip(keys, outs) if k != bad)
    assert backend.stats()["corrupt_reads"] == 1
    assert backend.lookup(bad) is None and nothing_pinned(backend)


def test_an_output_too_small_in_a_later_group_raises_after_the_reads_in_flight(backend):
    stored = values(2 * READ_GROUP + 2)
    backend.write(items(stored))
    keys = list(stored)
    backend.read_batch([(keys[0], memoryview(bytearray(len(stored[keys[0]]))))])  # descriptors opened
    fds = open_fds()
    outs = outs_64_past_a_page([len(stored[k]) for k in keys])
    small = max(range(2 * READ_GROUP, len(keys)), key=lambda i: len(stored[keys[i]]))  # in the last group
    outs[small] = outs[small][: len(stored[keys[small]]) - 1]
    with pytest.raises(InvalidValueError, match="smaller than the value"):
        backend.read_batch(list(zip(keys, outs)))
    assert nothing_pinned(backend) and open_fds() == fds
    ring = getattr(getattr(backend.engine, "_local", None), "ring", None)
    if ring is not None:  # uring: no read of the earlier groups is left in flight
        assert not ring._inflight and not ring._backlog
    # The backend keeps working, and nothing was dropped.
    outs[small] = outs_64_past_a_page([len(stored[keys[small]])])[0]
    assert backend.read_batch(list(zip(keys, outs))) == [len(stored[k]) for k in keys]


class MiscountingEngine(IoEngine):
    """Moves the bytes through ``inner`` but reports one byte less for every read."""

    name = "miscounting"

    def __init__(self, inner: IoEngine) -> None:
        super().__init__(direct=inner.direct)
        self.inner = inner

    def open_file(self, path, flags, mode=0o644):
        return self.inner.open_file(path, flags, mode)

    def submit(self, requests):
        counts = self.inner.run(requests)
        return IoFuture.completed([n - 1 if r.op is IoOp.READ else n for r, n in zip(requests, counts)])

    def close(self) -> None:
        pass


@pytest.mark.parametrize("name", BACKENDS)
def test_a_read_whose_count_is_not_the_value_size_is_never_served(tmp_path, direct_psync, name):
    be = make_backend(name, tmp_path, direct_psync, capacity=16 << 20)
    be.recover()
    stored = values(3)
    be.write(items(stored))
    be.engine = MiscountingEngine(direct_psync)
    keys = list(stored)
    got = be.read_batch([(k, memoryview(bytearray(len(stored[k])))) for k in keys])
    assert got == [None, None, None]
    assert be.stats()["corrupt_reads"] == 3 and len(be) == 0
    be.close()
