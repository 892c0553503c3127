"""Finding, or starting, the node that serves an engine's host (modes ``node``, ``auto``
and ``cluster`` of :class:`~gdskv.engine.attach.AttachConfig`).

:meth:`NodeLink.connect` returns an :class:`~gdskv.local.client.AttachedStore` on the
config's socket, or raises :class:`NodeUnavailableError`. In mode ``node`` it only
attaches. In modes ``auto`` and ``cluster``, when no node serves the socket, it starts
one, under an exclusive ``flock`` on ``<socket>.lock`` so that of several engine processes
starting at once exactly one starts it; the others wait for the lock, then find it:

    python -m gdskv.node --socket SOCKET --dram DRAM --ssd PATH:SSD --exit-when-idle 30
                         [--set FIELD=VALUE ...] [--master HOST:PORT --listen IP:0]

The node runs in a session of its own (``start_new_session``: a signal to the engine's
process group does not reach it) with stdout and stderr appended to ``node.log`` in the
store directory; the engine reads its events there until ``{"event": "attachable"}``
(or the node's exit, or :data:`START_TIMEOUT_S`), then leaves it running: it outlives the
engine and exits :data:`IDLE_EXIT_S` seconds after its last attached process left. A
node that failed to start is not started again before a back-off (1 s, doubling up to
60 s) has passed. In mode ``cluster`` the node listens on the address of this host that
routes to the master, so that peers on other hosts reach its data server.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Mapping, Optional

from gdskv.errors import ConfigError, NodeUnavailableError

if TYPE_CHECKING:
    from gdskv.engine.attach import AttachConfig

log = logging.getLogger(__name__)

#: A node started by an engine exits this long after its last attached process left.
IDLE_EXIT_S = 30
#: Longest wait for a starting node's "attachable" event (it recovers its SSD tier first).
START_TIMEOUT_S = 300.0
#: The node's log (its stdout and stderr) in the store directory.
LOG_NAME = "node.log"
_BACKOFF_S = (1.0, 60.0)


def node_options(store_options: Mapping[str, Any]) -> List[str]:
    """The ``--set field=value`` arguments that give a node started by this process
    ``store_options`` (numbers, strings, booleans as true/false). ConfigError for a value
    a command line cannot carry."""
    argv: List[str] = []
    for name, value in store_options.items():
        if isinstance(value, bool):
            argv += ["--set", f"{name}={'true' if value else 'false'}"]
        elif isinstance(value, (int, float, str)):
            argv += ["--set", f"{name}={value}"]
        else:
            raise ConfigError("store option values must be numbers, strings or booleans", field=name, got=type(value).__name__)
    return argv


class NodeLink:
    """How one engine process reaches its host's node (see the module docstring)."""

    def __init__(self, cfg: "AttachConfig") -> None:
        if not cfg.attached or cfg.socket is None:
            raise ConfigError("a node link needs mode auto, node or cluster", mode=cfg.mode)
        self.cfg = cfg
        self.socket = cfg.socket
        self.lock_path = cfg.socket + ".lock"
        self.may_start = cfg.mode in ("auto", "cluster")
        self.started: Optional[subprocess.Popen] = None
        self._backoff = _BACKOFF_S[0]
        self._next_start = 0.0
        self._warned_no_cluster = False

    def connect(self) -> Any:
        """An attached store on the socket, starting the node first where the mode says so."""
        try:
            return self._checked(_attach(self.socket))
        except NodeUnavailableError:
            if not self.may_start:
                raise
        if time.monotonic() < self._next_start:
            raise NodeUnavailableError("the node failed to start; trying again later", socket=self.socket)
        with _FileLock(self.lock_path, timeout_s=START_TIMEOUT_S + 30):
            try:  # another process may have started it while this one waited for the lock
                return self._checked(_attach(self.socket))
            except NodeUnavailableError:
                pass
            try:
                self._start()
            except NodeUnavailableError:
                self._next_start = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, _BACKOFF_S[1])
                raise
            self._backoff = _BACKOFF_S[0]
            return self._checked(_attach(self.socket))

    def _checked(self, store: Any) -> Any:
        if self.cfg.mode == "cluster" and "node_id" not in store.info and not self._warned_no_cluster:
            self._warned_no_cluster = True
            log.warning(
                "gdskv: the node at %s is not part of a cluster (started without --master): lookups find this host's KV only",
                self.socket,
            )
        return store

    def argv(self) -> List[str]:
        """The command line of the node this process would start."""
        cfg = self.cfg
        sets = node_options(cfg.store_options)
        argv = [
            sys.executable, "-m", "gdskv.node", "--socket", self.socket, "--dram", str(cfg.dram_bytes),
            "--ssd", f"{os.path.abspath(cfg.path)}:{cfg.ssd_bytes}", "--exit-when-idle", str(IDLE_EXIT_S), *sets,
        ]
        if cfg.mode == "cluster":
            assert cfg.master is not None
            argv += ["--master", cfg.master, "--listen", f"{_address_towards(cfg.master)}:0"]
        return argv

    def _start(self) -> None:
        """Start the node and wait for its "attachable" event (NodeUnavailableError when
        it exits or times out first)."""
        cfg = self.cfg
        argv = self.argv()
        store_dir = Path(os.path.abspath(cfg.path))
        try:
            store_dir.mkdir(parents=True, exist_ok=True)
            Path(self.socket).parent.mkdir(parents=True, exist_ok=True)
            logf = open(store_dir / LOG_NAME, "ab")
        except OSError as exc:
            raise NodeUnavailableError(f"cannot start a node for {store_dir}: {exc}", socket=self.socket) from None
        with logf:
            offset = logf.tell()
            log.info("gdskv: process %d starts the node for %s: %s", os.getpid(), store_dir, " ".join(argv))
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True, close_fds=True,
                    cwd="/",
                )
            except OSError as exc:
                raise NodeUnavailableError(f"cannot start a node: {exc}", socket=self.socket) from None
        # Reaped when it exits, however long after; it never stops with this process.
        threading.Thread(target=proc.wait, name="gdskv-node-reaper", daemon=True).start()
        self.started = proc
        log_path = store_dir / LOG_NAME
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for event in _events(log_path, offset):
                if event.get("event") == "attachable":
                    return
            if proc.poll() is not None:
                raise NodeUnavailableError(
                    f"the node started for {store_dir} exited with status {proc.returncode}: {_tail(log_path, offset)}",
                    socket=self.socket, log=str(log_path),
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise NodeUnavailableError(
                    f"the node started for {store_dir} did not serve within {START_TIMEOUT_S:.0f} s", socket=self.socket, log=str(log_path)
                )
            time.sleep(0.05)


def _attach(sock: str) -> Any:
    import gdskv

    return gdskv.attach(sock)


def _events(path: Path, offset: int) -> List[dict]:
    """The JSON events the node wrote to its log since ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if line.startswith(b"{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


def _tail(path: Path, offset: int, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"
    return text[-limit:] or "(nothing logged)"


def _address_towards(master: str) -> str:
    """The address of this host on the route to ``master`` (no packet is sent)."""
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class _FileLock:
    """An exclusive ``flock`` on a file, waited for at most ``timeout_s``."""

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.fd = -1

    def __enter__(self) -> "_FileLock":
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise NodeUnavailableError(f"cannot open the node's start lock: {exc}", lock=self.path) from None
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise NodeUnavailableError("another process held the node's start lock too long", lock=self.path) from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the lock
