"""The embedded tiered store, as composed parts.

- :mod:`gdskv.store.store`: :class:`Store`, the coordination of the parts (its docstring
  states the API's contracts and which way the parts depend on each other);
- :mod:`gdskv.store.offloader`: the queue to SSD and its thread; the rule of when a batch is
  due is :mod:`gdskv.store.offload_rule` (pure functions, shared with the trace simulator);
- :mod:`gdskv.store.hbm_front`: the HBM (GPU) tier in front of DRAM;
- :mod:`gdskv.store.listeners`: who hears what is stored and evicted (the cluster's hook);
- :mod:`gdskv.store.report`: ``stats()`` and ``check()`` results;
- :mod:`gdskv.store.locking`: the lock taken for bookkeeping that must not be skipped.

The DRAM tier, the NVMe backends and the I/O engines the store is built from live in
:mod:`gdskv.tiers` and :mod:`gdskv.gds`.
"""

from gdskv.store.listeners import StoreListener
from gdskv.store.report import CheckReport
from gdskv.store.parts import StoreParts
from gdskv.store.store import CLOSE_DRAIN_TRIES, Store

__all__ = ["CLOSE_DRAIN_TRIES", "CheckReport", "Store", "StoreListener", "StoreParts"]
