"""A liburing build that kills its caller (SIGILL on a CPU without the instructions it was
compiled for) makes the uring engine unavailable instead of crashing the process."""

from __future__ import annotations

import pytest

from gdskv.gds import uring
from gdskv.gds.iovec import EngineUnavailableError


@pytest.fixture
def fresh_answer(monkeypatch):
    monkeypatch.setattr(uring, "_CRASH", [])


def test_a_child_killed_by_a_signal_is_reported_and_kept(fresh_answer, monkeypatch):
    monkeypatch.setattr(uring, "_CANARY", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert uring.liburing_crash() == "a test process calling it was killed by SIGILL"
    monkeypatch.setattr(uring, "_CANARY", "pass")  # the answer is kept: no second child
    assert uring.liburing_crash() == "a test process calling it was killed by SIGILL"


def test_the_engine_is_unavailable_with_the_reason(fresh_answer, monkeypatch):
    pytest.importorskip("liburing")
    monkeypatch.setattr(uring, "_CANARY", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(EngineUnavailableError, match="cannot run on this machine") as info:
        uring.UringEngine(depth=2, slots=1, chunk_bytes=4096)
    assert "SIGILL" in info.value.context["cause"]


def test_a_child_that_exits_with_an_error_is_not_a_crash(fresh_answer, monkeypatch):
    # e.g. a kernel that refuses io_uring: the engine's own setup reports that, with its errno
    monkeypatch.setattr(uring, "_CANARY", "raise SystemExit(3)")
    assert uring.liburing_crash() is None
