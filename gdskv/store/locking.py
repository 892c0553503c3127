"""Taking the store's lock for bookkeeping that must not be skipped."""

from __future__ import annotations

import threading
from typing import Optional


class lock_through_interrupts:  # noqa: N801 - used as a function: ``with lock_through_interrupts(lock):``
    """``lock``, for the bookkeeping that ends a put or a read (counts, pins) and must not be
    skipped. An exception raised while this thread waits for the lock (a signal handler's:
    Ctrl-C's ``KeyboardInterrupt`` in the main thread) is raised once the body has run, not
    instead of it: a put left counted as in progress made ``close()`` wait for ever, and a put
    of the same bytes wait for its copy. So a Ctrl-C does not cut this wait short; the lock
    is only ever held briefly (the store's I/O runs outside it, but for a remove's). The
    caller must not hold the lock already. (A class, not a generator: it runs on every read.)"""

    __slots__ = ("_lock", "_deferred")

    def __init__(self, lock: "threading.RLock") -> None:
        self._lock = lock
        self._deferred: Optional[BaseException] = None

    def __enter__(self) -> None:
        while True:
            try:
                self._lock.acquire()
            except BaseException as exc:  # noqa: BLE001 - raised in __exit__, once the body has run
                self._deferred = self._deferred or exc
                if not self._lock._is_owned():  # type: ignore[attr-defined]  (it came while waiting: wait again)
                    continue
            break

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        self._lock.release()
        if self._deferred is not None and exc_type is None:
            raise self._deferred
        return False
