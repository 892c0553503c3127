"""Fixtures of the attach tests (imported by each test module): a node's store served on a
Unix socket in this process, and ``gdskv-node --socket`` daemons in processes of their own."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import gdskv
from gdskv.local import LocalServer


@pytest.fixture
def sock_dir():
    """A short directory for sockets (a Unix socket path has at most 107 bytes)."""
    d = tempfile.mkdtemp(prefix="gdskv-t-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def served(tmp_path, sock_dir):
    """``served(**store_options) -> (store, server)``: a store with a shared arena, served on
    a socket in ``sock_dir``. Everything is closed at teardown, clients first."""
    made = []

    def _make(name: str = "node", *, staging_bytes: int = 64 << 20, **options):
        options.setdefault("dram", "8MiB")
        options.setdefault("ssd", "64MiB")
        options.setdefault("bucket_bytes", 1 << 20)
        store = gdskv.open(tmp_path / name, dram_shared=True, **options)
        server = LocalServer(store, sock_dir / f"{name}.sock", staging_bytes=staging_bytes)
        server.start()
        made.append((store, server))
        return store, server

    yield _make
    for store, server in made:
        server.close()
        store.close()


class NodeDaemon:
    """A ``gdskv-node --socket`` process (DRAM + SSD, no master)."""

    def __init__(self, store_dir: Path, socket: Path, *extra: str, dram: str = "8MiB", ssd: str = "64MiB") -> None:
        self.store_dir, self.socket = store_dir, socket
        self.argv = [sys.executable, "-m", "gdskv.node", "--socket", str(socket), "--dram", dram,
                     "--ssd", f"{store_dir}:{ssd}", "--set", "bucket_bytes=1048576", *extra]
        self.proc = None

    def start(self) -> "NodeDaemon":
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"gdskv-node exited: {self.proc.stderr.read()}")
        assert json.loads(line) == {"event": "attachable", "socket": str(self.socket)}
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def node_daemon(tmp_path, sock_dir):
    """``node_daemon(name="node", *extra_args) -> NodeDaemon`` (started); stopped at teardown."""
    started = []

    def _start(name: str = "node", *extra: str, **kw) -> NodeDaemon:
        daemon = NodeDaemon(tmp_path / name, sock_dir / f"{name}.sock", *extra, **kw).start()
        started.append(daemon)
        return daemon

    yield _start
    for daemon in started:
        daemon.stop()


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
