"""A signal handler that raises (as SIGINT's default handler raises KeyboardInterrupt) can land
anywhere in the ``uring`` engine's bookkeeping while the main thread drives its ring. Whatever
it cut short, every request of every batch still ends: with its bytes moved and verified, or
with an error; and the ring goes on working (no staging slot or entry lost)."""

from __future__ import annotations

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
