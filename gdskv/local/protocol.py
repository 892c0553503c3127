"""The wire format between a node and the processes attached to it over its Unix socket.

Only control messages cross the socket; values are copied through shared memory (the node's
DRAM arena and a read staging area, both memfds passed at the handshake with
``SCM_RIGHTS``). Every message is one frame: a header :data:`HEADER` (body length ``u32``,
then a code ``u8``: the operation in a request, :data:`OK` or :data:`ERROR` in a reply),
then the body. Integers are little-endian. A request is answered in order, except the
fire-and-forget ones (:data:`RELEASE`, :data:`ABORT`), which get no reply.

Handshake: the client's first frame is :data:`HELLO` (:data:`HELLO_BODY`: magic, protocol
version, the destinations it can take); the node answers :data:`OK` with
:data:`WELCOME_BODY` and a JSON description, the two descriptors riding on that reply, or
:data:`ERROR` (another protocol version: :class:`FormatVersionError`), and closes.

Requests and their replies (``n`` items; keys travel after the fixed-size items, in order):

========== ======================================================== =========================================
op         request body                                             reply body
========== ======================================================== =========================================
GET        ``u32 n``, n x (``u16`` key length, ``u64`` room), keys  n x (``u8`` kind, ``u64`` offset, ``u64``
                                                                    size, ``u32`` pin); then the bytes of the
                                                                    INLINE values, in order
RELEASE    ``u32 n``, n x ``u32`` pin                               (none)
RESERVE    ``u8`` overwrite, ``u32 n``, n x (``u16`` key length,    ``u32 m``, m x (``u8`` kind, ``u64``
           ``u64`` size, ``u32`` crc), keys                         offset, ``u32`` slot); when m < n, the
                                                                    error of item m (``u32`` length, JSON)
COMMIT     ``u32 n``, n x ``u32`` slot                              n x ``u8`` (1: committed, 0: dropped)
ABORT      ``u32 n``, n x ``u32`` slot                              (none)
EXISTS     ``u32 n``, n x ``u16`` key length, keys                  n x ``u8``
REMOVE     ``u32 n``, n x ``u16`` key length, keys                  n x ``u8``
STATS      (empty)                                                  JSON
FLUSH      ``f64`` timeout in seconds (negative: none)                  (empty), once every queued offload is on SSD
========== ======================================================== =========================================

An :data:`ERROR` reply's body is JSON: ``{"type": <GdskvError subclass>, "message", "context"}``.
GET kinds: :data:`MISS`, :data:`IN_ARENA` (pinned at ``offset`` of the arena until
RELEASEd), :data:`IN_STAGING` (at ``offset`` of the staging area, held until RELEASEd),
:data:`INLINE` (the bytes follow the table: no shared room was free). RESERVE kinds:
:data:`STORED` (these bytes are stored already: nothing to copy), :data:`SLOT` (copy the
value to ``offset`` of the arena, then COMMIT or ABORT the slot).

Destinations (:data:`DEST_HOST`) leave room for device memory (CUDA IPC handles) later: a
client names the kinds it can take in HELLO, and a node that does not know one ignores it.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Dict, List, Tuple, Type

from gdskv import errors
from gdskv.errors import GdskvError, ProtocolError

#: The socket's name in a store directory, when no path is given.
SOCKET_NAME = "node.sock"
#: Longest path a Unix socket can be bound to (``sun_path``, less its terminating zero).
MAX_SOCKET_PATH = 107
#: Version of this protocol; a node refuses a client of another.
VERSION = 1
MAGIC = b"gdskv-lc"

HEADER = struct.Struct("<IB")
HELLO_BODY = struct.Struct("<8sHH")  # magic, version, destination kinds (bit set)
WELCOME_BODY = struct.Struct("<HQQ")  # version, arena bytes, staging bytes (then JSON)
COUNT = struct.Struct("<I")
GET_ITEM = struct.Struct("<HQ")
GET_REPLY_ITEM = struct.Struct("<BQQI")
RESERVE_HEAD = struct.Struct("<BI")
RESERVE_ITEM = struct.Struct("<HQI")
RESERVE_REPLY_ITEM = struct.Struct("<BQI")
KEY_LEN = struct.Struct("<H")
ID = struct.Struct("<I")
SECONDS = struct.Struct("<d")

# requests
HELLO, GET, RELEASE, RESERVE, COMMIT, ABORT, EXISTS, REMOVE, STATS, FLUSH = range(1, 11)
#: Requests the node does not answer.
NO_REPLY = frozenset({RELEASE, ABORT})
# replies
OK, ERROR = 0, 1
# GET kinds
MISS, IN_ARENA, IN_STAGING, INLINE = 0, 1, 2, 3
# RESERVE kinds
STORED, SLOT = 0, 1
# destination kinds a client can take
DEST_HOST = 1

#: Most items in one request; a larger batch is split by the client.
MAX_ITEMS = 4096
#: Longest key (as in every store).
MAX_KEY = 4096
#: Largest request body a node reads; a larger header is refused and the connection closed.
MAX_REQUEST_BYTES = MAX_ITEMS * (GET_ITEM.size + MAX_KEY) + 64


class Disconnected(Exception):
    """The peer closed the connection (or it broke) in the middle of a frame, or between two."""


def recv_exact(sock: socket.socket, n: int) -> memoryview:
    """Read exactly ``n`` bytes. Raises :class:`Disconnected` when the peer goes first."""
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise Disconnected(f"the peer closed the connection after {got} of {n} bytes")
        got += r
    return view


class FrameReader:
    """Reads frames from a stream socket with as few ``recv`` calls as the data allows: what
    one ``recv`` brings beyond a frame is kept for the next. A body is valid until the next
    :meth:`read`."""

    def __init__(self, sock: socket.socket, size: int = 256 << 10) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def _fill(self, need: int) -> None:
        """Have at least ``need`` unread bytes buffered (``need`` <= the buffer's size)."""
        if self._start + need > len(self._buf):  # move what is unread to the front
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        while self._end - self._start < need:
            r = self.sock.recv_into(self._view[self._end :])
            if r == 0:
                raise Disconnected(f"the peer closed the connection after {self._end - self._start} of {need} bytes")
            self._end += r

    def read(self, *, limit: int = 1 << 62) -> Tuple[int, memoryview]:
        """One frame: ``(code, body)``. A header announcing more than ``limit`` bytes raises
        :class:`ProtocolError` before any of them is read."""
        self._fill(HEADER.size)
        length, code = HEADER.unpack_from(self._buf, self._start)
        if length > limit:
            raise ProtocolError("a request larger than the node reads", length=length, limit=limit)
        self._start += HEADER.size
        if length <= len(self._buf):
            self._fill(length)
            body = self._view[self._start : self._start + length]
            self._start += length
            return code, body
        # A frame larger than the buffer: a buffer of its own, grown as its bytes arrive (never
        # allocated on the header's word alone).
        out = bytearray(self._view[self._start : self._end])
        self._start = self._end = 0
        while len(out) < length:
            chunk = self.sock.recv(min(1 << 20, length - len(out)))
            if not chunk:
                raise Disconnected(f"the peer closed the connection after {len(out)} of {length} bytes")
            out += chunk
        return code, memoryview(out)


def frame(code: int, *parts: "bytes | bytearray | memoryview") -> List["bytes | bytearray | memoryview"]:
    """The pieces of one frame, for ``sock.sendmsg``."""
    return [HEADER.pack(sum(len(p) for p in parts), code), *parts]


def send_frame(sock: socket.socket, code: int, *parts: "bytes | bytearray | memoryview") -> None:
    send_pieces(sock, frame(code, *parts))


#: Frames up to this size are joined and sent with one ``sendall``; larger ones (inline
#: values) go with ``sendmsg``, without a copy.
JOIN_BYTES = 64 << 10


def send_pieces(sock: socket.socket, pieces: List["bytes | bytearray | memoryview"]) -> None:
    """Send every byte of ``pieces`` in order, in one system call where the socket takes it."""
    if sum(map(len, pieces)) <= JOIN_BYTES:
        sock.sendall(b"".join(pieces))
        return
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def encode_error(exc: BaseException) -> bytes:
    """The JSON body of an ERROR reply for ``exc``."""
    if isinstance(exc, GdskvError):
        context = {k: _jsonable(v) for k, v in exc.context.items()}
        return json.dumps({"type": type(exc).__name__, "message": exc.message, "context": context}).encode()
    return json.dumps({"type": "GdskvError", "message": f"the node failed: {type(exc).__name__}: {exc}", "context": {}}).encode()


def decode_error(body: "bytes | memoryview") -> GdskvError:
    """The :class:`GdskvError` an ERROR reply describes (its own subclass where it is one of
    gdskv's)."""
    try:
        doc = json.loads(bytes(body))
        cls: Type[GdskvError] = getattr(errors, str(doc.get("type")), GdskvError)
        if not (isinstance(cls, type) and issubclass(cls, GdskvError)):
            cls = GdskvError
        return cls(str(doc.get("message", "the node refused the request")), **dict(doc.get("context") or {}))
    except (ValueError, TypeError, AttributeError):
        return ProtocolError("an error reply that cannot be read", body=bytes(body[:200]))


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return str(value)


def parse_keys(body: memoryview, at: int, lengths: List[int]) -> List[bytes]:
    """The keys that follow the fixed-size items of a request, from offset ``at``; the body
    must end with them. Raises :class:`ProtocolError` on anything else."""
    keys = []
    for n in lengths:
        if not 1 <= n <= MAX_KEY:
            raise ProtocolError("a key length out of range", got=n, max=MAX_KEY)
        keys.append(bytes(body[at : at + n]))
        at += n
    if at != len(body):
        raise ProtocolError("a request whose length does not match its items", expected=at, got=len(body))
    return keys


def parse_count(body: memoryview, at: int, item_size: int) -> int:
    """The item count at ``at``, checked against :data:`MAX_ITEMS` and the body's length."""
    if len(body) < at + COUNT.size:
        raise ProtocolError("a request too short for its item count", got=len(body))
    (n,) = COUNT.unpack_from(body, at)
    if n > MAX_ITEMS:
        raise ProtocolError("too many items in one request", got=n, max=MAX_ITEMS)
    if len(body) < at + COUNT.size + n * item_size:
        raise ProtocolError("a request too short for its items", items=n, got=len(body))
    return n


def dumps(doc: Dict[str, Any]) -> bytes:
    return json.dumps(doc, default=_jsonable).encode()
