"""The master's state: nodes with leases, objects and their replicas, hotness, mailboxes.

A plain, thread-safe data structure (one lock); :mod:`gdskv.master.service` puts gRPC in
front of it. Nothing here does I/O, so it can be tested and benchmarked alone. Every
request is validated as a whole before anything changes, so a bad request changes nothing.

Primitives and their contracts (``now`` is ``time.monotonic()``, passed in for testing):

- ``register_node(info, now)``: (re)join; a node already known is reset (its replicas and
  mailbox dropped: the node re-registers what it holds right after), but for its removals
  still pending: those stay, so a key removed while the node was down does not come back
  with it (its re-registration is an echo, and the removal task is handed out again).
- ``heartbeat(node_id, usage, accesses, now) -> Tasks``: renews the lease, records usage and
  access counts, hands out mailbox tasks. :class:`UnknownNodeError` if the node is not known
  (the master restarted, or the node was dropped after its lease and grace ran out).
- ``update_replicas(node_id, batches, now)``: ordered REGISTER / UNREGISTER runs. A
  registration of a value different from the one other nodes hold under the key is refused
  (returned in ``conflicts``); a registration completes the node's WRITING reservation.
- ``lookup(keys, count_access, now)``: for each key, its COMPLETE replicas on nodes with a
  live lease, best tier first. WRITING and EVICTING replicas are never returned.
- ``prepare_put(node_id, keys, sizes, crcs, now)``: per key PLACED (a WRITING replica is
  reserved on the given node, or on the live node with the most free DRAM), EXISTS (same
  size and crc already COMPLETE) or CONFLICT.
- ``remove(keys, now)``: replicas become EVICTING (no longer handed out) and each holder
  gets a removal task; the records go when the holder unregisters them (or is dropped).
- ``expire(now)``: drop nodes past lease + grace, and WRITING reservations past their timeout.

Two-phase eviction: a node unregisters a replica *before* deleting its bytes, so a lookup
answered after the unregistration never sends a reader there.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from gdskv.errors import InvalidKeyError, InvalidValueError, NoSpaceError, UnknownNodeError
from gdskv.master.config import MasterConfig
from gdskv.master.hotness import DecayClock, Heat
from gdskv.master.mailbox import Mailbox
from gdskv.master.model import (
    COMPLETE,
    CONFLICT,
    DRAM,
    EVICTING,
    EXISTS,
    NVME,
    PLACED,
    REGISTER,
    TIERS,
    UNREGISTER,
    WRITING,
    LookupResult,
    NodeView,
    PlaceResult,
    RemoveResult,
    ReplicaBatch,
    Tasks,
    Usage,
)

class NodeEntry:
    __slots__ = (
        "node_id", "address", "transport", "dram_capacity", "dram_used", "nvme_capacity",
        "nvme_used", "expires", "reserved", "keys", "mailbox",
    )

    def __init__(self, info: "NodeView", expires: float) -> None:
        self.node_id = info.node_id
        self.address = info.address
        self.transport = info.transport
        self.dram_capacity = info.dram_capacity
        self.dram_used = info.dram_used
        self.nvme_capacity = info.nvme_capacity
        self.nvme_used = info.nvme_used
        self.expires = expires
        self.reserved = 0  # bytes placed here since the last heartbeat
        self.keys: Dict[bytes, None] = {}  # keys with at least one replica here
        self.mailbox = Mailbox()

    def view(self, now: float) -> "NodeView":
        return NodeView(
            node_id=self.node_id, address=self.address, transport=self.transport,
            dram_capacity=self.dram_capacity, dram_used=self.dram_used,
            nvme_capacity=self.nvme_capacity, nvme_used=self.nvme_used,
            lease_remaining_s=self.expires - now, replicas=len(self.keys),
        )


class Replica:
    __slots__ = ("node", "tier", "state", "size", "crc")

    def __init__(self, node: NodeEntry, tier: int, state: int, size: int, crc: int) -> None:
        self.node = node
        self.tier = tier
        self.state = state
        self.size = size
        self.crc = crc


class Obj:
    __slots__ = ("replicas", "heat", "task_at")

    def __init__(self, replicas: Optional[List[Replica]] = None) -> None:
        self.replicas: List[Replica] = replicas if replicas is not None else []  # sorted by tier, fastest first
        self.heat: Optional[Heat] = None  # created on first access
        self.task_at = 0.0  # when a promotion/offload task was last queued (0: none pending)


class Registry:
    """Nodes, objects, replicas, hotness and mailboxes. See the module docstring."""

    def __init__(self, config: Optional[MasterConfig] = None) -> None:
        self.config = config or MasterConfig()
        self._lock = threading.Lock()
        self._nodes: Dict[str, NodeEntry] = {}
        self._objects: Dict[bytes, Obj] = {}
        self._writing: Dict[Tuple[NodeEntry, bytes], float] = {}  # WRITING reservations, oldest first
        self._clock = DecayClock(self.config.heat_half_life_s)
        self._trigger = min(self.config.promote_threshold, self.config.offload_threshold)
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ nodes

    def register_node(self, info: NodeView, now: float) -> None:
        _check_node_id(info.node_id)
        if not info.address:
            raise InvalidValueError("node needs a data address", node_id=info.node_id)
        with self._lock:
            old = self._nodes.get(info.node_id)
            removing: List[Tuple[bytes, Replica]] = []  # the old entry's removals still pending
            if old is not None:
                removing = [
                    (key, r) for key in old.keys for r in self._objects[key].replicas
                    if r.node is old and r.state == EVICTING
                ]
                self._drop_node(old)
                self.counters["nodes_reset"] += 1
            node = self._nodes[info.node_id] = NodeEntry(info, now + self.config.lease_s)
            for key, r in removing:
                obj = self._objects.setdefault(key, Obj())
                obj.replicas.append(Replica(node, r.tier, EVICTING, r.size, r.crc))
                obj.replicas.sort(key=_tier_of)
                node.keys[key] = None
                node.mailbox.put("remove", key)
            self.counters["nodes_registered"] += 1

    def deregister_node(self, node_id: str) -> bool:
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return False
            self._drop_node(node)
            self.counters["nodes_deregistered"] += 1
            return True

    def heartbeat(
        self, node_id: str, usage: Usage, accessed: Sequence[bytes], counts: Sequence[int], now: float
    ) -> Tasks:
        if len(accessed) != len(counts):
            raise InvalidValueError("accessed keys and counts differ in length", keys=len(accessed), counts=len(counts))
        self._check_keys(accessed)
        cfg = self.config
        with self._lock:
            node = self._node(node_id)
            node.expires = now + cfg.lease_s
            node.dram_used, node.dram_capacity = usage.dram_used, usage.dram_capacity
            node.nvme_used, node.nvme_capacity = usage.nvme_used, usage.nvme_capacity
            node.reserved = 0
            self._touch_many(accessed, counts, now)
            box = node.mailbox
            tasks = Tasks(
                offload=box.take("offload", cfg.offloads_per_heartbeat),
                promote=box.take("promote", cfg.promotions_per_heartbeat),
                remove=box.take("remove", cfg.removals_per_heartbeat),
            )
            self.counters["heartbeats"] += 1
            self.counters["tasks_offload"] += len(tasks.offload)
            self.counters["tasks_promote"] += len(tasks.promote)
            self.counters["tasks_remove"] += len(tasks.remove)
            return tasks

    def _node(self, node_id: str) -> NodeEntry:
        node = self._nodes.get(node_id)
        if node is None:
            raise UnknownNodeError("unknown node", node_id=node_id)
        return node

    def _drop_node(self, node: NodeEntry) -> None:
        """Forget ``node`` and every replica it holds. Lock held."""
        for key in node.keys:
            obj = self._objects.get(key)
            if obj is None:
                continue
            obj.replicas = [r for r in obj.replicas if r.node is not node]
            if not obj.replicas:
                del self._objects[key]
        node.keys = {}
        for pair in [p for p in self._writing if p[0] is node]:
            del self._writing[pair]
        if self._nodes.get(node.node_id) is node:
            del self._nodes[node.node_id]

    def expire(self, now: float) -> int:
        """Drop nodes past lease + grace and stale WRITING reservations; return nodes dropped."""
        grace = self.config.effective_grace_s
        with self._lock:
            dead = [n for n in self._nodes.values() if n.expires + grace < now]
            for node in dead:
                self._drop_node(node)
            self.counters["nodes_expired"] += len(dead)
            limit = now - self.config.writing_timeout_s
            while self._writing:
                (node, key), since = next(iter(self._writing.items()))
                if since > limit:
                    break
                self._drop_replicas(node, key, lambda r: r.state == WRITING)
                self._writing.pop((node, key), None)
                self.counters["writing_expired"] += 1
            return len(dead)

    def list_nodes(self, now: float) -> Tuple[List[NodeView], int, int]:
        with self._lock:
            views = [n.view(now) for n in self._nodes.values()]
            replicas = sum(len(o.replicas) for o in self._objects.values())
            return views, len(self._objects), replicas

    # ------------------------------------------------------------------ replicas

    def update_replicas(self, node_id: str, batches: Sequence[ReplicaBatch], now: float) -> Tuple[int, int, List[bytes]]:
        """Apply ordered REGISTER/UNREGISTER runs; return (registered, unregistered, conflicts)."""
        for batch in batches:
            self._check_batch(batch)
        registered = unregistered = 0
        conflicts: List[bytes] = []
        with self._lock:
            node = self._node(node_id)
            for batch in batches:
                if batch.op == REGISTER:
                    objects, tier, node_keys = self._objects, batch.tier, node.keys
                    cancel = bool(node.mailbox.remove)
                    for key, size, crc in zip(batch.keys, batch.sizes, batch.crcs):
                        if not cancel and key not in objects:  # the common case: a new object
                            objects[key] = Obj([Replica(node, tier, COMPLETE, size, crc)])
                            node_keys[key] = None
                            registered += 1
                        elif self._register(node, tier, key, size, crc, now):
                            registered += 1
                        else:
                            conflicts.append(key)
                else:
                    for key in batch.keys:
                        unregistered += self._unregister(node, batch.tier, key)
            self.counters["registered"] += registered
            self.counters["unregistered"] += unregistered
            self.counters["conflicts"] += len(conflicts)
        return registered, unregistered, conflicts

    def _register(self, node: NodeEntry, tier: int, key: bytes, size: int, crc: int, now: float) -> bool:
        obj = self._objects.get(key)
        if obj is None:  # the common case: a new object, nothing to reconcile
            obj = self._objects[key] = Obj()
            obj.replicas.append(Replica(node, tier, COMPLETE, size, crc))
            node.keys[key] = None
            if node.mailbox.remove:
                node.mailbox.cancel("remove", key)
            return True
        exact: Optional[Replica] = None
        writing: Optional[Replica] = None
        for r in obj.replicas:
            if r.node is node:
                if r.state == WRITING:
                    writing = r
                elif r.tier == tier:
                    exact = r
            elif r.state != EVICTING and r.node.expires > now and (r.size != size or r.crc != crc):
                return False  # another node holds (or is writing) another value
        if writing is None and any(r.node is node and r.state == EVICTING for r in obj.replicas):
            # An echo of the removed value (an offload or a promotion finishing after the
            # removal): the key stays removed; a new put would have reserved a WRITING replica.
            self.counters["echoes_ignored"] += 1
            return True
        mine = exact or writing
        # The node's other records of this key are stale if they hold another value (its
        # store keeps one value per key), and a reservation is done once a replica exists.
        drop = [
            r for r in obj.replicas
            if r.node is node and r is not mine and (r.state == WRITING or r.size != size or r.crc != crc)
        ]
        if drop:
            obj.replicas = [r for r in obj.replicas if r not in drop]
        if mine is None:
            mine = Replica(node, tier, COMPLETE, size, crc)
            obj.replicas.append(mine)
        else:
            mine.tier, mine.state, mine.size, mine.crc = tier, COMPLETE, size, crc
        if writing is not None:
            self._writing.pop((node, key), None)
        obj.replicas.sort(key=_tier_of)
        node.keys[key] = None
        node.mailbox.cancel("remove", key)
        obj.task_at = 0.0
        return True

    def _unregister(self, node: NodeEntry, tier: int, key: bytes) -> int:
        dropped = self._drop_replicas(node, key, (lambda r: True) if tier == 0 else (lambda r: r.tier == tier))
        if dropped and key not in node.keys:
            node.mailbox.cancel("remove", key)
            self._writing.pop((node, key), None)
        return dropped

    def _drop_replicas(self, node: NodeEntry, key: bytes, which) -> int:
        """Drop ``node``'s replicas of ``key`` that ``which`` accepts. Lock held."""
        obj = self._objects.get(key)
        if obj is None:
            return 0
        keep = [r for r in obj.replicas if r.node is not node or not which(r)]
        dropped = len(obj.replicas) - len(keep)
        obj.replicas = keep
        if not any(r.node is node for r in keep):
            node.keys.pop(key, None)
        if not keep:
            del self._objects[key]
        return dropped

    # ------------------------------------------------------------------ reads

    def lookup(self, keys: Sequence[bytes], count_access: bool, now: float) -> LookupResult:
        self._check_keys(keys)
        counts: List[int] = []
        node_index: List[int] = []
        tiers: List[int] = []
        sizes: List[int] = []
        crcs: List[int] = []
        table: Dict[NodeEntry, int] = {}
        objects = self._objects
        with self._lock:
            epoch = self._clock.epoch(now)
            for key in keys:
                obj = objects.get(key)
                if obj is None:
                    counts.append(0)
                    continue
                n = 0
                for r in obj.replicas:
                    if r.state == COMPLETE and r.node.expires > now:
                        idx = table.get(r.node)
                        if idx is None:
                            idx = table[r.node] = len(table)
                        node_index.append(idx)
                        tiers.append(r.tier)
                        sizes.append(r.size)
                        crcs.append(r.crc)
                        n += 1
                counts.append(n)
                if count_access and n:
                    heat = obj.heat or self._new_heat(obj)
                    if heat.add(1, epoch) >= self._trigger:
                        self._maybe_task(obj, key, now, epoch)
            nodes = [node.view(now) for node in table]
            self.counters["lookups"] += 1
            self.counters["lookup_keys"] += len(keys)
        return LookupResult(counts, node_index, tiers, sizes, crcs, nodes)

    def report_access(self, keys: Sequence[bytes], counts: Sequence[int], now: float) -> None:
        if len(keys) != len(counts):
            raise InvalidValueError("keys and counts differ in length", keys=len(keys), counts=len(counts))
        self._check_keys(keys)
        with self._lock:
            self._touch_many(keys, counts, now)

    def _touch_many(self, keys: Sequence[bytes], counts: Sequence[int], now: float) -> None:
        epoch = self._clock.epoch(now)
        for key, count in zip(keys, counts):
            obj = self._objects.get(key)
            if obj is not None and (obj.heat or self._new_heat(obj)).add(count, epoch) >= self._trigger:
                self._maybe_task(obj, key, now, epoch)

    @staticmethod
    def _new_heat(obj: Obj) -> Heat:
        obj.heat = Heat()
        return obj.heat

    def heat(self, key: bytes, now: float) -> float:
        with self._lock:
            obj = self._objects.get(key)
            return 0.0 if obj is None or obj.heat is None else obj.heat.read(self._clock.epoch(now))

    def _maybe_task(self, obj: Obj, key: bytes, now: float, epoch: int) -> None:
        """Queue a promotion (hot, NVMe only) or an offload (hot, DRAM only) task. Lock held."""
        cfg = self.config
        if obj.task_at and now - obj.task_at < cfg.task_timeout_s:
            return
        fast = nvme = None
        for r in obj.replicas:
            if r.state != COMPLETE or r.node.expires <= now:
                continue
            if r.tier == NVME:
                nvme = nvme or r
            else:
                fast = fast or r
        heat = obj.heat.value if obj.heat is not None else 0.0
        if fast is None and nvme is not None and heat >= cfg.promote_threshold:
            nvme.node.mailbox.put("promote", key)
        elif fast is not None and nvme is None and heat >= cfg.offload_threshold:
            fast.node.mailbox.put("offload", key)
        else:
            return
        obj.task_at = now

    # ------------------------------------------------------------------ writes

    def prepare_put(
        self, node_id: str, keys: Sequence[bytes], sizes: Sequence[int], crcs: Sequence[int], now: float
    ) -> PlaceResult:
        self._check_batch(ReplicaBatch(REGISTER, DRAM, keys, sizes, crcs))
        status: List[int] = []
        node_index: List[int] = []
        table: Dict[NodeEntry, int] = {}
        with self._lock:
            fixed = self._node(node_id) if node_id else None
            if fixed is not None and fixed.expires <= now:
                raise UnknownNodeError("node's lease has expired", node_id=node_id)
            live = [n for n in self._nodes.values() if n.expires > now] if fixed is None else [fixed]
            for key, size, crc in zip(keys, sizes, crcs):
                verdict = self._existing(self._objects.get(key), size, crc, now)
                if verdict != PLACED:
                    status.append(verdict)
                    node_index.append(0)
                    continue
                if not live:
                    raise NoSpaceError("no live node to place values on", nodes=len(self._nodes))
                node = fixed or max(live, key=_free_dram)
                node.reserved += size
                obj = self._objects.get(key)
                if obj is None:
                    obj = self._objects[key] = Obj()
                if not any(r.node is node and r.state == WRITING for r in obj.replicas):
                    obj.replicas.append(Replica(node, DRAM, WRITING, size, crc))
                    obj.replicas.sort(key=_tier_of)
                    node.keys[key] = None
                    self._writing.pop((node, key), None)
                    self._writing[(node, key)] = now
                idx = table.get(node)
                if idx is None:
                    idx = table[node] = len(table)
                status.append(PLACED)
                node_index.append(idx)
            nodes = [n.view(now) for n in table]
            self.counters["placed"] += status.count(PLACED)
        return PlaceResult(status, node_index, nodes)

    def _existing(self, obj: Optional[Obj], size: int, crc: int, now: float) -> int:
        """PLACED if nothing readable or reserved is in the way, else EXISTS or CONFLICT."""
        if obj is None:
            return PLACED
        verdict = PLACED
        for r in obj.replicas:
            if r.state == EVICTING or r.node.expires <= now:
                continue
            if r.size != size or r.crc != crc:
                return CONFLICT
            if r.state == COMPLETE:
                verdict = EXISTS
        return verdict

    def abort_put(self, node_id: str, keys: Sequence[bytes]) -> int:
        self._check_keys(keys)
        with self._lock:
            node = self._node(node_id)
            dropped = 0
            for key in keys:
                dropped += self._drop_replicas(node, key, lambda r: r.state == WRITING)
                self._writing.pop((node, key), None)
            return dropped

    def remove(self, keys: Sequence[bytes], now: float) -> RemoveResult:
        self._check_keys(keys)
        existed: List[bool] = []
        pairs: set[Tuple[int, int]] = set()
        table: Dict[NodeEntry, int] = {}
        with self._lock:
            for i, key in enumerate(keys):
                obj = self._objects.get(key)
                if obj is None:
                    existed.append(False)
                    continue
                existed.append(any(r.state == COMPLETE and r.node.expires > now for r in obj.replicas))
                keep: List[Replica] = []
                for r in obj.replicas:
                    if r.node.expires <= now or r.state == WRITING:
                        self._writing.pop((r.node, key), None)
                        continue  # dropped now: nothing readable there
                    keep.append(r)
                    if r.state == COMPLETE:
                        r.state = EVICTING
                    if r.node not in table:
                        table[r.node] = len(table)
                    pairs.add((i, table[r.node]))
                    r.node.mailbox.put("remove", key)
                    r.node.mailbox.cancel("promote", key)
                    r.node.mailbox.cancel("offload", key)
                dropped_nodes = {r.node for r in obj.replicas} - {r.node for r in keep}
                for node in dropped_nodes:
                    node.keys.pop(key, None)
                obj.replicas = keep
                if not keep:
                    del self._objects[key]
            nodes = [n.view(now) for n in table]
            self.counters["removed"] += sum(existed)
        ordered = sorted(pairs)
        return RemoveResult(existed, [p[0] for p in ordered], [p[1] for p in ordered], nodes)

    # ------------------------------------------------------------------ validation

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        cfg = self.config
        if len(keys) > cfg.max_batch_keys:
            raise InvalidValueError("too many keys in one request", got=len(keys), limit=cfg.max_batch_keys)
        if not keys:
            return
        limit = cfg.max_key_bytes
        lengths = list(map(len, keys))
        if min(lengths) == 0 or max(lengths) > limit:
            bad = next(k for k in keys if not k or len(k) > limit)
            raise InvalidKeyError("key must be 1 byte to the limit long", got=len(bad), limit=limit, key=bad[:64])

    def _check_batch(self, batch: ReplicaBatch) -> None:
        if batch.op not in (REGISTER, UNREGISTER):
            raise InvalidValueError("unknown replica op", got=batch.op)
        if batch.tier not in TIERS and not (batch.op == UNREGISTER and batch.tier == 0):
            raise InvalidValueError("unknown tier", got=batch.tier)
        self._check_keys(batch.keys)
        if batch.op == REGISTER:
            if not (len(batch.keys) == len(batch.sizes) == len(batch.crcs)):
                raise InvalidValueError(
                    "keys, sizes and crcs differ in length",
                    keys=len(batch.keys), sizes=len(batch.sizes), crcs=len(batch.crcs),
                )
            limit = self.config.max_object_bytes
            if batch.sizes and (min(batch.sizes) <= 0 or max(batch.sizes) > limit):
                key, size = next((k, n) for k, n in zip(batch.keys, batch.sizes) if not 0 < n <= limit)
                raise InvalidValueError("object size out of range", key=key[:64], size=size, limit=limit)


def _tier_of(replica: Replica) -> int:
    return replica.tier


def _free_dram(node: NodeEntry) -> int:
    return node.dram_capacity - node.dram_used - node.reserved


def _check_node_id(node_id: str) -> None:
    if not node_id or len(node_id) > 256:
        raise InvalidValueError("node id must be 1 to 256 characters", got=node_id[:64] if node_id else node_id)


def batches_from(op: int, tier: int, items: Iterable[Tuple[bytes, int, int]]) -> ReplicaBatch:
    """Build a REGISTER batch from ``(key, size, crc)`` triples (a helper for tests and tools)."""
    keys, sizes, crcs = [], [], []
    for key, size, crc in items:
        keys.append(key)
        sizes.append(size)
        crcs.append(crc)
    return ReplicaBatch(op, tier, keys, sizes, crcs)
