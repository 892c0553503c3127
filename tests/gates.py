"""Sync points for deterministic concurrency tests.

A :class:`Gate` wraps one callable of a live store (its I/O engine's ``run``, a backend
method, a store method): the wrapped call announces that it was reached and then waits until
the test opens the gate, so a test can hold a background thread at an exact point of a data
flow and act while it is held. The files, threads and stores stay real.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

HOLD_LIMIT_S = 30.0  # a gate that is never opened fails the test instead of hanging it


class Gate:
    """Hold calls of ``func`` for which ``when(*args)`` is true until :meth:`open`."""

    def __init__(self, func: Callable[..., Any], when: Optional[Callable[..., bool]] = None, *, times: int = 1) -> None:
        self._func = func
        self._when = when
        self._left = times
        self._lock = threading.Lock()
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hold = False
        if self._when is None or self._when(*args, **kwargs):
            with self._lock:
                if self._left > 0:
                    self._left -= 1
                    hold = True
        if hold:
            self.reached.set()
            if not self._open.wait(HOLD_LIMIT_S):
                raise TimeoutError("gate was never opened")
        return self._func(*args, **kwargs)

    def wait_reached(self, timeout: float = HOLD_LIMIT_S) -> None:
        if not self.reached.wait(timeout):
            raise AssertionError("the gated call was never reached")

    def open(self) -> None:
        self._open.set()


class After:
    """Call ``func``, then hold (once) until :meth:`open`: a sync point just after a call."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self._func = func
        self._held = False
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._func(*args, **kwargs)
        if not self._held:
            self._held = True
            self.reached.set()
            if not self._open.wait(HOLD_LIMIT_S):
                raise TimeoutError("gate was never opened")
        return result

    def wait_reached(self, timeout: float = HOLD_LIMIT_S) -> None:
        if not self.reached.wait(timeout):
            raise AssertionError("the gated call was never reached")

    def open(self) -> None:
        self._open.set()


def still_waiting(target: Callable[[], Any], seconds: float = 0.3) -> threading.Thread:
    """Start ``target`` on a thread and check that it has not returned ``seconds`` later (it
    waits for something a gate holds); returns the thread, for the test to join."""
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(seconds)
    assert thread.is_alive(), f"{target} returned while it should have waited"
    return thread
