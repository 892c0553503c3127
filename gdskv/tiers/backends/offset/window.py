"""The offset backend's *window*: where writes may land between two checkpoints.

A checkpoint of the offset backend lists, besides every live object, a window: free extents
of the data file (about ``window_bytes``, lowest offsets first) plus the extents of the
batch that triggered it. Until the next checkpoint, records are written only inside it, so
on reopen only the window needs to be scanned for records newer than the checkpoint.

- :func:`pick_window` chooses it from the allocator's free extents;
- :func:`in_window` says whether an allocation landed inside it;
- :func:`scan_window` finds the records newer than the checkpoint's sequence number in it:
  each 4 KiB boundary is a candidate; a candidate counts when its header checks (magic,
  header CRC32C), its sequence number is newer than the watermark, and its key and value
  match their CRC32C (tombstones have no value). A header whose value fails its checksum is
  a write torn by a crash: counted, skipped. It also returns the highest sequence number
  of any header that checks (torn and cut-off records too), so that recovery can number
  the next writes above everything a later scan could meet.

Window extents are stored in the checkpoint as index entries with an empty key
(:data:`WINDOW_KEY`; object keys are never empty).
"""

from __future__ import annotations

import bisect
from typing import List, Tuple

from gdskv.errors import CorruptionError
from gdskv.gds.aligned import alloc_aligned
from gdskv.gds.engine import IoEngine, IoRequest
from gdskv.tiers.backends.base import RecoveryReport
from gdskv.tiers.backends.record import (
    ALIGN,
    FLAG_TOMBSTONE,
    RECORD_HEADER,
    RECORD_MAGIC,
    IndexEntry,
    align_up,
    checksum,
    decode_head,
    head_size,
)


#: Key of the checkpoint entries that describe window extents (object keys are never empty).
WINDOW_KEY = b""
#: Largest piece of the window read at once while scanning it on reopen.
SCAN_CHUNK = 16 << 20

Extent = Tuple[int, int]  # [start, end) in the data file
Found = Tuple[int, int, IndexEntry]  # sequence number, record flags, where the value is


def default_window(capacity: int) -> int:
    """Window size for a file of ``capacity`` bytes: 1/16 of it, within [4 MiB, 256 MiB]."""
    return max(4 << 20, min(256 << 20, capacity // 16)) // ALIGN * ALIGN


def pick_window(free_extents: List[Tuple[int, int]], window_bytes: int) -> List[Extent]:
    """The lowest free extents (``(offset, size)``), clipped to ``window_bytes`` in all."""
    window, total = [], 0
    for offset, size in free_extents:
        take = min(size, window_bytes - total)
        if take <= 0:
            break
        window.append((offset, offset + take))
        total += take
    return window


def in_window(window: List[Extent], offset: int, size: int) -> bool:
    """Whether ``[offset, offset + size)`` lies inside one extent of the sorted ``window``."""
    i = bisect.bisect_right(window, (offset, float("inf"))) - 1
    return i >= 0 and offset + size <= window[i][1]


def merge_extents(extents: List[Extent]) -> List[Extent]:
    """Sort and merge touching or overlapping extents."""
    out: List[Extent] = []
    for start, end in sorted(extents):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def scan_window(
    engine: IoEngine, fd: int, path: str, window: List[Extent], watermark: int, report: RecoveryReport
) -> Tuple[List[Found], int]:
    """Records newer than ``watermark`` inside ``window``, in file order, and the highest
    sequence number of any valid header met (whole, torn or cut off by the window's end;
    0 when none). Raises :class:`IoError` when part of the window cannot be read."""
    found: List[Found] = []
    if not window:
        return found, 0
    largest = max(end - start for start, end in window)
    staging = alloc_aligned(min(largest, SCAN_CHUNK) + (1 << 20))
    try:
        scanner = _Scanner(engine, fd, path, watermark, staging.view, found, report)
        for start, end in window:
            scanner.extent(start, end)
    finally:
        staging.close()
    return found, scanner.newest


class _Scanner:
    def __init__(self, engine: IoEngine, fd: int, path: str, watermark: int, buf: memoryview, found: List[Found], report: RecoveryReport) -> None:
        self.engine, self.fd, self.path, self.watermark = engine, fd, path, watermark
        self.buf, self.found, self.report = buf, found, report
        self.base = self.have = 0  # buf holds file bytes [base, base + have)
        self.newest = 0  # highest sequence number of a header that checks

    def extent(self, start: int, end: int) -> None:
        buf = self.buf
        pos = start
        self.base, self.have = start, 0
        while pos + RECORD_HEADER.size <= end:
            if not (self.base <= pos and pos + ALIGN <= self.base + self.have):
                self.base, self.have = pos, self._read(pos, min(end, pos + buf.nbytes) - pos, buf)
                if self.have < RECORD_HEADER.size:
                    return
            rel = pos - self.base
            if buf[rel : rel + 4] != RECORD_MAGIC:
                pos += ALIGN
                continue
            try:
                header = decode_head(buf[rel : rel + RECORD_HEADER.size], path=self.path, offset=pos)
            except CorruptionError:
                pos += ALIGN
                continue
            self.newest = max(self.newest, header.seq)
            tombstone = bool(header.flags & FLAG_TOMBSTONE)
            size = head_size(header.key_len) + (0 if tombstone else align_up(header.value_len))
            if header.seq <= self.watermark or pos + size > end:
                pos += ALIGN  # older than the checkpoint (stale bytes), or not whole
                continue
            record = self._record(pos, size)
            key = bytes(record[RECORD_HEADER.size : RECORD_HEADER.size + header.key_len])
            value_at = head_size(header.key_len)
            entry = IndexEntry(key, pos + value_at, header.value_len, header.seq, header.crc)
            # A tombstone's CRC is of its key alone (0 in those of older versions: trusted as
            # they were): a torn head block must not make it remove another key.
            if tombstone and header.crc and checksum(key, b"") != header.crc:
                self.report.dropped_torn += 1
                pos += ALIGN
                continue
            if tombstone or (key and checksum(key, record[value_at : value_at + header.value_len]) == header.crc):
                self.found.append((header.seq, header.flags, entry))
                pos += size
            else:
                self.report.dropped_torn += 1  # header written, value not (a crash mid-write)
                pos += ALIGN

    def _record(self, pos: int, size: int) -> memoryview:
        if self.base <= pos and pos + size <= self.base + self.have:
            return self.buf[pos - self.base : pos - self.base + size]
        whole = bytearray(size)
        self._read(pos, size, memoryview(whole))
        return memoryview(whole)

    def _read(self, offset: int, length: int, buf: memoryview) -> int:
        """Read window bytes; an :class:`IoError` propagates. Skipping bytes that cannot be
        read now would lose what they hold, tombstones included (a removed key would
        come back), so the open fails instead, as it does for an unreadable checkpoint."""
        return self.engine.run([IoRequest.read(self.fd, offset, buf[:length], path=self.path)])[0]
