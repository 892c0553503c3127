"""Offset allocator: sub-allocates one contiguous region (an arena, a file, a device pool).

Contract:
- ``allocate(size, align=None)`` returns the offset of a free extent of at least ``size``
  bytes, rounded up to ``alignment``, or ``None`` when no free extent is large enough (a
  miss, not an error); with ``align`` the offset is a multiple of it. ``fits(size, align)``
  says whether that allocation would succeed now.
- ``free(offset)`` returns an extent to the free list and coalesces it with free neighbours,
  so a fully freed allocator is again one extent of ``capacity`` bytes.
- ``used`` is exact: the sum of the rounded sizes of live allocations.

First fit over the free extents sorted by offset keeps allocations packed towards the front.
Not thread-safe: the owning tier serialises calls under its own lock.
"""

from __future__ import annotations

import bisect
from typing import Optional, Tuple

from gdskv.errors import ConfigError, GdskvError


class OffsetAllocator:
    """First-fit allocator with coalescing free extents over ``[0, capacity)``."""

    def __init__(self, capacity: int, *, alignment: int = 64) -> None:
        if capacity <= 0:
            raise ConfigError("allocator capacity must be positive", got=capacity)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError("alignment must be a power of two", got=alignment)
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._live: dict[int, int] = {}
        self.used = 0

    def rounded(self, size: int) -> int:
        """The number of bytes an allocation of ``size`` really takes."""
        return -(-size // self.alignment) * self.alignment

    def allocate(self, size: int, *, align: Optional[int] = None) -> Optional[int]:
        """Reserve ``size`` bytes; return the offset, or ``None`` if nothing fits.

        ``align`` (a power of two, a multiple of ``alignment``) asks for a start offset that
        is a multiple of it; the free bytes skipped in front of it stay free."""
        if size <= 0:
            raise GdskvError("allocation size must be positive", got=size)
        need = self.rounded(size)
        found = self._find(need, self._check_align(align))
        if found is None:
            return None
        i, start = found
        self._cut(i, start, need)
        return start

    def fits(self, size: int, *, align: Optional[int] = None) -> bool:
        """Whether :meth:`allocate` of ``size`` (and ``align``) would succeed now."""
        return self._find(self.rounded(size), self._check_align(align)) is not None

    def _find(self, need: int, align: int) -> Optional[Tuple[int, int]]:
        """First fit: ``(index of the free extent, aligned start)`` for ``need`` bytes."""
        for i, offset in enumerate(self._free_offsets):
            start = -(-offset // align) * align
            if offset + self._free_sizes[offset] >= start + need:
                return i, start
        return None

    def _check_align(self, align: Optional[int]) -> int:
        if align is None or align == self.alignment:
            return self.alignment
        if align <= 0 or align & (align - 1) or align % self.alignment:
            raise GdskvError("allocation alignment must be a power of two and a multiple of the allocator's", got=align, alignment=self.alignment)
        return align

    def claim(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset + size)`` (rounded up) as allocated; it must lie inside one
        free extent. Used to rebuild an allocator from a persisted index."""
        need = self.rounded(size)
        if size <= 0 or offset % self.alignment:
            raise GdskvError("claim of a misaligned or empty range", offset=offset, size=size)
        i = bisect.bisect_right(self._free_offsets, offset) - 1
        start = self._free_offsets[i] if i >= 0 else -1
        if i < 0 or offset + need > start + self._free_sizes[start]:
            raise GdskvError("claim of a range that is not free", offset=offset, size=need)
        self._cut(i, offset, need)

    def _cut(self, i: int, start: int, need: int) -> None:
        """Allocate ``[start, start + need)`` out of free extent ``i``, which holds it; what
        lies before and after it stays free."""
        offset = self._free_offsets[i]
        end = offset + self._free_sizes.pop(offset)
        tail = start + need
        if start > offset:  # the head stays free where it is
            self._free_sizes[offset] = start - offset
            if tail < end:
                self._free_offsets.insert(i + 1, tail)
                self._free_sizes[tail] = end - tail
        elif tail < end:  # the common case: the extent shrinks in place
            self._free_offsets[i] = tail
            self._free_sizes[tail] = end - tail
        else:
            del self._free_offsets[i]
        self._live[start] = need
        self.used += need

    def extents(self) -> list[tuple[int, int]]:
        """The free extents as ``(offset, size)``, lowest offset first."""
        return [(offset, self._free_sizes[offset]) for offset in self._free_offsets]

    def free(self, offset: int) -> None:
        """Release the allocation at ``offset`` (which must be live)."""
        size = self._live.pop(offset, None)
        if size is None:
            raise GdskvError("free of an offset that is not allocated", offset=offset)
        self.used -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        # Coalesce with the following extent.
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:
            size += self._free_sizes.pop(self._free_offsets[i])
            del self._free_offsets[i]
        # Coalesce with the preceding extent.
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        """The largest single allocation that would succeed now."""
        return max(self._free_sizes.values(), default=0)

    @property
    def free_extents(self) -> int:
        """Number of free extents (1 when nothing is allocated: fragmentation gauge)."""
        return len(self._free_offsets)

    def size_of(self, offset: int) -> int:
        """Rounded size of the live allocation at ``offset``."""
        return self._live[offset]
