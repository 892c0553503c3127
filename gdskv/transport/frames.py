"""Wire format of the TCP data plane. Every length is explicit and every header is checksummed,
so a truncated frame, a peer that disconnects mid-transfer, or bytes out of step are detected
(:class:`PeerDisconnectedError`, :class:`ProtocolError`), never read as data.

Request::

    [REQUEST header][count x ITEM_REQUEST][key bytes ...][u32 crc32c of items + keys]
    [WRITE only: the values, back to back, in item order]

``ITEM_REQUEST`` carries the key length, a size (READ: the room the reader has for the value;
WRITE: the value's length) and, for WRITE, the CRC32C of key + value (the store's checksum),
verified by the node before the value is stored.

Response::

    [RESPONSE header]
    status OK, READ:   count x ([ITEM_REPLY][value bytes if the item is OK]), in any order
                       (``index`` says which key), so DRAM values can go out before NVMe ones
    status OK, others: [count x u8 item status][u32 crc32c of the statuses]
    status not OK:     [message bytes (utf-8)]; then the node closes the connection

A READ item's ``crc`` is the CRC32C of key + value, which the reader may check end to end.
Bump :data:`VERSION` whenever a struct below changes.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import List, Sequence, Tuple

import crc32c as _crc

from gdskv.errors import ProtocolError

VERSION = 1
REQUEST_MAGIC = b"GKVQ"
RESPONSE_MAGIC = b"GKVS"

# magic, version, op, flags, request_id, count, body_len (items + keys + crc), header_crc
REQUEST = struct.Struct("<4sBBHQIQI")
assert REQUEST.size == 32  # bump VERSION when this changes

# key_len, reserved, crc (WRITE), size
ITEM_REQUEST = struct.Struct("<HHIQ")
assert ITEM_REQUEST.size == 16  # bump VERSION when this changes

# magic, version, status, flags, request_id, count, message_len, header_crc
RESPONSE = struct.Struct("<4sBBHQIII")
assert RESPONSE.size == 28  # bump VERSION when this changes

# status, tier, reserved, index, size, crc (key + value), header_crc
ITEM_REPLY = struct.Struct("<BBHIQII")
assert ITEM_REPLY.size == 24  # bump VERSION when this changes

CRC = struct.Struct("<I")


class LimitError(ProtocolError):
    """A well-formed request over one of the node's :class:`Limits` (answered TOO_LARGE)."""


class Op(enum.IntEnum):
    PING = 1
    READ = 2  # serve DRAM / NVMe replicas
    WRITE = 3  # store values (a thin client's put)
    REMOVE = 4  # delete local replicas
    PULL = 5  # fetch keys from the cluster into the node's own store


class Status(enum.IntEnum):
    """Response status (whole request)."""

    OK = 0
    BAD_REQUEST = 1  # malformed: bad magic, version, checksum, lengths
    TOO_LARGE = 2  # over a limit (keys per request, key length, value size, bytes)
    UNSUPPORTED = 3  # unknown op
    INTERNAL = 4  # the node failed while serving


class ItemStatus(enum.IntEnum):
    """Per-item status."""

    OK = 0
    MISS = 1  # not stored here (READ, REMOVE)
    TOO_SMALL = 2  # READ: the reader's room is smaller than the value (no bytes follow)
    EXISTS = 3  # WRITE: a different value is stored under the key
    NO_SPACE = 4  # WRITE: no room in time
    CORRUPT = 5  # WRITE: the value does not match its checksum
    INVALID = 6  # WRITE: value the store refuses (e.g. larger than its DRAM)
    ERROR = 7  # anything else


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What a node accepts in one request; larger requests are refused (TOO_LARGE)."""

    #: Keys per request. Default 65536.
    max_count: int = 65536
    #: Key length in bytes. Default 4096.
    max_key_bytes: int = 4096
    #: Value size in bytes (READ room is clamped to it; WRITE values above are refused).
    #: Default 64 GiB.
    max_value_bytes: int = 64 << 30
    #: Total value bytes of one WRITE request. Default 1 GiB.
    max_write_bytes: int = 1 << 30


def checksum(data: "bytes | memoryview", seed: int = 0) -> int:
    return _crc.crc32c(data, seed)


def value_crc(key: bytes, value: "bytes | memoryview") -> int:
    """CRC32C of key followed by value: the store's per-object checksum."""
    return _crc.crc32c(value, _crc.crc32c(key))


# ---------------------------------------------------------------- requests


def encode_request(op: Op, request_id: int, keys: Sequence[bytes], sizes: Sequence[int], crcs: Sequence[int]) -> List[bytes]:
    """Header, item table + keys + body crc, as buffers to send (values are sent after)."""
    items = b"".join(ITEM_REQUEST.pack(len(k), 0, c, s) for k, s, c in zip(keys, sizes, crcs))
    body = items + b"".join(keys)
    body_crc = CRC.pack(checksum(body))
    body_len = len(body) + CRC.size
    head = REQUEST.pack(REQUEST_MAGIC, VERSION, op, 0, request_id, len(keys), body_len, 0)
    head = head[:-4] + CRC.pack(checksum(head[:-4]))
    return [head, body, body_crc]


def decode_request_header(raw: "bytes | memoryview", limits: Limits) -> Tuple[int, int, int, int]:
    """Validate a request header; return (op, request_id, count, body_len)."""
    magic, version, op, _flags, request_id, count, body_len, crc = REQUEST.unpack(raw)
    if magic != REQUEST_MAGIC:
        raise ProtocolError("bad request magic", got=bytes(magic))
    if checksum(bytes(raw[:-4])) != crc:
        raise ProtocolError("request header checksum mismatch")
    if version != VERSION:
        raise ProtocolError("unsupported data-plane version", supported=VERSION, got=version)
    if count > limits.max_count:
        raise LimitError("too many keys in one request", got=count, limit=limits.max_count)
    max_body = count * (ITEM_REQUEST.size + limits.max_key_bytes) + CRC.size
    if body_len < count * (ITEM_REQUEST.size + 1) + CRC.size:
        raise ProtocolError("request body too short for its keys", got=body_len, count=count)
    if body_len > max_body:
        raise LimitError("request body too long", got=body_len, count=count, limit=max_body)
    return op, request_id, count, body_len


def decode_request_body(body: "bytes | memoryview", count: int, limits: Limits) -> Tuple[List[bytes], List[int], List[int]]:
    """Validate the item table and keys; return (keys, sizes, crcs)."""
    body = memoryview(body)
    if checksum(body[:-4]) != CRC.unpack(body[-4:])[0]:
        raise ProtocolError("request body checksum mismatch")
    table = ITEM_REQUEST.size * count
    keys: List[bytes] = []
    sizes: List[int] = []
    crcs: List[int] = []
    pos = table
    for i in range(count):
        key_len, _reserved, crc, size = ITEM_REQUEST.unpack_from(body, i * ITEM_REQUEST.size)
        if key_len == 0:
            raise ProtocolError("empty key", item=i)
        if key_len > limits.max_key_bytes:
            raise LimitError("key too long", item=i, got=key_len, limit=limits.max_key_bytes)
        if pos + key_len > len(body) - CRC.size:
            raise ProtocolError("keys overrun the request body", item=i)
        keys.append(bytes(body[pos : pos + key_len]))
        pos += key_len
        sizes.append(size)
        crcs.append(crc)
    if pos != len(body) - CRC.size:
        raise ProtocolError("request body has trailing bytes", got=len(body) - CRC.size - pos)
    return keys, sizes, crcs


# ---------------------------------------------------------------- responses


def encode_response(status: Status, request_id: int, count: int, message: bytes = b"") -> bytes:
    head = RESPONSE.pack(RESPONSE_MAGIC, VERSION, status, 0, request_id, count, len(message), 0)
    return head[:-4] + CRC.pack(checksum(head[:-4])) + message


def decode_response_header(raw: "bytes | memoryview", request_id: int) -> Tuple[int, int, int]:
    """Validate a response header; return (status, count, message_len)."""
    magic, version, status, _flags, rid, count, message_len, crc = RESPONSE.unpack(raw)
    if magic != RESPONSE_MAGIC:
        raise ProtocolError("bad response magic", got=bytes(magic))
    if checksum(bytes(raw[:-4])) != crc:
        raise ProtocolError("response header checksum mismatch")
    if version != VERSION:
        raise ProtocolError("unsupported data-plane version", supported=VERSION, got=version)
    if rid != request_id:
        raise ProtocolError("response for another request", expected=request_id, got=rid)
    if message_len > 1 << 20:
        raise ProtocolError("error message too long", got=message_len)
    return status, count, message_len


def encode_item(status: int, tier: int, index: int, size: int, crc: int) -> bytes:
    head = ITEM_REPLY.pack(status, tier, 0, index, size, crc, 0)
    return head[:-4] + CRC.pack(checksum(head[:-4]))


def decode_item(raw: "bytes | memoryview") -> Tuple[int, int, int, int, int]:
    """Validate an item header; return (status, tier, index, size, crc)."""
    status, tier, _reserved, index, size, crc, head_crc = ITEM_REPLY.unpack(raw)
    if checksum(bytes(raw[:-4])) != head_crc:
        raise ProtocolError("item header checksum mismatch")
    return status, tier, index, size, crc


def encode_statuses(statuses: Sequence[int]) -> bytes:
    raw = bytes(statuses)
    return raw + CRC.pack(checksum(raw))


def decode_statuses(raw: "bytes | memoryview") -> List[int]:
    raw = bytes(raw)
    if checksum(raw[:-4]) != CRC.unpack(raw[-4:])[0]:
        raise ProtocolError("status table checksum mismatch")
    return list(raw[:-4])
