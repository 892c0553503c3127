"""The store's cluster hooks: listeners (stored / evicting, two-phase), borrow, promote,
offload, inventory."""

import threading

import pytest

from conftest import block
from gdskv.errors import NoSpaceError
from gdskv.store import StoreListener
from gdskv.tiers.backends.record import checksum
from gdskv.types import Tier

KiB = 1024


class Recorder(StoreListener):
    """Records events; while an eviction is reported, checks the bytes are still held."""

    def __init__(self, store):
        self.store = store
        self.events = []
        self.held_during_eviction = []

    def on_stored(self, tier, items):
        self.events.append(("stored", tier, list(items)))

    def on_evicting(self, tier, keys):
        self.events.append(("evicting", tier, list(keys)))
        for key in keys:
            if tier is Tier.DRAM:
                entry = self.store.parts.dram.entries.get(key)
                self.held_during_eviction.append(entry is not None and entry.complete and entry.offset >= 0)
            else:  # the backend's lock is held by this thread: read its index directly
                self.held_during_eviction.append(key in self.store.parts.nvme._objects)

    def keys(self, kind, tier):
        return [
            item[0] if kind == "stored" else item
            for k, t, items in self.events
            if k == kind and t is tier
            for item in items
        ]


def test_put_reports_dram_then_offload_reports_nvme_with_the_store_checksum(make_store):
    store = make_store()
    rec = Recorder(store)
    store.add_listener(rec)
    value = block(1, 10 * KiB)
    store.put("a", value)
    assert rec.events == [("stored", Tier.DRAM, [(b"a", len(value), checksum(b"a", value))])]
    store.flush()
    assert ("stored", Tier.NVME, [(b"a", len(value), checksum(b"a", value))]) in rec.events
    store.put("a", value)  # idempotent: nothing new is readable
    assert len(rec.keys("stored", Tier.DRAM)) == 1


def test_dram_eviction_is_reported_before_the_entry_is_freed(make_store):
    store = make_store(dram="256KiB", ssd="4MiB")
    rec = Recorder(store)
    store.add_listener(rec)
    for i in range(12):
        store.put(f"k{i}", block(i, 64 * KiB))
        store.flush()  # on SSD: evictable
    evicted = rec.keys("evicting", Tier.DRAM)
    assert evicted, "DRAM never filled up"
    assert all(rec.held_during_eviction)
    for key in evicted:
        entry = store.parts.dram.entries.get(key)
        assert entry is None or not entry.complete or entry.offset >= 0  # gone (or put back by promotion)
        assert store.get(key) == block(int(key[1:]), 64 * KiB)  # still on NVMe


def test_nvme_bucket_eviction_is_reported_before_the_bucket_goes(make_store):
    store = make_store(dram="1MiB", ssd="512KiB", bucket_bytes=128 * KiB)
    rec = Recorder(store)
    store.add_listener(rec)
    for i in range(20):
        store.put(f"k{i}", block(i, 60 * KiB))
        store.flush()
    evicted = rec.keys("evicting", Tier.NVME)
    assert evicted, "the NVMe tier never filled up"
    assert all(rec.held_during_eviction)
    for key in evicted:
        assert key not in store.parts.nvme._objects or any(
            key in items for kind, tier, items in rec.events if kind == "stored" and tier is Tier.NVME
        )


def test_a_failing_listener_does_not_break_the_store(make_store):
    store = make_store()

    class Broken(StoreListener):
        def on_stored(self, tier, items):
            raise RuntimeError("boom")

    store.add_listener(Broken())
    store.put("k", b"value")
    assert store.get("k") == b"value"


def test_removed_listener_hears_nothing(make_store):
    store = make_store()
    rec = Recorder(store)
    store.add_listener(rec)
    store.remove_listener(rec)
    store.put("k", b"v")
    assert rec.events == []


def test_borrow_gives_zero_copy_views_and_pins_them(make_store):
    store = make_store(dram="256KiB", ssd=0)
    values = {f"k{i}": block(i, 64 * KiB) for i in range(3)}
    for key, value in values.items():
        store.put(key, value)
    with store.borrow(["k0", "absent", "k2"]) as found:
        assert found[1] is None
        view, crc = found[0]
        assert bytes(view) == values["k0"] and crc == checksum(b"k0", values["k0"])
        assert view.readonly
        # DRAM is nearly full: new puts evict, but never the pinned entries.
        for i in range(3, 8):
            store.put(f"k{i}", block(i, 64 * KiB))
        assert bytes(view) == values["k0"] and bytes(found[2][0]) == values["k2"]
        assert store.exists("k0") and store.exists("k2")
    store.put("k9", block(9, 64 * KiB))
    store.put("k10", block(10, 64 * KiB))
    assert not store.exists("k0")  # unpinned: evictable again


def test_borrow_pins_block_puts_that_need_the_room(make_store):
    store = make_store(dram="128KiB", ssd=0, put_timeout_s=0.05)
    store.put("a", block(1, 64 * KiB))
    store.put("b", block(2, 64 * KiB))
    with store.borrow(["a", "b"]):
        with pytest.raises(NoSpaceError):
            store.put("c", block(3, 64 * KiB))
    store.put("c", block(3, 64 * KiB))


def test_promote_copies_an_nvme_only_object_into_dram(make_store):
    store = make_store(dram="256KiB", ssd="4MiB", promote_after_reads=0)
    rec = Recorder(store)
    store.add_listener(rec)
    for i in range(8):
        store.put(f"k{i}", block(i, 64 * KiB))
        store.flush()
    cold = rec.keys("evicting", Tier.DRAM)[0]
    assert cold not in store.parts.dram.entries
    assert not store.promote(cold)  # DRAM is above its high watermark
    for i in range(5, 8):
        store.remove(f"k{i}")
    assert store.promote(cold)
    assert store.parts.dram.readable(cold) is not None
    assert rec.keys("stored", Tier.DRAM)[-1] == cold
    assert not store.promote(cold)  # already in DRAM
    assert not store.promote("absent")
    assert store.get(cold) == block(int(cold[1:]), 64 * KiB)


def test_offload_queues_dram_only_objects_under_the_watermark_policy(make_store):
    store = make_store(offload="watermark")
    store.put("a", block(1, 4 * KiB))
    store.put("b", block(2, 4 * KiB))
    store.flush()
    assert store.stats()["nvme"]["objects"] == 0
    assert store.offload(["a", "absent"]) == 1
    assert store.offload(["a"]) == 0  # already queued
    store.flush()
    assert store.stats()["nvme"]["objects"] == 1


def test_inventory_lists_every_tier_with_size_and_crc(make_store, tmp_path):
    store = make_store()
    store.put("a", b"aaaa")
    store.flush()
    store.put("b", b"bb")
    inv = sorted(store.inventory(), key=lambda r: (r[0], r[1].value))
    assert inv == [
        (b"a", Tier.DRAM, 4, checksum(b"a", b"aaaa")),
        (b"a", Tier.NVME, 4, checksum(b"a", b"aaaa")),
        (b"b", Tier.DRAM, 2, checksum(b"b", b"bb")),
    ]


def test_listener_sees_concurrent_puts_in_commit_order(make_store):
    store = make_store(dram="8MiB")
    rec = Recorder(store)
    store.add_listener(rec)

    def writer(t):
        for i in range(50):
            store.put(f"t{t}-{i}", block(t * 100 + i, 1 * KiB))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(rec.keys("stored", Tier.DRAM)) == sorted(f"t{t}-{i}".encode() for t in range(4) for i in range(50))
