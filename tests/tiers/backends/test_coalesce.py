"""Coalescing a batch's records into write requests: one per run of aligned records that
follow one another in the file."""

from __future__ import annotations

import pytest

from backend_io import items, read
from conftest import block
from gdskv.gds.aligned import IOV_MAX, alloc_aligned
from gdskv.gds.engine import IoOp
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.coalesce import ALONE_FROM, MAX_RUN_BYTES, coalesced_writes

KiB = 1024


@pytest.fixture
def pages():
    """32 MiB of page-aligned memory (unmapped once the last view of it is gone)."""
    return alloc_aligned(32 << 20).view


def spans(requests):
    return [(r.offset, sum(b.nbytes for b in r.buffers), len(r.buffers)) for r in requests]


def test_records_end_to_end_make_one_request(pages):
    records = [(i * 8 * KiB, [pages[i * 8 * KiB : i * 8 * KiB + 4 * KiB], pages[i * 8 * KiB + 4 * KiB : (i + 1) * 8 * KiB]])
               for i in range(10)]
    requests = coalesced_writes(7, records, path="data")
    assert spans(requests) == [(0, 80 * KiB, 20)]
    assert requests[0].op is IoOp.WRITE and requests[0].fd == 7 and requests[0].path == "data"
    assert list(requests[0].buffers) == [b for _, bufs in records for b in bufs]  # in file order


def test_a_gap_in_the_file_starts_a_new_request(pages):
    records = [(0, [pages[: 4 * KiB]]), (4 * KiB, [pages[4 * KiB : 8 * KiB]]), (64 * KiB, [pages[8 * KiB : 12 * KiB]])]
    assert spans(coalesced_writes(3, records)) == [(0, 8 * KiB, 2), (64 * KiB, 4 * KiB, 1)]


def test_a_record_the_engine_must_stage_goes_alone(pages):
    unaligned = pages[4 * KiB + 64 : 8 * KiB + 64]  # 4 KiB long, 64 bytes past a page
    records = [(0, [pages[: 4 * KiB]]), (4 * KiB, [unaligned]), (8 * KiB, [pages[8 * KiB : 12 * KiB]]),
               (12 * KiB, [pages[12 * KiB : 16 * KiB]]), (16 * KiB, [pages[16 * KiB : 16 * KiB + 100]])]
    assert spans(coalesced_writes(3, records)) == [
        (0, 4 * KiB, 1), (4 * KiB, 4 * KiB, 1), (8 * KiB, 8 * KiB, 2), (16 * KiB, 100, 1),
    ]


def test_a_run_stops_at_iov_max_buffers_and_at_max_run_bytes(pages):
    small = [(i * 4 * KiB, [pages[(i % 16) * 4 * KiB : (i % 16 + 1) * 4 * KiB]]) for i in range(IOV_MAX + 5)]
    assert [n for _, _, n in spans(coalesced_writes(3, small))] == [IOV_MAX, 5]
    size = ALONE_FROM // 2
    many = [(i * size, [pages[(i % 32) * size : (i % 32 + 1) * size]]) for i in range(40)]
    runs = [n for _, n, _ in spans(coalesced_writes(3, many))]
    assert sum(runs) == 40 * size and max(runs) <= MAX_RUN_BYTES and len(runs) == -(-40 * size // MAX_RUN_BYTES)
    assert coalesced_writes(3, []) == []


def test_large_records_go_one_request_each(pages):
    size = ALONE_FROM
    records = [(i * size, [pages[i * size : (i + 1) * size]]) for i in range(3)]
    assert spans(coalesced_writes(3, records)) == [(i * size, size, 1) for i in range(3)]


class CountingEngine:
    """Wraps an engine and counts the write requests submitted to it."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.writes = 0

    def submit(self, requests):
        self.writes += sum(r.op is IoOp.WRITE for r in requests)
        return self._engine.submit(requests)

    def run(self, requests):
        return self.submit(requests).result()

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("name", ["bucket", "offset"])
def test_a_batch_of_records_end_to_end_goes_out_as_one_request(tmp_path, direct_psync, name):
    """48 values of 64 KiB on pages (as the DRAM tier holds KV blocks): 48 records of 68 KiB
    laid end to end, 3.2 MiB, go out as one request, and read back byte-exact."""
    engine = CountingEngine(direct_psync)
    backend = make_backend(name, tmp_path, engine, capacity=64 << 20)
    backend.recover()
    try:
        size, count = 64 * KiB, 48
        memory = alloc_aligned(count * size)
        values = {f"kv-{i}".encode(): block(i, size) for i in range(count)}
        for i, value in enumerate(values.values()):
            memory.view[i * size : (i + 1) * size] = value
        batch = [(key, memory.view[i * size : (i + 1) * size], crc) for i, (key, _, crc) in enumerate(items(values))]
        engine.writes = 0
        backend.write(batch)
        assert engine.writes == 1
        for key, value in values.items():
            assert read(backend, key, size) == value
        del batch
        memory.close()
    finally:
        backend.close()
