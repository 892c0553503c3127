"""The work in progress inside a :class:`gdskv.Store`, and waiting for it.

Puts copy their value in and reads copy values out *outside* the store lock, from and into
pinned entries; a device put copies into HBM with no lock held at all. :class:`Activity`
counts them, so that ``close()`` can wait until no put is copying in (before it drains) and
no read is copying out (before it frees the tiers), and so that a put or remove of a key can
wait for a device put of the same key to end. Every method is called with the store lock
held; the waits release it meanwhile (on the store's condition).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Dict, Optional

from gdskv.config import MAX_WAIT_S
from gdskv.errors import GdskvError, InvalidValueError

#: How long one wait for another thread's copy lasts before the waiter looks again.
COPY_POLL_S = 0.05


def deadline_arg(timeout: Any, what: str) -> Optional[float]:
    """The ``time.monotonic()`` deadline of a wait of ``timeout`` seconds (None or ``inf``:
    no deadline). Anything but a number of seconds up to a year is :class:`InvalidValueError`."""
    if timeout is None or timeout == math.inf:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
        raise InvalidValueError(f"{what} timeout must be a number of seconds or None", got=repr(timeout))
    if timeout > MAX_WAIT_S:
        raise InvalidValueError(f"{what} timeout must be at most {MAX_WAIT_S:.0f} s (a year), or None", got=timeout)
    return time.monotonic() + timeout


class Activity:
    """Puts, reads and device puts in progress (see the module docstring)."""

    def __init__(self, cond: threading.Condition, *, room_waiters: Callable[[], int]) -> None:
        """``room_waiters()``: how many puts wait for DRAM room; a put that ends wakes them
        (a committed entry may be evictable, a failed one's bytes are free)."""
        self._cond = cond
        self._room_waiters = room_waiters
        self.putting = 0  # puts between their reservation and their commit
        self.reading = 0  # reads copying out of the tiers
        self._idle_waiter = False  # close() waits for one of the two to reach 0
        self._copy_waiters = 0  # puts waiting for another thread's copy of the same key
        #: Keys whose device put is copying into HBM, with the thread doing it.
        self._device_puts: Dict[bytes, int] = {}

    def put_began(self) -> None:
        self.putting += 1

    def put_done(self) -> None:
        """A put's copy is over: wake whoever waits for it, and the puts waiting for room."""
        self.putting -= 1
        if self._copy_waiters or self._room_waiters() or (self._idle_waiter and not self.putting):
            self._cond.notify_all()

    def read_began(self) -> None:
        self.reading += 1

    def read_done(self) -> None:
        self.reading -= 1
        if self._idle_waiter and not self.reading:
            self._cond.notify_all()

    def wait_no_puts(self) -> None:
        self._wait_idle(lambda: self.putting)

    def wait_no_reads(self) -> None:
        self._wait_idle(lambda: self.reading)

    def _wait_idle(self, in_progress: Callable[[], int]) -> None:
        self._idle_waiter = True
        try:
            while in_progress():
                self._cond.wait()
        finally:
            self._idle_waiter = False

    # -- device puts ----------------------------------------------------------------

    def device_put_began(self, k: bytes) -> None:
        self._device_puts[k] = threading.get_ident()

    def device_put_ended(self, k: bytes) -> None:
        """(Atomic: safe to call before the lock is taken, even if an interrupt lands.)"""
        self._device_puts.pop(k, None)

    def device_put_in_progress(self, k: bytes) -> bool:
        return k in self._device_puts

    def await_device_put(self, k: bytes, check: Callable[[], None]) -> None:
        """Wait until no device put of ``k`` is copying its value into HBM: what the key holds
        is known only then. ``check()`` after each wait (the store's: raises once it is
        closed or closing). Called by the thread doing that device put (a listener calling the
        store, which it must not), it raises rather than wait for itself."""
        owner = self._device_puts.get(k)
        if owner is None:
            return
        if owner == threading.get_ident():
            raise GdskvError("the store was called on a key from inside that key's own put (a listener must not call the store)", key=k[:64])
        while k in self._device_puts:
            self.wait_for_copy()
            check()

    def wait_for_copy(self) -> None:
        """Wait a little for another thread's copy of a key to end (it notifies when it does)."""
        self._copy_waiters += 1
        try:
            self._cond.wait(COPY_POLL_S)
        finally:
            self._copy_waiters -= 1

    @property
    def copy_waiters(self) -> int:
        """How many puts wait for another thread's copy now."""
        return self._copy_waiters
