"""One io_uring and its staging memory: the working part of the ``uring`` engine.

A :class:`Ring` belongs to the thread that created it (the engine keeps one per thread), so
submissions from different threads never share a lock. Its lock only orders the rare case
of another thread driving it (a future waited on by a thread other than the submitter's, or
an event loop driving the ring of a future awaited there: :meth:`Ring.watch`). The kernel
finishes some requests (buffered reads that wait for the page cache, reads of pipes) as
work of the thread that submitted them and cancels them when that thread exits: a thread
must not end while a batch it submitted is in flight (they then end with ``IoError``,
errno ``EFAULT`` or ``ECANCELED``). gdskv's own threads wait for what they submit.

Work is cut into *ops*, one submission queue entry each:

- a *direct* op transfers straight between the file and the caller's buffers — the file is
  buffered, or the request already obeys the O_DIRECT rules;
- a *bounce* op moves one chunk of an unaligned O_DIRECT request (:mod:`gdskv.gds.bounce`)
  through one chunk slot of the staging memory: ``slots`` chunks of ``chunk_bytes``;
- a *small read* (:class:`_Small`) is a read into one buffer of an O_DIRECT file whose
  aligned span is at most :data:`SMALL_READ` bytes, aligned or not: it always goes through a
  small slot of the staging memory and is copied out in one slice assignment, with one
  Python object for request and op together. At a few pages, that copy costs less than
  checking the caller's alignment and having the kernel map its pages, and it keeps the
  per-read Python work of a batch of 4 KiB reads small.

The staging memory is the chunks, then ``small_slots`` small slots of :data:`SMALL_READ`
bytes (one per entry by default: a small read never waits for a staging slot, however
large the chunks are; it may still wait behind a large op ahead of it, as the backlog is
issued in order), allocated page-aligned once, rounded up to whole huge pages (so that the
kernel maps it 2 MiB-aligned and every chunk lies on huge pages), and registered with the
kernel as one fixed buffer (staged transfers then use ``READV_FIXED``/``WRITEV_FIXED``
where the kernel has them; staging over 1 GiB, the most the kernel registers as one
buffer, goes by plain vectored I/O).

Each op points a reusable ``Iovec`` (:mod:`gdskv.gds.iovec`) at its memory; ops wait in a
backlog while the ring is full (``depth`` in flight), no staging slot is free, or (large
reads) ``read_inflight_bytes`` of large reads are in flight, so a batch of any size and any
request size works with bounded memory. Completions
are reaped with ``CqeIter`` (one entry at a time, ``cqe[0]``). The ``liburing`` wrapper
holds the GIL inside blocking calls, so the ring never blocks in it: waiting is a
``poll()`` on the ring's file descriptor, which releases the GIL.

Entries are prepared in a scratch ``Sqe`` and copied into the submission queue by one call
(``put_sqe``): an entry is never taken from the queue without being prepared, even if an
exception (a signal handler raising in the main thread) cuts the work short, so the kernel
never sees a stale entry. Such an exception can still leave the ring's bookkeeping half
done (an op taken from the backlog but not issued, a completion consumed but not handled).
The ring then stops issuing until the kernel holds none of its entries (as many
completions consumed as entries put), and rebuilds its state from what is left
(:meth:`Ring._repair`): the requests whose work was lost end with :class:`IoError`, their
staging slots come back, and the rest of the backlog goes on.

A short transfer is resumed where it stopped; a transfer that makes no progress before the
bytes the caller asked for raises :class:`IoError` with path, offset and lengths, as does
any error the kernel returns. A request's future resolves only once none of its ops is in
flight any more, so no buffer is released while the kernel may still write into it.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import select
import threading
import time
import weakref
from typing import Any, Collection, Deque, Dict, Generator, List, Optional, Sequence, Set, Union

from gdskv.errors import ConfigError, GdskvError, IoError, StoreClosedError
from gdskv.gds.aligned import DIRECT_ALIGN, HUGE_PAGE, IOV_MAX, SMALL_READ, AlignedBuffer, address_of, advance, alloc_aligned, is_aligned, is_direct_fd, split_views
from gdskv.gds.bounce import Bounce, split_write
from gdskv.gds.engine import DrivenFuture, IoOp, IoRequest, abandoned_error, check_buffers, request_error, usable
from gdskv.gds.iovec import Template

_READ = IoOp.READ

#: Upper bound of one poll() while waiting, so a completion reaped by another driver of
#: the same ring can never leave a waiter asleep for long.
_POLL_MS = 50
#: Bytes of completions handled (and copied out of staging) between two refills of the
#: submission queue, and bytes of entries prepared (and copied into staging) before they
#: are handed to the kernel while more are prepared: the device never waits on a long copy,
#: and small requests still go in one system call per batch.
_REFILL_BYTES = 1 << 20
#: Direct transfers larger than this go to the kernel as several entries of this size:
#: large enough that a KV block of a few MiB is one entry (the block layer still cuts it to
#: the device's ``max_sectors_kb``), small enough that a batch of large values ends evenly
#: instead of waiting on its last, largest entry (on a disk that takes 4 MiB requests, large
#: O_DIRECT writes from huge pages ran faster split at 4 MiB than at 1 MiB, and reads no
#: slower: docs/notes/staging-chunk-and-read-cap.md).
SPLIT_BYTES = 4 << 20
#: Default cap on the bytes of large reads (anything but small reads) in flight on one
#: ring: enough to keep an NVMe drive busy (a few GB/s times a millisecond), and no more,
#: since a virtual disk can read large blocks faster the fewer are in flight
#: (``benchmarks/bench_read_staging.py`` compares settings on a disk; what chose this one:
#: docs/notes/staging-chunk-and-read-cap.md). Writes ran no faster with a cap, so they
#: have none.
READ_INFLIGHT_BYTES = 4 << 20


def _future_of(op: "Union[_Op, _Small]") -> "RingFuture":
    """The future of the batch ``op`` belongs to."""
    return op.future if op.__class__ is _Small else op.req.future  # type: ignore[union-attr]


class RingFuture(DrivenFuture):
    """Completion of one batch submitted to a :class:`Ring`; waiting drives the ring, and so
    does going through its completed requests (the ring is refilled from its backlog)."""

    def __init__(self, ring: "Ring", requests: Sequence[IoRequest]) -> None:
        super().__init__(len(requests))
        self._ring = ring
        self._requests = requests  # for the error of a request whose work was lost (Ring._repair)

    def _resolve(self, index: int, value: Union[int, BaseException]) -> None:
        if self._values[index] is not None:  # ended already (as lost, by a withdrawn submit)
            return
        self._values[index] = value
        self._pending -= 1
        self._order.append(index)

    def _end_lost(self, keep: "Collection[int]" = ()) -> None:
        """End as lost (:func:`~gdskv.gds.engine.abandoned_error`) each request not ended yet, but those in ``keep``."""
        for index, value in enumerate(self._values):
            if value is None and index not in keep:
                request = self._requests[index]
                self._resolve(index, abandoned_error(request, request.offset))

    def _wait(self, timeout: Optional[float], resolved: Optional[int] = None) -> None:
        self._ring.wait(self, timeout, resolved)

    def _progress(self) -> None:
        if self._ring._backlog:
            self._ring.wait(self, 0)

    def done(self) -> bool:
        """Whether :meth:`result` returns (or raises) without waiting; never raises."""
        if self._pending:
            try:
                self._ring.wait(self, 0)
            except StoreClosedError:  # the ring cannot finish it: result() raises that at once
                return True
        return self._pending == 0

    def __await__(self) -> Generator[Any, None, List[int]]:
        """Wait without holding a thread: the event loop watches the ring's descriptor and
        drives the ring in its own thread when completions are in (:meth:`Ring.watch`);
        whoever else reaps the batch's last completion wakes this await in its loop
        (:meth:`Ring._notify_watchers`), and it rechecks every ``_POLL_MS`` besides.
        Cancelling the awaiting task stops the wait, not the requests."""
        if not self.done():
            ring = self._ring
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            try:
                ring.watch(loop, self, waiter)
                while self._pending:
                    if waiter.done():  # woken, yet not ended: wait again (never spin)
                        old, waiter = waiter, loop.create_future()
                        ring.watch(loop, self, waiter)
                        ring.unwatch(loop, self, old)
                    yield from asyncio.wait([waiter], timeout=_POLL_MS / 1000).__await__()
                    ring.wait(self, 0)  # raises if the ring cannot end it (closed, broken)
            finally:
                ring.unwatch(loop, self, waiter)
        return self.result(0)


class _Watch:
    """An event loop's watch of a ring (see :meth:`Ring.watch`)."""

    __slots__ = ("fd", "waiters", "waking", "registered")

    def __init__(self, fd: int) -> None:
        self.fd = fd  # the loop's duplicate of the ring's descriptor (-1: not made yet)
        #: The waiters of each future awaited in the loop (one per awaiting task).
        self.waiters: Dict[RingFuture, List["asyncio.Future[None]"]] = {}
        #: A wake-up is scheduled in the loop (:meth:`Ring._notify_watchers`).
        self.waking = False
        #: The loop may have ``fd`` registered (cleared before the reader is removed).
        self.registered = False


class _Req:
    """One request of a batch: its ops, first error, and where its result goes."""

    __slots__ = ("future", "index", "request", "nbytes", "pending", "error", "bounce")

    def __init__(self, future: RingFuture, index: int, request: IoRequest) -> None:
        self.future = future
        self.index = index
        self.request = request
        self.nbytes = 0
        self.pending = 0
        self.error: Optional[BaseException] = None
        self.bounce: Optional[Bounce] = None


class _Op:
    """One submission: a direct transfer or one bounced chunk."""

    __slots__ = ("req", "offset", "length", "need", "done", "buffers", "c_lo", "c_hi", "slot", "iov", "bounce", "reading")

    def __init__(
        self, req: _Req, offset: int, length: int, need: int, buffers: Optional[List[memoryview]], bounce: Optional[Bounce] = None
    ) -> None:
        self.req = req
        self.offset = offset  # file offset of the transfer's first byte
        self.length = length  # bytes the transfer moves
        self.need = need  # bytes that must arrive before the op is complete
        self.done = 0
        self.buffers = buffers  # direct: the caller's views; bounce: None
        self.c_lo = offset
        self.c_hi = offset + length
        self.slot: Optional[int] = None
        self.iov: Optional[Template] = None  # held until completion
        self.bounce = bounce  # a bounced write: the plan of the part this chunk belongs to
        self.reading = 0  # while a read's entry is in flight: its bytes (in Ring._reading)


class _Small:
    """A small read (see the module docstring): request and op in one object.

    It transfers the aligned span ``[offset, offset + length)`` into its staging slot; it
    is complete once ``need`` bytes (up to the request's end) are in, and then bytes
    ``[skip, skip + dst.nbytes)`` of the slot are copied into ``dst``."""

    __slots__ = ("future", "index", "request", "offset", "length", "need", "done", "dst", "skip", "slot")

    def __init__(self, future: RingFuture, index: int, request: IoRequest, dst: memoryview, lo: int, hi: int) -> None:
        self.future = future
        self.index = index
        self.request = request
        self.offset = lo
        self.length = hi - lo
        self.skip = request.offset - lo
        self.need = self.skip + dst.nbytes
        self.done = 0
        self.dst = dst
        self.slot: Optional[int] = None


class Ring:
    """An io_uring of ``depth`` entries with ``slots`` staging chunks and ``small_slots``
    (default ``depth``) staging slots for small reads. See the module docstring."""

    def __init__(
        self,
        lib: Any,
        *,
        depth: int,
        slots: int,
        chunk_bytes: int,
        fixed: bool,
        split_bytes: int = SPLIT_BYTES,
        read_inflight_bytes: int = READ_INFLIGHT_BYTES,
        small_slots: Optional[int] = None,
    ) -> None:
        if slots < 1 or (small_slots is not None and small_slots < 1):  # a request needing one would wait for good
            raise ConfigError("an io_uring needs at least one staging chunk and one small slot", slots=slots, small_slots=small_slots)
        self._L = lib
        self.depth = depth
        #: Large reads wait in the backlog while this many bytes of them are in flight
        #: (one is always let through); small reads are not counted.
        self.read_inflight_bytes = read_inflight_bytes
        self._reading = 0
        self.chunk_bytes = chunk_bytes
        #: Direct transfers larger than this go as several entries of this size (aligned).
        self.split_bytes = max(split_bytes, chunk_bytes)
        self.closed = False
        #: Set when io_uring_enter failed outright; the engine then builds a new ring.
        self.broken = False
        self._lock = threading.Lock()
        self._ring = lib.Ring()
        try:
            lib.io_uring_queue_init(depth, self._ring)
        except OSError as exc:
            raise IoError(f"io_uring setup failed: {exc.strerror}", errno=exc.errno, depth=depth) from exc
        self._staging: Optional[AlignedBuffer] = None
        try:
            self._set_up(lib, slots=slots, small_slots=small_slots, chunk_bytes=chunk_bytes, fixed=fixed)
        except BaseException as exc:
            # Give the ring's descriptor and staging back: the engine builds a new ring on
            # the next submission, and each failed one would keep a descriptor otherwise.
            lib.io_uring_queue_exit(self._ring)
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            if isinstance(exc, OSError):
                raise IoError(f"io_uring staging setup failed: {exc.strerror}", errno=exc.errno, depth=depth,
                              slots=slots, chunk_bytes=chunk_bytes) from exc
            raise

    def _set_up(self, lib: Any, *, slots: int, small_slots: Optional[int], chunk_bytes: int, fixed: bool) -> None:
        """The staging (allocated, sliced into slots, registered as fixed buffers where
        ``fixed``) and the bookkeeping of a ring whose queue is set up."""
        self._small_read = min(SMALL_READ, chunk_bytes)
        small_slots = self.depth if small_slots is None else small_slots
        # Slots 0 .. slots-1 are the chunks (bounce ops), slots .. slots+small_slots-1 the
        # small slots after them (small reads): one index space, two free lists.
        self._chunk_slots = slots
        staging = slots * chunk_bytes + small_slots * self._small_read
        if staging >= HUGE_PAGE:  # a whole number of huge pages: the kernel maps it 2 MiB-aligned,
            staging = -(-staging // HUGE_PAGE) * HUGE_PAGE  # so every chunk sits on huge pages
        self._staging = alloc_aligned(staging)
        self._staging_addr = address_of(self._staging.view)
        starts = [i * chunk_bytes for i in range(slots)]
        starts += [slots * chunk_bytes + i * self._small_read for i in range(small_slots)]
        sizes = [chunk_bytes] * slots + [self._small_read] * small_slots
        self._slot_views = [self._staging.view[start : start + size] for start, size in zip(starts, sizes)]
        # Free chunks are handed out last freed first, so large reads cycle through as few
        # chunks as are in flight. Handing them out in turn (each reused after all the
        # others) made staged reads steadier on a virtual disk, not faster, so this order
        # stays (docs/notes/staging-chunk-and-read-cap.md, docs/notes/read-slow-mode.md).
        self._free_slots = list(range(slots - 1, -1, -1))
        self._free_small = list(range(slots + small_slots - 1, slots - 1, -1))
        self._templates: Dict[int, List[Template]] = {}
        #: By slot: its address. For the small slots (None for the chunks, whose ops take
        #: their iovecs from ``_templates``): a single-entry iovec used by the small read
        #: that holds the slot, its entry, and the length from the slot's start that the
        #: entry points at (-1: anything else).
        self._slot_addrs = [self._staging_addr + start for start in starts]
        self._slot_iovs: List[Optional[Template]] = [None] * slots + [Template(lib, 1) for _ in range(small_slots)]
        self._slot_entries = [None if t is None else t.entry(0) for t in self._slot_iovs]
        self._slot_lens = [-1] * (slots + small_slots)
        self.fixed = False
        if fixed:
            whole = Template(lib, 1)
            whole.point(self._staging_addr, self._staging.nbytes)
            try:
                lib.io_uring_register_buffers(self._ring, whole.obj)
                self.fixed = True
            except OSError:  # e.g. RLIMIT_MEMLOCK too small: plain vectored I/O on staging
                self.fixed = False
        self._cqe = lib.Cqe()
        #: Where each entry is prepared before ``put_sqe`` copies it into the queue.
        self._sqe = lib.Sqe()
        self._backlog: Deque[Union[_Op, _Small]] = collections.deque()
        self._inflight: Dict[int, Union[_Op, _Small]] = {}
        self._unsubmitted_bytes = 0
        self._next_id = 1
        #: Entries put into the submission queue and completions consumed, ever: equal when
        #: the kernel holds nothing of this ring's.
        self._put = 0
        self._reaped = 0
        #: An exception cut the bookkeeping short (see the module docstring); cleared by
        #: :meth:`_repair`.
        self._interrupted = False
        #: Futures of this ring whose requests may not have ended (for :meth:`_repair`).
        self._futures: "weakref.WeakSet[RingFuture]" = weakref.WeakSet()
        #: Futures awaited, per event loop watching the ring's descriptor (:meth:`watch`).
        self._watchers: Dict[Any, _Watch] = {}
        #: Bytes of O_DIRECT writes moved through staging (whole blocks), for ``describe()``.
        self.staged_write_bytes = 0

    # ------------------------------------------------------------------ submission

    def submit(self, requests: Sequence[IoRequest]) -> RingFuture:
        future = RingFuture(self, requests)
        error: Optional[BaseException] = None
        with self._lock:
            if self.closed:
                raise StoreClosedError("io_uring is closed")
            if self.broken:
                raise IoError("io_uring is unusable after a failed submission")
            self._futures.add(future)
            try:
                self._submit_locked(future, requests)
            except BaseException as exc:
                self._interrupted = True  # a plain store: no signal handler runs before it
                error = exc
        if error is not None:
            self._withdraw(future)
            raise error
        return future

    def _withdraw(self, future: RingFuture) -> None:
        """Take back the batch of a :meth:`submit` that is raising (the ring is interrupted):
        its ops leave the backlog (those not issued, and any resumed after a short transfer),
        and this waits, the lock released, until none of them is in flight; then its
        requests not ended end as lost. The caller gets no future, so its buffers must be
        its own again when ``submit()`` raises. Other batches go on."""
        poller = None
        while True:
            with self._lock:
                if any(_future_of(op) is future for op in self._backlog):
                    self._interrupted = True  # (repair gives back the slots they hold)
                    self._backlog = collections.deque(op for op in self._backlog if _future_of(op) is not future)
                if not self.closed:
                    self._pump()  # interrupted: reaps, issues nothing until repaired
                ops = list(self._backlog) + list(self._inflight.values())
                if self.closed or not any(_future_of(op) is future for op in ops):
                    future._end_lost()
                    return
            if poller is None:
                poller = select.poll()
                poller.register(self._ring.ring_fd, select.POLLIN)
            poller.poll(_POLL_MS)

    def _submit_locked(self, future: RingFuture, requests: Sequence[IoRequest]) -> None:
        """Queue the ops of ``requests`` (resolving at once the ones that fail or move
        nothing) and start them. Lock held."""
        direct_fds: Dict[int, bool] = {}  # one fcntl per file and batch, not per request
        backlog = self._backlog
        small = self._small_read
        for index, request in enumerate(requests):
            buffers = request.buffers
            if request.op is _READ and len(buffers) == 1:
                direct = request.direct
                if direct is None:
                    direct = direct_fds.get(request.fd)
                if direct is None:
                    try:
                        direct = direct_fds[request.fd] = is_direct_fd(request.fd)
                    except OSError as exc:
                        future._resolve(index, request_error(request, request.offset, exc))
                        continue
                dst = buffers[0]
                if direct and usable(dst, True) and dst.nbytes:  # unusable: check_buffers says why
                    offset = request.offset
                    lo = offset - offset % DIRECT_ALIGN
                    hi = -(-(offset + dst.nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
                    if hi - lo <= small:
                        backlog.append(_Small(future, index, request, dst, lo, hi))
                        continue
            req = _Req(future, index, request)
            try:
                check_buffers(request)
                ops = self._plan(req, direct_fds)
            except (OSError, ValueError, TypeError, BufferError, GdskvError) as exc:
                # This request fails alone; nothing of it is queued, the rest of the batch goes on.
                future._resolve(index, request_error(request, request.offset, exc))
                continue
            if not ops:  # nothing to transfer, or less than a block past end of file
                try:
                    if req.bounce is not None:
                        req.bounce.finish()
                    future._resolve(index, req.nbytes)
                except OSError as exc:
                    future._resolve(index, request_error(request, request.offset, exc))
                continue
            req.pending = len(ops)
            self._backlog.extend(ops)
        self._pump()

    def _plan(self, req: _Req, direct_fds: Dict[int, bool]) -> List[_Op]:
        r = req.request
        buffers = r.buffers
        nbytes = req.nbytes = buffers[0].nbytes if len(buffers) == 1 else sum(b.nbytes for b in buffers)
        if nbytes == 0:
            return []
        direct = r.direct
        if direct is None:
            direct = direct_fds.get(r.fd)
        if direct is None:
            direct = direct_fds[r.fd] = is_direct_fd(r.fd)
        if not direct or is_aligned(r.offset, buffers):  # (never more than IOV_MAX buffers)
            return self._direct_ops(req, r.offset, buffers, nbytes)
        if r.op is IoOp.WRITE and len(buffers) <= IOV_MAX:
            return self._write_ops(req)
        plan = req.bounce = Bounce(r, self.chunk_bytes, nbytes)
        if r.op is IoOp.READ:
            return [_Op(req, c_lo, c_hi - c_lo, plan.need(c_lo, c_hi), None) for c_lo, c_hi in plan.pieces]
        self.staged_write_bytes += plan.hi - plan.lo
        return [_Op(req, c_lo, c_hi - c_lo, c_hi - c_lo, None, plan) for c_lo, c_hi in plan.pieces]

    def _direct_ops(self, req: _Req, offset: int, buffers: Sequence[memoryview], nbytes: int) -> List[_Op]:
        """Entries that move ``buffers`` at ``offset`` as they are (at most ``IOV_MAX``
        buffers each: more, on a buffered file, go as consecutive entries)."""
        if len(buffers) > IOV_MAX:
            ops: List[_Op] = []
            for first in range(0, len(buffers), IOV_MAX):
                group = buffers[first : first + IOV_MAX]
                size = sum(b.nbytes for b in group)
                ops.extend(self._direct_ops(req, offset, group, size))
                offset += size
            return ops
        if nbytes <= self.split_bytes:
            return [_Op(req, offset, nbytes, nbytes, list(buffers))]
        # Large transfers go as several entries, so one batch keeps the device busy
        # evenly instead of waiting on its last, largest request.
        ops = []
        start = 0
        for piece in split_views(buffers, self.split_bytes):
            n = min(self.split_bytes, nbytes - start)
            ops.append(_Op(req, offset + start, n, n, piece))
            start += n
        return ops

    def _write_ops(self, req: _Req) -> List[_Op]:
        """An unaligned write on an O_DIRECT file: its aligned parts go straight from the
        caller's memory, the rest through staging (:func:`split_write`)."""
        ops: List[_Op] = []
        for part, direct in split_write(req.request):
            nbytes = part.nbytes
            if direct:
                ops.extend(self._direct_ops(req, part.offset, part.buffers, nbytes))
                continue
            plan = req.bounce = Bounce(part, self.chunk_bytes, nbytes)  # the last one holds any tail
            self.staged_write_bytes += plan.hi - plan.lo
            ops.extend(_Op(req, c_lo, c_hi - c_lo, c_hi - c_lo, None, plan) for c_lo, c_hi in plan.pieces)
        return ops

    def _pump(self) -> None:
        """Issue what fits, submit, reap; repeat while reaping freed room; then wake the
        awaits whose futures ended (:meth:`_notify_watchers`). Lock held. An exception
        that escapes marks the ring interrupted: it may have cut the bookkeeping short."""
        try:
            self._drive()
            if self._watchers:
                self._notify_watchers()
        except BaseException:
            self._interrupted = True  # a plain store: no signal handler runs before it
            raise

    def _drive(self) -> None:
        sq_ready = self._L.io_uring_sq_ready
        if self.broken:  # (reaping first: a short transfer goes back to the backlog)
            self._reap()
            while self._backlog:
                self._fail_any(self._backlog.popleft(), IoError("io_uring is unusable after a failed submission"))
            # The entries never submitted never complete: the kernel holds nothing else then.
            if self._interrupted and self._put - self._reaped == sq_ready(self._ring):
                self._repair()
            return
        if self._interrupted:  # nothing new goes in until the kernel holds nothing of ours
            if sq_ready(self._ring):
                self._submit()
            self._reap()
            if self._put != self._reaped:
                return
            self._repair()
        while True:
            self._issue()
            if sq_ready(self._ring):
                self._submit()
            if self.broken:  # the next pump fails the backlog
                self._reap()
                return
            # A few completions at a time, so freed slots are refilled and resubmitted
            # before the device runs dry while staging is copied out.
            if not self._reap(_REFILL_BYTES):
                return

    def _issue(self) -> None:
        backlog = self._backlog
        inflight = self._inflight
        while backlog and len(inflight) < self.depth:
            op = backlog[0]
            if op.__class__ is _Small:
                if not self._issue_small():
                    return
                continue
            req = op.req
            if req.error is not None:  # an earlier op of this request failed: skip the rest
                self._backlog.popleft()
                self._finish_op(op)
                continue
            reading = op.length - op.done if req.request.op is _READ else 0
            if reading and self._reading and self._reading + reading > self.read_inflight_bytes:
                return  # resumed as reads complete
            if op.buffers is None and op.slot is None:
                if not self._free_slots:
                    return
                if req.request.op is IoOp.WRITE:  # filled before the op holds it: never half-filled
                    slot = self._free_slots[-1]
                    try:
                        op.bounce.fill(op.c_lo, op.c_hi, self._slot_views[slot][: op.length])  # type: ignore[union-attr]
                    except OSError as exc:
                        self._backlog.popleft()
                        self._fail_op(op, request_error(req.request, op.c_lo, exc))
                        continue
                op.slot = self._free_slots.pop()
            if op.iov is None:
                try:  # before the op leaves the backlog: a failure here fails the op alone
                    op.iov = self._iov_of(op)
                except (ValueError, TypeError, BufferError) as exc:
                    self._backlog.popleft()
                    self._fail_op(op, request_error(req.request, op.offset + op.done, exc))
                    continue
            self._backlog.popleft()
            self._prep(op, reading)
            self._unsubmitted_bytes += op.length
            if self._unsubmitted_bytes >= _REFILL_BYTES:  # start the device while filling the rest
                self._submit()
                if self.broken:
                    return

    def _issue_small(self) -> bool:
        """Prepare entries for the small reads at the head of the backlog while a staging
        slot, a submission entry and room in flight are free. False when it stopped for
        lack of one of them; True when the backlog is empty or starts with another op."""
        L = self._L
        ring = self._ring
        sqe = self._sqe
        put_sqe = L.put_sqe
        prep_fixed = L.io_uring_prep_readv_fixed if self.fixed else None
        backlog = self._backlog
        inflight = self._inflight
        depth = self.depth
        free = self._free_small
        iovs, entries, addrs, lens = self._slot_iovs, self._slot_entries, self._slot_addrs, self._slot_lens
        while backlog and len(inflight) < depth:
            op = backlog[0]
            if op.__class__ is not _Small:
                return True
            slot = op.slot
            if slot is None:
                if not free:
                    return False
                slot = op.slot = free.pop()
            backlog.popleft()
            done = op.done
            length = op.length - done
            if done or lens[slot] != length:  # repoint the slot's iovec (rarely: sizes repeat)
                entry = entries[slot]
                entry.base = addrs[slot] + done
                entry.len = length
                lens[slot] = -1 if done else length
            if prep_fixed is not None:
                prep_fixed(sqe, op.request.fd, iovs[slot].obj, 0, op.offset + done)
            else:
                L.io_uring_prep_readv(sqe, op.request.fd, iovs[slot].obj, op.offset + done)
            ident = self._next_id
            self._next_id = ident + 1
            sqe.user_data = ident
            inflight[ident] = op
            self._put += 1  # no call between these and put_sqe (see _prep)
            if not put_sqe(ring, sqe):
                self._put_failed(ident)
                return False
            self._unsubmitted_bytes += length
            if self._unsubmitted_bytes >= _REFILL_BYTES:
                self._submit()
                if self.broken:
                    return False
        return True

    def _iov_of(self, op: _Op) -> Template:
        """The iovec of ``op``'s transfer from where it stands (``op.done``). Raises for
        buffers whose address cannot be taken; the op then holds no template."""
        if op.buffers is not None:
            iov = self._template(len(op.buffers))
            try:
                iov.fill(op.buffers)
            except BaseException:
                self._templates.setdefault(iov.capacity, []).append(iov)
                raise
            return iov
        iov = self._template(1)
        iov.point(self._slot_addrs[op.slot] + op.done, op.length - op.done)  # type: ignore[operator]
        return iov

    def _prep(self, op: _Op, reading: int) -> None:
        """Put an entry for ``op``, whose iovec is ready (:meth:`_iov_of`), into the
        submission queue; ``reading``: the bytes it counts against ``read_inflight_bytes``.

        The entry is prepared in the scratch ``Sqe`` and copied in by ``put_sqe``; the
        bookkeeping right before that call has no call in it, so no signal handler can run
        between them: the op is in flight (and counted) exactly when its entry is in the
        queue. The queue has room: it has at least ``depth`` entries, each entry the kernel
        has not taken yet is an op in flight, and fewer than ``depth`` are when one is
        issued (so nothing here asks the ring for room)."""
        L = self._L
        is_read = op.req.request.op is IoOp.READ
        fd = op.req.request.fd
        iov = op.iov
        sqe = self._sqe
        if op.buffers is not None:
            (L.io_uring_prep_readv if is_read else L.io_uring_prep_writev)(sqe, fd, iov.obj, op.offset + op.done)
        else:
            if self.fixed:
                prep = L.io_uring_prep_readv_fixed if is_read else L.io_uring_prep_writev_fixed
                prep(sqe, fd, iov.obj, 0, op.offset + op.done)
            else:
                (L.io_uring_prep_readv if is_read else L.io_uring_prep_writev)(sqe, fd, iov.obj, op.offset + op.done)
        ident = self._next_id
        self._next_id = ident + 1
        sqe.user_data = ident
        self._inflight[ident] = op
        op.reading = reading
        self._reading += reading
        self._put += 1
        if not L.put_sqe(self._ring, sqe):
            self._put_failed(ident)

    def _put_failed(self, ident: int) -> None:
        """``put_sqe`` found the queue full, which the bookkeeping says cannot happen: undo
        the entry's bookkeeping and break the ring (it fails what it holds and the engine
        replaces it), rather than wait for a completion that cannot come."""
        self._put -= 1
        exc = OSError(errno.EIO, "io_uring submission queue full (the ring's bookkeeping is wrong)")
        self._fail_unrun(self._inflight.pop(ident), exc)
        self._abort_unsubmitted(exc, end=ident)  # (this entry, the last id given, was not put)

    def _template(self, count: int) -> Template:
        capacity = 4 if count <= 4 else 1 << (count - 1).bit_length()
        pool = self._templates.get(capacity)
        if pool:
            return pool.pop()
        return Template(self._L, capacity)

    def _submit(self) -> None:
        """Hand the entries put to the kernel; a failure other than a shortage breaks the
        ring (:meth:`_abort_unsubmitted`), which then takes no more entries."""
        if self.broken:
            return
        try:
            self._L.io_uring_submit(self._ring)
        except (BlockingIOError, InterruptedError):
            return  # the kernel is short of resources: retried on the next pump
        except OSError as exc:
            if exc.errno is None:  # not the system's: a signal handler's, raised after the call
                raise
            self._abort_unsubmitted(exc)
            return
        self._unsubmitted_bytes = 0

    def _abort_unsubmitted(self, exc: OSError, end: Optional[int] = None) -> None:
        """io_uring_enter failed outright: the ring is unusable and what was queued but not
        taken by the kernel will never complete. Fail those ops; the engine replaces the ring.
        ``end``: the id after the last entry put (default: the next id to give)."""
        self.broken = True
        # The entries the kernel did not take are the last ones put, and each entry put took
        # the next id: their ids are the last ones given (so this can run again after an
        # interruption and fail nothing the kernel holds).
        end = self._next_id if end is None else end
        unsubmitted = self._L.io_uring_sq_ready(self._ring)
        for ident in range(end - unsubmitted, end):
            op = self._inflight.pop(ident, None)
            if op is not None:
                self._fail_unrun(op, exc)

    def _fail_unrun(self, op: "Union[_Op, _Small]", exc: OSError) -> None:
        """Fail ``op``, just taken out of flight: the kernel never took its entry."""
        if op.__class__ is _Small:
            self._fail_any(op, request_error(op.request, op.request.offset, exc))  # type: ignore[union-attr]
        else:
            self._reading -= op.reading  # type: ignore[union-attr]
            op.reading = 0  # type: ignore[union-attr]
            self._fail_any(op, request_error(op.req.request, op.offset, exc))  # type: ignore[union-attr]

    # ------------------------------------------------------------------ completion

    def _reap(self, limit_bytes: int = 1 << 62) -> int:
        """Handle completions, stopping once about ``limit_bytes`` were transferred."""
        L = self._L
        cqe = self._cqe
        inflight = self._inflight
        views = self._slot_views
        free = self._free_small  # (the small reads', handled inline)
        count = 0
        total = 0
        try:
            for _ in L.CqeIter(self._ring, cqe):
                entry = cqe[0]
                count += 1
                try:
                    res = entry.res
                except OSError as exc:
                    res = -(exc.errno or 5)
                op = inflight.pop(entry.user_data, None)
                if op.__class__ is _Small:
                    if res > 0 and op.done + res >= op.need:  # the common case, inline
                        slot = op.slot
                        skip = op.skip
                        dst = op.dst
                        n = dst.nbytes
                        dst[:] = views[slot][skip : skip + n]
                        free.append(slot)
                        future = op.future
                        if future._values[op.index] is None:
                            future._values[op.index] = n
                            future._pending -= 1
                            future._order.append(op.index)
                    else:
                        self._complete_small(op, res)  # type: ignore[arg-type]
                elif op is not None:
                    self._reading -= op.reading
                    op.reading = 0
                    self._complete(op, res)
                total += res
                if total >= limit_bytes:
                    break
        finally:
            if count:  # entries handled (even if one raised) are not seen again
                self._reaped += count
                L.io_uring_cq_advance(self._ring, count)
        return count

    def _complete_small(self, op: _Small, res: int) -> None:
        request = op.request
        if res >= 0:
            op.done += res
            if op.done >= op.need:
                slot = op.slot
                skip = op.skip
                op.dst[:] = self._slot_views[slot][skip : skip + op.dst.nbytes]  # type: ignore[index]
                self._free_small.append(slot)  # type: ignore[arg-type]
                op.future._resolve(op.index, op.dst.nbytes)
                return
            if res and not op.done % DIRECT_ALIGN:
                self._backlog.appendleft(op)  # resume where it stopped, in the same slot
                return
            error: BaseException = IoError(
                "short read", path=request.path, offset=request.offset, expected=op.dst.nbytes,
                got=max(0, op.done - op.skip),
            )
        else:
            error = request_error(request, request.offset + max(0, op.done - op.skip), OSError(-res, os.strerror(-res)))
        self._free_small.append(op.slot)  # type: ignore[arg-type]
        op.slot = None
        op.future._resolve(op.index, error)

    def _complete(self, op: _Op, res: int) -> None:
        req = op.req
        request = req.request
        if res < 0:
            exc = OSError(-res, os.strerror(-res))
            self._fail_op(op, request_error(request, op.offset + op.done, exc))
            return
        op.done += res
        if op.done < op.need:
            if res == 0 or (op.buffers is None and op.done % DIRECT_ALIGN):
                self._fail_op(
                    op,
                    IoError(
                        f"short {request.op.value}",
                        path=request.path, offset=request.offset, expected=req.nbytes,
                        got=max(0, op.offset + op.done - request.offset),
                    ),
                )
                return
            if op.buffers is not None:
                op.buffers = advance(op.buffers, res)
            self._release_iov(op)  # it points where the transfer started
            self._backlog.appendleft(op)  # resume where it stopped
            return
        if op.buffers is None and request.op is IoOp.READ:
            req.bounce.drain(op.c_lo, op.c_hi, self._slot_views[op.slot][: op.length])  # type: ignore[union-attr,index]
        self._finish_op(op)

    def _repair(self) -> None:
        """Rebuild the bookkeeping an exception cut short, once the kernel holds none of
        this ring's entries (see the module docstring). Lock held.

        Nothing is in flight, so: an op still listed in flight had its completion consumed
        and not handled; a staging slot is in use only by an op waiting in the backlog; a
        request whose ops are not all in the backlog lost one (its work was not all done).
        Each such request ends with :class:`IoError`, after the ops of it still waiting
        have run (their slots are needed back); every other request goes on. A second
        interruption leaves the ring interrupted, and this runs again: each step can."""
        self._inflight.clear()
        self._reading = 0
        self._unsubmitted_bytes = 0
        self._templates = {}  # an iovec listed free twice would serve two entries at once
        held = set()
        waiting: Dict[_Req, int] = {}  # the requests with ops in the backlog, and how many
        queued: Dict[int, Set[int]] = {}  # by future's id: the indices of its requests in the backlog
        for op in self._backlog:
            if op.slot is not None:
                held.add(op.slot)
            if op.__class__ is _Small:
                queued.setdefault(id(op.future), set()).add(op.index)
            else:
                waiting[op.req] = waiting.get(op.req, 0) + 1
                queued.setdefault(id(op.req.future), set()).add(op.req.index)
        chunks = self._chunk_slots
        self._free_slots = [slot for slot in range(chunks - 1, -1, -1) if slot not in held]
        self._free_small = [slot for slot in range(len(self._slot_views) - 1, chunks - 1, -1) if slot not in held]
        self._slot_lens = [-1] * len(self._slot_views)
        for req, count in waiting.items():
            if req.pending != count:  # an op of it was lost
                if req.error is None:
                    req.error = abandoned_error(req.request, req.request.offset)
                req.pending = count
        for future in list(self._futures):
            if future._pending:
                future._end_lost(keep=queued.get(id(future), ()))
        self._interrupted = False

    def _release_iov(self, op: _Op) -> None:
        if op.iov is not None:
            self._templates.setdefault(op.iov.capacity, []).append(op.iov)
            op.iov = None

    def _fail_any(self, op: "_Op | _Small", exc: BaseException) -> None:
        """Fail an op of either kind that is not in flight."""
        if op.__class__ is _Small:
            if op.slot is not None:
                self._free_small.append(op.slot)
                op.slot = None
            op.future._resolve(op.index, exc)  # type: ignore[union-attr]
        else:
            self._fail_op(op, exc)  # type: ignore[arg-type]

    def _fail_op(self, op: _Op, exc: BaseException) -> None:
        if op.req.error is None:
            op.req.error = exc
        self._finish_op(op)

    def _finish_op(self, op: _Op) -> None:
        if op.slot is not None:
            self._free_slots.append(op.slot)
            op.slot = None
        self._release_iov(op)
        req = op.req
        req.pending -= 1
        if req.pending:
            return
        if req.error is None and req.bounce is not None and req.request.op is IoOp.WRITE:
            try:
                req.bounce.finish()
            except OSError as exc:
                req.error = request_error(req.request, req.request.offset, exc)
        req.future._resolve(req.index, req.error if req.error is not None else req.nbytes)

    # ------------------------------------------------------------------ waiting

    def wait(self, future: RingFuture, timeout: Optional[float], resolved: Optional[int] = None) -> None:
        """Drive the ring until ``future`` resolves (or, given ``resolved``, until more than
        that many of its requests have) or ``timeout`` seconds pass (0: no wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = None
        while True:
            with self._lock:
                if not self.closed:
                    self._pump()
                if future._pending == 0 or (resolved is not None and len(future._order) > resolved):
                    return
                if self.closed or (self.broken and not self._inflight):
                    raise StoreClosedError("io_uring closed with requests pending")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            if poller is None:
                poller = select.poll()
                poller.register(self._ring.ring_fd, select.POLLIN)
            ms = _POLL_MS if remaining is None else min(_POLL_MS, max(1, int(remaining * 1000)))
            poller.poll(ms)

    def watch(self, loop: asyncio.AbstractEventLoop, future: RingFuture, waiter: "asyncio.Future[None]") -> None:
        """While ``future`` is awaited in ``loop``: the loop watches the ring's descriptor
        (readable when completions are in) and drives the ring then (:meth:`_on_readable`);
        ``waiter`` is set once ``future`` has ended, whichever thread reaped its last
        completion (:meth:`_notify_watchers`). One watch per loop serves every future awaited
        there. Call from the loop's thread; undo with :meth:`unwatch` (also after this raised).

        The loop watches a duplicate of the descriptor, closed by the last :meth:`unwatch`
        once the loop has let go of it: closing the ring cannot free the number while the loop
        still has it registered (the next file to get it would be confused with it). The watch
        is listed before the reader is added and until after it is removed, so an exception
        anywhere here leaves it for the next :meth:`unwatch` to finish."""
        watch = self._watchers.get(loop)
        if watch is None:
            watch = self._watchers[loop] = _Watch(-1)
        if watch.fd < 0:
            watch.fd = os.dup(self._ring.ring_fd)
        if not watch.registered:
            watch.registered = True
            loop.add_reader(watch.fd, self._on_readable, loop, watch.fd)
        watch.waiters.setdefault(future, []).append(waiter)

    def unwatch(self, loop: asyncio.AbstractEventLoop, future: RingFuture, waiter: "asyncio.Future[None]") -> None:
        """Undo :meth:`watch` of ``waiter``; waiters already set, of any future, go too. The
        last one out removes the loop's reader and closes its descriptor."""
        watch = self._watchers.get(loop)
        if watch is None:
            return
        for awaited, waiters in list(watch.waiters.items()):
            kept = [w for w in waiters if w is not waiter and not w.done()]
            if kept:
                watch.waiters[awaited] = kept
            else:
                watch.waiters.pop(awaited, None)
        if not watch.waiters:
            watch.registered = False
            if watch.fd >= 0:
                loop.remove_reader(watch.fd)
            del self._watchers[loop]  # (no call between this and the close)
            if watch.fd >= 0:
                os.close(watch.fd)

    def _on_readable(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        """Drive the ring (reap, refill) in ``loop``'s thread; the awaits that ended are
        woken by :meth:`_pump`. If driving raised, wake them all (each finds out why from
        :meth:`wait`). A registration left behind by an interrupted :meth:`unwatch` is
        removed (it would make the loop spin)."""
        watch = self._watchers.get(loop)
        if watch is None or watch.fd != fd:
            loop.remove_reader(fd)
            return
        try:
            with self._lock:
                if not self.closed:
                    self._pump()
        except BaseException:
            for waiters in list(watch.waiters.values()):
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
            raise

    def _notify_watchers(self) -> None:
        """Wake, in their loops, the awaits of futures that have ended (after a pump, in
        whichever thread: an await must not sleep until its next recheck because another
        caller reaped its batch's last completion)."""
        try:
            running: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, watch in list(self._watchers.items()):
            if loop is running:
                self._wake_ended(loop)
                continue
            if watch.waking:
                continue
            if not any(not f._pending and any(not w.done() for w in ws) for f, ws in list(watch.waiters.items())):
                continue
            watch.waking = True  # (before the call: the loop may run the wake-up before it returns)
            try:
                loop.call_soon_threadsafe(self._wake_ended, loop)
            except RuntimeError:  # the loop is closed: nobody waits there any more
                watch.waking = False

    def _wake_ended(self, loop: asyncio.AbstractEventLoop) -> None:
        """Set the waiters, in ``loop``, of the futures that have ended (in the loop's thread)."""
        watch = self._watchers.get(loop)
        if watch is None:
            return
        watch.waking = False
        for future, waiters in list(watch.waiters.items()):
            if not future._pending:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Finish what is in flight, then release the ring and its staging. Idempotent."""
        with self._lock:
            if self.closed:
                return
        poller = select.poll()
        poller.register(self._ring.ring_fd, select.POLLIN)
        while True:
            with self._lock:
                self._pump()
                if not self._inflight and not self._backlog:
                    self.closed = True
                    break
            poller.poll(_POLL_MS)
        L = self._L
        if self.fixed:
            try:
                L.io_uring_unregister_buffers(self._ring)
            except OSError:
                pass
        L.io_uring_queue_exit(self._ring)
        self._slot_views = []
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def __del__(self) -> None:  # a thread's ring whose thread has ended
        try:
            if not self.closed:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing sensible to do
            pass
