"""The tier simulator: the store's placement rules, driven by a trace, with no bytes and no I/O.

It uses the store's own eviction policy objects (:func:`gdskv.tiers.policies.make_policy`:
``insert``/``touch``/``remove``/``first_victim``/``ordered``) and mirrors the rules of
:class:`gdskv.Store` that decide where a block is:

- **Request** = prefix lookup, then puts. The request's blocks are read in order while they
  hit (DRAM first, then NVMe); the first miss ends the prefix. Every block from the first
  miss on is then put: a block already in a tier is an idempotent put (no change, no touch),
  any other one goes into DRAM. This is what an engine does with ``get``/``put`` of the store.
- **DRAM**: object-level ``eviction`` policy (LRU touches on every DRAM hit). Capacity in
  blocks is ``(dram_bytes - dram_bytes % 64) // round_up(block_bytes, 64)``, exactly what the
  store's first-fit arena holds when every block has the same size. A put into a full DRAM
  evicts the first *evictable* block in policy order: with an SSD tier only blocks whose SSD
  copy is complete (or was since evicted there) are evictable; without one, any block
  (dropped). Evicting a block forgets its NVMe read count, as the store does.
- **Offload, eager**: every put is queued; once the queue holds ``bucket_bytes`` of values
  or ``bucket_max_keys`` blocks, buckets are written from its front, each taking as many
  records as fit in ``min(bucket_bytes, ssd_bytes // 4)`` (at least one) — the store's
  offloader rules, taken from :mod:`gdskv.store.offload_rule`. **Watermark**: when a put takes DRAM above ``high_watermark``,
  evictable blocks go first, then the coldest DRAM-only blocks are written to SSD and evicted
  until usage reaches ``low_watermark`` — the rule of the store's offloader (``Offloader._select``).
- **NVMe**: buckets of blocks, evicted whole in ``ssd_eviction`` order (LRU touches the
  bucket of every NVMe hit) under the ``ssd_bytes`` cap, counting each record's on-disk size
  (:func:`gdskv.tiers.backends.record.record_size`: 4 KiB-aligned header and value). A block
  evicted from NVMe while still in DRAM stays there, evictable, and is never re-offloaded.
- **Promotion**: a block read from NVMe ``promote_after_reads`` times is copied back into
  DRAM if that keeps DRAM at or below ``high_watermark`` and a slot is free (no eviction).

Note what follows from the store's rules: with eager offload DRAM stays full once warm
(blocks leave only when a put needs room), so promotion, which needs DRAM below the high
watermark, hardly ever happens; with watermark offload it does.

Where it simplifies (all I/O is instant; these are the consequences):

- A due bucket is written inside the put that makes it due. The store's offloader may lag
  behind the puts; a later put of the same request can then still find on NVMe a block
  that the pending write is about to evict (an idempotent put there, a fresh one here).
- A partly filled bucket is written at the end of each request (the store writes it once its
  oldest block waited ``bucket_max_age_s``, 0.2 s by default: shorter than a prefill).
  Watermark offload happens at once inside the put that crosses the high watermark (the
  store does it in the background right after).
- A put that finds DRAM full of blocks still queued for SSD writes one bucket of the queue
  and goes on (the store's put waits for the offloader to do the same).
- Every block has the same size, ``block_bytes`` (engines allocate whole pages); the
  arena's fragmentation with mixed sizes is not modelled. No HBM tier, no remote nodes.

With ``block_bytes`` a multiple of 64, requests shorter than the DRAM tier (in blocks), and
the store's offloader caught up after each put and flushed after each request, the store
and this simulator agree exactly: tests/trace/test_store_crosscheck.py checks hits per
tier, promotions, evictions and tier contents request by request.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

from gdskv.config import StoreConfig, format_size
from gdskv.errors import ConfigError
from gdskv.store.offload_rule import batch_limit_bytes, keys_per_full_batch
from gdskv.tiers.backends.record import record_size
from gdskv.tiers.dram import DRAM_ALIGNMENT
from gdskv.tiers.policies import EvictionPolicy, make_policy

# DRAM entry states. The store's SsdState has ON_SSD and LOST; here both are OFFLOADED, and
# "still on NVMe" is simply ``block in nvme`` (a block is in at most one live bucket).
NONE, PENDING, OFFLOADED = 0, 1, 2

#: Key length assumed for the on-disk record header (an engine's prefix-hash key).
DEFAULT_KEY_BYTES = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What a simulation needs: the store's configuration and the size of one block."""

    #: Tiers and policies, exactly as the store takes them. Default: ``StoreConfig()``.
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    #: Bytes of KV in one block (block tokens x KV bytes per token). Required.
    block_bytes: int
    #: Encoded key length, which sizes each on-disk record header. Default 32.
    key_bytes: int = DEFAULT_KEY_BYTES

    def __post_init__(self) -> None:
        if type(self.block_bytes) is not int or self.block_bytes <= 0:
            raise ConfigError("block size must be a positive byte count", field="block_bytes", got=self.block_bytes)
        if type(self.key_bytes) is not int or not 0 < self.key_bytes <= 4096:
            raise ConfigError("key length must be 1..4096 bytes", field="key_bytes", got=self.key_bytes)


@dataclasses.dataclass
class SimCounters:
    """What happened, in blocks (and buckets for the NVMe tier)."""

    requests: int = 0
    accesses: int = 0
    dram_hits: int = 0
    nvme_hits: int = 0
    misses: int = 0
    puts: int = 0  # blocks that entered the cache (absent from every tier)
    promoted: int = 0  # NVMe blocks copied back into DRAM
    offloaded: int = 0  # blocks written to NVMe
    buckets_written: int = 0
    dram_evicted: int = 0  # blocks that left DRAM
    nvme_evicted: int = 0  # blocks that left NVMe (with their bucket)
    buckets_evicted: int = 0
    dropped: int = 0  # blocks that left the cache entirely

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


def _largest_n(limit: float, step: int, offset: int = 0) -> int:
    """The largest n >= -1 with ``n * step + offset <= limit`` under the store's float compare."""
    n = int(max(limit - offset, -step) // step)
    while (n + 1) * step + offset <= limit:
        n += 1
    while n >= 0 and n * step + offset > limit:
        n -= 1
    return n


class TierSimulator:
    """DRAM + NVMe placement driven block by block. See the module docstring.

    ``run(block_lists)`` replays requests (each a list of prefix-chained block ids) and
    accumulates :attr:`counters`; it may be called again to continue the same simulation.

    State: ``dram`` maps a block to its state (NONE: DRAM only; PENDING: queued for SSD;
    OFFLOADED: written to SSD, evictable). ``nvme`` maps a block to the bucket holding it;
    a bucket is named after its first block (unique: a block is in at most one live
    bucket), and ``buckets`` lists the blocks of buckets holding more than one — a bucket
    named ``b`` that is not listed holds ``b`` alone. NVMe usage is ``len(nvme)`` records.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        cfg = config.store
        size = config.block_bytes
        self.block_bytes = size
        self.dram_policy: EvictionPolicy = make_policy(cfg.eviction)
        capacity = cfg.dram_bytes - cfg.dram_bytes % DRAM_ALIGNMENT
        rounded = -(-size // DRAM_ALIGNMENT) * DRAM_ALIGNMENT
        self.dram_slots = capacity // rounded
        if size > cfg.dram_bytes or self.dram_slots == 0:
            raise ConfigError(
                "a block is larger than the DRAM tier", block=format_size(size), dram=format_size(cfg.dram_bytes)
            )
        high = cfg.high_watermark * capacity
        low = cfg.low_watermark * capacity
        self._high_n = _largest_n(high, rounded)  # used > high  <=>  n > _high_n
        self._low_n = _largest_n(low, rounded)  # used <= low  <=>  n <= _low_n
        self._promote_n = _largest_n(high, rounded, size)  # used + size <= high  <=>  n <= _promote_n
        self._low_bytes = low
        self._rounded = rounded

        self.has_ssd = cfg.has_ssd
        self.ssd_policy: Optional[EvictionPolicy] = make_policy(cfg.ssd_eviction) if self.has_ssd else None
        self.record_bytes = record_size(config.key_bytes, size)
        # The store's offloader takes a batch once the queue is full (offload_rule.batch_full);
        # a batch takes records (on-disk sizes) while they fit in batch_limit_bytes, and at
        # least one.
        limit = batch_limit_bytes(cfg.offloader, cfg.ssd_bytes)
        per_bucket = min(cfg.bucket_max_keys, max(1, limit // self.record_bytes))
        self.bucket_blocks = per_bucket
        self._due_n = keys_per_full_batch(size, cfg.offloader)
        if self.has_ssd and self.record_bytes > cfg.ssd_bytes:
            raise ConfigError(
                "a block is larger than the NVMe tier",
                record=format_size(self.record_bytes),
                ssd=format_size(cfg.ssd_bytes),
            )
        self.ssd_slots = cfg.ssd_bytes // self.record_bytes if self.has_ssd else 0
        self._promote_after = cfg.promote_after_reads if self.has_ssd else 0
        self._eager = cfg.offload == "eager"
        if self.has_ssd and not self._eager and self._low_n >= self.dram_slots:
            raise ConfigError(
                "low_watermark leaves no DRAM slot free: watermark offload could never make room",
                low_watermark=cfg.low_watermark,
                dram_slots=self.dram_slots,
            )

        self.dram: Dict[int, int] = {}
        self.nvme: Dict[int, int] = {}
        self.buckets: Dict[int, List[int]] = {}
        self._pending: List[int] = []  # blocks queued for SSD (eager), oldest first
        self._nvme_reads: Dict[int, int] = {}
        self.counters = SimCounters()

    # ------------------------------------------------------------------ the hot loop

    def run(self, block_lists: Sequence[Sequence[int]]) -> SimCounters:
        """Replay requests in order; returns the (accumulated) counters.

        One loop with everything bound to locals: this is what must run at millions of
        block accesses per second. Eager offload with one block per bucket (the usual case:
        a KV block is as large as a bucket) writes the bucket inline; the rare paths (a
        full DRAM of queued blocks, multi-block buckets, watermark offload, promotion) are
        methods.
        """
        dram = self.dram
        nvme = self.nvme
        d_touch = self.dram_policy.touch
        d_insert = self.dram_policy.insert
        d_remove = self.dram_policy.remove
        d_first = self.dram_policy.first_victim
        ssd = self.ssd_policy
        s_touch = ssd.touch if ssd is not None else None
        s_insert = ssd.insert if ssd is not None else None
        s_remove = ssd.remove if ssd is not None else None
        s_first = ssd.first_victim if ssd is not None else None
        buckets = self.buckets
        pending = self._pending
        slots = self.dram_slots
        ssd_slots = self.ssd_slots
        has_ssd = self.has_ssd
        eager = has_ssd and self._eager
        # Eager, one block per bucket: each put's bucket is written at once.
        direct = eager and self._due_n == 1
        evictable = OFFLOADED if has_ssd else NONE
        due_n = self._due_n
        high_n = self._high_n
        promote_after = self._promote_after
        nvme_reads = self._nvme_reads
        dram_hits = nvme_hits = accesses = puts = requests = written = 0
        for blocks in block_lists:
            requests += 1
            n = len(blocks)
            accesses += n
            i = 0
            # Prefix lookup: DRAM, then NVMe, until the first miss.
            for b in blocks:
                if b in dram:
                    d_touch(b)
                    dram_hits += 1
                else:
                    bucket = nvme.get(b)
                    if bucket is None:
                        break
                    s_touch(bucket)  # type: ignore[misc]
                    nvme_hits += 1
                    if promote_after:
                        reads = nvme_reads.get(b, 0) + 1
                        nvme_reads[b] = reads
                        if reads >= promote_after:
                            self._promote(b)
                i += 1
            if i == n:
                continue
            # Puts from the first miss on.
            for b in blocks[i:] if i else blocks:
                if b in dram or b in nvme:
                    continue
                puts += 1
                if len(dram) >= slots:
                    victim = d_first()
                    if dram[victim] < evictable:
                        self._make_room()
                    else:
                        del dram[victim]
                        d_remove(victim)
                        if nvme_reads:
                            nvme_reads.pop(victim, None)
                if direct:
                    dram[b] = OFFLOADED
                    d_insert(b)
                    while len(nvme) >= ssd_slots:
                        victim = s_first()  # type: ignore[misc]
                        s_remove(victim)  # type: ignore[misc]
                        if buckets and victim in buckets:
                            for g in buckets.pop(victim):
                                del nvme[g]
                        else:
                            del nvme[victim]
                    s_insert(b)  # type: ignore[misc]
                    nvme[b] = b
                    written += 1
                elif eager:
                    dram[b] = PENDING
                    d_insert(b)
                    pending.append(b)
                    if len(pending) >= due_n:
                        self._write_due()
                else:
                    dram[b] = NONE
                    d_insert(b)
                    if has_ssd and len(dram) > high_n:
                        self._watermark_offload()
            if pending:
                self._offload(len(pending))
        c = self.counters
        c.requests += requests
        c.accesses += accesses
        c.dram_hits += dram_hits
        c.nvme_hits += nvme_hits
        c.misses = c.accesses - c.dram_hits - c.nvme_hits
        c.puts += puts
        c.buckets_written += written
        c.offloaded += written
        # What left each tier follows from what entered it and what is there now.
        c.dram_evicted = c.puts + c.promoted - len(dram)
        c.nvme_evicted = c.offloaded - len(nvme)
        c.buckets_evicted = c.buckets_written - (len(ssd) if ssd is not None else 0)
        c.dropped = c.puts - len(dram) - sum(1 for b in nvme if b not in dram)
        return c

    # ------------------------------------------------------------------ DRAM

    def _evict(self, name: int) -> None:
        del self.dram[name]
        self.dram_policy.remove(name)
        self._nvme_reads.pop(name, None)

    def _first_evictable(self) -> Optional[int]:
        dram = self.dram
        for name in self.dram_policy.ordered():
            if dram[name] == OFFLOADED:
                return name
        return None

    def _make_room(self) -> None:
        """Free one DRAM slot when the first block in policy order is not evictable."""
        victim = self._first_evictable()
        if victim is None:
            # DRAM is full of blocks not yet on SSD: the store's put waits while the
            # offloader writes the oldest queued bucket (eager) or offloads the coldest
            # blocks down to the low watermark (watermark); simulated as done at once.
            if self._pending:
                self._offload(min(self.bucket_blocks, len(self._pending)))
            else:
                self._watermark_offload()
                if len(self.dram) < self.dram_slots:
                    return
            victim = self._first_evictable()
            assert victim is not None  # a bucket was just written from DRAM
        self._evict(victim)

    def _evict_down_to_low(self) -> None:
        """Evict evictable blocks in policy order until usage is at the low watermark."""
        dram = self.dram
        excess = len(dram) - self._low_n
        if excess <= 0:
            return
        # Usually few (or no) DRAM blocks are on SSD in watermark mode: count them in C
        # first, so the walk in policy order can stop as soon as it has them all.
        want = min(excess, list(dram.values()).count(OFFLOADED))
        if not want:
            return
        victims = []
        for name in self.dram_policy.ordered():
            if dram[name] == OFFLOADED:
                victims.append(name)
                if len(victims) == want:
                    break
        remove = self.dram_policy.remove
        reads = self._nvme_reads
        for name in victims:
            del dram[name]
            remove(name)
            if reads:
                reads.pop(name, None)

    def _watermark_offload(self) -> None:
        """Watermark policy: evict what is on SSD, then offload the coldest DRAM-only blocks
        (and evict them) until usage reaches the low watermark."""
        self._evict_down_to_low()
        dram = self.dram
        projected = len(dram) * self._rounded
        low = self._low_bytes
        if projected <= low:
            return
        size = self.block_bytes
        chosen = []
        for name in self.dram_policy.ordered():
            if dram[name] == NONE:
                chosen.append(name)
                projected -= size
                if projected <= low:
                    break
        self._pending.extend(chosen)
        self._offload(len(chosen))
        # The store now evicts down to the low watermark in policy order. Everything that
        # was evictable before went in the first step (usage stayed above low), so the
        # evictable blocks are exactly ``chosen``, and ``chosen`` is in policy order.
        remove = self.dram_policy.remove
        reads = self._nvme_reads
        for name in chosen[: len(dram) - self._low_n]:
            del dram[name]
            remove(name)
            if reads:
                reads.pop(name, None)

    def _promote(self, block: int) -> None:
        dram = self.dram
        if len(dram) > self._promote_n or len(dram) >= self.dram_slots:
            return
        del self._nvme_reads[block]
        dram[block] = OFFLOADED
        self.dram_policy.insert(block)
        self.counters.promoted += 1

    # ------------------------------------------------------------------ NVMe

    def _write_due(self) -> None:
        """Eager: write full buckets while the queue is due (as the offloader does)."""
        while len(self._pending) >= self._due_n:
            self._offload(self.bucket_blocks)

    def _offload(self, count: int) -> None:
        """Write the first ``count`` queued blocks as buckets of up to ``bucket_blocks``,
        each after evicting whole buckets in policy order until it fits.

        Every record has the same on-disk size, so the store's byte test
        ``used + bucket > ssd_bytes`` is ``blocks on NVMe + blocks in bucket > ssd_slots``.
        """
        policy = self.ssd_policy
        assert policy is not None
        first, remove, insert = policy.first_victim, policy.remove, policy.insert
        nvme = self.nvme
        dram = self.dram
        buckets = self.buckets
        ssd_slots = self.ssd_slots
        per_bucket = self.bucket_blocks
        queue = self._pending[:count]
        del self._pending[:count]
        if per_bucket == 1:
            for b in queue:
                while len(nvme) >= ssd_slots:
                    victim = first()
                    remove(victim)
                    if buckets and victim in buckets:
                        for g in buckets.pop(victim):
                            del nvme[g]
                    else:
                        del nvme[victim]
                insert(b)
                nvme[b] = b
                dram[b] = OFFLOADED  # a queued block is still in DRAM: PENDING is not evictable
            written = count
        else:
            written = 0
            for start in range(0, count, per_bucket):
                blocks = queue[start : start + per_bucket]
                k = len(blocks)
                while len(nvme) + k > ssd_slots:
                    victim = first()
                    remove(victim)
                    for g in buckets.pop(victim, None) or (victim,):
                        del nvme[g]
                bucket = blocks[0]
                if k > 1:
                    buckets[bucket] = blocks
                insert(bucket)
                for b in blocks:
                    nvme[b] = bucket
                    dram[b] = OFFLOADED
                written += 1
        self.counters.offloaded += count
        self.counters.buckets_written += written

    # ------------------------------------------------------------------ queries

    @property
    def nvme_used_bytes(self) -> int:
        return len(self.nvme) * self.record_bytes
