"""What a :class:`gdskv.Store` reports: :func:`store_stats` and :class:`CheckReport`."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from gdskv.metrics import rate
from gdskv.tiers.dram import DramTier


@dataclasses.dataclass
class CheckReport:
    """Result of :meth:`gdskv.Store.check`."""

    dram_objects: int
    nvme_objects: int
    corrupt_keys: List[bytes]

    @property
    def ok(self) -> bool:
        return not self.corrupt_keys


def store_stats(
    config: Any, c: Dict[str, float], dram: DramTier, nvme: Any, *,
    hbm: Optional[dict], offload: Optional[dict], io_engine: Optional[dict], recovery: Any,
) -> Dict[str, Any]:
    """The dictionary :meth:`gdskv.Store.stats` returns, from the store's counters ``c`` and
    its parts (``nvme`` None without an SSD tier; ``hbm`` the HBM front's figures, or None)."""
    out: Dict[str, Any] = {
        "dram": {
            "objects": sum(1 for e in dram.entries.values() if e.complete),
            "used_bytes": dram.used,
            "capacity": dram.capacity,
            "huge_pages_advised": dram.huge_pages_advised,
            "hits": int(c.get("dram_hits", 0)),
            "read_bytes": int(c.get("dram_read_bytes", 0)),
            "read_bytes_per_s": rate(c.get("dram_read_bytes", 0), c.get("dram_read_seconds", 0)),
            "put_bytes_per_s": rate(c.get("put_bytes", 0), c.get("put_seconds", 0)),
            "evicted": int(c.get("dram_evicted", 0)),
            "dropped": int(c.get("dram_dropped", 0)),
            "evicted_bytes": int(c.get("dram_evicted_bytes", 0)),
            "free_extents": dram.allocator.free_extents,
        },
        "gets": {"misses": int(c.get("misses", 0))},
        "puts": {
            "count": int(c.get("puts", 0)),
            "idempotent": int(c.get("puts_idempotent", 0)),
            "waited": int(c.get("put_waits", 0)),
            "no_space": int(c.get("put_no_space", 0)),
        },
        "removes": int(c.get("removes", 0)),
        "promoted": int(c.get("promoted", 0)),
        "config": {"offload": config.offload, "eviction": config.eviction},
    }
    if hbm is not None:
        out["hbm"] = hbm
    if nvme is not None:
        out["nvme"] = {
            **nvme.stats(),
            "hits": int(c.get("nvme_hits", 0)),
            "read_bytes": int(c.get("nvme_read_bytes", 0)),
            "read_bytes_per_s": rate(c.get("nvme_read_bytes", 0), c.get("nvme_read_seconds", 0)),
        }
        out["offload"] = offload
        out["io_engine"] = io_engine
        out["recovery"] = recovery.as_dict()
    return out
