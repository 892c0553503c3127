"""The connector modes with real node processes: ``node`` (attach to a running node),
``auto`` (start the host's node when none serves, one for several processes starting at
once), ``cluster`` (the node it starts joins a master), and the store that keeps an
engine serving while its node is gone (SIGKILL), and attaches again when it is back."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import gdskv
from gdskv.config import MiB
from gdskv.engine import hostnode
from gdskv.engine.attach import AttachConfig, acquire_store, release_store
from gdskv.engine.hostnode import NodeLink
from gdskv.engine.resilient import ResilientStore, wait_attached
from gdskv.errors import NodeUnavailableError, StoreClosedError

NODE = [sys.executable, "-m", "gdskv.node"]
SMALL = dict(dram_bytes=8 * MiB, ssd_bytes=32 * MiB, store_options={"bucket_bytes": 1 << 20})


@pytest.fixture
def short_dir():
    """A short directory: a Unix socket path has at most 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="gdskv-m-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def nodes():
    """Node pids to stop at teardown (nodes started by the code under test outlive it)."""
    pids = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
    for pid in pids:
        wait_for(lambda: not alive(pid), 60, f"node {pid} to exit")


class Daemon:
    """``gdskv-node --socket`` run by the test (mode ``node``)."""

    def __init__(self, store_dir: Path, sock: Path) -> None:
        self.argv = [*NODE, "--socket", str(sock), "--dram", "8MiB", "--ssd", f"{store_dir}:32MiB", "--set", "bucket_bytes=1048576"]
        self.proc = None

    def start(self) -> "Daemon":
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        assert json.loads(line)["event"] == "attachable"
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.fixture
def daemon(short_dir):
    made = []

    def _make() -> Daemon:
        d = Daemon(short_dir / "kv", short_dir / "node.sock")
        made.append(d)
        return d

    yield _make
    for d in made:
        d.stop()


def warnings(caplog, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage())


# ---------------------------------------------------------------------------------- node


def test_node_mode_attaches_to_the_running_node(daemon, short_dir):
    node = daemon().start()
    cfg = AttachConfig(path=str(short_dir / "kv"), mode="node", socket=str(short_dir / "node.sock"))
    a = acquire_store(cfg, role="vLLM scheduler")
    b = acquire_store(cfg, role="vLLM worker, TP rank 0 of 1")
    assert a is b and isinstance(a, ResilientStore) and a.available
    assert a.roles == ["vLLM scheduler", "vLLM worker, TP rank 0 of 1"]
    a.put("k", b"value")
    with gdskv.attach(short_dir / "node.sock") as other:  # another process would see it too
        assert other.get("k") == b"value"
    assert a.node_info()["node_pid"] == node.proc.pid
    release_store(a)
    assert a.available  # one user left
    release_store(b)
    with pytest.raises(StoreClosedError):
        a.get("k")
    assert node.proc.poll() is None  # mode node never stops the node


def test_node_mode_never_starts_a_node(short_dir):
    link = NodeLink(AttachConfig(path=str(short_dir / "kv"), mode="node"))
    with pytest.raises(NodeUnavailableError):
        link.connect()
    assert link.started is None and not (short_dir / "kv").exists()


def test_a_killed_node_gives_misses_and_one_warning_then_hits_once_it_is_back(daemon, short_dir, caplog):
    caplog.set_level(logging.WARNING)
    node = daemon().start()
    cfg = AttachConfig(path=str(short_dir / "kv"), mode="node", socket=str(short_dir / "node.sock"))
    store = acquire_store(cfg, role="vLLM worker, TP rank 1 of 2")
    try:
        store.put("before", b"x" * 4096)
        assert store.get("before") == b"x" * 4096
        node.kill()
        out = bytearray(4096)
        for _ in range(3):  # the engine goes on: misses, dropped puts
            assert store.get("before") is None
            assert store.get_into("before", out) is None
            assert store.batch_get_into(["before", "b"], [out, bytearray(1)]) == [None, None]
            assert store.exists("before") is False and store.batch_exists(["a", "b"]) == [False, False]
            store.put("during", b"y")
            store.batch_put(["d1", "d2"], [b"1", b"2"])
        stats = store.stats()["resilient"]
        assert stats["attached"] is False and stats["outages"] == 1 and stats["dropped_puts"] == 9
        lost = [r.getMessage() for r in caplog.records if "lost the gdskv node" in r.getMessage()]
        assert len(lost) == 1, lost
        assert f"process {os.getpid()} (vLLM worker, TP rank 1 of 2)" in lost[0] and str(short_dir / "node.sock") in lost[0]
        time.sleep(1.5)  # retries while it is gone say nothing more
        assert warnings(caplog, "lost the gdskv node") == 1 and warnings(caplog, "again") == 0

        daemon().start()  # the operator restarts it on the same socket
        assert wait_attached(store, 30)
        store.put("after", b"z" * 100)
        assert store.get("after") == b"z" * 100
        assert store.stats()["resilient"]["reattached"] == 1
        assert warnings(caplog, "attached to the gdskv node at") == 1
        assert warnings(caplog, "lost the gdskv node") == 1
    finally:
        release_store(store)


def test_a_node_that_is_not_there_at_start_is_attached_once_it_serves(daemon, short_dir, caplog):
    caplog.set_level(logging.WARNING)
    cfg = AttachConfig(path=str(short_dir / "kv"), mode="node", socket=str(short_dir / "node.sock"))
    store = acquire_store(cfg, role="SGLang TP rank 0 of 1")
    try:
        assert isinstance(store, ResilientStore) and not store.available
        assert store.get("k") is None and store.stats()["resilient"]["outages"] == 1
        assert warnings(caplog, "cannot reach the gdskv node") == 1
        daemon().start()
        assert wait_attached(store, 30)
        store.put("k", b"v")
        assert store.get("k") == b"v"
        assert warnings(caplog, "cannot reach the gdskv node") == 1
    finally:
        release_store(store)


# ---------------------------------------------------------------------------------- auto


def test_auto_starts_the_hosts_node_and_the_next_process_attaches_to_it(short_dir, nodes):
    cfg = AttachConfig(path=str(short_dir / "kv"), **SMALL)
    store = acquire_store(cfg, role="vLLM worker, TP rank 0 of 1")
    try:
        assert store.available
        pid = store.node_info()["node_pid"]
        nodes.append(pid)
        assert pid != os.getpid() and alive(pid)
        assert os.getsid(pid) == pid  # a session of its own: the engine's signals do not reach it
        store.put("k", b"v" * 1000)
        found = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(f"""
                from gdskv.engine.attach import AttachConfig, acquire_store
                s = acquire_store(AttachConfig(path={str(short_dir / "kv")!r}))
                print(s.node_info()["node_pid"], bytes(s.get("k")) == b"v" * 1000)
            """)],
            capture_output=True, text=True, timeout=120,
        )
        assert found.stdout.split() == [str(pid), "True"], found.stderr
        log = (short_dir / "kv" / hostnode.LOG_NAME).read_text()
        assert log.count('"attachable"') == 1
    finally:
        release_store(store)


def test_the_node_started_for_auto_mode_gets_the_store_options():
    cfg = AttachConfig(path="/tmp/kv", dram_bytes=8 * MiB, ssd_bytes=0, store_options={"bucket_bytes": 1 << 20, "direct_io": False})
    argv = NodeLink(cfg).argv()
    assert argv[:3] == [sys.executable, "-m", "gdskv.node"]
    assert argv[3:] == ["--socket", "/tmp/kv/node.sock", "--dram", str(8 * MiB), "--ssd", "/tmp/kv:0",
                        "--exit-when-idle", "30", "--set", "bucket_bytes=1048576", "--set", "direct_io=false"]


STARTER = textwrap.dedent("""
    import json, sys, time
    from gdskv.engine.attach import AttachConfig, acquire_store
    path, at = sys.argv[1], float(sys.argv[2])
    time.sleep(max(0.0, at - time.time()))
    s = acquire_store(AttachConfig(path=path, dram_bytes=8 << 20, ssd_bytes=32 << 20))
    print(json.dumps({"pid": s.node_info().get("node_pid")}), flush=True)
""")


def test_processes_starting_at_once_in_auto_mode_start_one_node(short_dir, nodes):
    path = str(short_dir / "kv")
    at = time.time() + 3.0  # after every interpreter has started
    procs = [
        subprocess.Popen([sys.executable, "-c", STARTER, path, str(at)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        found.append(json.loads(out.strip().splitlines()[-1])["pid"])
    nodes.extend(set(found))
    assert len(set(found)) == 1 and found[0] is not None, found
    assert (short_dir / "kv" / hostnode.LOG_NAME).read_text().count('"attachable"') == 1
    # The node outlives the processes that started it, and exits once idle (30 s; not waited for).
    assert alive(found[0])


def test_auto_mode_starts_the_node_again_when_it_is_killed(short_dir, nodes, caplog):
    caplog.set_level(logging.WARNING)
    store = acquire_store(AttachConfig(path=str(short_dir / "kv"), **SMALL), role="vLLM scheduler")
    try:
        first = store.node_info()["node_pid"]
        nodes.append(first)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not alive(first), 30, "the node to die")
        assert store.get("k") is None
        assert wait_attached(store, 60)
        second = store.node_info()["node_pid"]
        nodes.append(second)
        assert second != first
        store.put("k", b"v")
        assert store.get("k") == b"v"
        assert warnings(caplog, "lost the gdskv node") == 1 and warnings(caplog, "attached to the gdskv node") == 1
    finally:
        release_store(store)


def test_a_node_that_cannot_start_is_a_warning_and_is_not_started_again_at_once(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    sock = tempfile.mktemp(prefix="gdskv-m-", suffix=".sock", dir="/tmp")
    cfg = AttachConfig(path=str(blocker / "kv"), socket=sock, **SMALL)
    link = NodeLink(cfg)
    with pytest.raises(NodeUnavailableError, match="cannot start a node"):
        link.connect()
    # A node whose store cannot open exits, and its error is in the warning.
    sub = tmp_path / "kv"
    sub.mkdir()
    (sub / "gdskv.json").write_text(json.dumps({"format": "gdskv", "format_version": 1, "backend": "no-such-backend"}))
    link = NodeLink(AttachConfig(path=str(sub), socket=sock, **SMALL))
    with pytest.raises(NodeUnavailableError, match="exited with status 2") as failed:
        link.connect()
    assert "another backend" in str(failed.value)
    started = link.started
    with pytest.raises(NodeUnavailableError, match="trying again later"):
        link.connect()  # within the back-off: no second node
    assert link.started is started
    try:
        os.unlink(sock + ".lock")
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------- cluster


def test_cluster_mode_starts_a_node_that_joins_the_master(short_dir, nodes):
    master = subprocess.Popen([sys.executable, "-m", "gdskv.master", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        address = json.loads(master.stdout.readline())["address"]
        cfg = AttachConfig(path=str(short_dir / "kv"), mode="cluster", master=address, **SMALL)
        assert NodeLink(cfg).argv()[-4:] == ["--master", address, "--listen", "127.0.0.1:0"]
        store = acquire_store(cfg, role="vLLM worker, TP rank 0 of 1")
        try:
            info = store.node_info()
            nodes.append(info["node_pid"])
            assert info["node_id"]  # part of the cluster
            store.put("shared", b"s" * 5000)
            client = gdskv.connect(address)  # a process elsewhere finds it through the master
            try:
                wait_for(lambda: client.get("shared") == b"s" * 5000, 30, "the master to know the key")
            finally:
                client.close()
        finally:
            release_store(store)
    finally:
        master.terminate()
        master.wait(60)


def test_cluster_mode_warns_when_the_node_it_finds_is_not_in_a_cluster(daemon, short_dir, caplog):
    caplog.set_level(logging.WARNING)
    daemon().start()
    cfg = AttachConfig(path=str(short_dir / "kv"), mode="cluster", master="127.0.0.1:1", socket=str(short_dir / "node.sock"))
    store = acquire_store(cfg)
    try:
        assert store.available
        assert warnings(caplog, "is not part of a cluster") == 1
    finally:
        release_store(store)
