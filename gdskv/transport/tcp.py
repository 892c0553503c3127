"""The TCP data-plane client: pooled connections per peer, batches split across them.

A READ sends one request per part of a batch and receives each value with ``recv_into``
straight into the caller's buffer. A batch larger than ``split_bytes`` is cut into parts
sent over up to ``connections`` connections at once, and batches to several peers run in
parallel (:meth:`TcpTransport.read_many`). With ``verify`` (the default) every value is
checked against the CRC32C its owner keeps for it.

A connection is reused only after a complete, well-formed exchange; any fault closes it. A
request that fails on a reused connection before any reply arrived (the peer closed it while
idle) is retried once on a fresh one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from gdskv.errors import (
    CorruptionError,
    GdskvError,
    InvalidValueError,
    PeerDisconnectedError,
    ProtocolError,
    RemoteError,
    TransportError,
)
from gdskv.transport.base import Transport
from gdskv.transport.frames import (
    ITEM_REPLY,
    RESPONSE,
    ItemStatus,
    Op,
    Status,
    decode_item,
    decode_response_header,
    decode_statuses,
    encode_request,
    value_crc,
)
from gdskv.transport.sockio import recv_bytes, recv_exact, send_buffers, set_deadline, tune

log = logging.getLogger(__name__)

T = TypeVar("T")
#: Per-key outcome of a read: the size, None (a clean miss), or the error for that key.
Outcome = Union[int, None, GdskvError]


class _Conn:
    __slots__ = ("sock", "peer", "reused")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.reused = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Pool:
    """Idle connections to one peer."""

    def __init__(self, peer: str, keep: int) -> None:
        self.peer = peer
        self.keep = keep
        self.idle: List[_Conn] = []
        self.lock = threading.Lock()


class _Retry(Exception):
    """Internal: the request failed on a reused connection before any reply; try once more."""


class TcpTransport(Transport):
    """Client of :class:`gdskv.transport.tcp_server.TcpServer`. Thread-safe."""

    name = "tcp"

    def __init__(
        self,
        *,
        connections: int = 4,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        verify: bool = True,
        split_bytes: int = 8 << 20,
        max_keys: int = 65536,
    ) -> None:
        if connections < 1:
            raise InvalidValueError("connections must be >= 1", got=connections)
        self.connections = connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.verify = verify
        self.split_bytes = split_bytes
        self.max_keys = max_keys
        self._pools: Dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=4 * connections, thread_name_prefix="gdskv-tcp")
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ public API

    def read(self, address: str, keys: Sequence[bytes], outs: Sequence[memoryview]) -> List[Optional[int]]:
        outcomes = self.read_many([(address, keys, outs)])[0]
        for outcome in outcomes:
            if isinstance(outcome, GdskvError):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def read_many(
        self, requests: Sequence[Tuple[str, Sequence[bytes], Sequence[memoryview]]]
    ) -> List[List[Outcome]]:
        """Several peers at once: per request, per key, the size, None, or the key's error."""
        results: List[List[Outcome]] = [[None] * len(keys) for _, keys, _ in requests]
        parts: List[Tuple[int, str, Sequence[bytes], Sequence[memoryview], int, int]] = []
        for r, (address, keys, outs) in enumerate(requests):
            if len(keys) != len(outs):
                raise InvalidValueError("keys and outs differ in length", keys=len(keys), outs=len(outs))
            for lo, hi in self._split(outs):
                parts.append((r, address, keys, outs, lo, hi))
        futures = [self._executor.submit(self._read_part, *p[1:]) for p in parts[1:]]
        done = [self._guard(self._read_part, *parts[0][1:])] if parts else []
        done += [f.result() for f in futures]
        for (r, _, _, _, lo, hi), outcome in zip(parts, done):
            if isinstance(outcome, GdskvError):
                results[r][lo:hi] = [outcome] * (hi - lo)
            else:
                results[r][lo:hi] = outcome
        return results

    def write(
        self, address: str, keys: Sequence[bytes], values: Sequence[memoryview], crcs: Sequence[int]
    ) -> List[ItemStatus]:
        sizes = [v.nbytes for v in values]
        statuses: List[ItemStatus] = []
        for lo, hi in self._split_write(sizes):
            statuses += self._call(address, lambda c: self._exchange_statuses(
                c, Op.WRITE, keys[lo:hi], sizes[lo:hi], crcs[lo:hi], values[lo:hi]))
        return statuses

    def remove(self, address: str, keys: Sequence[bytes]) -> List[bool]:
        out: List[bool] = []
        for lo in range(0, len(keys), self.max_keys):
            part = keys[lo : lo + self.max_keys]
            zeros = [0] * len(part)
            statuses = self._call(address, lambda c: self._exchange_statuses(c, Op.REMOVE, part, zeros, zeros))
            out += [s == ItemStatus.OK for s in statuses]
        return out

    def pull(self, address: str, keys: Sequence[bytes]) -> List[ItemStatus]:
        out: List[ItemStatus] = []
        for lo in range(0, len(keys), self.max_keys):
            part = keys[lo : lo + self.max_keys]
            zeros = [0] * len(part)
            out += self._call(address, lambda c: self._exchange_statuses(c, Op.PULL, part, zeros, zeros))
        return out

    def ping(self, address: str) -> None:
        self._call(address, lambda c: self._exchange_statuses(c, Op.PING, [], [], []))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"peers": len(self._pools), **self.counters}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pools = list(self._pools.values())
        self._executor.shutdown(wait=True)
        for pool in pools:
            with pool.lock:
                for conn in pool.idle:
                    conn.close()
                pool.idle.clear()

    # ------------------------------------------------------------------ splitting

    def _split(self, outs: Sequence[memoryview]) -> List[Tuple[int, int]]:
        """Contiguous parts: at most ``max_keys`` keys; about ``total / connections`` bytes
        each when the batch is larger than ``split_bytes``."""
        n = len(outs)
        if n == 0:
            return []
        total = sum(o.nbytes for o in outs)
        ways = min(self.connections, max(1, total // self.split_bytes), n)
        target = total / ways
        parts: List[Tuple[int, int]] = []
        lo = 0
        acc = 0
        for i, out in enumerate(outs):
            acc += out.nbytes
            if i + 1 - lo >= self.max_keys or (acc >= target * (len(parts) + 1) and len(parts) < ways - 1):
                parts.append((lo, i + 1))
                lo = i + 1
        if lo < n:
            parts.append((lo, n))
        return parts

    def _split_write(self, sizes: Sequence[int], limit: int = 256 << 20) -> List[Tuple[int, int]]:
        parts: List[Tuple[int, int]] = []
        lo = 0
        acc = 0
        for i, size in enumerate(sizes):
            if i > lo and (acc + size > limit or i - lo >= self.max_keys):
                parts.append((lo, i))
                lo, acc = i, 0
            acc += size
        if lo < len(sizes):
            parts.append((lo, len(sizes)))
        return parts

    # ------------------------------------------------------------------ connections

    def _pool(self, address: str) -> _Pool:
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = _Pool(address, self.connections)
            return pool

    def _acquire(self, pool: _Pool, fresh: bool) -> _Conn:
        if not fresh:
            with pool.lock:
                if pool.idle:
                    conn = pool.idle.pop()
                    conn.reused = True
                    return conn
        host, _, port = pool.peer.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout_s)
        except (OSError, ValueError) as exc:
            self.counters["connect_errors"] += 1
            reason = getattr(exc, "strerror", None) or exc
            raise TransportError(f"cannot connect to peer: {reason}", peer=pool.peer) from None
        tune(sock)
        set_deadline(sock, self.timeout_s)
        self.counters["connects"] += 1
        return _Conn(sock, pool.peer)

    def _release(self, pool: _Pool, conn: _Conn) -> None:
        with pool.lock:
            if not self._closed and len(pool.idle) < pool.keep:
                pool.idle.append(conn)
                return
        conn.close()

    def _call(self, address: str, exchange: Callable[[_Conn], T]) -> T:
        pool = self._pool(address)
        for attempt in (0, 1):
            conn = self._acquire(pool, fresh=attempt > 0)
            try:
                result = exchange(conn)
            except _Retry:
                conn.close()
                self.counters["stale_retries"] += 1
                continue
            except BaseException:
                conn.close()
                raise
            self._release(pool, conn)
            return result
        raise TransportError("peer closed fresh connections before replying", peer=address)  # pragma: no cover

    @staticmethod
    def _guard(fn: Callable[..., T], *args: Any) -> Union[T, GdskvError]:
        try:
            return fn(*args)
        except GdskvError as exc:
            return exc

    # ------------------------------------------------------------------ exchanges

    def _send_request(
        self, conn: _Conn, op: Op, keys: Sequence[bytes], sizes: Sequence[int], crcs: Sequence[int],
        values: Sequence[memoryview] = (),
    ) -> int:
        """Send a request and receive the response header; return the item count."""
        request_id = next(self._ids)
        try:
            send_buffers(conn.sock, [*encode_request(op, request_id, keys, sizes, crcs), *values], peer=conn.peer)
            head = bytearray(RESPONSE.size)
            recv_exact(conn.sock, memoryview(head), peer=conn.peer, what="response header")
        except TransportError as exc:
            if conn.reused and (not isinstance(exc, PeerDisconnectedError) or exc.context.get("got") == 0):
                raise _Retry() from exc
            raise
        status, count, message_len = decode_response_header(head, request_id)
        if status != Status.OK:
            message = recv_bytes(conn.sock, message_len, peer=conn.peer, what="error message").decode("utf-8", "replace")
            name = Status(status).name if status in Status._value2member_map_ else str(status)
            raise RemoteError("peer refused the request", peer=conn.peer, op=op.name, code=name, details=message)
        if count != len(keys):
            raise ProtocolError(
                "response item count differs from the request", peer=conn.peer, expected=len(keys), got=count
            )
        return count

    def _exchange_statuses(
        self, conn: _Conn, op: Op, keys: Sequence[bytes], sizes: Sequence[int], crcs: Sequence[int],
        values: Sequence[memoryview] = (),
    ) -> List[ItemStatus]:
        count = self._send_request(conn, op, keys, sizes, crcs, values)
        if op == Op.PING:
            return []
        raw = recv_bytes(conn.sock, count + 4, peer=conn.peer, what="status table")
        statuses = decode_statuses(raw)
        try:
            return [ItemStatus(s) for s in statuses]
        except ValueError:
            raise ProtocolError("unknown item status", peer=conn.peer) from None

    def _read_part(
        self, address: str, keys: Sequence[bytes], outs: Sequence[memoryview], lo: int, hi: int
    ) -> Union[List[Outcome], GdskvError]:
        try:
            return self._call(address, lambda c: self._exchange_read(c, keys[lo:hi], outs[lo:hi]))
        except GdskvError as exc:
            return exc

    def _exchange_read(self, conn: _Conn, keys: Sequence[bytes], outs: Sequence[memoryview]) -> List[Outcome]:
        rooms = [o.nbytes for o in outs]
        count = self._send_request(conn, Op.READ, keys, rooms, [0] * len(keys))
        results: List[Outcome] = [None] * count
        seen = bytearray(count)
        head = bytearray(ITEM_REPLY.size)
        head_view = memoryview(head)
        sock, peer = conn.sock, conn.peer
        nbytes = 0
        for _ in range(count):
            recv_exact(sock, head_view, peer=peer, what="item header")
            status, _tier, index, size, crc = decode_item(head)
            if index >= count or seen[index]:
                raise ProtocolError("item index out of range or repeated", peer=peer, index=index, count=count)
            seen[index] = 1
            if status == ItemStatus.OK:
                if size > rooms[index]:
                    raise ProtocolError(
                        "peer sent more bytes than there is room for", peer=peer, size=size, room=rooms[index]
                    )
                dest = outs[index][:size]
                recv_exact(sock, dest, peer=peer, what="value")
                nbytes += size
                if self.verify and value_crc(keys[index], dest) != crc:
                    self.counters["corrupt"] += 1
                    log.warning("gdskv-tcp: value of %r from %s failed its checksum", keys[index][:64], peer)
                    results[index] = CorruptionError("value failed its checksum in transit", peer=peer, key=keys[index][:64])
                else:
                    results[index] = size
            elif status == ItemStatus.MISS:
                self.counters["misses"] += 1
            elif status == ItemStatus.TOO_SMALL:
                results[index] = InvalidValueError(
                    "out is smaller than the value", key=keys[index][:64], size=size, got=rooms[index]
                )
            else:
                results[index] = RemoteError(
                    "peer failed to serve the value", peer=peer, key=keys[index][:64], code=int(status)
                )
        self.counters["values"] += sum(1 for r in results if isinstance(r, int))
        self.counters["bytes"] += nbytes
        return results
