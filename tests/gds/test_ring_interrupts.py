"""A signal handler that raises (as SIGINT's default handler raises KeyboardInterrupt) can land
anywhere in the ``uring`` engine's bookkeeping while the main thread drives its ring. Whatever
it cut short, every request of every batch still ends: with its bytes moved and verified, or
with an error; and the ring goes on working (no staging slot or entry lost)."""

from __future__ import annotations

import mmap
import os
import random
import signal

import pytest

from conftest import uring_unavailable
from gdskv.errors import IoError
from gdskv.gds.engine import IoRequest

pytestmark = pytest.mark.skipif(uring_unavailable() is not None, reason=str(uring_unavailable()))

PAGE = 4096


class Interrupted(BaseException):
    """What the tests' handler raises."""


def _in_engine(frame) -> bool:
    """Whether the interrupted frame is code of the uring engine (ring, engine, futures)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(("/gds/ring.py", "/gds/uring.py", "/gds/engine.py", "/gds/bounce.py")):
            return True
        frame = frame.f_back if "/gdskv/" in name else None
    return False


@pytest.fixture
def raising_alarm():
    """``arm(seconds)``: SIGALRM after ``seconds``; its handler raises :class:`Interrupted`
    once, and only inside the engine's code: landing elsewhere, it fires again 20 us later."""
    state = {"armed": False}

    def handler(signum, frame):
        if not state["armed"]:
            return
        if _in_engine(frame):
            state["armed"] = False
            raise Interrupted()
        signal.setitimer(signal.ITIMER_REAL, 20e-6)

    def arm(seconds: float) -> None:
        state["armed"] = True
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def disarm() -> None:
        state["armed"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)

    old = signal.signal(signal.SIGALRM, handler)
    arm.disarm = disarm  # type: ignore[attr-defined]
    yield arm
    disarm()
    signal.signal(signal.SIGALRM, old)


def _requests(fd: int, path: str, pages: int, rng: random.Random, op: str):
    """A batch of every kind of entry the ring has: small unaligned reads (through a staging
    slot), large unaligned reads or writes (bounced in chunks) and small unaligned writes
    (their partial blocks staged). Reads go anywhere; writes to places a page apart from
    each other, in random order. Returns the requests and their buffers."""
    sizes = [64 * PAGE + 100 if j % 10 == 0 else PAGE - 96 for j in range(40 if op == "write" else 600)]
    if op == "write":
        rng.shuffle(sizes)
        starts, page = [], 0
        for size in sizes:
            starts.append(page)
            page += -(-(size + 64) // PAGE) + 1
        assert page <= pages
    else:
        starts = [rng.randrange(pages - 1 - size // PAGE) for size in sizes]
    requests, buffers = [], []
    for page, size in zip(starts, sizes):
        if op == "write":
            buffer = bytearray(os.urandom(size))
            requests.append(IoRequest.write(fd, page * PAGE + 64, memoryview(buffer), path=path))
        else:
            buffer = bytearray(size)
            requests.append(IoRequest.read(fd, page * PAGE + 64, memoryview(buffer), path=path))
        buffers.append(buffer)
    return requests, buffers


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_raising_signal_handler_never_leaves_a_ring_batch_unfinished(tmp_path, raising_alarm, op):
    from gdskv.gds.uring import UringEngine

    pages = 512
    data = bytearray(os.urandom(pages * PAGE))
    path = tmp_path / "data"
    path.write_bytes(data)
    engine = UringEngine(direct=True, depth=32, chunk_bytes=64 << 10)
    fd = engine.open_file(path, os.O_RDWR)
    rng = random.Random(7)
    interrupted = 0
    try:
        for trial in range(150):
            requests, buffers = _requests(fd, str(path), pages, rng, op)
            future = engine.submit(requests)
            raising_alarm(rng.uniform(50e-6, 3e-3))
            try:
                future.result()
            except Interrupted:
                interrupted += 1
            finally:
                raising_alarm.disarm()
            outcomes = future.outcomes(timeout=10)  # TimeoutError: a request was lost
            written = os.pread(fd, 0, 0) if op == "read" else _read_back(path)
            for request, buffer, outcome in zip(requests, buffers, outcomes):
                where = slice(request.offset, request.offset + len(buffer))
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, IoError), outcome
                    if op == "write":  # its bytes may be anywhere between old and new
                        data[where] = written[where]
                    continue
                assert outcome == len(buffer)
                if op == "write":
                    data[where] = buffer
                assert buffer == data[where], f"trial {trial}: wrong bytes"
            if op == "write":
                assert written == data, f"trial {trial}: a write landed where none succeeded"
        # The ring still works, with all its staging: a batch needing every slot at once.
        requests, buffers = _requests(fd, str(path), pages, rng, "read")
        assert engine.submit(requests).result(timeout=10) == [len(b) for b in buffers]
        for request, buffer in zip(requests, buffers):
            assert buffer == _read_back(path)[request.offset : request.offset + len(buffer)]
    finally:
        os.close(fd)
        engine.close()
    assert interrupted > 50  # the handler did land in the engine's code, many times


def _read_back(path) -> bytes:
    """The file's bytes as the disk has them (buffered reads see O_DIRECT writes)."""
    with open(path, "rb") as f:
        return f.read()


class _FailingSubmits:
    """The ``liburing`` module, but ``io_uring_submit`` raises ``error()`` from call
    ``after`` + 1 on (``once``: only that call, after really submitting)."""

    def __init__(self, after: int, error, once: bool = False) -> None:
        import liburing

        self._lib = liburing
        self.calls = 0
        self.after = after
        self.error = error
        self.once = once

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def io_uring_submit(self, ring):
        self.calls += 1
        if self.calls <= self.after or (self.once and self.calls > self.after + 1):
            return self._lib.io_uring_submit(ring)
        if self.once:
            self._lib.io_uring_submit(ring)
        raise self.error()


def test_a_ring_that_cannot_submit_fails_only_what_the_kernel_never_took(tmp_path):
    """io_uring_enter failing for good: the ring breaks once and takes no more entries. Before,
    each later failure failed the last entries again, reaching back to a read the kernel
    held (of a pipe, here), whose buffer the kernel wrote into after it had 'failed'. A read
    that comes back short then cannot be resumed: it fails (it used to be left pending while
    the wait raised StoreClosedError)."""
    import errno

    from gdskv.gds.engine import IoOp
    from gdskv.gds.ring import Ring

    lib = _FailingSubmits(1, lambda: OSError(errno.EBADFD, "io_uring_enter failed"))
    ring = Ring(lib, depth=8, slots=4, chunk_bytes=64 << 10, fixed=False)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    path = tmp_path / "data"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        pipe_out, short_out = bytearray(8), bytearray(PAGE)
        requests = [IoRequest(IoOp.READ, r, 0, [memoryview(pipe_out)], "pipe", False)]
        requests.append(IoRequest(IoOp.READ, r2, 0, [memoryview(short_out)], "pipe", False))
        requests += [IoRequest.read(fd, i << 20, memoryview(bytearray(1 << 20)), path=str(path))._replace(direct=False) for i in range(5)]
        future = ring.submit(requests)
        with pytest.raises(TimeoutError):
            future.outcomes(timeout=0.5)  # the pipe reads are the kernel's until data comes
        assert future._values[:2] == [None, None] and lib.calls == 2
        os.write(w, b"LATEDATA")
        os.write(w2, b"SHORT")
        outcomes = future.outcomes(timeout=5)
        assert outcomes[0] == 8 and bytes(pipe_out) == b"LATEDATA"
        assert isinstance(outcomes[1], IoError) and bytes(short_out[:5]) == b"SHORT"
        assert all(isinstance(o, IoError) or o == 1 << 20 for o in outcomes[2:])
    finally:
        ring.close()
        for f in (r, w, r2, w2, fd):
            os.close(f)


def test_a_submit_that_raises_takes_its_batch_back(tmp_path, monkeypatch):
    """submit() raising (a handler's exception at its last step, here) gives the caller no
    future, so the batch must not run later with whatever the buffers then hold. Before, it
    stayed queued and ran on the next, unrelated batch."""
    from gdskv.gds.ring import Ring
    from gdskv.gds.uring import UringEngine

    path = tmp_path / "data"
    path.write_bytes(b"0" * 8192)
    engine = UringEngine(direct=True, depth=8, chunk_bytes=64 << 10)
    fd = engine.open_file(path, os.O_RDWR)
    real = Ring._pump
    raised = []

    def pump(self):
        if not raised:
            raised.append(True)
            raise Interrupted()
        return real(self)

    monkeypatch.setattr(Ring, "_pump", pump)
    try:
        buffer = bytearray(b"A" * 100)
        with pytest.raises(Interrupted):
            engine.submit([IoRequest.write(fd, 10, memoryview(buffer), path=str(path))])
        buffer[:] = b"B" * 100  # the caller's buffer is its own again
        assert engine.submit([IoRequest.read(fd, 4096, memoryview(bytearray(10)), path=str(path))]).result(timeout=10) == [10]
        assert path.read_bytes() == b"0" * 8192
    finally:
        os.close(fd)
        engine.close()


def test_an_oserror_a_handler_raises_after_a_submission_propagates(tmp_path):
    """A handler's TimeoutError (an OSError without an errno) right after io_uring_submit
    returned is the caller's, not a failed submission: it propagates, the ring goes on. Before,
    it was taken for a failed io_uring_enter, swallowed, and the ring broken."""
    from gdskv.gds.ring import Ring

    lib = _FailingSubmits(0, TimeoutError, once=True)
    ring = Ring(lib, depth=8, slots=8, chunk_bytes=64 << 10, fixed=False)
    path, data, fd = _pages(tmp_path, 64)
    try:
        with pytest.raises(TimeoutError):
            ring.submit(_page_reads(fd, path, [bytearray(PAGE) for _ in range(64)]))
        assert not ring.broken
        again = [bytearray(PAGE) for _ in range(64)]
        assert ring.submit(_page_reads(fd, path, again)).result(timeout=10) == [PAGE] * 64
        assert b"".join(again) == data
    finally:
        ring.close()
        os.close(fd)


def _pages(tmp_path, count: int):
    """A file of ``count`` random pages, open for reading: (path, its bytes, descriptor)."""
    path = tmp_path / "data"
    data = os.urandom(count * PAGE)
    path.write_bytes(data)
    return path, data, os.open(path, os.O_RDONLY)


def _page_reads(fd: int, path, outs):
    """Requests reading page ``i`` into ``outs[i]``."""
    return [IoRequest.read(fd, i * PAGE, memoryview(out), path=str(path)) for i, out in enumerate(outs)]


class _CheckPoints:
    """A profile function that raises :class:`Interrupted` at the ``target``-th check point
    of the ring's code: the entry of a Python function called from it, or the return of a C
    call it made (where CPython runs signal handlers)."""

    def __init__(self) -> None:
        self.count = 0
        self.target = -1
        self.fired = False

    def __call__(self, frame, event, arg):
        if event not in ("call", "c_return") or frame.f_code.co_name == "__del__" or not _under_ring(frame):
            return  # (an exception raised in __del__ is only printed: not the ring's concern)
        self.count += 1
        if self.count == self.target:
            self.fired = True
            raise Interrupted()

    def arm(self, target: int) -> None:
        self.count, self.target, self.fired = 0, target, False
        import sys

        sys.setprofile(self)

    @staticmethod
    def disarm() -> None:
        import sys

        sys.setprofile(None)


def _under_ring(frame) -> bool:
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("/gds/ring.py"):
            return True
        if name == __file__:
            return False
        frame = frame.f_back
    return False


def _mixed_batch(fd: int, path: str, op: str, rng: random.Random):
    """Small reads, reads bounced in several chunks, an aligned read split into many entries;
    or unaligned writes, bounced whole or in part, in distinct blocks."""
    if op == "read":
        specs = [(rng.randrange(500) * PAGE + 64, PAGE - 96) for _ in range(8)]
        specs += [(5 * PAGE + 64, 20 * PAGE + 100), (100 * PAGE + 7, 3 * PAGE), (200 * PAGE, 32 * PAGE)]
    else:
        specs = [(300 * PAGE + 64, 20 * PAGE + 100), (330 * PAGE + 100, 100), (340 * PAGE + 5, 2 * PAGE), (360 * PAGE + 64, 9 * PAGE)]
    requests, buffers = [], []
    for offset, size in specs:
        if op == "read":
            buffer = memoryview(mmap.mmap(-1, size)) if offset % PAGE == size % PAGE == 0 else memoryview(bytearray(size))
            requests.append(IoRequest.read(fd, offset, buffer, path=path))
        else:
            buffer = memoryview(bytearray(os.urandom(size)))
            requests.append(IoRequest.write(fd, offset, buffer, path=path))
        buffers.append(buffer)
    return requests, buffers


@pytest.mark.parametrize("op", ["read", "write"])
def test_an_exception_at_every_check_point_of_the_ring(tmp_path, op):
    """One run per check point of the ring's code (a small ring: many entries per request,
    few slots): an exception there, and every request still ends (right bytes or IoError),
    no byte changes outside the writes, and the ring is whole again: nothing in flight, every
    staging slot and iovec free once, and a batch needing all of them works. Every 9th run
    takes a second exception while the interrupted batch is waited on."""
    import threading

    from gdskv.gds.uring import UringEngine

    path = tmp_path / "data"
    original = os.urandom(600 * PAGE)
    checks = _CheckPoints()
    target = 0
    while True:
        target += 1
        path.write_bytes(original)
        engine = UringEngine(direct=True, depth=4, chunk_bytes=16 << 10, slots=3)
        fd = engine.open_file(path, os.O_RDWR)
        ring = engine._ring()
        ring.split_bytes = 16 << 10
        requests, buffers = _mixed_batch(fd, str(path), op, random.Random(target))
        future = None
        checks.arm(target)
        try:
            future = engine.submit(requests)
            future.result()
        except Interrupted:
            pass
        finally:
            checks.disarm()
        if not checks.fired:
            os.close(fd)
            engine.close()
            break
        where = f"exception at check point {target} ({'in submit' if future is None else 'while waiting'})"
        if future is not None:
            if target % 9 == 0:
                checks.arm(target % 40 + 1)
                try:
                    future.outcomes(timeout=5)
                except Interrupted:
                    pass
                finally:
                    checks.disarm()
            outcomes = future.outcomes(timeout=5)  # TimeoutError: a request was lost
            assert sorted(future._order) == list(range(len(requests))), where
            disk = path.read_bytes()
            for request, buffer, outcome in zip(requests, buffers, outcomes):
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, IoError), (where, outcome)
                    continue
                assert outcome == buffer.nbytes, where
                source = original if op == "read" else disk
                assert bytes(buffer) == source[request.offset : request.offset + buffer.nbytes], where
            spans = [(r.offset - r.offset % PAGE, -(-(r.offset + b.nbytes) // PAGE) * PAGE) for r, b in zip(requests, buffers)]
            for page in range(600):
                lo, hi = page * PAGE, (page + 1) * PAGE
                if not any(s < hi and e > lo for s, e in spans):
                    assert disk[lo:hi] == original[lo:hi], (where, page)
            for r, b in zip(requests, buffers):  # the rest of a written request's blocks
                lo, hi = r.offset - r.offset % PAGE, -(-(r.offset + b.nbytes) // PAGE) * PAGE
                assert disk[lo : r.offset] == original[lo : r.offset] and disk[r.offset + b.nbytes : hi] == original[r.offset + b.nbytes : hi], where
        current = path.read_bytes()
        again, outs = _mixed_batch(fd, str(path), "read", random.Random(0))
        assert engine.submit(again).result(timeout=5) == [b.nbytes for b in outs], where
        assert all(bytes(b) == current[r.offset : r.offset + b.nbytes] for r, b in zip(again, outs)), where
        assert ring._put == ring._reaped and not ring._inflight and not ring._backlog and not ring._interrupted, where
        assert sorted(ring._free_slots) == list(range(3)) and sorted(ring._free_small) == list(range(3, 3 + ring.depth)), where
        iovecs = [id(t) for pool in ring._templates.values() for t in pool]
        assert len(iovecs) == len(set(iovecs)), where
        os.close(fd)
        closing = threading.Thread(target=engine.close, daemon=True)
        closing.start()
        closing.join(5)
        assert not closing.is_alive(), where
    assert target > (300 if op == "read" else 200)  # the sweep went through the ring's code


def test_a_full_submission_queue_breaks_the_ring_and_every_request_ends(tmp_path):
    """put_sqe never finds the queue full (the ring keeps fewer entries in flight than it
    has); if it did, the ring breaks and fails what it cannot finish instead of waiting for
    an entry that was never queued."""
    import liburing

    from gdskv.gds.ring import Ring

    class FullAtThird:
        calls = 0

        def __getattr__(self, name):
            return getattr(liburing, name)

        def put_sqe(self, ring, sqe):
            FullAtThird.calls += 1
            return False if FullAtThird.calls == 3 else liburing.put_sqe(ring, sqe)

    ring = Ring(FullAtThird(), depth=8, slots=8, chunk_bytes=64 << 10, fixed=False)
    path, data, fd = _pages(tmp_path, 16)
    try:
        outs = [bytearray(PAGE) for _ in range(16)]
        future = ring.submit(_page_reads(fd, path, outs))
        outcomes = future.outcomes(timeout=5)
        assert ring.broken and isinstance(outcomes[2], IoError)
        for i, outcome in enumerate(outcomes):
            assert isinstance(outcome, IoError) or (outcome == PAGE and outs[i] == data[i * PAGE : (i + 1) * PAGE])
    finally:
        ring.close()
        os.close(fd)


def test_a_broken_ring_interrupted_while_failing_its_entries_still_ends_everything(tmp_path):
    """io_uring_enter fails, and a handler raises while the ring fails the entries the kernel
    never took: those stay listed as in flight, though they can never complete. The ring
    repairs itself once the kernel holds nothing else (before, submit(), wait() and close()
    waited for them forever)."""
    import errno
    import sys
    import threading

    from gdskv.gds.uring import UringEngine

    path = tmp_path / "data"
    path.write_bytes(os.urandom(64 * PAGE))
    engine = UringEngine(direct=True, depth=8)
    fd = engine.open_file(path, os.O_RDONLY)
    ring = engine._ring()
    real = ring._L

    class Lib:
        failed = False

        def __getattr__(self, name):
            return getattr(real, name)

        def io_uring_submit(self, r):
            if not Lib.failed:
                Lib.failed = True
                raise OSError(errno.EIO, "Input/output error")
            return real.io_uring_submit(r)

        def io_uring_sq_ready(self, r):
            n = real.io_uring_sq_ready(r)
            if sys._getframe(1).f_code.co_name == "_abort_unsubmitted":
                raise Interrupted()  # at the check point after this call
            return n

    ring._L = Lib()
    outcome = []

    def run():  # on this thread's ring, from another thread: a hang there fails the test
        try:
            ring.submit([IoRequest.read(fd, i * PAGE, memoryview(bytearray(PAGE)), path=str(path)) for i in range(3)])
        except Interrupted:
            outcome.append("interrupted")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert outcome == ["interrupted"]
    assert ring.broken and not ring._inflight
    closing = threading.Thread(target=engine.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()
    os.close(fd)


def test_a_raising_submit_waits_for_its_own_entries_only(tmp_path):
    """submit() raising takes its batch back, waiting only for its own entries in the kernel,
    not for another batch's (a pipe read that may never end, here)."""
    import sys
    import threading

    from gdskv.gds.engine import IoOp
    from gdskv.gds.uring import UringEngine

    path = tmp_path / "data"
    path.write_bytes(os.urandom(16 * PAGE))
    engine = UringEngine(direct=True)
    fd = engine.open_file(path, os.O_RDONLY)
    r, w = os.pipe()
    held = engine.submit([IoRequest(IoOp.READ, r, 0, [memoryview(bytearray(10))], "pipe", False)])
    ring = engine._ring()  # (this thread's, which holds the pipe read)
    outcome = []

    def raise_at_pump(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_pump":
            sys.setprofile(None)
            raise Interrupted()

    def run():
        sys.setprofile(raise_at_pump)
        try:
            ring.submit([IoRequest.read(fd, 0, memoryview(bytearray(2 * PAGE)), path=str(path))])
        except Interrupted:
            outcome.append("interrupted")
        finally:
            sys.setprofile(None)

    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        assert outcome == ["interrupted"] and not held.done()
    finally:
        os.write(w, b"x" * 10)
        assert held.result(timeout=10) == [10]
        engine.close()
        for f in (r, w, fd):
            os.close(f)


def test_a_raising_submit_takes_back_an_op_resumed_after_a_short_read(tmp_path, monkeypatch):
    """submit() raising right after io_uring_submit, its read coming back short (the file ends)
    and resumed from the backlog while another batch keeps the kernel busy: the resumed op
    leaves with the batch. Before, it ran after submit() had raised, writing into the
    buffer the caller had back, and ended its request a second time."""
    from gdskv.gds.engine import IoOp
    from gdskv.gds.ring import Ring
    from gdskv.gds.uring import UringEngine

    path = tmp_path / "data"
    path.write_bytes(b"A" * 10 * PAGE)
    engine = UringEngine(direct=False)
    fd = engine.open_file(path, os.O_RDONLY)
    r, w = os.pipe()
    held = engine.submit([IoRequest(IoOp.READ, r, 0, [memoryview(bytearray(16))], "pipe", False)])
    real = Ring._submit
    raised = []

    def submit_then_raise(self):
        real(self)
        if not raised:
            raised.append(True)
            raise Interrupted()

    monkeypatch.setattr(Ring, "_submit", submit_then_raise)
    buffer = memoryview(bytearray(16 * PAGE))
    try:
        with pytest.raises(Interrupted):
            engine.submit([IoRequest.read(fd, 0, buffer, path=str(path))])
        monkeypatch.setattr(Ring, "_submit", real)
        buffer[:] = bytes(len(buffer))  # the caller's again
        with open(path, "ab") as f:
            f.write(b"B" * 6 * PAGE)  # a resumed read would now find these
        os.write(w, b"x" * 16)
        assert held.result(timeout=10) == [16]
        engine.run([IoRequest.read(fd, 0, memoryview(bytearray(PAGE)), path=str(path))])  # the ring repairs, goes on
        assert bytes(buffer) == bytes(len(buffer))
        assert all(f._pending >= 0 and len(f._order) == len(set(f._order)) for f in list(engine._ring()._futures))
    finally:
        engine.close()
        for f in (r, w, fd):
            os.close(f)


def _io_uring_fds() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]"
        except OSError:
            pass
    return count


def test_a_ring_whose_staging_cannot_be_allocated_gives_its_descriptor_back(tmp_path, monkeypatch):
    """The engine builds a thread's ring at its first submission: when the staging cannot be
    had (no memory), the submission fails with an IoError saying so, the ring set up for it
    is let go (each retry would keep one more descriptor otherwise), and once memory is
    there again the next submission works."""
    import errno

    import gdskv.gds.ring as ring_module
    from gdskv.gds.uring import UringEngine

    engine = UringEngine(direct=True)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = engine.open_file(path, os.O_RDONLY)
    real = ring_module.alloc_aligned

    def no_memory(nbytes, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    try:
        before = _io_uring_fds()
        monkeypatch.setattr(ring_module, "alloc_aligned", no_memory)
        for _ in range(3):
            with pytest.raises(IoError, match="io_uring staging setup failed: Cannot allocate memory"):
                engine.submit([IoRequest.read(fd, 0, memoryview(bytearray(4096)))])
        assert _io_uring_fds() == before
        monkeypatch.setattr(ring_module, "alloc_aligned", real)
        out = bytearray(4096)
        assert engine.submit([IoRequest.read(fd, 0, memoryview(out))]).result() == [4096]
        assert bytes(out) == b"x" * 4096
    finally:
        os.close(fd)
        engine.close()
