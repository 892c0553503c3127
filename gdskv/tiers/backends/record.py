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
import threading
from typing import Dict, Iterable, List, Optional

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


def record_start(entry: "IndexEntry") -> int:
    """Where the record of the index ``entry`` starts: its value's offset less the header
    block (:func:`head_size`, computed inline: the offset backend runs this per object it
    evicts)."""
    return entry.value_offset - (RECORD_HEADER.size + len(entry.key) + ALIGN - 1) // ALIGN * ALIGN


def record_size(key_len: int, value_len: int) -> int:
    """Bytes a record takes on disk, padding included."""
    return head_size(key_len) + align_up(value_len)


def encode_head(
    key: bytes, value_len: int, seq: int, crc: int, *, flags: int = 0, into: Optional[memoryview] = None
) -> "bytearray | memoryview":
    """The header block of a record: header, key, zero padding up to the value. Written
    into ``into`` (``head_size(len(key))`` bytes, padding zeroed here) when given, else
    into a new bytearray; returns the block."""
    head = bytearray(head_size(len(key))) if into is None else into
    fields = (RECORD_MAGIC, FORMAT_VERSION, flags, seq, len(key), value_len, crc)
    packed = struct.pack("<4sHHQIQI", *fields)
    RECORD_HEADER.pack_into(head, 0, *fields, _crc.crc32c(packed))
    end = RECORD_HEADER.size + len(key)
    head[RECORD_HEADER.size : end] = key
    if into is not None:
        into[end:] = ZERO_PAGE[: len(into) - end]  # the padding is less than one block
    return head


#: Memory of finished :class:`HeadBlocks`, kept for the next batches (at most
#: :data:`_SPARE_KEEP` buffers): a batch then costs no mapping and no page faults.
_spare: List[AlignedBuffer] = []
_spare_lock = threading.Lock()
_SPARE_KEEP = 4


class HeadBlocks:
    """The header blocks of one batch of records, in page-aligned memory (reused from batch
    to batch).

    A record whose value sits page-aligned in memory and fills whole 4 KiB blocks (a KV
    block in the DRAM arena) is then one aligned write, header block and value together:
    the engine sends it from memory as it is, one request to the kernel, instead of staging
    the header block and writing it as a request of its own. ``encode`` hands out the
    blocks in order; they must stay untouched until the batch's writes are done, and
    ``close()`` (or leaving the ``with`` block) hands the memory to the next batch, so no
    write of this batch may still be in flight then. The memory is reused because encoding
    into it beat new bytearrays and new mappings (docs/notes/write-path.md)."""

    def __init__(self, key_lens: Iterable[int]) -> None:
        total = sum(head_size(n) for n in key_lens)
        self._mem: Optional[AlignedBuffer] = _take_spare(total) if total else None
        self._pos = 0
        self._end = total  # a spare buffer may be larger than this batch asked for

    def encode(self, key: bytes, value_len: int, seq: int, crc: int, *, flags: int = 0) -> memoryview:
        """The next block (sized for ``key``), filled as :func:`encode_head` fills one."""
        size = head_size(len(key))
        if self._mem is None or self._pos + size > self._end:
            raise ValueError("more header blocks than HeadBlocks was sized for")
        block = self._mem.view[self._pos : self._pos + size]
        self._pos += size
        encode_head(key, value_len, seq, crc, flags=flags, into=block)
        return block

    def close(self) -> None:
        """Hand the memory back for the next batch (none of its writes may be in flight)."""
        if self._mem is None:
            return
        mem, self._mem = self._mem, None
        with _spare_lock:
            _spare.append(mem)
            if len(_spare) <= _SPARE_KEEP:
                return
            mem = min(_spare, key=lambda b: b.nbytes)  # keep the largest
            _spare.remove(mem)
        mem.close()  # unmapped once the last block view is gone

    def __enter__(self) -> "HeadBlocks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _take_spare(nbytes: int) -> AlignedBuffer:
    """The smallest spare buffer of at least ``nbytes``, or a new one (small pages: header
    memory is touched a block at a time, a huge page would be zero-filled for a few)."""
    with _spare_lock:
        fits = [b for b in _spare if b.nbytes >= nbytes]
        if fits:
            best = min(fits, key=lambda b: b.nbytes)
            _spare.remove(best)
            return best
    return alloc_aligned(nbytes, huge=False)


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
    pack = INDEX_ENTRY.pack
    # (one bytes per entry, made by one concatenation: faster than two list items each, which
    # matters for a checkpoint base of many entries)
    parts = [pack(e.value_offset, e.value_len, e.seq, e.crc, len(e.key)) + e.key for e in entries]
    return _index_bytes(bucket_id, data_len, len(parts), b"".join(parts))


def encode_keys(bucket_id: int, keys: Iterable[bytes]) -> bytes:
    """An index of keys alone: what :func:`encode_index` writes for entries whose other
    fields are all 0, without making those entries (a checkpoint delta lists thousands of
    keys gone)."""
    parts = []
    heads: Dict[int, bytes] = {}  # key length -> its packed entry
    for key in keys:
        head = heads.get(len(key))
        if head is None:
            head = heads[len(key)] = INDEX_ENTRY.pack(0, 0, 0, 0, len(key))
        parts.append(head + key)  # (one bytes per entry, as encode_index makes them)
    return _index_bytes(bucket_id, 0, len(parts), b"".join(parts))


def _index_bytes(bucket_id: int, data_len: int, count: int, body: bytes) -> bytes:
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
