"""Pages of an outside engine's own KV tensors, behind the paged-KV engine protocol.

vLLM keeps one KV tensor per attention layer (its "KV cache" per layer), with a block
dimension: the block (page) ``b`` of layer ``i`` is ``tensors[i].select(block_dim, b)``,
``2 * num_kv_heads * page_size * head_dim`` elements however the engine orders them inside
(K and V split first on a GPU, interleaved per head on the CPU backend). The bytes are
moved as they are, so a page saved by one engine loads into another of the same layout
and namespace byte for byte.

:class:`TensorPagesEngine` implements :class:`~gdskv.engine.allocator.PagedKVEngine`
over those tensors for the store-level operations of the
:class:`~gdskv.engine.allocator.OffloadingAllocator` (``load`` / ``save``): pages are the
engine's block numbers and their allocation stays with the engine, so ``allocate``
raises :class:`~gdskv.engine.errors.PoolExhaustedError` and ``free`` is refused.
``read_segment`` / ``write_segment`` move one layer of one block, for the per-layer hooks
of an engine (staged loads and reserved saves of the allocator).
:class:`NoPagesEngine` has a layout and no pages at all: an allocator over it answers
lookups against the store (a scheduler process holds no KV).

torch is imported when a :class:`TensorPagesEngine` is built.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from gdskv.engine.errors import LayoutMismatchError, PoolExhaustedError
from gdskv.engine.layout import PageLayout
from gdskv.errors import ConfigError, InvalidValueError


class NoPagesEngine:
    """A paged-KV engine with a layout and no pages of its own (lookups only).

    :class:`TensorPagesEngine` reuses its refusal to allocate or free: there the engine
    allocates and frees its own KV blocks.
    """

    #: Why allocate/free are refused (the subclass says the engine manages its blocks).
    refusal = "this engine holds no pages (lookups only)"

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout

    @property
    def num_free_pages(self) -> int:
        return 0

    def allocate(self, n: int) -> List[int]:
        if n == 0:
            return []
        raise PoolExhaustedError(self.refusal, wanted=n, free=0)

    def free(self, pages: Sequence[int]) -> None:
        if list(pages):
            raise InvalidValueError(self.refusal, pages=list(pages)[:8])

    def read_page(self, page: int, outs: Sequence[Any]) -> None:
        raise InvalidValueError("this engine holds no pages", page=page)

    def write_page(self, page: int, srcs: Sequence[Any]) -> None:
        raise InvalidValueError("this engine holds no pages", page=page)


def find_block_dim(tensor: Any, num_blocks: int, layer_nbytes: int) -> int:
    """The dimension of ``tensor`` that indexes its ``num_blocks`` blocks: the first one of
    that size whose slices hold exactly ``layer_nbytes`` bytes (LayoutMismatchError if none)."""
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks and tensor.numel() // size * tensor.element_size() == layer_nbytes:
            return dim
    raise LayoutMismatchError(
        "KV tensor has no block dimension of the expected size",
        shape=tuple(tensor.shape),
        num_blocks=num_blocks,
        block_nbytes=layer_nbytes,
    )


class TensorPagesEngine(NoPagesEngine):
    """Store-level page I/O over an engine's per-layer KV tensors. See the module docstring."""

    refusal = "the engine allocates and frees its own KV blocks"

    def __init__(self, layout: PageLayout, tensors: Sequence[Any], *, num_blocks: int) -> None:
        if layout.kind != "per_layer":
            raise ConfigError("engine KV tensors are per layer", kind=layout.kind)
        if len(tensors) != layout.num_layers:
            raise LayoutMismatchError("one KV tensor per layer", expected=layout.num_layers, got=len(tensors))
        self.layout = layout
        self.num_blocks = num_blocks
        self.tensors = list(tensors)
        self.block_dims = [find_block_dim(t, num_blocks, layout.layer_nbytes) for t in self.tensors]
        self.reads = 0
        self.writes = 0

    def read_page(self, page: int, outs: Sequence[Any]) -> None:
        """Copy block ``page`` of every layer into ``outs`` (one uint8 array per layer)."""
        for block, out in zip(self._blocks(page, outs), outs):
            self._view(out, block).copy_(block)
        self.reads += 1

    def write_page(self, page: int, srcs: Sequence[Any]) -> None:
        """Copy ``srcs`` (one uint8 array per layer) into block ``page`` of every layer."""
        for block, src in zip(self._blocks(page, srcs), srcs):
            block.copy_(self._view(src, block))
        self.writes += 1

    def read_segment(self, page: int, layer: int, out: Any) -> None:
        """Copy block ``page`` of layer ``layer`` into ``out`` (one uint8 array)."""
        block = self._block(page, layer, out)
        self._view(out, block).copy_(block)

    def write_segment(self, page: int, layer: int, src: Any) -> None:
        """Copy ``src`` (one uint8 array) into block ``page`` of layer ``layer``."""
        block = self._block(page, layer, src)
        block.copy_(self._view(src, block))

    def _block(self, page: int, layer: int, buf: Any) -> Any:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise InvalidValueError("no such layer", layer=layer, num_layers=self.layout.num_layers)
        self._check_page(page)
        if memoryview(buf).nbytes != self.layout.layer_nbytes:
            raise LayoutMismatchError("page segment has the wrong size", expected=self.layout.layer_nbytes, got=memoryview(buf).nbytes)
        return self.tensors[layer].select(self.block_dims[layer], int(page))

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)) or not 0 <= page < self.num_blocks:
            raise InvalidValueError("not a block of this KV cache", page=page, num_blocks=self.num_blocks)

    def _blocks(self, page: int, bufs: Sequence[Any]) -> List[Any]:
        self._check_page(page)
        if len(bufs) != self.layout.num_layers:
            raise LayoutMismatchError("wrong number of page segments", expected=self.layout.num_layers, got=len(bufs))
        size = self.layout.layer_nbytes
        for buf in bufs:
            if memoryview(buf).nbytes != size:
                raise LayoutMismatchError("page segment has the wrong size", expected=size, got=memoryview(buf).nbytes)
        return [t.select(dim, int(page)) for t, dim in zip(self.tensors, self.block_dims)]

    @staticmethod
    def _view(buf: Any, block: Any) -> Any:
        import torch

        array = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8)
        return torch.from_numpy(array).view(block.dtype).view(block.shape)
