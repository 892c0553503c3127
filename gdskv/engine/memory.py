"""An in-memory paged-KV engine: the null implementation of the engine protocol.

:class:`MemoryEngine` implements :class:`~gdskv.engine.allocator.PagedKVEngine` over a numpy
pool (no model, no torch), so the allocator, the store path and adapters can be tested and
measured alone. Pages hold whatever bytes a test writes with :meth:`MemoryEngine.fill`.
Every page I/O is recorded in ``reads`` / ``writes`` (page numbers, in order).
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from gdskv.engine.errors import LayoutMismatchError, PoolExhaustedError
from gdskv.engine.layout import PageLayout
from gdskv.errors import ConfigError, InvalidValueError


class MemoryEngine:
    """A pool of ``num_pages`` pages of ``layout`` in host memory."""

    def __init__(self, layout: PageLayout, num_pages: int) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages <= 0:
            raise ConfigError("num_pages must be a positive integer", got=num_pages)
        self.layout = layout
        self.num_pages = num_pages
        self.pool = np.zeros((num_pages, layout.page_nbytes), dtype=np.uint8)
        self._free: List[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = np.zeros(num_pages, dtype=bool)
        self.reads: List[int] = []
        self.writes: List[int] = []

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        if n > len(self._free):
            raise PoolExhaustedError("memory pool exhausted", wanted=n, free=len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._in_use[pages] = True
        return pages

    def free(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._check(page)
        for page in pages:
            self._in_use[page] = False
            self._free.append(page)

    def read_page(self, page: int, outs: Sequence[Any]) -> None:
        for seg, out in zip(self._segments(page, outs), outs):
            np.frombuffer(out, dtype=np.uint8)[:] = seg
        self.reads.append(page)

    def write_page(self, page: int, srcs: Sequence[Any]) -> None:
        for seg, src in zip(self._segments(page, srcs), srcs):
            seg[:] = np.frombuffer(src, dtype=np.uint8)
        self.writes.append(page)

    def fill(self, page: int, seed: int) -> np.ndarray:
        """Write deterministic random bytes into ``page``; return them."""
        self._check(page)
        self.pool[page] = np.random.default_rng(seed).integers(0, 256, self.layout.page_nbytes, dtype=np.uint8)
        return self.pool[page].copy()

    def _segments(self, page: int, bufs: Sequence[Any]) -> List[np.ndarray]:
        self._check(page)
        lay = self.layout
        if len(bufs) != lay.num_segments:
            raise LayoutMismatchError("wrong number of page segments", expected=lay.num_segments, got=len(bufs))
        size = lay.segment_nbytes
        for buf in bufs:
            if memoryview(buf).nbytes != size:
                raise LayoutMismatchError("page segment has the wrong size", expected=size, got=memoryview(buf).nbytes)
        return [self.pool[page, i * size : (i + 1) * size] for i in range(lay.num_segments)]

    def _check(self, page: int) -> None:
        if not isinstance(page, (int, np.integer)) or not 0 <= page < self.num_pages or not self._in_use[page]:
            raise InvalidValueError("not an allocated page of this pool", page=page, num_pages=self.num_pages)
