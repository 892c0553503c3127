"""The node's Unix socket: processes on its host attach to its store through it.

:class:`LocalServer` binds ``PATH`` (by default ``node.sock`` in the store directory), with
permissions ``0600`` unless told otherwise: only the node's user may attach. An attached
process maps the store's DRAM arena and the node's read staging area (shared memory passed
at the handshake) and may write into the arena, so whoever can open the socket is trusted
with every value of the store; the socket's permissions are the boundary.

Each connection is a :class:`~gdskv.local.session.Session` in a thread of its own; when it
ends, everything it held is given back. :meth:`LocalServer.close` ends every session before
it returns, so the store can close after it (a put slot still held would make
``Store.close`` wait).

The socket is bound in a private directory and renamed into place, so it never exists with
other permissions than asked; a socket left behind by a node that died is replaced, one that
a live node serves is a :class:`ConfigError`.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from gdskv.errors import ConfigError
from gdskv.local import protocol as p
from gdskv.local.session import Session
from gdskv.local.staging import STAGING_BYTES, ReadStaging

log = logging.getLogger(__name__)

SOCKET_NAME = p.SOCKET_NAME


def default_socket_path(store_dir: "str | os.PathLike[str]") -> Path:
    return Path(store_dir) / SOCKET_NAME


class LocalServer:
    """Serves a store to the processes of this host (see the module docstring)."""

    def __init__(
        self, store: Any, path: "str | os.PathLike[str] | None" = None, *, mode: int = 0o600,
        staging_bytes: int = STAGING_BYTES, describe: Optional[Dict[str, Any]] = None, reach: Any = None,
    ) -> None:
        """``store``: an open store whose DRAM arena is shared (``dram_shared=True``).
        ``describe``: more facts for the handshake's description (e.g. the node id).
        ``reach``: what attached processes see beyond the store (a
        :class:`~gdskv.local.reach.ClusterReach` on a cluster node; default: nothing)."""
        if store.parts.dram.shared_fd < 0:
            raise ConfigError("a store served to attached processes needs a shared DRAM arena (dram_shared=True)", store=str(store.path))
        if not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ConfigError("the socket mode must be permission bits such as 0o600", got=mode)
        self.store = store
        self.path = Path(path) if path is not None else default_socket_path(store.path)
        if len(os.fsencode(self.path)) > p.MAX_SOCKET_PATH:
            raise ConfigError("a Unix socket path must be at most 107 bytes long", path=str(self.path))
        self.mode = mode
        self._describe = dict(describe or {})
        self.reach = reach
        self.staging = ReadStaging(staging_bytes)
        self._sock: Optional[socket.socket] = None
        self._sessions: Set[Session] = set()
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._accepter: Optional[threading.Thread] = None
        self._closed = False
        self.attached_total = 0
        self._idle_since = time.monotonic()

    def start(self) -> Path:
        """Bind and listen; returns the socket's path."""
        self._clear_stale()
        private = tempfile.mkdtemp(prefix=".gdskv-sock-", dir=self.path.parent)
        staged = os.path.join(private, "s")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(staged)
            os.chmod(staged, self.mode)
            sock.listen(64)
            os.rename(staged, self.path)
        except BaseException:
            sock.close()
            raise
        finally:
            if os.path.exists(staged):
                os.unlink(staged)
            os.rmdir(private)
        self._sock = sock
        self._accepter = threading.Thread(target=self._accept, name="gdskv-local-accept", daemon=True)
        self._accepter.start()
        return self.path

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError("the socket path exists and is not a socket", path=str(self.path))
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:  # nobody listens: left by a node that died
            os.unlink(self.path)
            return
        finally:
            probe.close()
        raise ConfigError("another node serves this socket already", path=str(self.path))

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            peer = _peer(conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                session = Session(
                    self.store, self.staging, conn, peer=peer, welcome=self._welcome,
                    on_end=self._session_ended, server_stats=self.stats, reach=self.reach,
                )
                self._sessions.add(session)
                self.attached_total += 1
            threading.Thread(target=session.serve, name=f"gdskv-local-{peer}", daemon=True).start()

    def _welcome(self) -> Tuple[bytes, List[int]]:
        dram = self.store.parts.dram
        doc = {"store": str(self.store.path), "node_pid": os.getpid(), **self._describe}
        body = p.WELCOME_BODY.pack(p.VERSION, dram.capacity, self.staging.nbytes) + p.dumps(doc)
        return body, [dram.shared_fd, self.staging.fd]

    def _session_ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.discard(session)
            if not self._sessions:
                self._idle_since = time.monotonic()
            self._ended.notify_all()

    def idle_s(self) -> float:
        """Seconds since the last attached process left (or since start); 0 while any is attached."""
        with self._lock:
            return 0.0 if self._sessions else time.monotonic() - self._idle_since

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            held = [s.holding for s in self._sessions]
        return {
            "socket": str(self.path), "attached": len(held), "attached_total": self.attached_total,
            "pins": sum(h["pins"] for h in held), "slots": sum(h["slots"] for h in held),
            "staging_used_bytes": self.staging.used, "staging_bytes": self.staging.nbytes,
            "pulled_from_peers": getattr(self.reach, "pulled", 0),
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, end every session (what they held is given back) and remove the
        socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions)
        if self._sock is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
            except OSError:
                pass
            self._sock.close()
        for session in sessions:
            session.shutdown()
        with self._lock:
            if not self._ended.wait_for(lambda: not self._sessions, timeout):
                log.warning("gdskv: %d attached sessions did not end in %.0f s", len(self._sessions), timeout)
        if self._accepter is not None:
            self._accepter.join(timeout)
        self.staging.close()

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _peer(conn: socket.socket) -> str:
    """``pid N uid U`` of the process at the other end, as the kernel tells it."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return f"pid {pid} uid {uid}"
    except OSError:
        return "an unknown process"
