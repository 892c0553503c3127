"""psync batches: pool tasks take requests until none is left, and a caller waiting without a
timeout runs requests too, unless it is the main thread (where Ctrl-C lands); every request
runs exactly once."""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path

import pytest

from awaiting import await_with_the_executor_busy
from conftest import block
from gdskv.gds.engine import IoRequest
from gdskv.gds.psync import PsyncEngine


@pytest.fixture
def calls(monkeypatch):
    """os.preadv counted per thread; the engine's pool threads wait for ``calls.release``
    (a slow device) while other threads read at once."""
    real = os.preadv
    counts: "collections.Counter[str]" = collections.Counter()
    lock = threading.Lock()
    release = threading.Event()

    def counted(fd, buffers, offset, *args):
        name = threading.current_thread().name
        with lock:
            counts[name] += 1
        if name.startswith("gdskv-psync"):
            release.wait(10)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", counted)
    counted.counts = counts
    counted.release = release
    yield counted
    release.set()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_batch_runs_each_request_once_on_at_most_its_threads(tmp_path, calls, direct):
    path = tmp_path / "data"
    path.write_bytes(block(1, 200 * 4096))
    engine = PsyncEngine(threads=3, direct=direct)
    fd = engine.open_file(path, os.O_RDONLY)
    try:
        calls.release.set()
        outs = [bytearray(1000) for _ in range(200)]
        requests = [IoRequest.read(fd, i * 4096 + 7, memoryview(out), path=str(path)) for i, out in enumerate(outs)]
        assert engine.run(requests) == [1000] * 200
    finally:
        os.close(fd)
        engine.close()
    assert all(out == block(1, 200 * 4096)[i * 4096 + 7 : i * 4096 + 1007] for i, out in enumerate(outs))
    assert sum(calls.counts.values()) == 200  # one preadv each: none ran twice
    assert len([name for name in calls.counts if name.startswith("gdskv-psync")]) <= 3


def test_a_caller_waiting_runs_the_requests_the_pool_has_not_started(tmp_path, calls):
    """With the pool's one thread stuck on a slow read, as_completed() in a thread other than
    the main one still yields the other requests of the batch: that caller ran them."""
    path = tmp_path / "data"
    path.write_bytes(block(2, 3 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    timer = threading.Timer(5, calls.release.set)  # ends the test on an engine that does not
    timer.start()
    outs = [bytearray(4096) for _ in range(3)]
    early = []

    def caller():
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)])
        while not any(name.startswith("gdskv-psync") for name in list(calls.counts)):  # the pool's thread is stuck in a read
            time.sleep(0.001)
        for index, outcome in future.as_completed():
            assert outcome == 4096
            if not calls.release.is_set():
                early.append(index)
            if len(early) == 2:
                calls.release.set()
        assert future.outcomes(timeout=10) == [4096] * 3

    try:
        thread = threading.Thread(target=caller, name="caller")
        thread.start()
        thread.join(10)
        assert len(early) == 2 and calls.counts["caller"] == 2
        assert b"".join(outs) == block(2, 3 * 4096)
    finally:
        timer.cancel()
        calls.release.set()
        os.close(fd)
        engine.close()


def test_a_caller_waiting_with_a_timeout_runs_nothing(tmp_path, calls):
    """A timeout bounds the wait: the caller does not start a read that could outlast it."""
    path = tmp_path / "data"
    path.write_bytes(block(3, 2 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(2)])
        with pytest.raises(TimeoutError):
            future.result(timeout=0.05)
        assert calls.counts[threading.current_thread().name] == 0
        calls.release.set()
        assert future.result(timeout=10) == [4096, 4096]
    finally:
        calls.release.set()
        os.close(fd)
        engine.close()


class Interrupted(BaseException):
    """What the tests' signal handler raises (as SIGINT's default handler raises KeyboardInterrupt)."""


@pytest.fixture
def alarm():
    """Raise :class:`Interrupted` in the main thread ``seconds`` from now: ``alarm(seconds)``."""
    import signal

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def test_a_signal_in_the_main_thread_interrupts_its_wait_not_the_batch(tmp_path, calls, alarm):
    """Ctrl-C while the main thread waits on a batch: result() raises it, and the batch goes
    on on the pool and ends with every byte count (the main thread runs no request, so no
    interrupt can cut one short or become its outcome)."""
    path = tmp_path / "data"
    path.write_bytes(block(4, 4 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    outs = [bytearray(4096) for _ in range(4)]
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)])
        others = []
        waiter = threading.Thread(target=lambda: others.append(future.outcomes(timeout=10)))
        waiter.start()
        alarm(0.2)
        with pytest.raises(Interrupted):
            future.result()
        calls.release.set()
        waiter.join(10)
        assert others == [[4096] * 4] and future.result(timeout=10) == [4096] * 4
        assert b"".join(outs) == block(4, 4 * 4096)
        assert calls.counts[threading.main_thread().name] == 0
    finally:
        calls.release.set()
        os.close(fd)
        engine.close()


def test_any_exception_a_request_raises_is_its_outcome_and_the_batch_goes_on(tmp_path, monkeypatch):
    """Even one that is not an Exception (SystemExit) is recorded as that request's
    outcome, as a pool future holds it; the other requests still run."""
    path = tmp_path / "data"
    path.write_bytes(block(5, 4 * 4096))
    engine = PsyncEngine(threads=2)
    fd = os.open(path, os.O_RDONLY)
    real = os.preadv

    def exiting(fd_, buffers, offset, *args):
        if offset == 4096:
            raise SystemExit("a request that exits")
        return real(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", exiting)
    try:
        outcomes = engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(4)]).outcomes(timeout=10)
        assert isinstance(outcomes[1], SystemExit) and [outcomes[i] for i in (0, 2, 3)] == [4096] * 3
    finally:
        os.close(fd)
        engine.close()


def test_await_needs_no_free_executor_thread(tmp_path, monkeypatch):
    """Awaiting a batch holds no thread: it returns while the loop's default executor is
    busy (before, it waited for a thread there, after the requests had all ended)."""

    real = os.preadv

    def slow(fd_, buffers, offset, *args):
        time.sleep(0.05)  # still in flight when the await starts
        return real(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow)
    path = tmp_path / "data"
    path.write_bytes(block(6, 8 * 4096))
    engine = PsyncEngine(threads=4)
    fd = os.open(path, os.O_RDONLY)

    try:
        submit = lambda: engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(8)])  # noqa: E731
        assert await_with_the_executor_busy(submit) == [4096] * 8
    finally:
        os.close(fd)
        engine.close()


def test_a_small_read_started_by_a_signal_handler_does_not_share_the_interrupted_reads_staging(tmp_path):
    """Small O_DIRECT reads go through the thread's staging buffer; a handler that reads
    through the same engine in the same thread, between the interrupted read's transfer
    and its copy out, gets a buffer of its own (before, it overwrote the interrupted read's)."""
    import signal

    engine = PsyncEngine(threads=2, direct=True)
    (tmp_path / "a").write_bytes(b"A" * 65536)
    (tmp_path / "b").write_bytes(b"B" * 65536)
    fa = engine.open_file(tmp_path / "a", os.O_RDONLY)
    fb = engine.open_file(tmp_path / "b", os.O_RDONLY)
    handled = []

    def handler(signum, frame):
        if not handled or handled[-1] is not None:
            handled.append(None)
            engine.run([IoRequest.read(fb, 0, memoryview(bytearray(4096)))])
            handled[-1] = True

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    wrong = reads = 0
    try:
        # Enough reads and interrupts, not a fixed time: a loaded machine only takes longer.
        end = time.monotonic() + 120
        while (reads <= 1000 or len(handled) <= 50) and time.monotonic() < end:
            out = bytearray(4096)
            engine.run([IoRequest.read(fa, 4096 + 7, memoryview(out))])  # one request: runs in this thread
            reads += 1
            wrong += out != b"A" * 4096
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(fa)
        os.close(fb)
        engine.close()
    assert len(handled) > 50 and reads > 1000
    assert wrong == 0


def test_each_waiter_is_woken_by_the_outcome_it_waits_for(tmp_path, monkeypatch):
    """A waiter for one more outcome (as_completed) and a waiter for all of them (result) on
    one batch: each outcome wakes both at once (before, the second could take the first's
    wake-up, which then slept until its next look)."""

    path = tmp_path / "data"
    path.write_bytes(block(7, 4 * 4096))
    engine = PsyncEngine(threads=1)
    fd = os.open(path, os.O_RDONLY)
    real = os.preadv
    ended = {}

    def slow(fd_, buffers, offset, *args):
        time.sleep(0.6)
        n = real(fd_, buffers, offset, *args)
        ended[offset // 4096] = time.monotonic()
        return n

    monkeypatch.setattr(os, "preadv", slow)
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(4)])
        other = threading.Thread(target=lambda: future.result(timeout=30))
        other.start()
        late = [time.monotonic() - ended[index] for index, _ in future.as_completed()]
        other.join(30)
        assert len(late) == 4 and max(late) < 0.2, late
    finally:
        os.close(fd)
        engine.close()


def test_signals_raising_in_a_waiting_main_thread_leave_no_waiter_registered(tmp_path, monkeypatch):
    """A handler raising again and again while the main thread waits: every wait it cuts
    short unregisters, and the batch ends with every byte count.

    Nothing here depends on how fast the machine is. The batch's last request is held until
    more than 10 waits were cut short, so the count does not depend on how soon the pool gets
    through the rest (while it does, the handler lands as the outcomes come in). The signals
    go to the main thread alone, from a thread of the test's own that is joined before the
    handler is put back: a process timer's signal can go to any thread and be handled late,
    by the handler put back (pytest-timeout's, which then reports a timeout). Only the main
    thread waits, so after each interrupt no waiter may be registered at all."""
    import signal

    import gdskv

    path = tmp_path / "data"
    path.write_bytes(block(8, 64 * 4096))
    engine = PsyncEngine(threads=2)
    fd = os.open(path, os.O_RDONLY)
    last_fd = os.open(path, os.O_RDONLY)  # the last request's own: its read is held
    release = threading.Event()
    real = os.preadv

    def held(fd, buffers, offset, *args):
        if fd == last_fd:
            release.wait(60)  # (never set: the batch ends all the same, and the count fails)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", held)
    package = os.path.dirname(gdskv.__file__) + os.sep
    armed = [True]
    interrupted = 0
    left_registered = 0

    def handler(signum, frame):  # interrupts the engine's code only, not this test's loop
        if armed[0] and frame.f_code.co_filename.startswith(package):
            raise Interrupted()

    main = threading.main_thread().ident
    stop = threading.Event()

    def interrupt():  # a signal to the main thread every 0.1 ms or so
        while not stop.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.0001)

    sender = threading.Thread(target=interrupt, name="interrupter")
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        requests = [IoRequest.read(fd, (i % 64) * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(2999)]
        requests.append(IoRequest.read(last_fd, 0, memoryview(bytearray(4096)), path=str(path)))
        future = engine.submit(requests)
        sender.start()
        while future._pending:
            try:
                future.result()
            except Interrupted:
                interrupted += 1
                left_registered += bool(future._bells)
                if interrupted > 10:
                    release.set()
        armed[0] = False
        assert future.outcomes(timeout=30) == [4096] * 3000
        assert interrupted > 10 and not left_registered and not future._bells
    finally:
        armed[0] = False
        stop.set()
        if sender.ident is not None:
            sender.join()  # every signal it sent has reached the handler above
        signal.signal(signal.SIGUSR1, old)
        release.set()
        os.close(fd)
        os.close(last_fd)
        engine.close()


@pytest.mark.parametrize("where", ["the first pool task", "the last pool task", "leaving the lock"])
def test_a_submit_that_raises_takes_its_batch_back(tmp_path, monkeypatch, where):
    """An exception (a signal handler's) in submit() once pool tasks may have the batch:
    submit() raises only when no request of the batch runs any more, and those not started
    never do, so the caller's buffers are its own again (a read landing in them later would
    overwrite what the caller put there since). The engine goes on working."""
    import sys

    path = tmp_path / "data"
    path.write_bytes(block(6, 40 * 4096))
    real = os.preadv
    release = threading.Event()

    def slow(fd, buffers, offset, *args):  # the pool's reads start once submit() raises, and take a while
        if threading.current_thread().name.startswith("gdskv-psync"):
            release.wait(10)
            time.sleep(0.02)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow)
    engine = PsyncEngine(threads=3)
    fd = engine.open_file(path, os.O_RDONLY)
    outs = [bytearray(4096) for _ in range(40)]
    requests = [IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)]
    handed = [0]

    def profile(frame, event, arg):
        code = frame.f_code
        if where == "leaving the lock":
            hit = event == "c_return" and code.co_name == "submit" and code.co_filename.endswith("psync.py") and getattr(arg, "__name__", "") == "__exit__"
        else:  # a pool task handed over
            hit = event == "return" and code.co_name == "put" and code.co_filename.endswith("psync.py")
            handed[0] += hit
            hit = hit and handed[0] == (1 if where == "the first pool task" else 3)
        if hit:
            release.set()
            raise Interrupted()

    try:
        sys.setprofile(profile)
        try:
            with pytest.raises(Interrupted):
                engine.submit(requests)
        finally:
            sys.setprofile(None)
        assert release.is_set()
        for out in outs:
            out[:] = b"\xee" * 4096
        again = [bytearray(4096) for _ in range(8)]
        assert engine.run([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(again)]) == [4096] * 8
        assert b"".join(again) == block(6, 40 * 4096)[: 8 * 4096]
    finally:
        os.close(fd)
        engine.close()  # every pool task has ended
    assert all(out == b"\xee" * 4096 for out in outs), "a request of the withdrawn batch ran after submit() raised"


def test_an_exception_at_every_check_point_of_a_psync_submit(tmp_path):
    """One run per check point of submit()'s code and what it calls (a profile function
    counts them: each Python function entered, each C call returned), with an exception
    there. Whenever submit() raises, nothing of its batch runs afterwards (the caller's
    buffers stay as it leaves them), and the engine goes on working and closes."""
    import sys

    path = tmp_path / "data"
    path.write_bytes(block(9, 24 * 4096))
    expected = block(9, 24 * 4096)
    target = 0
    while True:
        target += 1
        engine = PsyncEngine(threads=3)
        fd = engine.open_file(path, os.O_RDONLY)
        outs = [bytearray(4096) for _ in range(24)]
        count = [0]

        def profile(frame, event, arg, target=target, count=count):
            if event not in ("call", "c_return"):
                return
            while frame is not None and not (frame.f_code.co_name == "submit" and frame.f_code.co_filename.endswith("psync.py")):
                frame = frame.f_back
            if frame is None:
                return
            count[0] += 1
            if count[0] == target:
                raise Interrupted()

        raised = False
        sys.setprofile(profile)
        try:
            future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)])
        except Interrupted:
            raised = True
        finally:
            sys.setprofile(None)
        where = f"exception at check point {target}"
        if raised:
            for out in outs:
                out[:] = b"\xee" * 4096
        else:
            assert future.outcomes(timeout=10) == [4096] * 24, where
            assert b"".join(outs) == expected, where
        again = [bytearray(4096) for _ in range(6)]
        done = []
        runner = threading.Thread(target=lambda: done.append(engine.run([IoRequest.read(fd, i * 4096, memoryview(o), path=str(path)) for i, o in enumerate(again)])), daemon=True)
        runner.start()
        runner.join(10)
        assert done == [[4096] * 6] and b"".join(again) == expected[: 6 * 4096], where
        os.close(fd)
        closing = threading.Thread(target=engine.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), where
        if raised:
            assert all(out == b"\xee" * 4096 for out in outs), f"{where}: the batch ran after submit() raised"
        if count[0] < target:  # no exception: every check point was tried
            break
    assert target > 8  # the sweep went through submit()'s code


def test_an_engine_dropped_unclosed_ends_its_threads(tmp_path):
    import gc

    path = tmp_path / "data"
    path.write_bytes(block(5, 16 * 4096))
    before = {t.ident for t in threading.enumerate()}
    for _ in range(5):
        engine = PsyncEngine(threads=3)
        fd = os.open(path, os.O_RDONLY)
        assert engine.run([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096))) for i in range(16)]) == [4096] * 16
        os.close(fd)
        del engine
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("gdskv-psync")]
        if not left:
            break
        time.sleep(0.01)
    assert not left


def test_work_handed_to_the_pool_is_finished_at_interpreter_exit(tmp_path):
    """A process that submits a batch of writes and exits without waiting for it: the
    writes are all done before it ends, as a ThreadPoolExecutor's would be."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "data"
    script = textwrap.dedent(f"""
        import os
        from gdskv.gds.engine import IoRequest
        from gdskv.gds.psync import PsyncEngine
        engine = PsyncEngine(threads=2)
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o644)
        chunk = bytes(range(256)) * 4096  # 1 MiB
        engine.submit([IoRequest.write(fd, i << 20, memoryview(chunk)) for i in range(64)])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert path.stat().st_size == 64 << 20
    with open(path, "rb") as f:
        for i in range(64):
            assert f.read(1 << 20) == bytes(range(256)) * 4096, i


def test_an_exit_hook_that_runs_after_gdskvs_own_can_still_use_an_engine(tmp_path):
    """atexit runs hooks last-registered first: one registered before gdskv was imported
    runs after gdskv's. An engine still open then still runs its batches."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "data"
    path.write_bytes(block(7, 8 * 4096))
    script = textwrap.dedent(f"""
        import atexit, os
        state = {{}}
        def late_hook():
            got = state["engine"].run([state["request"](state["fd"], i * 4096, memoryview(bytearray(4096))) for i in range(8)])
            print("late hook read", got)
        atexit.register(late_hook)
        from gdskv.gds.engine import IoRequest
        from gdskv.gds.psync import PsyncEngine
        state.update(engine=PsyncEngine(threads=2), fd=os.open({str(path)!r}, os.O_RDONLY), request=IoRequest.read)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "late hook read [4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096]" in done.stdout
