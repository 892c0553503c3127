"""flush() under the watermark policy waits for the offload the policy has due.

A put that lifts DRAM above the high watermark only wakes the offloader; if flush() ran
before the offloader did, it found nothing queued and returned at once, leaving DRAM above
the high watermark (and promotion blocked). The store's lock is held across put and flush
here so the offloader cannot run in between: that ordering is deterministic.
"""

from __future__ import annotations

import numpy as np

BLOCK = 256 << 10


def test_flush_offloads_what_the_watermark_policy_selects(make_store):
    store = make_store(dram="4MiB", offload="watermark", high_watermark=0.75, low_watermark=0.5,
                       bucket_max_age_s=30.0)
    capacity = store.stats()["dram"]["capacity"]
    with store.parts.lock:  # sync point: the offloader cannot take the lock until flush waits
        for i in range(13):  # 3.25 MiB > 0.75 * 4 MiB
            store.put(f"k{i}", np.full(BLOCK, i, dtype=np.uint8))
        assert store.stats()["dram"]["used_bytes"] > 0.75 * capacity
        store.flush()
    stats = store.stats()
    assert stats["offload"]["objects"] > 0
    assert stats["dram"]["used_bytes"] <= 0.5 * capacity
    out = np.empty(BLOCK, dtype=np.uint8)
    for i in range(13):
        assert store.get_into(f"k{i}", out) == BLOCK and (out == i).all()
