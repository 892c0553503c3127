"""Helpers of gdskv.gds.aligned that cut buffers into the pieces an engine transfers."""

from __future__ import annotations

import random

from gdskv.gds.aligned import slices, split_views


def test_split_views_cuts_the_concatenation_into_pieces_of_the_size():
    data = bytes(range(256)) * 16
    bufs = [memoryview(data)[:1000], memoryview(data)[1000:1000], memoryview(data)[1000:3000], memoryview(data)[3000:3100]]
    pieces = split_views(bufs, 1024)
    assert [sum(v.nbytes for v in p) for p in pieces] == [1024, 1024, 1024, 28]
    assert b"".join(bytes(v) for p in pieces for v in p) == data[:3100]
    assert all(v.nbytes for p in pieces for v in p)  # no empty views
    assert split_views([], 4096) == []


def test_split_views_agrees_with_slices_piece_by_piece():
    """Random buffer lists and piece sizes: each piece holds the bytes ``slices`` gives for
    its range (``slices`` walks the buffers once per piece, ``split_views`` once in all)."""
    rng = random.Random(7)
    data = memoryview(bytes(range(256)) * 8)
    for _ in range(500):
        bufs = [data[: rng.randrange(0, 900)] for _ in range(rng.randrange(0, 8))]
        piece = rng.randrange(1, 1200)
        total = sum(b.nbytes for b in bufs)
        got = [b"".join(bytes(v) for v in p) for p in split_views(bufs, piece)]
        want = [b"".join(bytes(v) for v in slices(bufs, start, min(piece, total - start))) for start in range(0, total, piece)]
        assert got == want
