"""Helpers for the tests that await I/O futures."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest


async def awaited(future):
    return await future


def await_with_the_executor_busy(submit, timeout: float = 5):
    """Run a loop whose default executor has one thread, kept busy; in it, ``submit()`` a
    batch and await it (``timeout``: asyncio.TimeoutError if the await does not end)."""

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait, 30)
        try:
            return await asyncio.wait_for(awaited(submit()), timeout)
        finally:
            gate.set()
            await busy

    return asyncio.run(main())


def cancel_an_await(future, after: float) -> None:
    """Await ``future`` in a task, cancel the task ``after`` seconds later: the task ends
    cancelled (the requests are the test's to check)."""

    async def cancel():
        task = asyncio.ensure_future(awaited(future))
        await asyncio.sleep(after)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
