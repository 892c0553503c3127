"""Taking the store's lock for bookkeeping that must not be skipped."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional


@contextlib.contextmanager
def lock_through_interrupts(lock: "threading.RLock") -> Iterator[None]:
    """``lock``, for the bookkeeping that ends a put or a read (counts, pins) and must not be
    skipped. An exception raised while this thread waits for the lock (a signal handler's:
    Ctrl-C's ``KeyboardInterrupt`` in the main thread) is raised once the body has run, not
    instead of it: a put left counted as in progress made ``close()`` wait for ever, and a put
    of the same bytes wait for its copy. So a Ctrl-C does not cut this wait short; the lock
    is only ever held briefly (the store's I/O runs outside it, but for a remove's). The
    caller must not hold the lock already."""
    deferred: Optional[BaseException] = None
    while True:
        try:
            lock.acquire()
        except BaseException as exc:  # noqa: BLE001 - raised below, once the body has run
            deferred = deferred or exc
            if not lock._is_owned():  # type: ignore[attr-defined]  (it came while waiting: wait again)
                continue
        break
    try:
        yield
    finally:
        lock.release()
    if deferred is not None:
        raise deferred
