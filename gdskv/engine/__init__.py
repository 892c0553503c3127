"""Engine integration: prefix keys, the paged-KV protocol, the offloading allocator and
the reference engine.

Importing this package needs only numpy and xxhash. :mod:`gdskv.engine.reference` imports
torch and transformers (the ``engine`` extra) when an engine is built, and
:mod:`gdskv.engine.ttft` matplotlib and rich (the ``bench`` extra) when the benchmark runs;
``ReferenceEngine``, ``ModelShape`` and ``PrefillResult`` are resolved on first access.
"""

from __future__ import annotations

from typing import Any

from gdskv.engine.allocator import OffloadConfig, OffloadingAllocator, PagedKVEngine, PrefixHit
from gdskv.engine.errors import LayoutMismatchError, PoolExhaustedError
from gdskv.engine.layout import PageLayout
from gdskv.engine.prefix import KeyNamespace, PrefixKeys

_LAZY = {"ReferenceEngine": "reference", "ModelShape": "reference", "PrefillResult": "reference"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gdskv.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"gdskv.engine.{module}"), name)


__all__ = [
    "KeyNamespace",
    "LayoutMismatchError",
    "ModelShape",
    "OffloadConfig",
    "OffloadingAllocator",
    "PageLayout",
    "PagedKVEngine",
    "PoolExhaustedError",
    "PrefillResult",
    "PrefixHit",
    "PrefixKeys",
    "ReferenceEngine",
]
