"""The I/O engine protocol: move bytes between files and buffers, in batches.

An :class:`IoEngine` knows nothing of keys, records or layouts; a storage backend decides
*where* bytes go and hands the engine a batch of :class:`IoRequest` s:

- ``submit(requests) -> IoFuture``: start every request of the batch (reads fill their
  buffers, writes drain theirs) and return at once. Buffers must stay alive and unchanged
  until the future completes.
- ``IoFuture.result(timeout=None) -> list[int]``: the byte count of each request, in order,
  once all are done. A request that fails, or transfers fewer bytes than its buffers hold,
  makes ``result()`` raise :class:`gdskv.errors.IoError` with the path, offset and lengths;
  a request whose buffers cannot be used (not flat, contiguous byte ``memoryview`` s, or
  read-only memory to read into) fails alone with :class:`gdskv.errors.InvalidValueError`
  (:func:`request_error`). Empty buffers are allowed and move nothing; a request of no
  bytes at all is 0 and touches no file. ``result`` and ``outcomes`` raise ``TimeoutError``
  if ``timeout`` passes while any request is still in flight, whatever the others did.
  Futures also offer ``done()``, ``as_completed()`` (each request's outcome as it
  finishes) and can be awaited from asyncio (it ends once every request has; cancelling
  the awaiting task does not cancel the requests).
- ``open_file(path, flags, mode) -> int``: open a file the way this engine wants to move
  its bytes: with ``O_DIRECT`` when the engine was built with ``direct=True`` and the
  filesystem allows it, buffered otherwise (the refusal is counted and logged once).
  Backends open their data files through it and never manage alignment: every engine
  accepts unaligned offsets, lengths and buffers on an ``O_DIRECT`` file and moves them
  through aligned staging memory it allocated once (:mod:`gdskv.gds.bounce`). The one
  rule: two writes of one batch (or of batches in flight together) must not touch the
  same 4 KiB block of an O_DIRECT file, since each rewrites the whole block.
- ``describe() -> dict``: what :meth:`gdskv.Store.stats` shows (name, O_DIRECT, and for an
  engine chosen by ``auto``, why).
- ``close()``: idempotent; later submits raise :class:`StoreClosedError`.

Engines: ``psync`` (a thread pool of ``os.preadv``/``os.pwritev``; always available),
``uring`` (io_uring through the ``liburing`` package) and ``auto`` (probes and picks one of
them, :mod:`gdskv.gds.probe`); :class:`gdskv.gds.faulty.FaultyEngine` wraps any engine to
inject faults in tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import errno
import logging
import os
import time
from typing import Any, Generator, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from gdskv.errors import GdskvError, InvalidValueError, IoError
from gdskv.gds.aligned import open_file

log = logging.getLogger(__name__)


class IoOp(enum.Enum):
    READ = "read"
    WRITE = "write"


class IoRequest(NamedTuple):
    """One vectored read or write at ``offset`` of the open file ``fd``.

    ``buffers`` are byte views (writable ones for reads); their lengths add up to the
    transfer size. ``path`` is only used in error messages. ``direct`` says whether ``fd``
    is ``O_DIRECT`` when the caller knows (it opened the file and kept the answer of
    :func:`~gdskv.gds.aligned.is_direct_fd`); None lets the engine ask the kernel, once
    per file and batch. Immutable (a named tuple: cheap to build, which matters at hundreds
    of thousands of requests per second).
    """

    op: IoOp
    fd: int
    offset: int
    buffers: Sequence[memoryview]
    path: str = ""
    direct: Optional[bool] = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @classmethod
    def read(cls, fd: int, offset: int, *buffers: memoryview, path: str = "") -> "IoRequest":
        return cls(IoOp.READ, fd, offset, buffers, path)

    @classmethod
    def write(cls, fd: int, offset: int, *buffers: memoryview, path: str = "") -> "IoRequest":
        return cls(IoOp.WRITE, fd, offset, buffers, path)


def request_error(request: IoRequest, offset: int, exc: BaseException) -> GdskvError:
    """What a request that failed with ``exc`` at file ``offset`` resolves to: an
    :class:`IoError` with path, offset, length and errno for an ``OSError``; an
    :class:`InvalidValueError` for buffers the request cannot use (the ``ValueError``,
    ``TypeError`` or ``BufferError`` taking their address or a view of them raised); a
    :class:`GdskvError` as it is. Anything else is a bug and is not wrapped, nor is an
    ``OSError`` without an errno: it did not come from the system (a signal handler's
    ``TimeoutError``, say), so it propagates (raised from here)."""
    if isinstance(exc, GdskvError):
        return exc
    if isinstance(exc, OSError) and exc.errno is None:
        raise exc
    length = sum(b.nbytes if b.__class__ is memoryview else 0 for b in request.buffers)
    context = {"path": request.path, "offset": max(offset, request.offset), "length": length}
    if isinstance(exc, OSError):
        return IoError(f"{request.op.value} failed: {exc.strerror}", errno=exc.errno, **context)
    if isinstance(exc, (ValueError, TypeError, BufferError)):
        return InvalidValueError(f"{request.op.value} buffers unusable for I/O: {exc}", **context)
    raise exc


def abandoned_error(request: IoRequest, offset: int) -> IoError:
    """The error of a request whose work an exception (a signal handler's, say) cut short
    or withdrew before it ran: its errno, ``EINTR``, says nothing of the file or its bytes."""
    return IoError(
        f"{request.op.value} abandoned: an exception (a signal handler's, say) cut short the I/O engine's handling of it",
        path=request.path, offset=offset, errno=errno.EINTR,
    )


def check_buffers(request: IoRequest) -> None:
    """Raise :class:`InvalidValueError` unless every buffer of ``request`` is a flat byte
    view (``memoryview.cast("B")`` makes one of any contiguous buffer) and, for a read,
    writable (the kernel would write into read-only memory anyway: bytes are immutable)."""
    reading = request.op is IoOp.READ
    for buf in request.buffers:
        if usable(buf, reading):
            continue
        context = {"path": request.path, "offset": request.offset}
        if not isinstance(buf, memoryview):
            raise InvalidValueError("buffers must be memoryviews (flat byte views)", type=type(buf).__name__, **context)
        raise InvalidValueError(
            "buffers must be flat, contiguous byte views" + (", writable to read into" if reading else ""),
            format=buf.format, ndim=buf.ndim, contiguous=buf.c_contiguous, readonly=buf.readonly, **context,
        )


def usable(buf: memoryview, reading: bool) -> bool:
    """Whether ``buf`` is a flat, contiguous byte view, writable if ``reading``."""
    return (
        buf.__class__ is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous
        and not (reading and buf.readonly)
    )


class IoFuture:
    """Completion of one submitted batch; wraps per-request concurrent futures."""

    def __init__(self, parts: List["concurrent.futures.Future[int]"]) -> None:
        self._parts = parts

    @classmethod
    def completed(cls, counts: List[int]) -> "IoFuture":
        parts = []
        for count in counts:
            fut: "concurrent.futures.Future[int]" = concurrent.futures.Future()
            fut.set_result(count)
            parts.append(fut)
        return cls(parts)

    @classmethod
    def failed(cls, exc: BaseException) -> "IoFuture":
        fut: "concurrent.futures.Future[int]" = concurrent.futures.Future()
        fut.set_exception(exc)
        return cls([fut])

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def result(self, timeout: Optional[float] = None) -> List[int]:
        """Wait for every request; raise the first request's error, if any, or
        ``TimeoutError`` if ``timeout`` seconds pass while a request is still in flight
        (its buffers are still in use then, whatever the others did)."""
        self._wait_all(timeout)
        return [p.result(timeout=0) for p in self._parts]

    def outcomes(self, timeout: Optional[float] = None) -> List[Union[int, BaseException]]:
        """Wait for every request; return each one's byte count or its exception.
        ``TimeoutError`` as :meth:`result`."""
        self._wait_all(timeout)
        return [p.exception(timeout=0) or p.result(timeout=0) for p in self._parts]

    def _wait_all(self, timeout: Optional[float]) -> None:
        _, pending = concurrent.futures.wait(self._parts, timeout=timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} I/O requests still in flight")

    def as_completed(self, timeout: Optional[float] = None) -> Iterator[Tuple[int, Union[int, BaseException]]]:
        """Yield ``(index, byte count or exception)`` for each request as it finishes, so a
        caller can verify one while the others are still in flight."""
        where = {id(p): i for i, p in enumerate(self._parts)}
        for part in concurrent.futures.as_completed(self._parts, timeout=timeout):
            yield where[id(part)], part.exception(timeout=0) or part.result(timeout=0)

    def __await__(self) -> Generator[Any, None, List[int]]:
        """Awaiting returns (or raises) only once every request has ended, as
        :meth:`result` does: no buffer is still in use then. Cancelling the awaiting task
        stops the wait, not the requests."""
        if not self.done():  # asyncio.wait never cancels what it waits for
            yield from asyncio.wait([asyncio.wrap_future(p) for p in self._parts]).__await__()
        return self.result(0)


class DrivenFuture(IoFuture):
    """Completion of a batch whose outcomes are recorded as its requests end, and whose
    waiters move the work on: a subclass implements :meth:`_wait` (the ``uring`` engine
    drives its ring; ``psync`` runs requests not yet started) and may implement
    :meth:`_progress`. Outcomes go to ``_values`` (by request), ``_order`` (the order they
    ended in) and ``_pending`` (how many have not), through the subclass, which also
    implements ``__await__``."""

    #: While a caller goes through completed requests (:meth:`as_completed`), the work is
    #: moved on (:meth:`_progress`) after every this many: a large batch being verified
    #: then keeps the device busy.
    PROGRESS_EVERY = 16

    def __init__(self, count: int) -> None:
        self._values: List[Union[int, BaseException, None]] = [None] * count
        self._pending = count
        self._order: List[int] = []  # indices in the order they resolved

    def _wait(self, timeout: Optional[float], resolved: Optional[int] = None) -> None:  # pragma: no cover
        """Return once every request has ended (or, given ``resolved``, more than that many
        have), or once ``timeout`` seconds have passed (None: no limit; 0: do not wait)."""
        raise NotImplementedError

    def _progress(self) -> None:
        """Move the work on without waiting; by default nothing."""

    def done(self) -> bool:
        return self._pending == 0

    def outcomes(self, timeout: Optional[float] = None) -> List[Union[int, BaseException]]:
        if self._pending:
            self._wait(timeout)
        if self._pending:
            raise TimeoutError(f"{self._pending} I/O requests still in flight")
        return list(self._values)  # type: ignore[arg-type]

    def result(self, timeout: Optional[float] = None) -> List[int]:
        out = self.outcomes(timeout)
        for value in out:
            if isinstance(value, BaseException):
                raise value
        return out  # type: ignore[return-value]

    def as_completed(self, timeout: Optional[float] = None) -> Iterator[Tuple[int, Union[int, BaseException]]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        every = self.PROGRESS_EVERY
        while True:
            while seen < len(self._order):
                index = self._order[seen]
                seen += 1
                yield index, self._values[index]  # type: ignore[misc]
                if not seen % every:
                    self._progress()
            if not self._pending:
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{self._pending} I/O requests still in flight")
            self._wait(remaining, resolved=seen)

    def __await__(self) -> Generator[Any, None, List[int]]:  # pragma: no cover
        """Wait without holding a thread (each engine's future knows what wakes it)."""
        raise NotImplementedError


class IoEngine:
    """Base class of the I/O engines. Subclasses implement :meth:`submit` and :meth:`close`."""

    #: Registered name ("psync", "uring", "kvikio").
    name = "base"
    #: Class-level defaults, for engines that do not call ``IoEngine.__init__``.
    direct = False
    reason: Optional[str] = None
    direct_refused = 0

    def __init__(self, *, direct: bool = False) -> None:
        #: Whether :meth:`open_file` asks for O_DIRECT.
        self.direct = direct
        #: Why this engine was chosen (set by ``auto``), shown by :meth:`describe`.
        self.reason: Optional[str] = None
        self.direct_refused = 0

    def open_file(self, path: "str | os.PathLike[str]", flags: int, mode: int = 0o644) -> int:
        """Open ``path`` for this engine: O_DIRECT when enabled and allowed, else buffered."""
        fd, direct = open_file(path, flags, mode, direct=self.direct)
        if self.direct and not direct:
            self.direct_refused += 1
            if self.direct_refused == 1:
                log.info("gdskv: the filesystem of %s refuses O_DIRECT; using buffered I/O there", os.path.dirname(path))
        return fd

    def submit(self, requests: Sequence[IoRequest]) -> IoFuture:  # pragma: no cover
        raise NotImplementedError

    def run(self, requests: Sequence[IoRequest]) -> List[int]:
        """Submit and wait: the synchronous form of :meth:`submit`."""
        return self.submit(requests).result()

    def describe(self) -> dict[str, Any]:
        """What :meth:`gdskv.Store.stats` shows about this engine."""
        out: dict[str, Any] = {"name": self.name, "direct": self.direct, "direct_refused": self.direct_refused}
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    def close(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def __enter__(self) -> "IoEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
