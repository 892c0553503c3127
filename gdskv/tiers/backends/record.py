"""On-disk record and index formats shared by the NVMe backends.

A *record* is one object on disk::

    [RecordHeader][key bytes][zero pad to 4 KiB][value bytes][zero pad to 4 KiB]

so every value starts 4 KiB-aligned (O_DIRECT and cuFile can read it in place). The header
carries magic, format version, sequence number, key length, value length, the CRC32C of key
and value, and a CRC32C of the header itself.

An *index* lists the records of one sealed bucket so a store can reopen without reading the
data::

    [IndexHeader][IndexEntry][key bytes][IndexEntry][key bytes]...

Bump :data:`FORMAT_VERSION` whenever a struct below changes; readers refuse newer versions
with :class:`FormatVersionError` and treat unknown magic as corruption.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Iterable, List, Optional

import crc32c as _crc

from gdskv.errors import CorruptionError, FormatVersionError
from gdskv.gds.aligned import AlignedBuffer, alloc_aligned

FORMAT_VERSION = 1
ALIGN = 4096
RECORD_MAGIC = b"GKVR"
INDEX_MAGIC = b"GKVI"

# magic, version, flags, seq, key_len, value_len, crc(key+value), header_crc
RECORD_HEADER = struct.Struct("<4sHHQIQII")
assert RECORD_HEADER.size == 36  # bump FORMAT_VERSION when this changes

# magic, version, flags, bucket_id, count, data_len, entries_crc, header_crc
INDEX_HEADER = struct.Struct("<4sHHQIQII")
assert INDEX_HEADER.size == 36  # bump FORMAT_VERSION when this changes

# value_offset, value_len, seq, crc(key+value), key_len
INDEX_ENTRY = struct.Struct("<QQQII")
assert INDEX_ENTRY.size == 32  # bump FORMAT_VERSION when this changes

#: Record flag: a tombstone (value length 0) that removes its key from an offset-backend
#: store when it is newer than the key's record. Bucket files never hold tombstones.
FLAG_TOMBSTONE = 1

ZERO_PAGE = memoryview(bytes(ALIGN))


def align_up(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


def checksum(key: bytes, value) -> int:
    """CRC32C of the key followed by the value (any buffer)."""
    return _crc.crc32c(value, _crc.crc32c(key))


def head_size(key_len: int) -> int:
    """Bytes from the start of a record to its value."""
    return align_up(RECORD_HEADER.size + key_len)


def record_size(key_len: int, value_len: int) -> int:
    """Bytes a record takes on disk, padding included."""
    return head_size(key_len) + align_up(value_len)


def encode_head(
    key: bytes, value_len: int, seq: int, crc: int, *, flags: int = 0, into: Optional[memoryview] = None
) -> "bytearray | memoryview":
    """The header block of a record: header, key, zero padding up to the value. Written
    into ``into`` (``head_size(len(key))`` zeroed bytes) when given, else a new bytearray;
    returns the block."""
    head = bytearray(head_size(len(key))) if into is None else into
    fields = (RECORD_MAGIC, FORMAT_VERSION, flags, seq, len(key), value_len, crc)
    packed = struct.pack("<4sHHQIQI", *fields)
    RECORD_HEADER.pack_into(head, 0, *fields, _crc.crc32c(packed))
    head[RECORD_HEADER.size : RECORD_HEADER.size + len(key)] = key
    return head


class HeadBlocks:
    """The header blocks of one batch of records, in one page-aligned allocation.

    A record whose value sits page-aligned in memory and fills whole 4 KiB blocks (a KV
    block in the DRAM arena) is then one aligned write, header block and value together:
    the engine sends it from memory as it is, one request to the kernel, instead of staging
    the header block and writing it as a request of its own. ``encode`` hands out the blocks in
    order; they must stay alive until the batch's writes are done (``close()`` after, or
    use as a context manager)."""

    def __init__(self, key_lens: Iterable[int]) -> None:
        total = sum(head_size(n) for n in key_lens)
        # Short-lived (one batch): small pages, no huge page zero-filled for a few headers.
        self._mem: Optional[AlignedBuffer] = alloc_aligned(total, huge=False) if total else None
        self._pos = 0

    def encode(self, key: bytes, value_len: int, seq: int, crc: int, *, flags: int = 0) -> memoryview:
        """The next block (sized for ``key``), filled as :func:`encode_head` fills one."""
        size = head_size(len(key))
        if self._mem is None or self._pos + size > self._mem.nbytes:
            raise ValueError("more header blocks than HeadBlocks was sized for")
        block = self._mem.view[self._pos : self._pos + size]
        self._pos += size
        encode_head(key, value_len, seq, crc, flags=flags, into=block)
        return block

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()  # unmapped once the last block view is gone
            self._mem = None

    def __enter__(self) -> "HeadBlocks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_buffers(head: "bytearray | memoryview", value: memoryview) -> List[memoryview]:
    """The iovecs that write one record: head block, value, zero padding."""
    bufs = [memoryview(head), value]
    pad = align_up(value.nbytes) - value.nbytes
    if pad:
        bufs.append(ZERO_PAGE[:pad])
    return bufs


@dataclasses.dataclass(frozen=True)
class RecordHeader:
    seq: int
    key_len: int
    value_len: int
    crc: int
    flags: int = 0


def decode_head(buf: bytes, *, path: str = "", offset: int = 0) -> RecordHeader:
    """Parse and verify a record header; raise CorruptionError / FormatVersionError."""
    if len(buf) < RECORD_HEADER.size:
        raise CorruptionError("truncated record header", path=path, offset=offset)
    magic, version, flags, seq, key_len, value_len, crc, head_crc = RECORD_HEADER.unpack_from(buf)
    if magic != RECORD_MAGIC:
        raise CorruptionError("bad record magic", path=path, offset=offset, got=magic)
    if _crc.crc32c(bytes(buf[: RECORD_HEADER.size - 4])) != head_crc:
        raise CorruptionError("record header checksum mismatch", path=path, offset=offset)
    if version > FORMAT_VERSION:
        raise FormatVersionError("record written by a newer format", path=path, supported=FORMAT_VERSION, got=version)
    return RecordHeader(seq, key_len, value_len, crc, flags)


@dataclasses.dataclass(frozen=True)
class IndexEntry:
    """Where one record's value lives inside its bucket, and how to verify it."""

    key: bytes
    value_offset: int
    value_len: int
    seq: int
    crc: int


def encode_index(bucket_id: int, data_len: int, entries: Iterable[IndexEntry]) -> bytes:
    """Serialise a bucket index (header + entries), checksummed."""
    parts = []
    count = 0
    for e in entries:
        parts.append(INDEX_ENTRY.pack(e.value_offset, e.value_len, e.seq, e.crc, len(e.key)))
        parts.append(e.key)
        count += 1
    body = b"".join(parts)
    fields = (INDEX_MAGIC, FORMAT_VERSION, 0, bucket_id, count, data_len, _crc.crc32c(body))
    head = struct.pack("<4sHHQIQI", *fields)
    return head + struct.pack("<I", _crc.crc32c(head)) + body


def decode_index(buf: bytes, *, path: str = "") -> tuple[int, int, List[IndexEntry]]:
    """Parse and verify an index; return ``(bucket_id, data_len, entries)``."""
    if len(buf) < INDEX_HEADER.size:
        raise CorruptionError("truncated index", path=path, size=len(buf))
    magic, version, _flags, bucket_id, count, data_len, body_crc, head_crc = INDEX_HEADER.unpack_from(buf)
    if magic != INDEX_MAGIC:
        raise CorruptionError("bad index magic", path=path, got=magic)
    if _crc.crc32c(buf[: INDEX_HEADER.size - 4]) != head_crc:
        raise CorruptionError("index header checksum mismatch", path=path)
    if version > FORMAT_VERSION:
        raise FormatVersionError("index written by a newer format", path=path, supported=FORMAT_VERSION, got=version)
    body = memoryview(buf)[INDEX_HEADER.size :]
    if _crc.crc32c(body) != body_crc:
        raise CorruptionError("index entries checksum mismatch", path=path)
    entries: List[IndexEntry] = []
    pos = 0
    for _ in range(count):
        if pos + INDEX_ENTRY.size > len(body):
            raise CorruptionError("index shorter than its entry count", path=path, count=count)
        value_offset, value_len, seq, crc, key_len = INDEX_ENTRY.unpack_from(body, pos)
        pos += INDEX_ENTRY.size
        key = bytes(body[pos : pos + key_len])
        pos += key_len
        if len(key) != key_len or value_offset % ALIGN or value_offset + value_len > data_len:
            raise CorruptionError("index entry out of bounds", path=path, offset=value_offset, length=value_len)
        entries.append(IndexEntry(key, value_offset, value_len, seq, crc))
    return bucket_id, data_len, entries
