"""The TCP data-plane server: one thread per connection, requests served in order.

A request is read whole (header, item table, keys; for WRITE the values straight into a
per-connection staging buffer) and validated before the :class:`Provider` sees it. READ
values go out with one ``sendmsg`` per group of items, straight from the provider's buffers
(pinned DRAM views, or the staging buffer NVMe values were read into).

Faults never take the server down: a malformed or oversized request is answered with an
error status and the connection is closed (its framing can no longer be trusted); a client
that disconnects mid-request only ends its own connection. Counters in :meth:`stats`.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from typing import Dict, List, Optional

from gdskv.errors import GdskvError, PeerDisconnectedError, ProtocolError, TransportError
from gdskv.transport.base import DataServer, Provider, ServedItem, Staging
from gdskv.transport.frames import (
    REQUEST,
    ItemStatus,
    Limits,
    LimitError,
    Op,
    Status,
    decode_request_body,
    decode_request_header,
    encode_item,
    encode_response,
    encode_statuses,
)
from gdskv.transport.sockio import recv_bytes, recv_exact, recv_header_or_eof, send_buffers, set_deadline, tune

log = logging.getLogger(__name__)


class TcpServer(DataServer):
    """Serves ``provider`` on ``listen`` ("host:port"; port 0 picks a free port)."""

    def __init__(
        self,
        provider: Provider,
        listen: str = "127.0.0.1:0",
        *,
        limits: Optional[Limits] = None,
        timeout_s: float = 60.0,
        staging_keep_bytes: int = 64 << 20,
    ) -> None:
        self.provider = provider
        self.limits = limits or Limits()
        self.timeout_s = timeout_s
        self.staging_keep_bytes = staging_keep_bytes
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise TransportError("listen address must be host:port", got=listen)
        self._host, self._port = host, int(port)
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._conns: Dict[socket.socket, threading.Thread] = {}
        self._accepter: Optional[threading.Thread] = None
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.address = ""

    def start(self) -> str:
        try:
            self._sock = socket.create_server((self._host, self._port), backlog=128)
        except OSError as exc:
            raise TransportError(f"cannot listen: {exc.strerror or exc}", address=f"{self._host}:{self._port}") from None
        self.address = f"{self._host}:{self._sock.getsockname()[1]}"
        self._accepter = threading.Thread(target=self._accept_loop, name="gdskv-data-accept", daemon=True)
        self._accepter.start()
        return self.address

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            tune(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"), name="gdskv-data-conn", daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns[conn] = thread
                self.counters["connections"] += 1
            thread.start()

    # ------------------------------------------------------------------ one connection

    def _serve(self, conn: socket.socket, peer: str) -> None:
        staging = Staging(self.staging_keep_bytes)
        try:
            while not self._closed:
                set_deadline(conn, None)  # idle between requests: wait as long as the client likes
                header = recv_header_or_eof(conn, REQUEST.size, peer=peer)
                if header is None:
                    return
                set_deadline(conn, self.timeout_s)
                if not self._handle(conn, peer, header, staging):
                    return
                staging.shrink(self.staging_keep_bytes)
        except PeerDisconnectedError as exc:
            self.counters["disconnects"] += 1
            log.debug("gdskv-data: %s", exc)
        except TransportError as exc:
            self.counters["transport_errors"] += 1
            log.debug("gdskv-data: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass

    def _handle(self, conn: socket.socket, peer: str, header: bytearray, staging: Staging) -> bool:
        """Serve one request; False when the connection must close."""
        request_id = 0
        started = [False]  # whether response bytes went out (no error frame possible then)
        try:
            op, request_id, count, body_len = decode_request_header(header, self.limits)
            body = recv_bytes(conn, body_len, peer=peer, what="request body")
            keys, sizes, crcs = decode_request_body(body, count, self.limits)
            if op in Op._value2member_map_:
                self.counters[f"op_{Op(op).name.lower()}"] += 1  # before replying: a client sees it counted
            if op == Op.READ:
                self._read(conn, peer, request_id, keys, sizes, staging, started)
            elif op == Op.WRITE:
                self._write(conn, peer, request_id, keys, sizes, crcs, staging)
            elif op == Op.REMOVE:
                self._reply_statuses(conn, peer, request_id, self.provider.remove(keys))
            elif op == Op.PULL:
                self._reply_statuses(conn, peer, request_id, self.provider.pull(keys))
            elif op == Op.PING:
                send_buffers(conn, [encode_response(Status.OK, request_id, 0)], peer=peer)
            else:
                self._refuse(conn, peer, request_id, Status.UNSUPPORTED, f"unknown op {op}")
                return False
            return True
        except LimitError as exc:
            self._refuse(conn, peer, request_id, Status.TOO_LARGE, str(exc))
        except ProtocolError as exc:
            self._refuse(conn, peer, request_id, Status.BAD_REQUEST, str(exc))
        except (PeerDisconnectedError, TransportError):
            raise
        except Exception as exc:  # a provider fault: report it, keep the server up
            log.warning("gdskv-data: request from %s failed: %s", peer, exc, exc_info=not isinstance(exc, GdskvError))
            self.counters["internal_errors"] += 1
            if not started[0]:
                self._refuse(conn, peer, request_id, Status.INTERNAL, f"{type(exc).__name__}: {exc}")
        return False

    def _refuse(self, conn: socket.socket, peer: str, request_id: int, status: Status, message: str) -> None:
        self.counters[f"refused_{status.name.lower()}"] += 1
        log.info("gdskv-data: refusing a request from %s: %s", peer, message)
        try:
            send_buffers(conn, [encode_response(status, request_id, 0, message.encode()[: 1 << 16])], peer=peer)
            _linger(conn)
        except (TransportError, OSError):
            pass

    def _read(
        self, conn: socket.socket, peer: str, request_id: int, keys: List[bytes], rooms: List[int],
        staging: Staging, started: List[bool],
    ) -> None:
        limit = self.limits.max_value_bytes
        rooms = [min(r, limit) for r in rooms]
        seen = bytearray(len(keys))
        served = 0
        groups = self.provider.read(keys, rooms, staging)
        try:
            buffers: List[object] = [encode_response(Status.OK, request_id, len(keys))]
            for group in groups:
                for item in group:
                    if not 0 <= item.index < len(keys) or seen[item.index]:
                        raise ProtocolError("provider served an item twice or out of range", index=item.index)
                    seen[item.index] = 1
                    buffers.extend(_item_buffers(item))
                    if item.status == ItemStatus.OK:
                        served += 1
                started[0] = True
                send_buffers(conn, buffers, peer=peer)
                buffers = []
            missing = [i for i in range(len(keys)) if not seen[i]]
            buffers.extend(encode_item(ItemStatus.MISS, 0, i, 0, 0) for i in missing)
            started[0] = True
            send_buffers(conn, buffers, peer=peer)
        finally:
            groups.close()  # releases pinned DRAM entries
        self.counters["items_served"] += served
        self.counters["items_missed"] += len(keys) - served

    def _write(
        self, conn: socket.socket, peer: str, request_id: int, keys: List[bytes], sizes: List[int],
        crcs: List[int], staging: Staging,
    ) -> None:
        limits = self.limits
        for key, size in zip(keys, sizes):
            if size == 0 or size > limits.max_value_bytes:
                raise LimitError("value size out of range", key=key[:64], size=size, limit=limits.max_value_bytes)
        total = sum(sizes)
        if total > limits.max_write_bytes:
            raise LimitError("write request too large", got=total, limit=limits.max_write_bytes)
        buf = staging.get(total)
        recv_exact(conn, buf, peer=peer, what="value")
        views: List[memoryview] = []
        pos = 0
        for size in sizes:
            views.append(buf[pos : pos + size])
            pos += size
        statuses = self.provider.write(keys, views, crcs)
        self._reply_statuses(conn, peer, request_id, statuses)

    def _reply_statuses(self, conn: socket.socket, peer: str, request_id: int, statuses: List[ItemStatus]) -> None:
        send_buffers(conn, [encode_response(Status.OK, request_id, len(statuses)), encode_statuses(statuses)], peer=peer)

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict:
        with self._lock:
            return {"address": self.address, "open_connections": len(self._conns), **self.counters}

    def close(self) -> None:
        """Stop accepting, break every open connection, wait for their threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.items())
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accepter is not None:
            self._accepter.join(timeout=5)
        for _, thread in conns:
            thread.join(timeout=5)


def _linger(conn: socket.socket, limit: int = 1 << 20, timeout_s: float = 0.2) -> None:
    """Half-close, then drain what the client still sends (briefly), so that the error frame
    is not lost to a reset caused by unread request bytes."""
    conn.shutdown(socket.SHUT_WR)
    set_deadline(conn, timeout_s)
    drained = 0
    try:
        while drained < limit:
            chunk = conn.recv(65536)
            if not chunk:
                return
            drained += len(chunk)
    except OSError:
        return


def _item_buffers(item: ServedItem) -> List[object]:
    if item.status == ItemStatus.OK and item.view is not None:
        return [encode_item(ItemStatus.OK, item.tier, item.index, item.view.nbytes, item.crc), item.view]
    return [encode_item(item.status, item.tier, item.index, item.size, 0)]
