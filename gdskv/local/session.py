"""One attached process's connection to a node: its requests, and what it holds.

A :class:`Session` serves one connection of the node's Unix socket in a thread of its own
(:meth:`Session.serve`): it reads a request, validates every field of it, runs it on the
store and answers (:mod:`gdskv.local.protocol`). What the process holds is the session's: the
DRAM values pinned for it to copy out, its room in the read staging area, and the put slots
it is copying into. When the connection ends, however the process ended (``SIGKILL``
included: the kernel closes its socket), every one of them is given back: pins released,
staging freed, slots aborted (an uncommitted value is never seen by anyone).

A request that is not well formed gets an :data:`~gdskv.local.protocol.ERROR` reply and
changes nothing; the session goes on. One that cannot be answered in order (a malformed
fire-and-forget message, a header announcing more than
:data:`~gdskv.local.protocol.MAX_REQUEST_BYTES`) gets an ERROR frame and the connection is
closed. A fault of the store (full, closed) is an ERROR reply naming it.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable, Dict, List, Optional, Tuple

from gdskv.errors import GdskvError, ProtocolError
from gdskv.local import protocol as p
from gdskv.local.reach import NoReach
from gdskv.local.staging import ReadStaging
from gdskv.store.reads import PinnedValue
from gdskv.store.writes import PutSlot

log = logging.getLogger(__name__)


class Session:
    """Serves one attached connection (see the module docstring)."""

    def __init__(
        self, store: Any, staging: ReadStaging, sock: socket.socket, *, peer: str,
        welcome: Callable[[], Tuple[bytes, List[int]]], on_end: Callable[["Session"], None],
        server_stats: Callable[[], Dict[str, Any]] = dict, reach: Any = None,
    ) -> None:
        """``welcome()``: the body and descriptors of the handshake's reply; ``on_end``:
        called once the session has given everything back; ``server_stats()``: the socket's
        figures, sent under ``"local"`` in a STATS reply; ``reach``: what lies beyond the store
        (:mod:`gdskv.local.reach`; default: nothing)."""
        self.store = store
        self.staging = staging
        self.sock = sock
        self.peer = peer
        self._welcome = welcome
        self._on_end = on_end
        self._server_stats = server_stats
        self.reach = reach if reach is not None else NoReach()
        self._next_id = 0
        self.pins: Dict[int, PinnedValue] = {}
        self.staged: Dict[int, int] = {}  # id -> offset in the staging area
        self.slots: Dict[int, PutSlot] = {}
        self._reader = p.FrameReader(sock)
        self._handlers = {
            p.GET: self._get, p.RESERVE: self._reserve, p.COMMIT: self._commit, p.EXISTS: self._exists,
            p.REMOVE: self._remove, p.STATS: self._stats, p.RELEASE: self._release, p.ABORT: self._abort,
            p.FLUSH: self._flush,
        }

    # ------------------------------------------------------------------ the loop

    def serve(self) -> None:
        """Handshake, then requests until the connection ends; then give everything back."""
        try:
            if self._handshake():
                while True:
                    try:
                        op, body = self._reader.read(limit=p.MAX_REQUEST_BYTES)
                    except ProtocolError as exc:
                        self._refuse(exc)
                        return
                    if not self._handle(op, body):
                        return
        except (p.Disconnected, OSError):
            pass  # the process is gone (or closed its end): nothing to answer
        finally:
            self._end()

    def _handshake(self) -> bool:
        op, body = self._reader.read(limit=4096)
        if op != p.HELLO or len(body) != p.HELLO_BODY.size:
            self._refuse(ProtocolError("the first message must be HELLO", op=op, length=len(body)))
            return False
        magic, version, _destinations = p.HELLO_BODY.unpack(body)
        if magic != p.MAGIC:
            self._refuse(ProtocolError("not a gdskv client (bad magic)", got=magic))
            return False
        if version != p.VERSION:
            from gdskv.errors import FormatVersionError

            self._refuse(FormatVersionError(
                f"this node speaks attach protocol version {p.VERSION}, the client {version}: "
                "use gdskv of the same version on both sides", node_version=p.VERSION, client_version=version,
            ))
            return False
        reply, fds = self._welcome()
        socket.send_fds(self.sock, [b"".join(p.frame(p.OK, reply))], fds)
        return True

    def _handle(self, op: int, body: memoryview) -> bool:
        """Run one request; False when the connection must end."""
        handler = self._handlers.get(op)
        if handler is None:
            self._reply_error(ProtocolError("unknown operation", op=op))
            return True
        try:
            reply = handler(body)
        except (GdskvError, ValueError, TypeError) as exc:  # ValueError: a bad value for the store
            if op in p.NO_REPLY:
                self._refuse(exc)
                return False
            self._reply_error(exc)
            return True
        if op not in p.NO_REPLY:
            p.send_frame(self.sock, p.OK, *reply)
        return True

    def _reply_error(self, exc: BaseException) -> None:
        p.send_frame(self.sock, p.ERROR, p.encode_error(exc))

    def _refuse(self, exc: BaseException) -> None:
        log.warning("gdskv: closing the attached connection of %s: %s", self.peer, exc)
        try:
            self._reply_error(exc)
        except OSError:
            pass

    def _new_id(self) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        return self._next_id

    # ------------------------------------------------------------------ requests

    def _get(self, body: memoryview) -> List[Any]:
        n = p.parse_count(body, 0, p.GET_ITEM.size)
        items = [p.GET_ITEM.unpack_from(body, p.COUNT.size + i * p.GET_ITEM.size) for i in range(n)]
        keys = p.parse_keys(body, p.COUNT.size + n * p.GET_ITEM.size, [length for length, _ in items])
        rooms = [room for _, room in items]
        pins = self.store.pin(keys, rooms)
        table: List[Tuple[int, int, int, int]] = [(p.MISS, 0, 0, 0)] * n
        inline: List[memoryview] = []
        try:
            missing = [i for i, pin in enumerate(pins) if pin is None]
            if missing and self.reach.pull([keys[i] for i in missing]):  # other nodes had some: now here
                for i, pin in zip(missing, self.store.pin([keys[i] for i in missing], [rooms[i] for i in missing])):
                    pins[i] = pin
            later = [i for i, pin in enumerate(pins) if pin is not None and not pin.in_dram]
            if later:
                inline = self._read_elsewhere(keys, pins, later, table)
        except BaseException:  # the pins are not handed out: give them back
            self.store.unpin([pin for pin in pins if pin is not None and pin.in_dram])
            raise
        for i, pin in enumerate(pins):
            if pin is not None and pin.in_dram:
                pid = self._new_id()
                self.pins[pid] = pin
                table[i] = (p.IN_ARENA, pin.offset, pin.size, pid)
        out = bytearray(n * p.GET_REPLY_ITEM.size)
        for i, row in enumerate(table):
            p.GET_REPLY_ITEM.pack_into(out, i * p.GET_REPLY_ITEM.size, *row)
        return [out, *inline]

    def _read_elsewhere(self, keys: List[bytes], pins: List[Optional[PinnedValue]], idx: List[int], table: List[Any]) -> List[memoryview]:
        """Read the values of ``idx`` that are in HBM or on NVMe into staging room (into a
        buffer of their own, sent inline, where the staging area is full)."""
        offsets: List[Optional[int]] = []
        outs: List[memoryview] = []
        for i in idx:
            size = pins[i].size  # type: ignore[union-attr]
            offset = self.staging.allocate(size)
            offsets.append(offset)
            outs.append(self.staging.view(offset, size) if offset is not None else memoryview(bytearray(size)))
        try:
            sizes = self.store.batch_get_into([keys[i] for i in idx], outs)
        except BaseException:
            for offset in offsets:
                if offset is not None:
                    self.staging.free(offset)
            raise
        inline = []
        for i, offset, out, size in zip(idx, offsets, outs, sizes):
            if size is None:  # removed meanwhile: a miss
                if offset is not None:
                    self.staging.free(offset)
            elif offset is not None:
                sid = self._new_id()
                self.staged[sid] = offset
                table[i] = (p.IN_STAGING, offset, size, sid)
            else:
                table[i] = (p.INLINE, 0, size, 0)
                inline.append(out[:size])
        return inline

    def _release(self, body: memoryview) -> List[Any]:
        ids = self._ids(body, lambda i: i in self.pins or i in self.staged)
        pins = [self.pins.pop(i) for i in ids if i in self.pins]
        for i in ids:
            if i in self.staged:
                self.staging.free(self.staged.pop(i))
        if pins:
            self.store.unpin(pins)
        return []

    def _reserve(self, body: memoryview) -> List[Any]:
        if len(body) < p.RESERVE_HEAD.size:
            raise ProtocolError("a RESERVE too short for its head", got=len(body))
        overwrite, _ = p.RESERVE_HEAD.unpack_from(body)
        if overwrite not in (0, 1):
            raise ProtocolError("overwrite must be 0 or 1", got=overwrite)
        n = p.parse_count(body, 1, p.RESERVE_ITEM.size)
        base = p.RESERVE_HEAD.size
        items = [p.RESERVE_ITEM.unpack_from(body, base + i * p.RESERVE_ITEM.size) for i in range(n)]
        keys = p.parse_keys(body, base + n * p.RESERVE_ITEM.size, [length for length, _, _ in items])
        rows: List[Tuple[int, int, int]] = []
        error = b""
        for key, (_, size, crc) in zip(keys, items):
            try:
                slot = self.store.reserve(key, size, crc, overwrite=bool(overwrite))
            except GdskvError as exc:
                error = p.encode_error(exc)
                break
            if slot is None:
                rows.append((p.STORED, 0, 0))
            else:
                sid = self._new_id()
                self.slots[sid] = slot
                rows.append((p.SLOT, slot.offset, sid))
        out = bytearray(p.COUNT.size + len(rows) * p.RESERVE_REPLY_ITEM.size)
        p.COUNT.pack_into(out, 0, len(rows))
        for i, row in enumerate(rows):
            p.RESERVE_REPLY_ITEM.pack_into(out, p.COUNT.size + i * p.RESERVE_REPLY_ITEM.size, *row)
        return [out, p.COUNT.pack(len(error)), error] if len(rows) < n else [out]

    def _commit(self, body: memoryview) -> List[Any]:
        ids = self._ids(body, lambda i: i in self.slots)
        return [bytes(int(self.slots.pop(i).commit()) for i in ids)]

    def _abort(self, body: memoryview) -> List[Any]:
        for i in self._ids(body, lambda i: i in self.slots):
            self.slots.pop(i).abort()
        return []

    def _ids(self, body: memoryview, known: Callable[[int], bool]) -> List[int]:
        """The ids of a RELEASE, COMMIT or ABORT, all known to this session (checked before
        any is acted on) and none twice."""
        n = p.parse_count(body, 0, p.ID.size)
        if len(body) != p.COUNT.size + n * p.ID.size:
            raise ProtocolError("a request whose length does not match its items", items=n, got=len(body))
        ids = [i for (i,) in p.ID.iter_unpack(body[p.COUNT.size :])]
        unknown = [i for i in ids if not known(i)]
        if unknown or len(set(ids)) != len(ids):
            raise ProtocolError("ids this connection does not hold (or one twice)", unknown=unknown[:8], items=n)
        return ids

    def _keys_only(self, body: memoryview) -> List[bytes]:
        n = p.parse_count(body, 0, p.KEY_LEN.size)
        lengths = [p.KEY_LEN.unpack_from(body, p.COUNT.size + i * p.KEY_LEN.size)[0] for i in range(n)]
        return p.parse_keys(body, p.COUNT.size + n * p.KEY_LEN.size, lengths)

    def _exists(self, body: memoryview) -> List[Any]:
        keys = self._keys_only(body)
        found = self.store.batch_exists(keys)
        missing = [i for i, here in enumerate(found) if not here]
        if missing:
            for i, there in zip(missing, self.reach.exists([keys[i] for i in missing])):
                found[i] = there
        return [bytes(int(b) for b in found)]

    def _remove(self, body: memoryview) -> List[Any]:
        return [bytes(int(b) for b in self.reach.remove(self.store, self._keys_only(body)))]

    def _stats(self, body: memoryview) -> List[Any]:
        if len(body):
            raise ProtocolError("STATS takes no body", got=len(body))
        return [p.dumps({**self.store.stats(), "local": self._server_stats()})]

    def _flush(self, body: memoryview) -> List[Any]:
        if len(body) != p.SECONDS.size:
            raise ProtocolError("FLUSH takes one timeout", got=len(body))
        (timeout,) = p.SECONDS.unpack(body)
        self.store.flush(None if timeout < 0 else timeout)  # (a bad number: the store's own error)
        return []

    # ------------------------------------------------------------------ the end

    def _end(self) -> None:
        """Give back everything the connection held; safe however the loop ended."""
        try:
            pins, self.pins = list(self.pins.values()), {}
            if pins:
                self.store.unpin(pins)
            for offset in self.staged.values():
                self.staging.free(offset)
            self.staged = {}
            for slot in self.slots.values():
                slot.abort()
            self.slots = {}
        finally:
            try:
                self.sock.close()
            finally:
                self._on_end(self)

    def shutdown(self) -> None:
        """End the connection from the node's side (the serving thread then cleans up)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def holding(self) -> Dict[str, int]:
        return {"pins": len(self.pins), "staged": len(self.staged), "slots": len(self.slots)}
