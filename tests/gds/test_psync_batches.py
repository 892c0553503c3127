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


class Interrupted(BaseException):
    """What the tests' signal handler raises (as SIGINT's default handler raises KeyboardInterrupt)."""


@pytest.fixture
def alarm():
    """Raise :class:`Interrupted` in the main thread ``seconds`` from now: ``alarm(seconds)``."""
    import signal

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_a_signal_in_a_caller_running_a_request_interrupts_the_caller_not_the_batch(tmp_path, calls, monkeypatch, alarm):
    """Ctrl-C while result() runs a request in the caller's thread: result() raises it; the
    request runs again on the pool, and the batch ends with every byte count (before, the
    interrupt became the request's outcome, raised in every thread waiting on the batch)."""
    import time

    path = tmp_path / "data"
    path.write_bytes(block(4, 4 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    counted = os.preadv

    def slow_in_the_caller(fd_, buffers, offset, *args):
        if threading.current_thread() is threading.main_thread():
            time.sleep(2)  # the alarm lands here
        return counted(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow_in_the_caller)
    outs = [bytearray(4096) for _ in range(4)]
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)])
        others = []
        waiter = threading.Thread(target=lambda: others.append(future.outcomes()))
        waiter.start()
        alarm(0.2)
        with pytest.raises(Interrupted):
            future.result()
        calls.release.set()
        waiter.join(10)
        assert others == [[4096] * 4] and future.result(timeout=10) == [4096] * 4
        assert b"".join(outs) == block(4, 4 * 4096)
    finally:
        calls.release.set()
        os.close(fd)
        engine.close()


def test_a_request_interrupted_once_the_pool_is_gone_fails_with_eintr(tmp_path, monkeypatch, alarm):
    """The engine closed (its pool shut down) while the caller runs a request, then the
    caller is interrupted: nobody can run that request again, so it fails, and the batch ends."""
    import errno
    import time

    from gdskv.errors import IoError

    path = tmp_path / "data"
    path.write_bytes(block(5, 4 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    real = os.preadv

    def slow(fd_, buffers, offset, *args):
        time.sleep(2 if threading.current_thread() is threading.main_thread() else 0.1)
        return real(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow)
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(4)])
        closer = threading.Thread(target=engine.close)  # returns once the pool has run the rest
        closer.start()
        alarm(0.8)
        with pytest.raises(Interrupted):
            future.result()
        closer.join(10)
        outcomes = future.outcomes(timeout=10)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], IoError) and failed[0].context["errno"] == errno.EINTR
        assert outcomes.count(4096) == 3
    finally:
        os.close(fd)
        engine.close()


def test_await_needs_no_free_executor_thread(tmp_path, monkeypatch):
    """Awaiting a batch holds no thread: it returns while the loop's default executor is
    busy (before, it waited for a thread there, after the requests had all ended)."""
    import asyncio
    import concurrent.futures
    import time

    real = os.preadv

    def slow(fd_, buffers, offset, *args):
        time.sleep(0.05)  # still in flight when the await starts
        return real(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow)
    path = tmp_path / "data"
    path.write_bytes(block(6, 8 * 4096))
    engine = PsyncEngine(threads=4)
    fd = os.open(path, os.O_RDONLY)

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait, 30)
        try:
            future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(8)])
            return await asyncio.wait_for(_awaited(future), 5)
        finally:
            gate.set()
            await busy

    try:
        assert asyncio.run(main()) == [4096] * 8
    finally:
        os.close(fd)
        engine.close()


async def _awaited(future):
    return await future


def test_a_small_read_started_by_a_signal_handler_does_not_share_the_interrupted_reads_staging(tmp_path):
    """Small O_DIRECT reads go through the thread's staging buffer; a handler that reads
    through the same engine in the same thread, between the interrupted read's transfer
    and its copy out, gets a buffer of its own (before, it overwrote the interrupted read's)."""
    import signal
    import time

    engine = PsyncEngine(threads=2, direct=True)
    (tmp_path / "a").write_bytes(b"A" * 65536)
    (tmp_path / "b").write_bytes(b"B" * 65536)
    fa = engine.open_file(tmp_path / "a", os.O_RDONLY)
    fb = engine.open_file(tmp_path / "b", os.O_RDONLY)
    handled = []

    def handler(signum, frame):
        if not handled or handled[-1] is not None:
            handled.append(None)
            engine.run([IoRequest.read(fb, 0, memoryview(bytearray(4096)))])
            handled[-1] = True

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    wrong = reads = 0
    try:
        end = time.monotonic() + 2
        while time.monotonic() < end:
            out = bytearray(4096)
            engine.run([IoRequest.read(fa, 4096 + 7, memoryview(out))])  # one request: runs in this thread
            reads += 1
            wrong += out != b"A" * 4096
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(fa)
        os.close(fb)
        engine.close()
    assert len(handled) > 50 and reads > 1000
    assert wrong == 0
