"""Mirror a store's replicas on the master, in the order they change.

The :class:`Registrar` is a :class:`gdskv.store.StoreListener`. The store calls it (under its
lock) when objects become readable in a tier and before it evicts objects; the registrar
turns those calls into REGISTER / UNREGISTER events in one ordered queue, and one thread
sends the queue to the master in batches (consecutive events of the same kind and tier go
in one run). So the master sees a node's changes in the order they happened.

Two-phase eviction: ``on_evicting`` queues the UNREGISTER and waits (up to
``evict_wait_s``) until the master has applied it; only then does the store free the bytes.
While the master is unreachable or a resync is under way nobody waits: there is nobody to
tell, and the resync will describe the store as it is.

Resync (at start, and whenever the master answers "unknown node" or a batch could not be
delivered): register the node (which resets its replicas on the master), then register the
store's whole :meth:`~gdskv.store.Store.inventory`, then replay the events queued since the
inventory began. Events before that point are dropped: the inventory already reflects them
(the store reports a change under the same lock hold that makes it, and the inventory reads
under those locks). Replayed events are idempotent.

``flush()`` waits until everything queued so far is on the master: a put calls it so that
when it returns, other nodes can find the new replica.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from gdskv.errors import GdskvError, MasterUnavailableError, UnknownNodeError
from gdskv.master.client import MasterClient
from gdskv.master.model import DRAM, HBM, NVME, REGISTER, UNREGISTER, NodeView, ReplicaBatch
from gdskv.store import Store, StoreListener
from gdskv.types import Tier

log = logging.getLogger(__name__)

TIER_NUMBER = {Tier.HBM: HBM, Tier.DRAM: DRAM, Tier.NVME: NVME}

# One queued change: (seq, op, tier number, keys, sizes, crcs)
Event = Tuple[int, int, int, List[bytes], List[int], List[int]]


class Registrar(StoreListener):
    """See the module docstring. ``describe()`` returns the :class:`NodeView` to register
    (called at each registration, so usage figures are fresh)."""

    def __init__(
        self,
        store: Store,
        master: MasterClient,
        node_id: str,
        describe: Callable[[], NodeView],
        *,
        evict_wait_s: float = 2.0,
        retry_s: float = 0.2,
    ) -> None:
        self.store = store
        self.master = master
        self.describe = describe
        self.node_id = node_id
        self.evict_wait_s = evict_wait_s
        self.retry_s = retry_s
        self._cond = threading.Condition()
        self._events: Deque[Event] = collections.deque()
        self._seq = 0  # last seq handed out
        self._acked = 0  # every event up to here is on the master (or covered by a resync)
        self._needs_resync = True
        self._resyncing = False
        self._connected = False
        self._registered = threading.Event()  # the first resync finished
        self._stored_at: Dict[bytes, float] = {}  # any replica became readable here
        self._put_at: Dict[bytes, float] = {}  # a new value was put here
        self._stop = False
        self.heartbeat_s: Optional[float] = None
        self.lease_s: Optional[float] = None
        self.counters: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="gdskv-registrar", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ store listener

    def on_stored(self, tier: Tier, items: List[Tuple[bytes, int, int]]) -> None:
        now = time.monotonic()
        with self._cond:
            for key, _, _ in items:
                self._stored_at[key] = now
            self._queue(REGISTER, TIER_NUMBER[tier], [i[0] for i in items], [i[1] for i in items], [i[2] for i in items])

    def on_evicting(self, tier: Tier, keys: List[bytes]) -> None:
        with self._cond:
            seq = self._queue(UNREGISTER, TIER_NUMBER[tier], list(keys), [], [])
            if seq is None:
                return
            self.counters["evictions"] += len(keys)
            if not self._wait_acked(seq, self.evict_wait_s):
                self.counters["evictions_unconfirmed"] += len(keys)

    # ------------------------------------------------------------------ node calls

    def removing(self, keys: Sequence[bytes]) -> None:
        """Keys about to be removed from every local tier: unregister them first."""
        with self._cond:
            self._queue(UNREGISTER, 0, list(keys), [], [])

    def stale(self, keys: Sequence[bytes], since: float) -> None:
        """Keys a reader was sent here for and that are not here: unregister them, unless
        one was stored after ``since`` (then the master's record is right)."""
        with self._cond:
            gone = [k for k in keys if self._stored_at.get(k, 0.0) <= since]
            if gone and self._queue(UNREGISTER, 0, gone, [], []) is not None:
                self.counters["stale_unregistered"] += len(gone)

    def note_put(self, keys: Sequence[bytes]) -> None:
        """Record that new values were put under ``keys`` (through the cluster's write paths)."""
        now = time.monotonic()
        with self._cond:
            for key in keys:
                self._put_at[key] = now

    def put_since(self, key: bytes, since: float) -> bool:
        """Whether a value was put under ``key`` after ``since``."""
        with self._cond:
            return self._put_at.get(key, 0.0) > since

    def forget_older_than(self, age_s: float) -> None:
        """Bound the memory of store times (kept for the two checks above)."""
        limit = time.monotonic() - age_s
        with self._cond:
            if len(self._stored_at) > 1024:
                self._stored_at = {k: t for k, t in self._stored_at.items() if t > limit}
            if len(self._put_at) > 1024:
                self._put_at = {k: t for k, t in self._put_at.items() if t > limit}

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything queued so far is on the master. False: it is not (the master
        is unreachable, a resync is pending, or ``timeout`` passed)."""
        with self._cond:
            return self._wait_acked(self._seq, timeout)

    def request_resync(self, reason: str) -> None:
        with self._cond:
            if not self._needs_resync:
                log.info("gdskv-node: re-registering with the master (%s)", reason)
                self._needs_resync = True
                self._connected = False
                self._cond.notify_all()

    def set_connected(self, connected: bool) -> None:
        with self._cond:
            self._connected = connected and not self._needs_resync
            self._cond.notify_all()

    def wait_registered(self, timeout: Optional[float] = None) -> bool:
        return self._registered.wait(timeout)

    @property
    def connected(self) -> bool:
        return self._connected

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------ queue

    def _queue(self, op: int, tier: int, keys: List[bytes], sizes: List[int], crcs: List[int]) -> Optional[int]:
        """Append an event (lock held); None when dropped (a resync will cover it)."""
        if self._needs_resync and not self._resyncing:
            return None
        self._seq += 1
        self._events.append((self._seq, op, tier, keys, sizes, crcs))
        self._cond.notify_all()
        return self._seq

    def _wait_acked(self, seq: int, timeout: Optional[float]) -> bool:
        """Lock held. Wait until ``seq`` is acked; give up at once when nobody can ack it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._acked < seq:
            if self._stop or self._needs_resync or self._resyncing or not self._connected:
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._cond.wait(remaining)
        return True

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._needs_resync and not self._events:
                    self._cond.wait()
                if self._stop:
                    return
                resync = self._needs_resync
                events = [] if resync else list(self._events)
            if resync:
                if not self._resync():
                    self._sleep(self.retry_s)
                continue
            self._send(events)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            if not self._stop:
                self._cond.wait(seconds)

    def _send(self, events: List[Event]) -> None:
        try:
            _, _, conflicts = self.master.update_replicas(self.node_id, _runs(events))
        except UnknownNodeError:
            self.request_resync("the master does not know this node")
            return
        except GdskvError as exc:
            self.counters["update_failures"] += 1
            log.warning("gdskv-node: could not update the master (%s); will re-register", exc)
            self.request_resync("an update was not delivered")
            return
        if conflicts:
            self.counters["conflicts"] += len(conflicts)
            log.warning(
                "gdskv-node: master refused %d replica(s) holding another value, e.g. %r", len(conflicts), conflicts[0][:64]
            )
        last = events[-1][0]
        with self._cond:
            while self._events and self._events[0][0] <= last:
                self._events.popleft()
            self._acked = max(self._acked, last)
            self._connected = True
            self.counters["events_sent"] += len(events)
            self._cond.notify_all()

    def _resync(self) -> bool:
        """Register the node and everything the store holds; True when done."""
        with self._cond:
            self._resyncing = True
            self._connected = False
            mark = self._seq
            while self._events and self._events[0][0] <= mark:
                self._events.popleft()  # covered by the inventory below
            self._cond.notify_all()  # evictions waiting for an ack: stop waiting
        try:
            lease_s, heartbeat_s = self.master.register_node(self.describe())
            inventory = self.store.inventory()
            batches = _inventory_batches(inventory)
            self.master.update_replicas(self.node_id, batches)
            replay = []
            with self._cond:
                replay = list(self._events)
            if replay:
                self.master.update_replicas(self.node_id, _runs(replay))
        except (UnknownNodeError, MasterUnavailableError) as exc:
            log.debug("gdskv-node: registration failed: %s", exc)
            with self._cond:
                self._resyncing = False
            self.counters["resync_failures"] += 1
            return False
        except GdskvError as exc:
            log.warning("gdskv-node: registration failed: %s", exc)
            with self._cond:
                self._resyncing = False
            self.counters["resync_failures"] += 1
            return False
        with self._cond:
            last = replay[-1][0] if replay else mark
            while self._events and self._events[0][0] <= last:
                self._events.popleft()
            self._acked = max(self._acked, last)
            self._needs_resync = False
            self._resyncing = False
            self._connected = True
            self.heartbeat_s, self.lease_s = heartbeat_s, lease_s
            self.counters["resyncs"] += 1
            self.counters["resync_objects"] += len(inventory)
            self._cond.notify_all()
        self._registered.set()
        log.info("gdskv-node: registered %s with %d replica(s)", self.node_id, len(inventory))
        return True


def _runs(events: Sequence[Event]) -> List[ReplicaBatch]:
    """Merge consecutive events of the same op and tier into one batch, order kept."""
    runs: List[ReplicaBatch] = []
    for _, op, tier, keys, sizes, crcs in events:
        last = runs[-1] if runs else None
        if last is not None and last.op == op and last.tier == tier:
            last.keys.extend(keys)  # type: ignore[attr-defined]
            if op == REGISTER:
                last.sizes.extend(sizes)  # type: ignore[attr-defined]
                last.crcs.extend(crcs)  # type: ignore[attr-defined]
        else:
            runs.append(ReplicaBatch(op, tier, list(keys), list(sizes), list(crcs)))
    return runs


def _inventory_batches(inventory: Sequence[Tuple[bytes, Tier, int, int]]) -> List[ReplicaBatch]:
    by_tier: Dict[int, ReplicaBatch] = {}
    for key, tier, size, crc in inventory:
        number = TIER_NUMBER[tier]
        batch = by_tier.get(number)
        if batch is None:
            batch = by_tier[number] = ReplicaBatch(REGISTER, number, [], [], [])
        batch.keys.append(key)  # type: ignore[attr-defined]
        batch.sizes.append(size)  # type: ignore[attr-defined]
        batch.crcs.append(crc)  # type: ignore[attr-defined]
    return list(by_tier.values())
