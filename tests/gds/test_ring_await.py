"""Awaiting a ``uring`` batch holds no thread: the event loop watches the ring's descriptor
and drives the ring itself when completions are in."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from awaiting import await_with_the_executor_busy, awaited, cancel_an_await
from conftest import block, uring_unavailable
from gdskv.gds.engine import IoOp, IoRequest

pytestmark = pytest.mark.skipif(uring_unavailable() is not None, reason=str(uring_unavailable()))

PAGE = 4096
PAGES = 4096  # 16 MiB: thousands of O_DIRECT reads take tens of milliseconds


@pytest.fixture
def setup(tmp_path):
    from gdskv.gds.uring import UringEngine

    path = tmp_path / "data"
    data = block(3, PAGES * PAGE)
    path.write_bytes(data)
    engine = UringEngine(direct=True)
    fd = engine.open_file(path, os.O_RDONLY)
    engine.run(_reads(fd, str(path), [0])[0])  # this thread's ring exists before the tests count descriptors
    yield engine, fd, str(path), data
    os.close(fd)
    engine.close()


def _reads(fd, path, pages):
    outs = [bytearray(PAGE) for _ in pages]
    return [IoRequest.read(fd, p * PAGE, memoryview(out), path=path) for p, out in zip(pages, outs)], outs


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_await_needs_no_free_executor_thread(setup):
    """Before, the await waited on the loop's default executor: with its one thread busy,
    the batch ended but the await did not."""
    engine, fd, path, data = setup

    requests, outs = _reads(fd, path, range(PAGES))

    def submit():
        future = engine.submit(requests)
        assert not future.done()  # still in flight when the await starts
        return future

    assert await_with_the_executor_busy(submit) == [PAGE] * PAGES and b"".join(outs) == data


def test_many_awaits_on_one_ring_in_one_loop_all_end_and_close_their_watch(setup):
    engine, fd, path, data = setup
    before = _open_fds()

    async def main():
        batches = [_reads(fd, path, range(i, PAGES, 16)) for i in range(16)]
        futures = [engine.submit(requests) for requests, _ in batches]  # all on this thread's ring
        got = await asyncio.gather(*(awaited(f) for f in futures))
        return got, batches

    got, batches = asyncio.run(main())
    for i, (counts, (requests, outs)) in enumerate(zip(got, batches)):
        assert counts == [PAGE] * len(requests)
        assert all(out == data[r.offset : r.offset + PAGE] for r, out in zip(requests, outs)), i
    assert _open_fds() == before  # the loop's duplicate of the ring's descriptor is closed


def test_an_await_drives_the_ring_of_the_thread_that_submitted(setup):
    """A batch submitted on another thread's ring, awaited here: the loop drives that ring
    (its thread does not wait on the batch)."""
    engine, fd, path, data = setup
    submitted = []
    requests, outs = _reads(fd, path, range(0, PAGES, 2))
    thread = threading.Thread(target=lambda: submitted.append(engine.submit(requests)))
    thread.start()
    thread.join()

    async def main():
        return await asyncio.wait_for(awaited(submitted[0]), 10)

    assert asyncio.run(main()) == [PAGE] * len(requests)
    assert all(out == data[r.offset : r.offset + PAGE] for r, out in zip(requests, outs))


def test_cancelling_an_await_leaves_the_batch_running(setup):
    engine, fd, path, data = setup
    before = _open_fds()
    requests, outs = _reads(fd, path, range(PAGES))
    future = engine.submit(requests)
    cancel_an_await(future, after=0)
    assert future.result(timeout=10) == [PAGE] * PAGES and b"".join(outs) == data
    assert _open_fds() == before


@pytest.fixture
def no_recheck(monkeypatch):
    """An await's periodic recheck every 50 ms, made 30 s: an await that ends within the
    tests' limits was woken, not found by a recheck."""
    import gdskv.gds.ring as ring_module

    monkeypatch.setattr(ring_module, "_POLL_MS", 30_000)


def test_an_await_is_woken_when_another_caller_reaps_its_batch(setup, no_recheck):
    """Coroutines each submitting and awaiting batches on one ring: a coroutine's submit() or
    done() often reaps another's completions, after which the ring's descriptor is no longer
    readable. Before, that await slept until its recheck (50 ms; 30 s here)."""
    engine, fd, path, data = setup

    async def worker(seed):
        for i in range(100):
            requests, outs = _reads(fd, path, [(seed * 131 + i * 7) % PAGES])
            assert await engine.submit(requests) == [PAGE]
            assert outs[0] == data[requests[0].offset : requests[0].offset + PAGE]

    async def main():
        await asyncio.wait_for(asyncio.gather(*(worker(seed) for seed in range(16))), 20)

    asyncio.run(main())


def test_two_tasks_awaiting_one_batch_both_end(setup, no_recheck):
    engine, fd, path, data = setup

    async def main():
        requests, outs = _reads(fd, path, range(PAGES))
        future = engine.submit(requests)
        return await asyncio.wait_for(asyncio.gather(awaited(future), awaited(future)), 5)

    first, second = asyncio.run(main())
    assert first == second == [PAGE] * PAGES


def test_an_exception_right_after_the_loop_starts_watching_leaves_nothing_registered(setup):
    """A handler raising right after add_reader returned: the loop must not keep the
    duplicate descriptor registered after it is closed (the next file given the number
    would be taken for it, and the loop would spin on the ring's completions)."""
    engine, fd, path, data = setup
    before = _open_fds()

    class Interrupted(BaseException):
        pass

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.add_reader

        def add_then_raise(*args):
            real(*args)
            loop.add_reader = real
            raise Interrupted()

        loop.add_reader = add_then_raise
        requests, _ = _reads(fd, path, range(PAGES))
        future = engine.submit(requests)
        with pytest.raises(Interrupted):
            await future
        registered = [key.fd for key in loop._selector.get_map().values() if key.fd not in (loop._ssock.fileno(), loop._csock.fileno())]
        future.result(timeout=10)
        return registered

    assert asyncio.run(main()) == []
    assert _open_fds() == before


def test_wakes_from_other_threads_keep_coming(setup, no_recheck, monkeypatch):
    """Another thread reaps each batch (the loop's own reader is made to do nothing) and
    wakes the await through the loop; the loop runs that wake-up before the scheduling call
    returns (the GIL passed to it). Before, the wake-up being scheduled was marked after the
    call, so the mark stayed and every later wake-up was skipped."""
    import time

    from gdskv.gds.ring import Ring

    engine, fd, path, data = setup
    monkeypatch.setattr(Ring, "_on_readable", lambda self, loop, fd: None)

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def and_let_the_loop_run(*args):
            handle = real(*args)
            time.sleep(0.05)
            return handle

        loop.call_soon_threadsafe = and_let_the_loop_run
        r, w = os.pipe()  # a batch awaited throughout keeps the loop's watch of the ring alive
        held = engine.submit([IoRequest(IoOp.READ, r, 0, [memoryview(bytearray(4))], "pipe", False)])
        background = asyncio.ensure_future(awaited(held))
        try:
            for _ in range(3):  # batches the kernel holds until the driver thread lets them end
                pr, pw = os.pipe()
                future = engine.submit([IoRequest(IoOp.READ, pr, 0, [memoryview(bytearray(2))], "pipe", False)])

                def drive():
                    time.sleep(0.02)  # the await has started
                    os.write(pw, b"ok")
                    future.outcomes(5)

                driver = threading.Thread(target=drive)
                driver.start()
                assert await asyncio.wait_for(awaited(future), 5) == [2]
                driver.join()
                os.close(pr)
                os.close(pw)
        finally:
            os.write(w, b"done")
            threading.Thread(target=held.outcomes, args=(5,)).start()
            assert await asyncio.wait_for(background, 5) == [4]
            os.close(r)
            os.close(w)

    asyncio.run(main())
