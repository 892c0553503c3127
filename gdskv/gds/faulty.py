"""A fault-injecting wrapper around any I/O engine, for tests of error handling.

:class:`FaultyEngine` passes requests to the engine it wraps, except those matching an
injected :class:`Fault`, which fail the way a device or filesystem fails:

- ``"eio"``: the request fails with EIO (a media error);
- ``"enospc"``: a write fails with ENOSPC (the filesystem is full);
- ``"short"``: a read transfers only the first half of its bytes into the caller's buffers
  and then fails as a short read, so a caller that ignored the error would see partly
  written, wrong bytes;
- ``"slow"``: the request succeeds, ``delay`` seconds late (a slow or busy device); a batch
  with slow requests in it completes after the longest of their delays.

Each failure is the :class:`IoError` a real engine raises (path, offset, errno). A fault
matches by operation and by a substring of the request's path, for ``times`` requests or
until :meth:`FaultyEngine.clear`. Batches complete before :meth:`submit` returns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import threading
import time
from typing import Any, List, Optional, Sequence, Union

from gdskv.errors import IoError
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest

KINDS = ("eio", "enospc", "short", "slow")


@dataclasses.dataclass
class Fault:
    """One injected fault; ``times=None`` keeps it until cleared."""

    kind: str
    op: Optional[IoOp] = None
    path_contains: str = ""
    times: Optional[int] = None
    hits: int = 0
    delay: float = 0.0

    def matches(self, request: IoRequest) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.op is not None and request.op is not self.op:
            return False
        if self.kind == "enospc" and request.op is not IoOp.WRITE:
            return False
        if self.kind == "short" and request.op is not IoOp.READ:
            return False
        return self.path_contains in request.path


class FaultyEngine(IoEngine):
    """Wraps ``inner``; requests matching an injected fault fail. See the module docstring."""

    name = "faulty"

    def __init__(self, inner: IoEngine) -> None:
        super().__init__(direct=inner.direct)
        self.inner = inner
        self._faults: List[Fault] = []
        self._lock = threading.Lock()
        self.injected = 0

    def inject(
        self, kind: str, *, op: Optional[IoOp] = None, path_contains: str = "", times: Optional[int] = None, delay: float = 0.0
    ) -> Fault:
        """Make matching requests fail with ``kind`` (one of :data:`KINDS`), or, for
        ``"slow"``, complete ``delay`` seconds late."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; valid: {', '.join(KINDS)}")
        if (kind == "slow") != (delay > 0):
            raise ValueError("a delay (seconds, > 0) goes with kind 'slow' and only with it")
        fault = Fault(kind, op, path_contains, times, delay=float(delay))
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every injected fault."""
        with self._lock:
            self._faults.clear()

    def open_file(self, path: "str | os.PathLike[str]", flags: int, mode: int = 0o644) -> int:
        return self.inner.open_file(path, flags, mode)

    def submit(self, requests: Sequence[IoRequest]) -> IoFuture:
        outcomes: List[Union[int, BaseException, None]] = [None] * len(requests)
        passed: List[int] = []
        shorts: List[int] = []
        delay = 0.0
        with self._lock:
            for i, request in enumerate(requests):
                fault = next((f for f in self._faults if f.matches(request)), None)
                if fault is None:
                    passed.append(i)
                    continue
                fault.hits += 1
                self.injected += 1
                if fault.kind == "slow":
                    delay = max(delay, fault.delay)
                    passed.append(i)
                elif fault.kind == "short":
                    shorts.append(i)
                else:
                    outcomes[i] = _failure(request, errno.EIO if fault.kind == "eio" else errno.ENOSPC)
        if delay:
            time.sleep(delay)
        if passed:
            for i, outcome in zip(passed, self.inner.submit([requests[i] for i in passed]).outcomes()):
                outcomes[i] = outcome
        for i in shorts:
            outcomes[i] = self._short_read(requests[i])
        return _settled(outcomes)

    def _short_read(self, request: IoRequest) -> IoError:
        half = request.nbytes // 2
        got = 0
        if half:
            part = _prefix(request.buffers, half)
            outcome = self.inner.submit([IoRequest(IoOp.READ, request.fd, request.offset, part, request.path)]).outcomes()[0]
            if isinstance(outcome, BaseException):  # the half read failed itself: that error, as it is
                return outcome if isinstance(outcome, IoError) else IoError(f"short read: {outcome}", path=request.path, offset=request.offset)
            got = outcome
        return IoError("short read", path=request.path, offset=request.offset, expected=request.nbytes, got=got)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "faults_injected": self.injected}

    def close(self) -> None:
        self.inner.close()


def _failure(request: IoRequest, code: int) -> IoError:
    return IoError(
        f"{request.op.value} failed: {os.strerror(code)}",
        path=request.path, offset=request.offset, length=request.nbytes, errno=code,
    )


def _prefix(buffers: Sequence[memoryview], n: int) -> List[memoryview]:
    out = []
    for b in buffers:
        if n <= 0:
            break
        out.append(b[:n])
        n -= min(n, b.nbytes)
    return out


def _settled(outcomes: Sequence[Any]) -> IoFuture:
    parts = []
    for outcome in outcomes:
        fut: "concurrent.futures.Future[int]" = concurrent.futures.Future()
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
        parts.append(fut)
    return IoFuture(parts)
