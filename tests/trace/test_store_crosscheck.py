"""The simulator and the real Store, driven with tiny capacities on the same sequence, must
agree request by request: hits per tier, promotions, evictions, and what each tier holds.

Why they must agree exactly here (see gdskv/trace/simulator.py for the rules mirrored):

- every block has the same size, a multiple of 64, so the store's first-fit DRAM arena
  holds exactly ``dram_bytes // block`` blocks and never fragments, and every NVMe record
  (4 KiB header + value) has the same size, so its byte cap is a block count;
- each request is driven the way the simulator models it: ``get`` of its blocks in order
  until the first miss, then ``put`` of the rest, then ``flush()`` — so a partly filled
  bucket is sealed at the end of the request, as the simulator does;
- no request puts as many blocks as DRAM has slots, so a put never waits for the
  offloader: the DRAM victim is always an older block whose SSD copy is complete, whatever
  the offloader thread's timing;
- the simulator's I/O is instant, so after each put the test waits until the store's
  offloader has written every due bucket (eager) or brought DRAM back under the high
  watermark (watermark): the state the simulator reaches at once. Without that wait a
  later put of the same request may still find on NVMe a block that the pending write is
  about to evict, and be an idempotent no-op in the store but a fresh put here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

import gdskv
from gdskv.tiers.backends.record import record_size
from gdskv.trace.simulator import SimConfig, TierSimulator
from gdskv.trace.synthetic import synthetic_trace

BLOCK = 4096
RECORD = record_size(len("blk-0"), BLOCK)  # 4 KiB header + value on NVMe
DRAM_SLOTS = 8
MAX_BLOCKS = 7  # longest request: fewer blocks than DRAM slots (see the module docstring)


@pytest.fixture
def fast_store(tmp_path):
    """A store on tmpfs when there is one: the test writes hundreds of tiny buckets, each
    fsynced three times, and agreement does not depend on the disk."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    root = tempfile.mkdtemp(prefix="gdskv-crosscheck-", dir=base)
    opened = []

    def _open(**options):
        store = gdskv.open(os.path.join(root, "store"), put_timeout_s=5.0, **options)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()
    shutil.rmtree(root, ignore_errors=True)


def key(b: int) -> str:
    return f"blk-{b}"


def value(b: int) -> bytes:
    return (b % 251).to_bytes(1, "little") * BLOCK


def trace(seed: int):
    return synthetic_trace(
        160, seed=seed, conversations=24, system_prompts=3, system_blocks=1, max_new_blocks=2, max_blocks=MAX_BLOCKS
    )


def wait_until_settled(store, settled, deadline_s: float = 10.0) -> None:
    """Offload runs in the store's background thread: wait until ``settled(stats)``."""
    deadline = time.monotonic() + deadline_s
    while True:
        s = store.stats()
        if settled(s):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"offloader did not settle: {s['dram']} {s['offload']}")
        time.sleep(0.0005)


def drive_store(store, blocks, settled) -> None:
    """One request: get until the first miss, put the rest, seal what is queued."""
    out = bytearray(BLOCK)
    i = 0
    for b in blocks:
        if store.get_into(key(b), out) is None:
            break
        i += 1
    for b in blocks[i:]:
        store.put(key(b), value(b))
        if settled is not None:
            wait_until_settled(store, settled)
    store.flush()


def snapshot_store(store) -> dict:
    s = store.stats()
    out = {
        "dram_hits": s["dram"]["hits"],
        "dram_blocks": s["dram"]["objects"],
        "dram_evicted": s["dram"]["evicted"] + s["dram"]["dropped"],
        "promoted": s["promoted"],
        "nvme_hits": 0,
        "nvme_blocks": 0,
        "buckets_evicted": 0,
    }
    if "nvme" in s:
        out.update(nvme_hits=s["nvme"]["hits"], nvme_blocks=s["nvme"]["objects"], buckets_evicted=s["nvme"]["buckets_evicted"])
    return out


def snapshot_sim(sim: TierSimulator) -> dict:
    c = sim.counters
    return {
        "dram_hits": c.dram_hits,
        "dram_blocks": len(sim.dram),
        "dram_evicted": c.dram_evicted,
        "promoted": c.promoted,
        "nvme_hits": c.nvme_hits,
        "nvme_blocks": len(sim.nvme),
        "buckets_evicted": c.buckets_evicted,
    }


MiB = 1 << 20
CASES = {
    # name: store options; ssd_slots sizes the SSD in records, and "buckets" is the number of
    # blocks per bucket the store's offloader will write (the test's own expectation).
    "dram-only-lru": dict(eviction="lru", ssd_slots=0, buckets=0),
    "dram-only-fifo": dict(eviction="fifo", ssd_slots=0, buckets=0),
    "eager-lru-ssdfifo-promote2": dict(
        eviction="lru", ssd_eviction="fifo", ssd_slots=20, bucket_bytes=BLOCK, promote_after_reads=2, buckets=1
    ),
    # Buckets of 3 records, written 3 at a time once 6 blocks of values are queued.
    "eager-fifo-ssdlru-buckets3": dict(
        eviction="fifo", ssd_eviction="lru", ssd_slots=21, bucket_bytes=3 * RECORD, promote_after_reads=1, buckets=3
    ),
    # bucket_max_keys decides both when a batch is due and how large it is.
    "eager-lru-ssdlru-maxkeys2": dict(
        eviction="lru", ssd_eviction="lru", ssd_slots=20, bucket_bytes=64 * MiB, bucket_max_keys=2,
        promote_after_reads=0, buckets=2,
    ),
    # A bucket never takes more than a quarter of the SSD: 2 records of 11 here, not 3.
    "eager-lru-ssdfifo-quarter": dict(
        eviction="lru", ssd_eviction="fifo", ssd_slots=11, bucket_bytes=6 * BLOCK, promote_after_reads=2, buckets=2
    ),
    "watermark-lru-promote2": dict(
        eviction="lru", ssd_slots=20, bucket_bytes=BLOCK, offload="watermark", high_watermark=0.75,
        low_watermark=0.5, promote_after_reads=2, buckets=1,
    ),
    "watermark-fifo-ssdlru-buckets2": dict(
        eviction="fifo", ssd_eviction="lru", ssd_slots=16, bucket_bytes=2 * RECORD, offload="watermark",
        high_watermark=0.9, low_watermark=0.6, promote_after_reads=1, buckets=2,
    ),
}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_simulator_agrees_with_store(fast_store, case, seed):
    opts = dict(CASES[case])
    ssd_slots = opts.pop("ssd_slots")
    buckets = opts.pop("buckets")
    opts.setdefault("bucket_max_keys", 1024)
    options = dict(
        dram=DRAM_SLOTS * BLOCK,
        ssd=ssd_slots * RECORD,
        bucket_max_age_s=0.005 if opts.get("offload") == "watermark" else 3600.0,
        **opts,
    )
    store = fast_store(**options)
    sim = TierSimulator(SimConfig(store=store.config, block_bytes=BLOCK))
    assert (sim.dram_slots, sim.ssd_slots) == (DRAM_SLOTS, ssd_slots)
    if ssd_slots:
        assert sim.bucket_blocks == buckets
    cfg = store.config
    settled = None
    if ssd_slots and cfg.offload == "eager":
        # A due batch is written before the next put, as the simulator does at once: a
        # later put of a block that this write evicts from NVMe is then a fresh put in both.
        # The offloader takes a batch once bucket_bytes of values or bucket_max_keys
        # objects are queued (and then one batch, of `buckets` blocks).
        due = min(cfg.bucket_max_keys, -(-cfg.bucket_bytes // BLOCK))
        settled = lambda s: s["offload"]["queued"] < due and s["offload"]["in_flight"] == 0  # noqa: E731
    elif ssd_slots:
        high = cfg.high_watermark * DRAM_SLOTS * BLOCK
        settled = lambda s: (  # noqa: E731
            s["dram"]["used_bytes"] <= high and s["offload"]["queued"] == 0 and s["offload"]["in_flight"] == 0
        )
    for n, blocks in enumerate(trace(seed).block_lists()):
        drive_store(store, blocks, settled)
        sim.run([blocks])
        assert snapshot_sim(sim) == snapshot_store(store), f"request {n}: {blocks}"
    final = snapshot_sim(sim)
    # The sequence must exercise what the case is about, or agreement proves little.
    assert final["dram_evicted"] > 0 and final["dram_hits"] > 0
    if ssd_slots:
        assert final["nvme_hits"] > 0 and final["buckets_evicted"] > 0
        if cfg.promote_after_reads and cfg.offload == "watermark":
            assert final["promoted"] > 0


def test_sequence_respects_the_agreement_conditions():
    for seed in (1, 2):
        assert max(len(b) for b in trace(seed).block_lists()) == MAX_BLOCKS < DRAM_SLOTS
