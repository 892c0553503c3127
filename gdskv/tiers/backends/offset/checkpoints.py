"""The offset backend's index on disk: a base checkpoint and the deltas written after it.

Layout under ``<store>/offset/``::

    checkpoint                    the *base*: every live object, the window and the
                                  watermark (an index, see :func:`record.encode_index`)
    delta-<base:016x>-<n:06d>     delta ``n`` (1, 2, ...) of the base whose watermark is
                                  ``base``: the objects added or replaced and the keys gone
                                  since the checkpoint before it, its window and watermark

Every file is written atomically (temporary file, fsync, rename, directory fsync) by the
backend. A checkpoint is taken each time the window fills, so one that lists every object
costs time in proportion to the store, not to what changed, and its share of the write time
grows with the store (docs/notes/write-path.md). A delta lists only what
changed since the checkpoint before it. A new base (and the deletion of every delta file)
comes once the deltas since the last base add up to more bytes than it, or number
:data:`MAX_DELTAS`: so the bytes a base costs are spread over as many bytes of deltas, or
over 64 windows of writes (a store of many small objects reaches that first), and an open
reads at most that many small files.

The state on disk is the base with its deltas applied in order (keys gone first, then the
objects added). A base's watermark is a sequence number no record uses (the backend spends
one on each base), so the deltas of an earlier base never match a later one; they are
stale, and deleted. A damaged delta, or one missing from the sequence, damages the state
as a damaged base does: recovery starts empty rather than bring back removed keys.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import crc32c as _crc

from gdskv.errors import CorruptionError, FormatVersionError
from gdskv.tiers.backends.files import TMP_SUFFIX
from gdskv.tiers.backends.record import FORMAT_VERSION, IndexEntry, decode_index, encode_index, encode_keys
from gdskv.tiers.backends.offset.window import WINDOW_KEY

BASE_FILE = "checkpoint"
DELTA_MAGIC = b"GKVD"
#: magic, version, flags, base watermark, length of the first index, header CRC
DELTA_HEADER = struct.Struct("<4sHHQII")
#: Deltas after which the next checkpoint is a base, whatever their size.
MAX_DELTAS = 64
#: Deltas may add up to this many bytes before a base follows, also when the base is smaller.
MIN_DELTA_BUDGET = 256 << 10

_DELTA_NAME = re.compile(r"delta-([0-9a-f]{16})-([0-9]{6})")

Extent = Tuple[int, int]


@dataclasses.dataclass
class Checkpoint:
    """The state a checkpoint (a base and its deltas) describes."""

    watermark: int
    capacity: int
    objects: Dict[bytes, IndexEntry]
    window: List[Extent]
    #: Highest sequence number of a listed object (0: none).
    newest: int = 0


def encode_base(watermark: int, capacity: int, objects: Iterable[IndexEntry], window: Sequence[Extent]) -> bytes:
    """A base checkpoint: ``objects`` and ``window`` (window extents are entries with an
    empty key, which no object has), the watermark in the index's bucket-id field and the
    capacity in its data-length field."""
    listed = list(objects)
    listed.extend(_window_entries(window))
    return encode_index(watermark, capacity, listed)


def encode_delta(
    base: int, watermark: int, capacity: int, added: Iterable[IndexEntry], gone: Iterable[bytes], window: Sequence[Extent]
) -> bytes:
    """A delta of the base whose watermark is ``base``: ``added`` objects (new or replacing
    the key's entry), keys ``gone``, and the new ``window`` and ``watermark``."""
    first = encode_index(watermark, capacity, list(added) + _window_entries(window))
    second = encode_keys(base, gone)
    head = DELTA_HEADER.pack(DELTA_MAGIC, FORMAT_VERSION, 0, base, len(first), 0)[:-4]
    return head + struct.pack("<I", _crc.crc32c(head)) + first + second


def decode_base(raw: bytes, *, path: str, capacity: int) -> Checkpoint:
    """Parse a base; window extents are clipped to ``capacity``. Raises CorruptionError or
    FormatVersionError."""
    watermark, stored, listed = decode_index(raw, path=path)
    checkpoint = Checkpoint(watermark, stored, {}, [])
    _take(checkpoint, listed, capacity)
    return checkpoint


def apply_delta(checkpoint: Checkpoint, raw: bytes, *, base: int, path: str, capacity: int) -> None:
    """Apply one delta of the base ``base`` to ``checkpoint``. Raises CorruptionError (also
    for a delta of another base) or FormatVersionError."""
    if len(raw) < DELTA_HEADER.size:
        raise CorruptionError("truncated checkpoint delta", path=path, size=len(raw))
    magic, version, _flags, of_base, first_len, head_crc = DELTA_HEADER.unpack_from(raw)
    if magic != DELTA_MAGIC or _crc.crc32c(raw[: DELTA_HEADER.size - 4]) != head_crc:
        raise CorruptionError("bad checkpoint delta header", path=path)
    if version > FORMAT_VERSION:
        raise FormatVersionError("checkpoint delta written by a newer format", path=path, supported=FORMAT_VERSION, got=version)
    if of_base != base:
        raise CorruptionError("checkpoint delta of another base", path=path, base=base, got=of_base)
    body = memoryview(raw)[DELTA_HEADER.size :]
    if first_len > len(body):
        raise CorruptionError("truncated checkpoint delta", path=path, size=len(raw))
    watermark, _capacity, listed = decode_index(bytes(body[:first_len]), path=path)
    second_base, _zero, gone = decode_index(bytes(body[first_len:]), path=path)
    if second_base != base or watermark < checkpoint.watermark:
        raise CorruptionError("checkpoint delta out of order", path=path, watermark=watermark, after=checkpoint.watermark)
    for entry in gone:
        checkpoint.objects.pop(entry.key, None)
    checkpoint.watermark = watermark
    checkpoint.window = []
    _take(checkpoint, listed, capacity)


def delta_name(base: int, n: int) -> str:
    return f"delta-{base:016x}-{n:06d}"


def delta_files(directory: Path) -> List[Tuple[int, int, Path]]:
    """``(base, n, path)`` of every delta file in ``directory`` (regular files named as
    deltas; anything else is left alone), in name order. Raises OSError."""
    found = []
    for path in directory.iterdir():
        match = _DELTA_NAME.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1), 16), int(match.group(2)), path))
    return sorted(found)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is the temporary name of a checkpoint file (a write cut short)."""
    if not name.endswith(TMP_SUFFIX):
        return False
    stem = name[: -len(TMP_SUFFIX)]
    return stem == BASE_FILE or _DELTA_NAME.fullmatch(stem) is not None


def base_is_due(deltas: int, delta_bytes: int, base_bytes: int) -> bool:
    """Whether the next checkpoint should be a base, after ``deltas`` deltas of
    ``delta_bytes`` in all since a base of ``base_bytes``."""
    return deltas >= MAX_DELTAS or delta_bytes > max(base_bytes, MIN_DELTA_BUDGET)


def _window_entries(window: Sequence[Extent]) -> List[IndexEntry]:
    return [IndexEntry(WINDOW_KEY, start, end - start, 0, 0) for start, end in window]


def _take(checkpoint: Checkpoint, listed: List[IndexEntry], capacity: int) -> None:
    for entry in listed:
        if entry.key == WINDOW_KEY:
            checkpoint.window.append((entry.value_offset, min(entry.value_offset + entry.value_len, capacity)))
        else:
            checkpoint.objects[entry.key] = entry
            checkpoint.newest = max(checkpoint.newest, entry.seq)


def read_checkpoint(directory: Path, *, capacity: int) -> Optional[Checkpoint]:
    """The state of the base in ``directory`` with its deltas applied in order; None when
    there is no base. Raises CorruptionError for a damaged base or delta (or one missing
    from the sequence), FormatVersionError, OSError."""
    base_path = directory / BASE_FILE
    if not base_path.exists():
        return None
    raw = base_path.read_bytes()
    checkpoint = decode_base(raw, path=str(base_path), capacity=capacity)
    base = checkpoint.watermark
    applied = 0
    for of_base, n, path in delta_files(directory):
        if of_base != base:
            continue  # an earlier base's: stale
        if n != applied + 1:
            raise CorruptionError("a checkpoint delta is missing", path=str(path), expected=applied + 1, got=n)
        apply_delta(checkpoint, path.read_bytes(), base=base, path=str(path), capacity=capacity)
        applied += 1
    return checkpoint
