"""Concurrency: readers, writers, removes, the offloader and eviction at once; every read
verified byte-exact, no deadlock."""

from __future__ import annotations

import threading

from conftest import block
from gates import Gate

KiB = 1024


def test_promotion_of_bytes_read_before_an_overwrite_does_not_serve_them(make_store):
    # A reader fetched the old value of "k" from SSD and is held just before promoting it
    # to DRAM. Meanwhile "k" is overwritten with a value of the same size, the new value is
    # offloaded and evicted from DRAM. Promoting the old bytes now would serve them from
    # DRAM under the new value's checksum.
    store = make_store(dram="1MiB", promote_after_reads=1, eviction="lru")
    old, new = block(1, 256 * KiB), block(2, 256 * KiB)

    def push_out_of_dram(tag):
        # Four more 256 KiB values fill the 1 MiB arena: the oldest entry goes to SSD only.
        for i in range(4):
            store.put(f"{tag}{i}", block(100 + i, 256 * KiB))
        store.flush()
        for i in range(4):
            store.remove(f"{tag}{i}")

    store.put("k", old)
    store.flush()
    push_out_of_dram("a")
    assert store.stats()["dram"]["objects"] == 0

    promote = store._maybe_promote = Gate(store._maybe_promote, lambda k, data: k == b"k")
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get("k")))
    reader.start()
    promote.wait_reached()
    store.put("k", new, overwrite=True)
    store.flush()
    push_out_of_dram("b")
    assert store.stats()["dram"]["objects"] == 0
    promote.open()
    reader.join(10)
    assert got == [old]  # the read itself began before the overwrite
    assert store.get("k") == new
    assert store.get("k") == new  # also once served from DRAM



def test_watermark_put_waiting_on_a_fragmented_arena_gets_room(make_store):
    # DRAM usage is below the low watermark, but removes left only 100 KiB holes: a 200 KiB
    # put fits nowhere, and every object is DRAM-only (nothing evictable yet). The waiting
    # put must make the offloader write cold objects so that evicting them makes room,
    # rather than time out with NoSpaceError.
    store = make_store(dram="1MiB", offload="watermark", put_timeout_s=10.0, promote_after_reads=0)
    values = {f"k{i}": block(i, 100 * KiB) for i in range(9)}  # 88% of DRAM: below high
    for key, value in values.items():
        store.put(key, value)
    for i in (1, 3, 5, 7):
        store.remove(f"k{i}")
        del values[f"k{i}"]
    assert store.stats()["offload"]["objects"] == 0
    big = block(99, 200 * KiB)
    store.put("big", big)
    values["big"] = big
    s = store.stats()
    assert s["puts"]["waited"] >= 1 and s["puts"]["no_space"] == 0
    assert s["offload"]["objects"] >= 1 and s["dram"]["dropped"] == 0
    for key, value in values.items():
        assert store.get(key) == value

