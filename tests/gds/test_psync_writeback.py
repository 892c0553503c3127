"""psync writes start write-back of their range; the hint never changes what is written."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from gdskv.gds.engine import IoRequest
from gdskv.gds.psync import PsyncEngine, start_writeback


def test_batched_writes_land_intact_and_read_back(tmp_path):
    path = tmp_path / "data"
    blocks = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(8)]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with PsyncEngine(threads=4) as engine:
            engine.run([IoRequest.write(fd, i << 20, memoryview(b), path=str(path)) for i, b in enumerate(blocks)])
            os.fsync(fd)
            outs = [np.empty(1 << 20, dtype=np.uint8) for _ in blocks]
            assert engine.run([IoRequest.read(fd, i << 20, memoryview(o)) for i, o in enumerate(outs)]) == [1 << 20] * 8
    finally:
        os.close(fd)
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    assert path.stat().st_size == 8 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_start_writeback_on_a_file_and_a_pipe(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * 8192, 0)
        assert start_writeback(fd, 0, 8192) is True
        assert start_writeback(fd, 0, 0) is False  # nothing to do
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert start_writeback(w, 0, 10) is False  # ESPIPE: ignored, not raised
    finally:
        os.close(r)
        os.close(w)
