"""The ``psync`` I/O engine: ``os.preadv`` / ``os.pwritev`` on a thread pool.

Both calls release the GIL, so a batch of N requests runs on up to ``threads`` cores and
disk queues at once. A batch of one request runs inline in the caller's thread (a hop to the
pool would only add latency). Short transfers are retried from where they stopped; a
transfer that makes no progress (EOF on read) raises :class:`IoError`.

Each completed buffered write starts write-back of its range at once (Linux
``sync_file_range(SYNC_FILE_RANGE_WRITE)``, asynchronous), so the device is busy while later
requests of the batch are still being copied into the page cache, instead of idling until
the caller's ``fsync``. It is only a hint: durability still comes from that ``fsync``, the
pages stay cached, and where the call is missing or fails nothing changes.

With ``direct=True`` files are opened ``O_DIRECT`` where the filesystem allows it. A request
on such a file that breaks the alignment rules goes through a staging buffer of
``chunk_bytes`` that each thread allocates once (aligned) and reuses
(:mod:`gdskv.gds.bounce`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from typing import Callable, List, Optional, Sequence

from gdskv.errors import IoError, StoreClosedError
from gdskv.gds.aligned import DIRECT_ALIGN, IOV_MAX, AlignedBuffer, advance, alloc_aligned, is_aligned, is_direct_fd
from gdskv.gds.bounce import Bounce, split_write
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest

#: Default staging chunk of each thread for unaligned O_DIRECT requests.
CHUNK_BYTES = 4 << 20


class PsyncEngine(IoEngine):
    """Thread pool of positional vectored reads and writes."""

    name = "psync"

    def __init__(self, threads: int = 4, *, direct: bool = False, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(direct=direct)
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="gdskv-psync")
        self._closed = False
        self._lock = threading.Lock()
        self._local = threading.local()
        self._staging: List[AlignedBuffer] = []
        #: Bytes of O_DIRECT writes moved through staging (whole blocks), for ``describe()``.
        self.staged_write_bytes = 0

    def submit(self, requests: Sequence[IoRequest]) -> IoFuture:
        if self._closed:
            raise StoreClosedError("I/O engine is closed", engine=self.name)
        if len(requests) == 1:
            try:
                return IoFuture.completed([self._execute(requests[0])])
            except IoError as exc:
                return IoFuture.failed(exc)
        with self._lock:
            if self._closed:
                raise StoreClosedError("I/O engine is closed", engine=self.name)
            return IoFuture([self._pool.submit(self._execute, r) for r in requests])

    def _execute(self, request: IoRequest) -> int:
        if len(request.buffers) > IOV_MAX:
            return self._execute_bounced(request)
        if is_direct_fd(request.fd) and not is_aligned(request.offset, request.buffers):
            if request.op is IoOp.READ:
                return self._execute_bounced(request)
            for part, direct in split_write(request):  # aligned parts straight from memory
                if direct:
                    execute(part)
                else:
                    self._execute_bounced(part)
            return request.nbytes
        return execute(request)

    def _execute_bounced(self, request: IoRequest) -> int:
        staging = self._staging_view()
        plan = Bounce(request, staging.nbytes)
        if request.op is IoOp.WRITE:
            with self._lock:
                self.staged_write_bytes += plan.hi - plan.lo
        try:
            for c_lo, c_hi in plan.pieces:
                view = staging[: c_hi - c_lo]
                if request.op is IoOp.READ:
                    _transfer(request, os.preadv, view, c_lo, plan.need(c_lo, c_hi))
                    plan.drain(c_lo, c_hi, view)
                else:
                    plan.fill(c_lo, c_hi, view)
                    _transfer(request, os.pwritev, view, c_lo, c_hi - c_lo)
            if request.op is IoOp.WRITE:
                plan.finish()
        except OSError as exc:
            if isinstance(exc, IoError):
                raise
            raise IoError(
                f"{request.op.value} failed: {exc.strerror}",
                path=request.path, offset=request.offset, length=request.nbytes, errno=exc.errno,
            ) from exc
        return request.nbytes

    def _staging_view(self) -> memoryview:
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = alloc_aligned(self.chunk_bytes)
            self._local.staging = buf
            with self._lock:
                self._staging.append(buf)
        return buf.view

    def describe(self) -> dict:
        return {**super().describe(), "threads": self.threads, "staged_write_bytes": self.staged_write_bytes}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for buf in self._staging:
            buf.close()
        self._staging.clear()


def _transfer(request: IoRequest, call, view: memoryview, offset: int, need: int) -> None:
    """Move at least ``need`` bytes of the aligned ``view`` at ``offset``; short -> IoError."""
    done = 0
    while done < need:
        n = call(request.fd, [view[done:]], offset + done)
        done += n
        if n == 0 or (done < need and done % DIRECT_ALIGN):
            raise IoError(
                f"short {request.op.value}",
                path=request.path, offset=request.offset, expected=request.nbytes,
                got=max(0, offset + done - request.offset),
            )


def execute(request: IoRequest) -> int:
    """Carry out one request synchronously, completing short transfers; return its size."""
    call = os.preadv if request.op is IoOp.READ else os.pwritev
    buffers: List[memoryview] = list(request.buffers)
    total = request.nbytes
    done = 0
    while buffers:
        try:
            n = call(request.fd, buffers, request.offset + done)
        except OSError as exc:
            raise IoError(
                f"{request.op.value} failed: {exc.strerror}",
                path=request.path, offset=request.offset + done, length=total, errno=exc.errno,
            ) from exc
        if n == 0:
            raise IoError(
                f"short {request.op.value}",
                path=request.path, offset=request.offset, expected=total, got=done,
            )
        done += n
        buffers = advance(buffers, n)
    if request.op is IoOp.WRITE:
        start_writeback(request.fd, request.offset, done)
    return done


SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: "Optional[Callable[..., int]] | bool" = None


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset + length)`` of ``fd`` to the device
    now, without waiting. Returns False where that is not available; never raises."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            func = ctypes.CDLL(None, use_errno=True).sync_file_range
            func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            func.restype = ctypes.c_int
            _sync_file_range = func
        except (OSError, AttributeError):
            _sync_file_range = False
    if not _sync_file_range or length <= 0:
        return False
    return _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0


