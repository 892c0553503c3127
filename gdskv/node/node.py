"""A node: a :class:`Store` joined to a cluster.

:class:`Node` wires together, around a store it does not own:

- a data server (:mod:`gdskv.transport`) that serves the store's DRAM and NVMe replicas to
  peers and accepts thin clients' writes (:class:`StoreProvider`);
- a :class:`Registrar` that mirrors the store's replicas on the master, in order, with
  two-phase eviction, and re-registers everything when the master does not know the node
  (at start, after a master restart, after a lost lease);
- a heartbeat thread that renews the lease, reports usage and local accesses, and collects
  mailbox tasks; a task thread that runs them: offload (DRAM -> SSD), promotion
  (SSD -> DRAM, only below the DRAM watermark), removal (skipped for a key stored again
  after the task was issued);
- a :class:`Fetcher` for :meth:`Node.pull` (fetch keys from peers into this store).

``gdskv-node`` (:mod:`gdskv.node.cli`) runs one as a daemon; :func:`gdskv.connect` with a
``local`` store runs one inside the caller's process.
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gdskv.errors import GdskvError, KeyExistsError, MasterUnavailableError, NoSpaceError, UnknownNodeError
from gdskv.master.client import MasterClient
from gdskv.master.model import NodeView, Tasks, Usage
from gdskv.node.config import ClusterConfig
from gdskv.node.fetch import Fetcher
from gdskv.node.provider import StoreProvider
from gdskv.node.registrar import Registrar
from gdskv.store import Store
from gdskv.tiers.backends.files import write_file_atomic
from gdskv.transport import ItemStatus, make_server, make_transport

log = logging.getLogger(__name__)

#: Most distinct keys of local accesses kept between two heartbeats.
MAX_ACCESS_KEYS = 10_000
#: Bytes a pull buffers at once.
PULL_CHUNK_BYTES = 256 << 20


#: The file in a store directory that keeps the id of the node serving it.
NODE_ID_FILE = "node-id"
_NODE_ID = re.compile(r"[0-9a-f]{16}")


def stored_node_id(store_dir: Path) -> str:
    """The node id kept in ``store_dir`` (made and kept there on first use). A node restarted
    on the same directory so comes back as itself: the master replaces its old entry at
    once, replicas and pending removals included, instead of keeping it as a second node
    until its lease runs out."""
    path = Path(store_dir) / NODE_ID_FILE
    try:
        node_id = path.read_text(encoding="ascii").strip()
        if _NODE_ID.fullmatch(node_id):
            return node_id
        log.warning("gdskv: %s does not hold a node id; making a new one", path)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("gdskv: cannot read %s (%s); making a new node id", path, exc)
    node_id = uuid.uuid4().hex[:16]
    try:
        write_file_atomic(path, node_id.encode("ascii"))
    except (OSError, GdskvError) as exc:
        log.warning("gdskv: cannot keep the node id in %s (%s): a restart will come back as another node", path, exc)
    return node_id


class Node:
    """See the module docstring. ``start()`` returns the data address; ``close()`` is idempotent."""

    def __init__(self, store: Store, master: str, config: Optional[ClusterConfig] = None) -> None:
        self.store = store
        self.config = config or ClusterConfig()
        self._started = False
        self._closed = False
        cfg = self.config
        self.node_id = cfg.node_id or stored_node_id(store.path)
        self.master_address = master
        self.master = MasterClient(master, timeout_s=cfg.rpc_timeout_s)
        self.transport = make_transport(
            cfg.transport, connections=cfg.connections, timeout_s=cfg.transfer_timeout_s, verify=cfg.verify_transfers
        )
        self.fetcher = Fetcher(self.master, self.transport, self_id=self.node_id)
        self.registrar = Registrar(store, self.master, self.node_id, self.describe, evict_wait_s=cfg.evict_wait_s)
        self.provider = StoreProvider(store, self.registrar, flush_timeout_s=cfg.flush_timeout_s, pull=self.pull)
        self.server = make_server(cfg.transport, self.provider, cfg.listen, timeout_s=cfg.transfer_timeout_s)
        self.address = ""
        self._accesses: collections.Counter[bytes] = collections.Counter()
        self._access_lock = threading.Lock()
        self._tasks: "queue.Queue[Optional[Tuple[float, Tasks]]]" = queue.Queue()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self.counters: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        if self._started:
            return self.address
        self._started = True
        bound = self.server.start()
        self.address = self.config.advertise or bound
        self.store.add_listener(self.registrar)
        self.registrar.start()
        for target, name in ((self._heartbeat_loop, "gdskv-heartbeat"), (self._task_loop, "gdskv-tasks")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self.address

    def wait_registered(self, timeout: Optional[float] = None) -> bool:
        """Wait until the node and every replica it held at start are on the master."""
        return self.registrar.wait_registered(timeout)

    def close(self, *, deregister: bool = True) -> None:
        """Stop serving; tell the master this node is gone (``deregister``). The store stays open."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        self.store.remove_listener(self.registrar)
        self.registrar.close()
        self.server.close()
        if deregister and self._started:
            try:
                self.master.deregister_node(self.node_id, timeout=2.0)
            except GdskvError as exc:
                log.info("gdskv-node: could not deregister: %s", exc)
        self.transport.close()
        self.master.close()

    def __enter__(self) -> "Node":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ master

    def usage(self) -> Usage:
        stats = self.store.stats()
        nvme = stats.get("nvme", {})
        return Usage(
            dram_used=int(stats["dram"]["used_bytes"]),
            dram_capacity=int(stats["dram"]["capacity"]),
            nvme_used=int(nvme.get("used_bytes", 0)),
            nvme_capacity=int(nvme.get("capacity", 0)),
        )

    def describe(self) -> NodeView:
        """How this node registers itself."""
        usage = self.usage() if self._started else Usage()
        return NodeView(
            node_id=self.node_id,
            address=self.address,
            transport=self.config.transport,
            dram_capacity=usage.dram_capacity,
            dram_used=usage.dram_used,
            nvme_capacity=usage.nvme_capacity,
            nvme_used=usage.nvme_used,
        )

    def report_access(self, keys: Sequence[bytes]) -> None:
        """Count local reads; they go to the master (hotness) with the next heartbeat."""
        with self._access_lock:
            for key in keys:
                if key in self._accesses or len(self._accesses) < MAX_ACCESS_KEYS:
                    self._accesses[key] += 1

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.registrar.heartbeat_s or self.config.heartbeat_s):
            with self._access_lock:
                accessed, self._accesses = self._accesses, collections.Counter()
            sent_at = time.monotonic()
            period = self.registrar.heartbeat_s or self.config.heartbeat_s
            try:
                tasks = self.master.heartbeat(
                    self.node_id, self.usage(), list(accessed), list(accessed.values()), timeout=max(period, 1.0)
                )
            except UnknownNodeError:
                self.counters["heartbeats_unknown"] += 1
                self.registrar.request_resync("the master does not know this node")
                continue
            except MasterUnavailableError as exc:
                self.counters["heartbeats_failed"] += 1
                self.registrar.set_connected(False)
                log.debug("gdskv-node: heartbeat failed: %s", exc)
                continue
            except GdskvError as exc:
                self.counters["heartbeats_failed"] += 1
                log.warning("gdskv-node: heartbeat refused: %s", exc)
                continue
            self.counters["heartbeats"] += 1
            self.registrar.set_connected(True)
            self.registrar.forget_older_than(max(60.0, 10 * period))
            if tasks.offload or tasks.promote or tasks.remove:
                self._tasks.put((sent_at, tasks))

    # ------------------------------------------------------------------ tasks

    def _task_loop(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            sent_at, tasks = item
            try:
                self.run_tasks(tasks, issued_after=sent_at)
            except GdskvError as exc:
                log.warning("gdskv-node: task failed: %s", exc)

    def run_tasks(self, tasks: Tasks, *, issued_after: float) -> None:
        """Run mailbox tasks. A removal is skipped for a key put here after ``issued_after``
        (the heartbeat that brought it was sent before that put)."""
        removals = [k for k in tasks.remove if not self.registrar.put_since(k, issued_after)]
        if removals:
            self.provider.remove(removals)
            self.counters["tasks_removed"] += len(removals)
        if tasks.offload:
            self.counters["tasks_offloaded"] += self.store.offload(tasks.offload)
        for key in tasks.promote:
            if self.store.promote(key):
                self.counters["tasks_promoted"] += 1

    # ------------------------------------------------------------------ pull

    def pull(self, keys: List[bytes]) -> List[ItemStatus]:
        """Fetch ``keys`` from their best replicas into this node's store."""
        statuses = [ItemStatus.OK] * len(keys)
        here = self.store.batch_exists(keys)
        todo = [i for i, present in enumerate(here) if not present]
        located = self.fetcher.locate([keys[i] for i in todo]) if todo else []
        start = 0
        while start < len(todo):
            chunk: List[int] = []
            nbytes = 0
            while start < len(todo) and (not chunk or nbytes + _size(located[start]) <= PULL_CHUNK_BYTES):
                chunk.append(start)
                nbytes += _size(located[start])
                start += 1
            self._pull_chunk(keys, todo, located, chunk, statuses)
        if todo:
            self.registrar.flush(self.config.flush_timeout_s)
        return statuses

    def _pull_chunk(
        self, keys: List[bytes], todo: List[int], located: List[Any], chunk: List[int], statuses: List[ItemStatus]
    ) -> None:
        ks = [keys[todo[j]] for j in chunk]
        bufs = [bytearray(max(1, _size(located[j]))) for j in chunk]
        sizes = self.fetcher.fetch_into(ks, [memoryview(b) for b in bufs], [located[j] for j in chunk])
        for j, key, buf, n in zip(chunk, ks, bufs, sizes):
            i = todo[j]
            if n is None:
                statuses[i] = ItemStatus.MISS
                continue
            try:
                self.registrar.note_put([key])
                self.store.put(key, memoryview(buf)[:n])
            except KeyExistsError:
                statuses[i] = ItemStatus.EXISTS
            except NoSpaceError:
                statuses[i] = ItemStatus.NO_SPACE
            except GdskvError as exc:
                log.warning("gdskv-node: pulled %r but could not store it: %s", key[:64], exc)
                statuses[i] = ItemStatus.ERROR
        self.counters["pulled"] += sum(1 for n in sizes if n is not None)

    # ------------------------------------------------------------------ stats

    def stats(self) -> Dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "master": self.master_address,
            "registered": self.registrar.connected,
            "node": dict(self.counters),
            "registrar": dict(self.registrar.counters),
            "server": self.server.stats() if hasattr(self.server, "stats") else {},
            "transport": self.transport.stats(),
            "fetch": dict(self.fetcher.counters),
        }


def _size(replicas: Any) -> int:
    return replicas[0].size if replicas else 0
