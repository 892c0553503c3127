"""The host DRAM tier: one arena allocated once, sub-allocated by :class:`OffsetAllocator`.

Values are 64-byte aligned in the arena, and values of 64 KiB or more page-aligned
(:func:`value_alignment`), so their pages go to SSD without a staging copy. The arena is
private memory on transparent huge pages where the kernel allows (:func:`alloc_arena`):
an O_DIRECT write from huge pages needs far fewer scatter-gather segments
(``docs/ssd-path.md``, "The memory the bytes come from").

The tier is a data structure, not a service: it holds the arena, the allocator, the entries
and the eviction order, and every method except the byte copies (:meth:`DramTier.write`,
:meth:`DramTier.read_into`, :meth:`DramTier.view`) must be called under the owning store's
lock. Copies run outside the lock on *pinned* entries.

Entry life cycle (two-phase, as for any async I/O)::

    reserve() -> WRITING --write()--> commit() -> COMPLETE --detach()--> freed when idle

A WRITING entry is invisible to readers. A detached entry (removed, overwritten or evicted)
is forgotten at once, but its bytes are freed only when its writer has finished copying into
it (:meth:`DramTier.written`), no reader pins it and no offload is writing from it, so nobody
ever copies into or from memory that was handed to another object.
"""

from __future__ import annotations

import enum
import mmap
import os
from typing import Callable, Dict, Iterator, Optional

import numpy as np

from gdskv.errors import ConfigError
from gdskv.gds.aligned import DIRECT_ALIGN, map_anonymous, map_shared
from gdskv.tiers.allocator import OffsetAllocator
from gdskv.tiers.policies import EvictionPolicy

#: Allocation granularity inside the arena: cache-line aligned values.
DRAM_ALIGNMENT = 64
#: Values of at least this many bytes start on a page boundary of the arena, so that an
#: O_DIRECT write to SSD (whose records put values on 4 KiB file offsets) sends their whole
#: pages straight from the arena (aligned to the engines' ``DIRECT_ALIGN``) instead of
#: copying them through staging first.
PAGE_ALIGNED_FROM = 64 << 10


def value_alignment(size: int) -> int:
    """Where in the arena a value of ``size`` bytes starts: a multiple of this."""
    return DIRECT_ALIGN if size >= PAGE_ALIGNED_FROM else DRAM_ALIGNMENT


def alloc_arena(nbytes: int, *, huge_pages: bool = True) -> "tuple[mmap.mmap, bool]":
    """The memory of an arena of ``nbytes``: private, page-aligned, zero-filled lazily and,
    with ``huge_pages``, advised onto huge pages (:func:`gdskv.gds.aligned.map_anonymous`).
    Returns ``(mapping, advised)``. ``benchmarks/bench_io.py`` places its values in memory
    from here too."""
    return map_anonymous(nbytes, huge=huge_pages)


def alloc_shared_arena(nbytes: int, *, huge_pages: bool = True) -> "tuple[mmap.mmap, int, bool]":
    """An arena that other processes can map (:func:`gdskv.gds.aligned.map_shared`): the
    arena of a node that processes on its host attach to (:mod:`gdskv.local`). Returns
    ``(mapping, descriptor, advised)``."""
    return map_shared(nbytes, huge=huge_pages, name="gdskv-dram-arena")


class SsdState(enum.Enum):
    """What the SSD tier holds for a DRAM entry."""

    NONE = "none"  # never offloaded: evicting it would lose it (when an SSD tier exists)
    PENDING = "pending"  # queued or being written: not evictable, bytes pinned
    ON_SSD = "on_ssd"  # a COMPLETE copy is on SSD: evictable at no loss
    LOST = "lost"  # was on SSD, evicted there by capacity: cold, evictable


class DramEntry:
    __slots__ = ("key", "offset", "size", "crc", "complete", "writing", "readers", "ssd", "detached", "queued_at")

    def __init__(self, key: bytes, offset: int, size: int, crc: int) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.crc = crc
        self.complete = False
        self.writing = True  # the reserving thread is copying the value in
        self.readers = 0
        self.ssd = SsdState.NONE
        self.detached = False
        self.queued_at = 0.0

    @property
    def idle(self) -> bool:
        return self.readers == 0 and not self.writing and self.ssd is not SsdState.PENDING


class DramTier:
    """Arena + allocator + entries + eviction order. See the module docstring."""

    def __init__(self, capacity: int, policy: EvictionPolicy, *, huge_pages: bool = True, shared: bool = False) -> None:
        """``shared``: the arena is shared memory whose descriptor is :attr:`shared_fd`
        (:func:`alloc_shared_arena`); else private memory, and :attr:`shared_fd` is -1."""
        self.allocator = OffsetAllocator(capacity, alignment=DRAM_ALIGNMENT)
        self.capacity = self.allocator.capacity
        self.shared_fd = -1
        try:
            if shared:
                self._mmap, self.shared_fd, self.huge_pages_advised = alloc_shared_arena(self.capacity, huge_pages=huge_pages)
            else:
                self._mmap, self.huge_pages_advised = alloc_arena(self.capacity, huge_pages=huge_pages)
        except OSError as exc:  # e.g. more than this machine can map
            raise ConfigError(
                f"cannot map a DRAM arena of {self.capacity} bytes: {exc.strerror}", capacity=self.capacity, errno=exc.errno
            ) from exc
        self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self.policy = policy
        self.entries: Dict[bytes, DramEntry] = {}

    # -- metadata (store lock held) ---------------------------------------------

    @property
    def used(self) -> int:
        return self.allocator.used

    def lookup(self, key: bytes) -> Optional[DramEntry]:
        """The entry for ``key`` in any state, or None."""
        return self.entries.get(key)

    def readable(self, key: bytes) -> Optional[DramEntry]:
        """The COMPLETE entry for ``key``, or None."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.complete else None

    def reserve(self, key: bytes, size: int, crc: int) -> Optional[DramEntry]:
        """Allocate room for ``key`` and register a WRITING entry; None if nothing fits.
        No entry may be listed under ``key`` (see :meth:`register`)."""
        entry = self.reserve_unlisted(key, size)
        if entry is not None:
            entry.crc = crc
            self.register(entry)
        return entry

    def register(self, entry: DramEntry) -> None:
        """List an entry of :meth:`reserve_unlisted` under its key. Raises ``RuntimeError``
        if another entry is listed there: that one would be orphaned, never freed."""
        current = self.entries.get(entry.key)
        if current is not None and current is not entry:
            raise RuntimeError(f"a DRAM entry is listed under {entry.key[:64]!r} already")
        self.entries[entry.key] = entry

    def reserve_unlisted(self, key: bytes, size: int) -> Optional[DramEntry]:
        """Allocate room as :meth:`reserve` does, without registering the entry under
        ``key``: it stays invisible (the HBM tier's sink lists it once its copy is done)."""
        offset = self.allocator.allocate(size, align=value_alignment(size))
        return None if offset is None else DramEntry(key, offset, size, 0)

    def discard_unlisted(self, entry: DramEntry) -> None:
        """Give back an entry of :meth:`reserve_unlisted` that will not be listed (its
        copy failed, was abandoned or is not needed): its bytes are freed once idle."""
        entry.detached = True
        self.written(entry)

    def fits(self, size: int) -> bool:
        """Whether :meth:`reserve` of a value of ``size`` bytes would find room now."""
        return self.allocator.fits(size, align=value_alignment(size))

    def written(self, entry: DramEntry) -> None:
        """The copy into a reserved entry is over (done or failed); a detached entry's bytes
        may be freed from now on."""
        entry.writing = False
        self.release(entry)

    def commit(self, entry: DramEntry) -> None:
        """Make a written entry visible to readers and to the eviction policy."""
        entry.complete = True
        self.policy.insert(entry.key)

    def detach(self, entry: DramEntry) -> None:
        """Forget ``entry``; its bytes are freed now if idle, else by :meth:`release`."""
        if entry.detached:
            return
        entry.detached = True
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
            self.policy.remove(entry.key)
        self.release(entry)

    def release(self, entry: DramEntry) -> None:
        """Free a detached entry's bytes once nothing uses them any more."""
        if entry.detached and entry.idle and entry.offset >= 0:
            self.allocator.free(entry.offset)
            entry.offset = -1

    def victims(self, evictable: Callable[[DramEntry], bool]) -> Iterator[DramEntry]:
        """Entries in eviction order that ``evictable`` accepts. Live iteration: stop
        iterating before detaching what it yields."""
        for key in self.policy.ordered():
            entry = self.entries[key]
            if entry.complete and entry.idle and evictable(entry):
                yield entry

    def touch(self, entry: DramEntry) -> None:
        self.policy.touch(entry.key)

    # -- byte copies (no lock; entry pinned or WRITING) ---------------------------

    def view(self, entry: DramEntry) -> memoryview:
        """A zero-copy view of the entry's bytes in the arena."""
        return memoryview(self.arena[entry.offset : entry.offset + entry.size])

    def write(self, entry: DramEntry, value: memoryview) -> None:
        self.arena[entry.offset : entry.offset + entry.size] = np.frombuffer(value, dtype=np.uint8)

    def read_into(self, entry: DramEntry, out: memoryview) -> None:
        np.frombuffer(out, dtype=np.uint8, count=entry.size)[:] = self.arena[entry.offset : entry.offset + entry.size]

    def close(self) -> None:
        self.entries.clear()
        self.arena = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        if self.shared_fd >= 0:
            os.close(self.shared_fd)  # processes that mapped it keep their mapping
            self.shared_fd = -1

