"""Engine integration, the engine-neutral core: prefix keys, page layouts, the paged-KV
protocol and the offloading allocator over a :class:`gdskv.kvstore.KVStore`, the device
prefix index, the asynchronous saver, tensor pages, the attach options and the in-memory
engine.

Importing this package needs only numpy and xxhash. It never imports the engine adapters
(:mod:`gdskv.connectors`) nor the TTFT benchmark and its reference engine
(:mod:`gdskv.ttft`); ``gdskv.engine.vllm`` and ``gdskv.engine.sglang`` are the adapters'
old module paths, kept for engine configs that name them.
"""

from __future__ import annotations

from gdskv.engine.allocator import OffloadConfig, OffloadingAllocator, PagedKVEngine, PrefixHit
from gdskv.engine.errors import LayoutMismatchError, PoolExhaustedError
from gdskv.engine.layout import PageLayout
from gdskv.engine.prefix import KeyNamespace, PrefixKeys

__all__ = [
    "KeyNamespace",
    "LayoutMismatchError",
    "OffloadConfig",
    "OffloadingAllocator",
    "PageLayout",
    "PagedKVEngine",
    "PoolExhaustedError",
    "PrefixHit",
    "PrefixKeys",
]
