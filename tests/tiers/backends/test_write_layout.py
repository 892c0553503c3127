"""How records reach the disk: a value that sits page-aligned in memory and fills whole
4 KiB blocks goes out with its header block as one aligned write, nothing staged; only a
partial last block is staged. Every backend, through ``uring`` with O_DIRECT."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import block, uring_unavailable
from gdskv.config import BACKENDS
from gdskv.gds.aligned import alloc_aligned
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.record import checksum

KiB = 1024


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    from gdskv.gds.uring import UringEngine

    engine = UringEngine(direct=True)
    be = make_backend(request.param, tmp_path, engine, capacity=256 << 20)
    be.recover()
    yield be
    be.close()
    engine.close()


def staged(backend) -> int:
    return backend.engine.describe()["staged_write_bytes"]


def skip_unless_direct(backend) -> None:
    """Only O_DIRECT files stage anything: on a filesystem that refuses it there is nothing to see."""
    if backend.engine.describe()["direct_refused"]:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")


@pytest.mark.parametrize("size", [64 * KiB, 2048 * KiB])
def test_whole_block_values_on_pages_are_written_unstaged(backend, size):
    count = 6
    arena = alloc_aligned(count * size)
    for i in range(count):
        arena.view[i * size : (i + 1) * size] = block(i, size)
    items = []
    for i in range(count):
        key = f"whole-{size}-{i}".encode()
        value = arena.view[i * size : (i + 1) * size]
        items.append((key, value, checksum(key, value)))
    before = staged(backend)
    backend.write(items)
    skip_unless_direct(backend)
    assert staged(backend) == before  # header blocks and values straight from memory
    outs = [np.zeros(size, dtype=np.uint8) for _ in items]
    got = backend.read_batch([(key, memoryview(out)) for (key, _, _), out in zip(items, outs)])
    assert got == [size] * count
    for i, out in enumerate(outs):
        assert out.tobytes() == block(i, size)
    del items, value
    arena.close()


def test_only_a_partial_last_block_is_staged(backend):
    size = 64 * KiB + 100
    arena = alloc_aligned(2 * (size + 4 * KiB))
    stride = size + 4 * KiB - 100  # page-aligned starts
    items = []
    for i in range(2):
        key = f"tail-{i}".encode()
        value = arena.view[i * stride : i * stride + size]
        value[:] = block(10 + i, size)
        items.append((key, value, checksum(key, value)))
    before = staged(backend)
    backend.write(items)
    skip_unless_direct(backend)
    assert staged(backend) - before == 2 * 4 * KiB  # one block per record: its tail
    out = bytearray(size)
    assert backend.read_batch([(items[1][0], memoryview(out))]) == [size]
    assert bytes(out) == block(11, size)
    del items, value
    arena.close()


def test_head_blocks_are_page_aligned_records_headers_in_order():
    from gdskv.gds.aligned import address_of
    from gdskv.tiers.backends.record import HeadBlocks, decode_head, encode_head, head_size

    keys = [b"a", b"k" * 5000, b"z"]  # the long key's block spans two pages
    with HeadBlocks(len(k) for k in keys) as heads:
        blocks = [heads.encode(k, 4096 * (i + 1), 100 + i, 7 * i) for i, k in enumerate(keys)]
        for i, (key, blk) in enumerate(zip(keys, blocks)):
            assert blk.nbytes == head_size(len(key))
            assert address_of(blk) % 4096 == 0
            assert bytes(blk) == bytes(encode_head(key, 4096 * (i + 1), 100 + i, 7 * i))  # same bytes as ever
            head = decode_head(bytes(blk))
            assert (head.seq, head.key_len, head.value_len, head.crc) == (100 + i, len(key), 4096 * (i + 1), 7 * i)
        with pytest.raises(ValueError, match="sized for"):
            heads.encode(b"one too many", 1, 1, 1)
        del blocks, blk


def test_head_blocks_reuse_memory_and_zero_what_a_previous_batch_left():
    from gdskv.gds.aligned import address_of
    from gdskv.tiers.backends.record import HeadBlocks, encode_head

    with HeadBlocks([4000]) as first:
        block = first.encode(b"\xff" * 4000, 1, 1, 1)  # fills nearly the whole block
        where = address_of(block)
        del block
    with HeadBlocks([1]) as second:
        block = second.encode(b"k", 4096, 2, 3)
        assert address_of(block) == where  # the same memory, taken again
        assert bytes(block) == bytes(encode_head(b"k", 4096, 2, 3))  # padding zeroed, not 0xff
        del block

