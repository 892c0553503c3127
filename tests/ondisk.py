"""Helpers for tests that look at, and damage, a store directory on disk.

They read the bucket backend's files with the same decoders the store uses, so a test can
find the byte range of one object and flip bytes in a value, a record header, the padding
or an index, exactly as a failing disk would.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path
from typing import Dict, List, Optional

import crc32c

from gdskv.errors import GdskvError
from gdskv.tiers.backends.bucket import DATA_SUFFIX, INDEX_SUFFIX
from gdskv.tiers.backends.files import TMP_SUFFIX
from gdskv.tiers.backends.record import INDEX_HEADER, IndexEntry, decode_index, head_size


def buckets_dir(store_path: Path) -> Path:
    return Path(store_path) / "buckets"


@dataclasses.dataclass(frozen=True)
class Located:
    """Where one object lives on disk."""

    data: Path
    index: Path
    entry: IndexEntry

    @property
    def record_start(self) -> int:
        return self.entry.value_offset - head_size(len(self.entry.key))


def index_files(store_path: Path) -> List[Path]:
    return sorted(buckets_dir(store_path).glob("*" + INDEX_SUFFIX))


def data_files(store_path: Path) -> List[Path]:
    return sorted(buckets_dir(store_path).glob("*" + DATA_SUFFIX))


def torn_files(store_path: Path) -> List[Path]:
    """What recovery must treat as torn: temporaries, and data files that have no index."""
    d = buckets_dir(store_path)
    if not d.exists():
        return []
    names = set(os.listdir(d))
    torn = [d / n for n in names if n.endswith(TMP_SUFFIX)]
    for n in names:
        if n.endswith(DATA_SUFFIX) and n[: -len(DATA_SUFFIX)] + INDEX_SUFFIX not in names:
            torn.append(d / n)
    return sorted(torn)


def disk_objects(store_path: Path) -> Dict[bytes, Located]:
    """Every object named by a (valid) index on disk, newest copy per key."""
    found: Dict[bytes, Located] = {}
    for index in index_files(store_path):
        _, _, entries = decode_index(index.read_bytes(), path=str(index))
        data = index.with_name(index.name[: -len(INDEX_SUFFIX)] + DATA_SUFFIX)
        for e in entries:
            old = found.get(e.key)
            if old is None or old.entry.seq < e.seq:
                found[e.key] = Located(data, index, e)
    return found


def locate(store_path: Path, key: "bytes | str") -> Located:
    k = key.encode() if isinstance(key, str) else key
    found = disk_objects(store_path).get(k)
    if found is None:
        raise KeyError(f"{k!r} is in no index on disk")
    return found


def flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of ``path`` in place (a bit-rot on disk)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        if len(byte) != 1:
            raise ValueError(f"offset {offset} is past the end of {path}")
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def set_index_version(index: Path, version: int) -> None:
    """Rewrite an index's format version with a valid header checksum (a newer writer)."""
    buf = bytearray(index.read_bytes())
    struct.pack_into("<H", buf, 4, version)
    struct.pack_into("<I", buf, INDEX_HEADER.size - 4, crc32c.crc32c(bytes(buf[: INDEX_HEADER.size - 4])))
    index.write_bytes(bytes(buf))


def bucket_of(index: Path) -> Optional[List[bytes]]:
    """The keys one index names, or None if it does not decode."""
    try:
        _, _, entries = decode_index(index.read_bytes(), path=str(index))
    except GdskvError:
        return None
    return [e.key for e in entries]
