"""The read staging area of a node: shared memory that values from the slower tiers are read
into for an attached process to copy out.

A value in DRAM is copied by an attached process straight out of the shared DRAM arena; a
value in HBM or on NVMe has no place there, and putting one there would evict what DRAM
caches. So the node reads it (verified, as every read) into room of this area, a memfd of its
own passed at the handshake beside the arena's, and the process copies it from there. Room is
handed out by an :class:`~gdskv.tiers.allocator.OffsetAllocator`, page-aligned, and held until
the process releases the value (or its connection ends). Thread-safe.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import numpy as np

from gdskv.gds.aligned import DIRECT_ALIGN, map_shared
from gdskv.tiers.allocator import OffsetAllocator

#: Default size of a node's read staging area.
STAGING_BYTES = 256 << 20


class ReadStaging:
    """Shared room for values read from HBM or NVMe (see the module docstring)."""

    def __init__(self, nbytes: int = STAGING_BYTES) -> None:
        self._allocator = OffsetAllocator(nbytes, alignment=DIRECT_ALIGN)
        self.nbytes = self._allocator.capacity
        self._mmap, self.fd, _ = map_shared(self.nbytes, huge=False, name="gdskv-read-staging")
        self._mem = np.frombuffer(self._mmap, dtype=np.uint8)
        self._lock = threading.Lock()

    def allocate(self, size: int) -> Optional[int]:
        """The offset of ``size`` free bytes, held until :meth:`free`; None when none are."""
        with self._lock:
            return self._allocator.allocate(size)

    def free(self, offset: int) -> None:
        with self._lock:
            self._allocator.free(offset)

    def view(self, offset: int, size: int) -> memoryview:
        return memoryview(self._mem[offset : offset + size])

    @property
    def used(self) -> int:
        with self._lock:
            return self._allocator.used

    def close(self) -> None:
        self._mem = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
