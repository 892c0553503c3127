"""A process attached to a node on its host: :class:`AttachedStore` (``gdskv.attach``).

It speaks :class:`gdskv.KVStore`, as an embedded store does, and moves no value through the
socket (:mod:`gdskv.local.protocol`) but where the node's read staging is full: at the
handshake it maps the node's DRAM arena and read staging area. A hit is one round trip and
one copy, from the shared memory into the caller's buffer (its pin is given back with the
connection's next request, or when the connection closes); a put is a reserved slot, one
copy into it and a commit (an uncommitted value is never visible; one whose process dies
before the commit is dropped by the node).

Connections: a call takes one from a small pool (one per thread that calls at once, at most
``connections``; more wait), so threads do not queue behind one another's copies. When the
node is gone, a call raises :class:`NodeUnavailableError`, and the next call connects again
(to a node restarted on the same socket: a new arena, mapped anew). A forked child does not
use its parent's connections (it makes its own). The CRC of a value is computed here, as
``Store.put`` computes it, and given to the node with the reservation.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from gdskv.errors import FormatVersionError, InvalidValueError, NodeUnavailableError, ProtocolError, StoreClosedError
from gdskv.local import protocol as p
from gdskv.tiers.backends.record import checksum
from gdskv.types import Key, byte_view, encode_key, sequence_arg

#: Default most connections to the node at once.
CONNECTIONS = 8
#: Most bytes a batch of puts reserves at once, as a share of the arena (the rest of a batch
#: goes in further rounds, so one batch cannot fill the arena with its own slots).
BATCH_ARENA_SHARE = 4


class _Mapping:
    """One node's shared memory, mapped into this process."""

    def __init__(self, fds: List[int], arena_bytes: int, staging_bytes: int) -> None:
        self.key = tuple(os.fstat(fd).st_ino for fd in fds)
        self._maps = [
            mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            for fd, n in zip(fds, (arena_bytes, staging_bytes))
        ]
        for m in self._maps:
            if hasattr(mmap, "MADV_DONTFORK"):
                m.madvise(mmap.MADV_DONTFORK)  # a forked child attaches on its own
        self.arena = np.frombuffer(self._maps[0], dtype=np.uint8)
        self.staging = np.frombuffer(self._maps[1], dtype=np.uint8)
        self.arena_bytes = arena_bytes

    def close(self) -> None:
        self.arena = self.staging = np.empty(0, dtype=np.uint8)
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is alive; the mapping goes with it


class _Connection:
    def __init__(self, sock: socket.socket, mapping: _Mapping, info: Dict[str, Any]) -> None:
        self.sock = sock
        self.mapping = mapping
        self.info = info
        self.reader = p.FrameReader(sock)
        #: Pins and staging room of this connection's last read, copied out already: given
        #: back with the next request (one message less per read), or when it closes.
        self.done: List[int] = []


class AttachedStore:
    """The store of a node on this host, attached through its socket (see the module docstring)."""

    def __init__(self, path: "str | os.PathLike[str]", *, connections: int = CONNECTIONS, timeout_s: float = 30.0) -> None:
        """``path``: the node's socket, or its store directory (``node.sock`` in it).
        Connects at once: :class:`NodeUnavailableError` when no node serves there,
        :class:`FormatVersionError` when it speaks another protocol version."""
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise InvalidValueError("connections must be a positive integer", got=connections)
        target = Path(path)
        self.path = target / p.SOCKET_NAME if target.is_dir() else target
        self._most = connections
        self._timeout = timeout_s
        self._lock = threading.Condition()
        self._idle: List[_Connection] = []
        self._open = 0
        self._waiting = 0  # threads waiting for a connection
        self._pid = os.getpid()
        self._closed = False
        self._mapping: Optional[_Mapping] = None
        self.info: Dict[str, Any] = {}
        self._release(self._take())  # fails here, at attach, when no node serves

    # ------------------------------------------------------------------ connections

    def _take(self) -> _Connection:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's connections are not ours
                self._idle, self._open, self._mapping, self._pid = [], 0, None, os.getpid()
            while True:
                if self._closed:
                    raise StoreClosedError("the attached store is closed", path=str(self.path))
                if self._idle:
                    return self._idle.pop()
                if self._open < self._most:
                    self._open += 1
                    break
                self._waiting += 1
                try:
                    self._lock.wait()
                finally:
                    self._waiting -= 1
        try:
            return self._connect()
        except BaseException:
            with self._lock:
                self._open -= 1
                self._lock.notify()
            raise

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            if self._closed or self._pid != os.getpid():
                conn.sock.close()
                self._open = max(0, self._open - 1)
            else:
                self._idle.append(conn)
            if self._waiting:
                self._lock.notify()

    def _drop(self, conn: _Connection) -> None:
        """A connection that broke: closed, and every idle one too (the node is gone; the next
        call connects anew)."""
        with self._lock:
            dead = [conn, *self._idle]
            self._idle = []
            self._open = max(0, self._open - len(dead))
            self._lock.notify_all()
        for c in dead:
            c.sock.close()

    def _connect(self) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(str(self.path))
            p.send_frame(sock, p.HELLO, p.HELLO_BODY.pack(p.MAGIC, p.VERSION, p.DEST_HOST))
            data, fds, _flags, _addr = socket.recv_fds(sock, 64 << 10, 2)
            try:
                if not data:
                    raise p.Disconnected("the node closed the connection at the handshake")
                body = self._welcome_body(sock, bytearray(data))
                mapping = self._map(fds, body)
            finally:
                for fd in fds:
                    os.close(fd)
            info = json.loads(bytes(body[p.WELCOME_BODY.size :]))
        except (OSError, p.Disconnected) as exc:
            sock.close()
            raise NodeUnavailableError(f"no node serves {self.path}: {exc}", path=str(self.path)) from None
        except BaseException:
            sock.close()
            raise
        self.info = info
        return _Connection(sock, mapping, info)

    def _welcome_body(self, sock: socket.socket, data: bytearray) -> memoryview:
        while len(data) < p.HEADER.size:
            data += p.recv_exact(sock, p.HEADER.size - len(data))
        length, code = p.HEADER.unpack_from(data)
        if len(data) < p.HEADER.size + length:
            data += p.recv_exact(sock, p.HEADER.size + length - len(data))
        body = memoryview(data)[p.HEADER.size : p.HEADER.size + length]
        if code == p.ERROR:
            raise p.decode_error(body)
        if code != p.OK or len(body) < p.WELCOME_BODY.size:
            raise ProtocolError("not a gdskv node's handshake", code=code, length=length)
        version = p.WELCOME_BODY.unpack_from(body)[0]
        if version != p.VERSION:
            raise FormatVersionError("the node speaks another attach protocol version", node_version=version, client_version=p.VERSION)
        return body

    def _map(self, fds: List[int], body: memoryview) -> _Mapping:
        if len(fds) != 2:
            raise ProtocolError("the node's handshake did not carry its shared memory", descriptors=len(fds))
        _, arena_bytes, staging_bytes = p.WELCOME_BODY.unpack_from(body)
        with self._lock:
            current = self._mapping
            if current is not None and current.key == tuple(os.fstat(fd).st_ino for fd in fds):
                return current  # the same node as the other connections: one mapping
        mapping = _Mapping(fds, arena_bytes, staging_bytes)
        with self._lock:
            self._mapping = mapping  # a restarted node: the old mapping goes with its connections
        return mapping

    def _call(self, conn: _Connection, op: int, *parts: "bytes | bytearray | memoryview") -> memoryview:
        """Send a request on ``conn`` (after the RELEASE of what it holds, in one message)
        and read its reply body (OK), or raise its error."""
        pieces: List[Any] = []
        if conn.done:
            pieces += p.frame(p.RELEASE, _ids(conn.done))
            conn.done = []
        pieces += p.frame(op, *parts)
        try:
            p.send_pieces(conn.sock, pieces)
            code, body = conn.reader.read()
        except (OSError, p.Disconnected) as exc:
            self._drop(conn)
            raise NodeUnavailableError(f"the node at {self.path} went away: {exc}", path=str(self.path)) from None
        if code == p.ERROR:
            raise p.decode_error(body)
        return body

    def _tell(self, conn: _Connection, op: int, *parts: "bytes | bytearray | memoryview") -> None:
        """Send a request that gets no reply (RELEASE, ABORT)."""
        try:
            p.send_frame(conn.sock, op, *parts)
        except OSError:
            self._drop(conn)
            raise

    # ------------------------------------------------------------------ reads

    def get(self, key: Key) -> Optional[bytearray]:
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[Key]) -> List[Optional[bytearray]]:
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        out: List[Optional[bytearray]] = []
        for i in range(0, len(ks), p.MAX_ITEMS):
            out.extend(self._read(ks[i : i + p.MAX_ITEMS], None))
        return out

    def get_into(self, key: Key, out: Any) -> Optional[int]:
        return self.batch_get_into([key], [out])[0]

    def batch_get_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> List[Optional[int]]:
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(outs, "outs")):
            raise InvalidValueError("keys and outs differ in length", keys=len(keys), outs=len(outs))
        ks = [encode_key(k) for k in keys]
        views = [byte_view(o, writable=True, what="out") for o in outs]
        sizes: List[Optional[int]] = []
        for i in range(0, len(ks), p.MAX_ITEMS):
            sizes.extend(self._read(ks[i : i + p.MAX_ITEMS], views[i : i + p.MAX_ITEMS]))
        return sizes

    def _read(self, ks: List[bytes], views: Optional[List[memoryview]]) -> List[Any]:
        """GET ``ks``: into ``views`` (sizes returned), or into new buffers (returned)."""
        n = len(ks)
        head = bytearray(p.COUNT.size + n * p.GET_ITEM.size)
        p.COUNT.pack_into(head, 0, n)
        for i, k in enumerate(ks):
            room = views[i].nbytes if views is not None else (1 << 63)
            p.GET_ITEM.pack_into(head, p.COUNT.size + i * p.GET_ITEM.size, len(k), room)
        conn = self._take()
        try:
            body = self._call(conn, p.GET, head, *ks)
            return self._copy_out(conn, body, n, views)
        finally:
            if conn.sock.fileno() >= 0:
                self._release(conn)

    def _copy_out(self, conn: _Connection, body: memoryview, n: int, views: Optional[List[memoryview]]) -> List[Any]:
        table = [p.GET_REPLY_ITEM.unpack_from(body, i * p.GET_REPLY_ITEM.size) for i in range(n)]
        at = n * p.GET_REPLY_ITEM.size
        held: List[int] = []
        results: List[Any] = [None] * n
        try:
            for i, (kind, offset, size, hold) in enumerate(table):
                if kind == p.MISS:
                    continue
                if kind == p.IN_ARENA:
                    src = conn.mapping.arena[offset : offset + size]
                    held.append(hold)
                elif kind == p.IN_STAGING:
                    src = conn.mapping.staging[offset : offset + size]
                    held.append(hold)
                else:
                    src = np.frombuffer(body, dtype=np.uint8, count=size, offset=at)
                    at += size
                if views is not None:
                    np.frombuffer(views[i], dtype=np.uint8, count=size)[:] = src
                    results[i] = size
                else:
                    results[i] = bytearray(src)
        finally:
            conn.done += held  # given back with the connection's next request
        return results

    # ------------------------------------------------------------------ writes

    def put(self, key: Key, value: Any, *, overwrite: bool = False) -> None:
        self.batch_put([key], [value], overwrite=overwrite)

    def batch_put(self, keys: Sequence[Key], values: Sequence[Any], *, overwrite: bool = False) -> None:
        """Each pair in turn; stops at the first error (earlier pairs stay stored)."""
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(values, "values")):
            raise InvalidValueError("keys and values differ in length", keys=len(keys), values=len(values))
        ks = [encode_key(k) for k in keys]
        views = [byte_view(v) for v in values]
        start = 0
        while start < len(ks):
            end, nbytes = start, 0
            limit = max(1, (self._arena_bytes() // BATCH_ARENA_SHARE))
            while end < len(ks) and end - start < p.MAX_ITEMS and (end == start or nbytes + views[end].nbytes <= limit):
                nbytes += views[end].nbytes
                end += 1
            self._put_round(ks[start:end], views[start:end], overwrite)
            start = end

    def _arena_bytes(self) -> int:
        mapping = self._mapping
        return mapping.arena_bytes if mapping is not None else 1 << 62

    def _put_round(self, ks: List[bytes], views: List[memoryview], overwrite: bool) -> None:
        n = len(ks)
        head = bytearray(p.RESERVE_HEAD.size + n * p.RESERVE_ITEM.size)
        p.RESERVE_HEAD.pack_into(head, 0, int(overwrite), n)
        for i, (k, v) in enumerate(zip(ks, views)):
            p.RESERVE_ITEM.pack_into(head, p.RESERVE_HEAD.size + i * p.RESERVE_ITEM.size, len(k), v.nbytes, checksum(k, v))
        conn = self._take()
        try:
            body = self._call(conn, p.RESERVE, head, *ks)
            (m,) = p.COUNT.unpack_from(body)
            rows = [p.RESERVE_REPLY_ITEM.unpack_from(body, p.COUNT.size + i * p.RESERVE_REPLY_ITEM.size) for i in range(m)]
            error = None
            if m < n:
                at = p.COUNT.size + m * p.RESERVE_REPLY_ITEM.size
                (length,) = p.COUNT.unpack_from(body, at)
                error = p.decode_error(body[at + p.COUNT.size : at + p.COUNT.size + length])
            slots = self._copy_in(conn, rows, views)
            if slots:
                self._call(conn, p.COMMIT, _ids(slots))
            if error is not None:
                raise error
        finally:
            if conn.sock.fileno() >= 0:
                self._release(conn)

    def _copy_in(self, conn: _Connection, rows: List[Tuple[int, int, int]], views: List[memoryview]) -> List[int]:
        """Copy each value that got a slot into it; the slots' ids. A copy that fails (an
        interrupt) aborts every slot of the round."""
        slots = [slot for kind, _, slot in rows if kind == p.SLOT]
        try:
            for (kind, offset, _), view in zip(rows, views):
                if kind == p.SLOT:
                    conn.mapping.arena[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        except BaseException:
            if slots:
                self._tell(conn, p.ABORT, _ids(slots))
            raise
        return slots

    # ------------------------------------------------------------------ queries

    def exists(self, key: Key) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        return self._per_key(p.EXISTS, keys)

    def remove(self, key: Key) -> bool:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[Key]) -> List[bool]:
        return self._per_key(p.REMOVE, keys)

    def _per_key(self, op: int, keys: Sequence[Key]) -> List[bool]:
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        out: List[bool] = []
        for i in range(0, len(ks), p.MAX_ITEMS):
            chunk = ks[i : i + p.MAX_ITEMS]
            head = bytearray(p.COUNT.size + len(chunk) * p.KEY_LEN.size)
            p.COUNT.pack_into(head, 0, len(chunk))
            for j, k in enumerate(chunk):
                p.KEY_LEN.pack_into(head, p.COUNT.size + j * p.KEY_LEN.size, len(k))
            conn = self._take()
            try:
                out.extend(bool(b) for b in bytes(self._call(conn, op, head, *chunk)))
            finally:
                if conn.sock.fileno() >= 0:
                    self._release(conn)
        return out

    def flush(self, timeout: Optional[float] = None) -> None:
        """``Store.flush`` on the node's store: wait until every queued offload is on SSD
        (:class:`TimedOutError` after ``timeout`` seconds)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0):
            raise InvalidValueError("flush timeout must be a number of seconds >= 0, or None", got=repr(timeout))
        conn = self._take()
        try:
            conn.sock.settimeout(None if timeout is None else max(self._timeout, timeout + 5.0))  # the node's wait, not ours
            self._call(conn, p.FLUSH, p.SECONDS.pack(-1.0 if timeout is None else float(timeout)))
        finally:
            if conn.sock.fileno() >= 0:
                conn.sock.settimeout(self._timeout)
                self._release(conn)

    def stats(self) -> Dict[str, Any]:
        """The node's store's figures, and ``attached``: this client's connections."""
        conn = self._take()
        try:
            doc = json.loads(bytes(self._call(conn, p.STATS)))
        finally:
            if conn.sock.fileno() >= 0:
                self._release(conn)
        with self._lock:
            doc["attached"] = {"socket": str(self.path), "connections": self._open, "node": dict(self.info)}
        return doc

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every connection (the node gives back what they held). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
            mapping, self._mapping = self._mapping, None
            self._lock.notify_all()
        for conn in idle:
            conn.sock.close()
        if mapping is not None:
            mapping.close()

    def __enter__(self) -> "AttachedStore":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AttachedStore({str(self.path)!r})"


def _ids(ids: List[int]) -> bytearray:
    """The body of a RELEASE, COMMIT or ABORT."""
    out = bytearray(p.COUNT.size + len(ids) * p.ID.size)
    p.COUNT.pack_into(out, 0, len(ids))
    for j, i in enumerate(ids):
        p.ID.pack_into(out, p.COUNT.size + j * p.ID.size, i)
    return out


def attach(path: "str | os.PathLike[str]", **options: Any) -> AttachedStore:
    """The store of the node serving ``path`` (its socket, or its store directory)."""
    return AttachedStore(path, **options)
