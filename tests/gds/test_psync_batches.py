"""psync batches: pool tasks take requests until none is left, and a caller waiting without a
timeout runs requests too; every request runs exactly once."""

from __future__ import annotations

import collections
import os
import threading

import pytest

from conftest import block
from gdskv.gds.engine import IoRequest
from gdskv.gds.psync import PsyncEngine


@pytest.fixture
def calls(monkeypatch):
    """os.preadv counted per thread; the engine's pool threads wait for ``calls.release``
    (a slow device) while other threads read at once."""
    real = os.preadv
    counts: "collections.Counter[str]" = collections.Counter()
    lock = threading.Lock()
    release = threading.Event()

    def counted(fd, buffers, offset, *args):
        name = threading.current_thread().name
        with lock:
            counts[name] += 1
        if name.startswith("gdskv-psync"):
            release.wait(10)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", counted)
    counted.counts = counts
    counted.release = release
    yield counted
    release.set()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_batch_runs_each_request_once_on_at_most_its_threads(tmp_path, calls, direct):
    path = tmp_path / "data"
    path.write_bytes(block(1, 200 * 4096))
    engine = PsyncEngine(threads=3, direct=direct)
    fd = engine.open_file(path, os.O_RDONLY)
    try:
        calls.release.set()
        outs = [bytearray(1000) for _ in range(200)]
        requests = [IoRequest.read(fd, i * 4096 + 7, memoryview(out), path=str(path)) for i, out in enumerate(outs)]
        assert engine.run(requests) == [1000] * 200
    finally:
        os.close(fd)
        engine.close()
    assert all(out == block(1, 200 * 4096)[i * 4096 + 7 : i * 4096 + 1007] for i, out in enumerate(outs))
    assert sum(calls.counts.values()) == 200  # one preadv each: none ran twice
    assert len([name for name in calls.counts if name.startswith("gdskv-psync")]) <= 3


def test_a_caller_waiting_runs_the_requests_the_pool_has_not_started(tmp_path, calls):
    """With the pool's one thread stuck on a slow read, as_completed() still yields the
    other requests of the batch: the waiting caller ran them."""
    path = tmp_path / "data"
    path.write_bytes(block(2, 3 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    timer = threading.Timer(5, calls.release.set)  # ends the test on an engine that does not
    timer.start()
    try:
        outs = [bytearray(4096) for _ in range(3)]
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)])
        early = []
        for index, outcome in future.as_completed():
            assert outcome == 4096
            if not calls.release.is_set():
                early.append(index)
            if len(early) == 2:
                calls.release.set()
        assert len(early) == 2 and future.outcomes(timeout=10) == [4096] * 3
        assert b"".join(outs) == block(2, 3 * 4096)
        assert calls.counts[threading.current_thread().name] == 2
    finally:
        timer.cancel()
        calls.release.set()
        os.close(fd)
        engine.close()


def test_a_caller_waiting_with_a_timeout_runs_nothing(tmp_path, calls):
    """A timeout bounds the wait: the caller does not start a read that could outlast it."""
    path = tmp_path / "data"
    path.write_bytes(block(3, 2 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(2)])
        with pytest.raises(TimeoutError):
            future.result(timeout=0.05)
        assert calls.counts[threading.current_thread().name] == 0
        calls.release.set()
        assert future.result(timeout=10) == [4096, 4096]
    finally:
        calls.release.set()
        os.close(fd)
        engine.close()
