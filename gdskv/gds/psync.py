"""The ``psync`` I/O engine: ``os.preadv`` / ``os.pwritev`` on a thread pool.

Both calls release the GIL, so a batch of N requests runs on up to ``threads`` cores and
disk queues at once. A batch of one request runs inline in the caller's thread (a hop to the
pool would only add latency). A larger batch is one :class:`BatchFuture`: ``min(threads, N)``
pool tasks each take the next request not yet started until none is left, and a caller
waiting without a timeout takes requests too (unless it is the main thread, where Ctrl-C
lands), so a batch costs a few pool hand-offs rather than one per request (a pool task per
request cost a 4 KiB read more CPU than its system call: docs/notes/small-reads-4k.md).
Short transfers are retried from where they stopped; a transfer that makes no progress (EOF
on read) raises :class:`IoError`. A ``submit()`` that raises (a signal handler's exception
as it hands the batch to the pool) first takes the batch back (:meth:`BatchFuture.withdraw`).

Each completed buffered write starts write-back of its range at once (Linux
``sync_file_range(SYNC_FILE_RANGE_WRITE)``, asynchronous), so the device is busy while later
requests of the batch are still being copied into the page cache, instead of idling until
the caller's ``fsync``. It is only a hint: durability still comes from that ``fsync``, the
pages stay cached, and where the call is missing or fails nothing changes.

With ``direct=True`` files are opened ``O_DIRECT`` where the filesystem allows it. A request
on such a file that breaks the alignment rules goes through an aligned staging buffer of
``chunk_bytes`` (:mod:`gdskv.gds.bounce`), taken from a few the engine keeps for reuse (at
most one per pool thread plus two; one a caller's own thread used inline goes back there
too, so threads that come and go do not each keep one).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, Union

from gdskv.errors import GdskvError, IoError, StoreClosedError
from gdskv.gds.aligned import DIRECT_ALIGN, IOV_MAX, SMALL_READ, AlignedBuffer, advance, alloc_aligned, is_aligned, is_direct_fd
from gdskv.gds.bounce import Bounce, split_write
from gdskv.gds.engine import DrivenFuture, IoEngine, IoFuture, IoOp, IoRequest, abandoned_error, check_buffers, request_error

log = logging.getLogger(__name__)

#: Default staging chunk of each thread for unaligned O_DIRECT requests.
CHUNK_BYTES = 4 << 20
#: Longest a waiter on a batch sleeps before it looks at the batch again (a safety net:
#: the thread that records an outcome wakes the waiters).
_RECHECK_S = 0.5


class PsyncEngine(IoEngine):
    """Thread pool of positional vectored reads and writes."""

    name = "psync"

    def __init__(self, threads: int = 4, *, direct: bool = False, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(direct=direct)
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._pool = _Workers(threads, "gdskv-psync")
        # An engine dropped unclosed ends its threads. (Not at exit: _finish_at_exit then
        # waits for the work they were handed.)
        self._stop_when_dropped = weakref.finalize(self, self._pool.stop)
        self._stop_when_dropped.atexit = False
        self._closed = False
        self._lock = threading.Lock()
        #: Staging buffers not in use (see the module docstring).
        self._spare_staging: List[AlignedBuffer] = []
        #: Each thread's staging for small reads (:meth:`_read_small`).
        self._local = threading.local()
        #: Bytes of O_DIRECT writes moved through staging (whole blocks), for ``describe()``.
        self.staged_write_bytes = 0

    def submit(self, requests: Sequence[IoRequest]) -> IoFuture:
        if self._closed:
            raise StoreClosedError("I/O engine is closed", engine=self.name)
        if len(requests) == 1:
            try:
                return IoFuture.completed([self._execute(requests[0])])
            except GdskvError as exc:
                return IoFuture.failed(exc)
        future: Optional[BatchFuture] = None
        try:
            with self._lock:
                if self._closed:
                    raise StoreClosedError("I/O engine is closed", engine=self.name)
                future = BatchFuture(self._execute, requests)
                for _ in range(min(self.threads, len(requests))):
                    self._pool.put(future.work)
        except BaseException:
            # (A signal handler's exception, say, once a pool task may have the batch.) The
            # caller gets no future, so its buffers must be its own again when this raises.
            if future is not None:
                future.withdraw()
            raise
        return future

    def _execute(self, request: IoRequest) -> int:
        """Carry out ``request``; any failure is raised as a :class:`GdskvError`
        (:func:`request_error`)."""
        try:
            check_buffers(request)
            if not request.nbytes:  # nothing to move (an unaligned one would rewrite a block)
                return 0
            is_direct = is_direct_fd(request.fd) if request.direct is None else request.direct
            if is_direct and request.op is IoOp.READ and len(request.buffers) == 1:
                offset = request.offset
                lo = offset - offset % DIRECT_ALIGN
                end = offset + request.buffers[0].nbytes
                if end - lo <= SMALL_READ:
                    return self._read_small(request, lo, end)
            if is_direct and not is_aligned(request.offset, request.buffers):
                if request.op is IoOp.READ:
                    return self._execute_bounced(request)
                for part, direct in split_write(request):  # aligned parts straight from memory
                    if direct:
                        execute(part)
                    else:
                        self._execute_bounced(part)
                return request.nbytes
            return execute(request)
        except GdskvError:
            raise
        except (OSError, ValueError, TypeError, BufferError) as exc:
            raise request_error(request, request.offset, exc) from exc

    def _read_small(self, request: IoRequest, lo: int, end: int) -> int:
        """A read whose aligned span ``[lo, ...)`` is at most
        :data:`~gdskv.gds.aligned.SMALL_READ` bytes, on an O_DIRECT file, aligned or not:
        through this thread's small staging buffer, then one copy. The buffer is out of the thread's slot while in use:
        a read that a signal handler starts meanwhile in the same thread gets its own."""
        local = self._local
        staging = getattr(local, "small", None)
        local.small = None
        if staging is None:
            staging = alloc_aligned(SMALL_READ, huge=False).view  # freed with the thread
        dst = request.buffers[0]
        need = end - lo
        _transfer(request, os.preadv, staging[: -(-need // DIRECT_ALIGN) * DIRECT_ALIGN], lo, need)
        skip = request.offset - lo
        dst[:] = staging[skip : skip + dst.nbytes]
        local.small = staging
        return dst.nbytes

    def _execute_bounced(self, request: IoRequest) -> int:
        buf = self._take_staging()
        try:
            return self._bounce(request, buf.view)
        finally:
            self._give_staging(buf)

    def _bounce(self, request: IoRequest, staging: memoryview) -> int:
        plan = Bounce(request, staging.nbytes)
        if request.op is IoOp.WRITE:
            with self._lock:
                self.staged_write_bytes += plan.hi - plan.lo
        for c_lo, c_hi in plan.pieces:  # an OSError becomes an IoError in _execute
            view = staging[: c_hi - c_lo]
            if request.op is IoOp.READ:
                _transfer(request, os.preadv, view, c_lo, plan.need(c_lo, c_hi))
                plan.drain(c_lo, c_hi, view)
            else:
                plan.fill(c_lo, c_hi, view)
                _transfer(request, os.pwritev, view, c_lo, c_hi - c_lo)
        if request.op is IoOp.WRITE:
            plan.finish()
        return request.nbytes

    def _take_staging(self) -> AlignedBuffer:
        with self._lock:
            if self._spare_staging:
                return self._spare_staging.pop()
        return alloc_aligned(self.chunk_bytes)

    def _give_staging(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if not self._closed and len(self._spare_staging) < self.threads + 2:
                self._spare_staging.append(buf)
                return
        buf.close()

    def describe(self) -> dict:
        return {**super().describe(), "threads": self.threads, "staged_write_bytes": self.staged_write_bytes}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_when_dropped.detach()
        self._pool.shutdown()
        with self._lock:  # a request still running inline in a caller's thread keeps its buffer
            spare, self._spare_staging = self._spare_staging, []
        for buf in spare:
            buf.close()


class _Workers:
    """``threads`` threads, started at once and kept, running the callables put into one
    queue in turn. Handing work over is one ``SimpleQueue.put``: C code, so an exception a
    signal handler raises in the caller lands before or after it, and leaves no lock taken
    (``ThreadPoolExecutor.submit`` takes Python-level locks, which such an exception can
    leave held, and the pool is then stuck for good).

    The threads end once the engine owning the pool is closed or garbage-collected
    (:meth:`stop`). At interpreter exit the work handed over by then is finished first
    (:func:`_finish_at_exit`), and the threads go on serving what later exit hooks submit.
    They are daemons, so that hook, not the interpreter's join of its threads, is what
    waits for them."""

    def __init__(self, threads: int, name: str) -> None:
        self._tasks: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=_serve, args=(self._tasks,), name=f"{name}_{i}", daemon=True) for i in range(threads)
        ]
        self.stopped = False
        for thread in self._threads:
            thread.start()
        with _live_lock:
            _live_workers.add(self)

    def put(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def stop(self) -> None:
        """Let each thread end once the work handed over before is done; do not wait."""
        self.stopped = True
        with _live_lock:
            _live_workers.discard(self)
        for _ in self._threads:
            self._tasks.put(None)

    def shutdown(self) -> None:
        """Run what was put, then end the threads (from another thread than theirs)."""
        self.stop()
        for thread in self._threads:
            thread.join()

    def drain(self) -> None:
        """Wait until the work handed over so far is done (every thread has come to a
        marker put after it); the threads then go on serving. Returns early if the pool is
        stopped meanwhile (its threads may end before reaching their markers)."""
        arrived = threading.Semaphore(0)
        release = threading.Event()

        def marker() -> None:
            arrived.release()
            release.wait()

        try:  # (from the first marker on: whatever interrupts this releases the ones taken)
            for _ in self._threads:
                self._tasks.put(marker)
            waiting = len(self._threads)
            while waiting and not self.stopped:
                if arrived.acquire(timeout=0.1):
                    waiting -= 1
        finally:
            release.set()


def _serve(tasks: "queue.SimpleQueue[Optional[Callable[[], None]]]") -> None:
    """A pool thread's loop, until it takes a None (:meth:`_Workers.stop`). It holds the
    queue, not the pool, so the pool leaves ``_live_workers`` once it is dropped too."""
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            task()
        except BaseException:  # noqa: BLE001 - tasks record their own outcomes: a bug, logged
            log.exception("gdskv: a psync pool task failed")
        del task  # (a finished batch, and the engine behind it, are not kept alive while idle)


#: Pools not stopped yet, drained at interpreter exit (the lock guards the set: pools come
#: and go from any thread).
_live_workers: "weakref.WeakSet[_Workers]" = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit, wait for the work each live pool was handed (as
    ``ThreadPoolExecutor`` does for its own). The pools stay usable: exit hooks that run
    after this one (registered before gdskv was imported) may still use an engine."""
    with _live_lock:
        pools = list(_live_workers)
    for workers in pools:
        workers.drain()


class BatchFuture(DrivenFuture):
    """A batch of requests run by whichever threads call :meth:`work`: the engine's pool
    tasks, and a thread other than the main one that waits on the batch with no timeout
    (``result()``, ``outcomes()``, ``as_completed()``): it runs requests not yet started
    instead of sleeping. Each request runs once; its outcome (byte count or exception,
    whatever the request raised, as a pool future would hold it) is recorded under a lock
    and wakes the waiters; ``await`` is woken by the thread that ends the batch.

    The main thread only sleeps while it waits. Signal handlers run there (Ctrl-C), and one
    that raises interrupts the wait, never a request half done: the batch goes on, on the
    pool. The sleep is a blocking ``get`` on a queue of the waiter's own (C code), not a
    ``Condition`` over the lock, whose Python-level release and re-acquire a raising handler
    can leave unbalanced; each outcome puts a token in the queue of every waiter asleep.
    """

    def __init__(self, run: Callable[[IoRequest], int], requests: Sequence[IoRequest]) -> None:
        super().__init__(len(requests))
        self._run = run
        self._requests = list(requests)
        self._lock = threading.Lock()
        self._next = 0  # the first request not yet taken
        self._bells: List["queue.SimpleQueue[None]"] = []  # one per sleeping waiter: a token wakes it
        self._on_done: List[Callable[[], None]] = []  # wakers of awaiting tasks

    def work(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Run requests not yet started until none is left (or ``until()`` is true)."""
        while until is None or not until():
            with self._lock:
                index = self._next
                if index >= len(self._requests):
                    return
                self._next = index + 1
            value: Union[int, BaseException]
            try:
                value = self._run(self._requests[index])
            except BaseException as exc:  # noqa: BLE001 - the request's outcome, never lost
                value = exc
            self._record([(index, value)])

    def withdraw(self) -> None:
        """Take the batch back (its :meth:`PsyncEngine.submit` is raising): the requests not
        started never start and end with :func:`~gdskv.gds.engine.abandoned_error`; this
        waits (as :meth:`_wait` does) until the ones started have ended. An exception while
        it waits (a second signal) propagates and leaves those to end on the pool."""
        with self._lock:
            start, self._next = self._next, len(self._requests)
        self._record([(index, abandoned_error(self._requests[index], self._requests[index].offset)) for index in range(start, len(self._requests))])
        self._wait(None)

    def _record(self, outcomes: Sequence[Tuple[int, Union[int, BaseException]]]) -> None:
        """Record the outcomes of requests this thread took, and wake whoever waits for them."""
        if not outcomes:
            return
        with self._lock:
            for index, value in outcomes:
                self._values[index] = value
                self._order.append(index)
            self._pending -= len(outcomes)
            bells = list(self._bells) if self._bells else ()
            wake, self._on_done = (self._on_done, []) if not self._pending else ([], self._on_done)
        for bell in bells:
            bell.put(None)
        for waker in wake:
            waker()

    def _wait(self, timeout: Optional[float], resolved: Optional[int] = None) -> None:
        """Outside the main thread and without a timeout, run requests until enough have
        ended or none is left to start; then sleep until enough have ended or the timeout
        passes (looking again every :data:`_RECHECK_S` in any case)."""
        def enough() -> bool:
            return self._pending == 0 or (resolved is not None and len(self._order) > resolved)

        if timeout is None and threading.current_thread() is not threading.main_thread():
            self.work(until=enough)
        deadline = None if timeout is None else time.monotonic() + timeout
        bell: "queue.SimpleQueue[None]" = queue.SimpleQueue()  # this waiter's own: no other takes its tokens
        while not enough():
            remaining = _RECHECK_S if deadline is None else min(_RECHECK_S, deadline - time.monotonic())
            if remaining <= 0:
                return
            try:
                with self._lock:
                    self._bells.append(bell)
                if enough():  # ended between the check above and the registration
                    return
                try:
                    bell.get(timeout=remaining)
                except queue.Empty:
                    pass
            finally:
                # Without the lock: waiting for it here (while a pool thread records an
                # outcome) is a wait that a raising handler cuts short, and the bell stayed
                # listed. The removal is this block's first call, one list operation (atomic
                # under the GIL, as _record's copy of the list is), and a handler runs only
                # after a call, at a backward jump or inside a blocking call: none runs
                # before it is done. A bell never appended (a handler raised while the
                # append waited for the lock) is not there.
                try:
                    self._bells.remove(bell)
                except ValueError:
                    pass

    def __await__(self) -> Generator[Any, None, List[int]]:
        """Wait without holding a thread: the thread that records the batch's last outcome
        wakes the awaiting task. Cancelling that task stops the wait, not the requests."""
        if self._pending:
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake() -> None:
                try:
                    loop.call_soon_threadsafe(_set_done, waiter)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

            with self._lock:
                if self._pending:
                    self._on_done.append(wake)
            while self._pending:
                yield from asyncio.wait([waiter], timeout=_RECHECK_S).__await__()
        return self.result(0)


def _set_done(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():
        waiter.set_result(None)


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
    """Carry out one request synchronously, completing short transfers; return its size.
    Empty buffers are skipped; more than ``IOV_MAX`` buffers go ``IOV_MAX`` per call."""
    call = os.preadv if request.op is IoOp.READ else os.pwritev
    buffers: List[memoryview] = [b for b in request.buffers if b.nbytes]
    total = sum(b.nbytes for b in buffers)
    done = 0
    while done < total:
        try:
            n = call(request.fd, buffers if len(buffers) <= IOV_MAX else buffers[:IOV_MAX], request.offset + done)
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


