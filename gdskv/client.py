"""The cluster client: the :class:`Store` API over every node's DRAM and SSD.

``gdskv.connect("master:50051", local=store)`` joins ``store`` to the cluster (a
:class:`gdskv.node.Node` runs inside this process: peers can read from it) and returns a
:class:`Client`; with ``local=None`` it is a thin client that stores nothing itself.

Contracts (all methods are thread-safe; keys and values as for :class:`Store`):

- ``put`` / ``batch_put``: with a local store, values go into it (and are registered with
  the master before the call returns); a thin client's values go to the node the master
  picks (the one with the most free DRAM). The same value under an existing key is a no-op;
  a different one raises :class:`KeyExistsError` unless ``overwrite=True`` (which removes
  the old value everywhere first). One master round trip per batch.
- ``get`` / ``get_into`` / ``batch_get_into`` / ``batch_get``: local tiers first, then the
  best remote replica (a peer's DRAM before a peer's NVMe), every peer of a batch in
  parallel. None is a miss: absent, or every replica unreachable or stale (counted).
- ``exists`` / ``batch_exists``: local, then the master (live, COMPLETE replicas only).
- ``remove`` / ``batch_remove``: the master stops handing the key out, then every holder
  deletes it (directly; a holder that cannot be reached gets it from its mailbox).
- ``prefetch(keys, node)``: ask a node to pull keys into its own store.
- ``nodes()``, ``stats()``, ``close()`` (idempotent; the local store stays open).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Dict, List, Optional, Sequence

from gdskv.node.removal import remove_everywhere
from gdskv.errors import (
    CorruptionError,
    GdskvError,
    InvalidValueError,
    KeyExistsError,
    MasterUnavailableError,
    NoSpaceError,
    RemoteError,
    StoreClosedError,
    UnknownNodeError,
)
from gdskv.master.client import MasterClient
from gdskv.master.model import CONFLICT, EXISTS, PLACED, NodeView
from gdskv.node.config import ClusterConfig
from gdskv.node.fetch import Fetcher
from gdskv.node.node import Node
from gdskv.store import Store
from gdskv.transport import ItemStatus, make_transport
from gdskv.transport.frames import value_crc
from gdskv.types import Key, byte_view, encode_key, sequence_arg

log = logging.getLogger(__name__)


class Client:
    """See the module docstring. Built by :func:`gdskv.connect`."""

    def __init__(self, master: str, *, local: Optional[Store] = None, config: Optional[ClusterConfig] = None) -> None:
        self.config = config or ClusterConfig()
        cfg = self.config
        self.local = local
        self._node: Optional[Node] = None
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()
        if local is not None:
            self._node = Node(local, master, cfg)
            self._node.start()
            self._master = self._node.master
            self._transport = self._node.transport
            self._fetcher = self._node.fetcher
        else:
            self._master = MasterClient(master, timeout_s=cfg.rpc_timeout_s)
            self._transport = make_transport(
                cfg.transport, connections=cfg.connections, timeout_s=cfg.transfer_timeout_s, verify=cfg.verify_transfers
            )
            self._fetcher = Fetcher(self._master, self._transport)

    @property
    def node(self) -> Optional[Node]:
        """The node this client runs for its local store (None for a thin client)."""
        return self._node

    # ================================================================== writes

    def put(self, key: Key, value: Any, *, overwrite: bool = False) -> None:
        self.batch_put([key], [value], overwrite=overwrite)

    def batch_put(self, keys: Sequence[Key], values: Sequence[Any], *, overwrite: bool = False) -> None:
        """Store every pair (see the module docstring); raises on the first key that fails."""
        self._check_open()
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(values, "values")):
            raise InvalidValueError("keys and values differ in length", keys=len(keys), values=len(values))
        ks = [encode_key(k) for k in keys]
        views = [byte_view(v) for v in values]
        crcs = [value_crc(k, v) for k, v in zip(ks, views)]
        if overwrite:
            self._remove_conflicting(ks, views, crcs)
        if self._node is not None:
            self._put_local(ks, views, crcs, overwrite)
        else:
            self._put_remote(ks, views, crcs)

    def _remove_conflicting(self, ks: List[bytes], views: List[memoryview], crcs: List[int]) -> None:
        """``overwrite=True``: remove the keys that hold another value anywhere first."""
        node_id = self._node.node_id if self._node is not None else ""
        plan = self._master.prepare_put(node_id, ks, [v.nbytes for v in views], crcs)
        self._abort(plan, ks)  # a probe only: release the reservations it made
        conflicting = [k for k, s in zip(ks, plan.status) if s == CONFLICT]
        if conflicting:
            self.batch_remove(conflicting)

    def _abort(self, plan: Any, ks: List[bytes]) -> None:
        by_node: Dict[str, List[bytes]] = collections.defaultdict(list)
        for k, status, idx in zip(ks, plan.status, plan.node_index):
            if status == PLACED:
                by_node[plan.nodes[idx].node_id].append(k)
        for node_id, keys in by_node.items():
            try:
                self._master.abort_put(node_id, keys)
            except GdskvError as exc:
                log.debug("gdskv: abort_put failed: %s", exc)

    def _put_local(self, ks: List[bytes], views: List[memoryview], crcs: List[int], overwrite: bool) -> None:
        assert self._node is not None and self.local is not None
        node_id = self._node.node_id
        try:
            statuses = self._master.prepare_put(node_id, ks, [v.nbytes for v in views], crcs).status
        except (MasterUnavailableError, UnknownNodeError):
            # The master is away (or has not seen this node yet): store locally; the node
            # registers everything it holds as soon as the master knows it.
            statuses = [PLACED] * len(ks)
            self.counters["puts_unregistered"] += len(ks)
        for i, (k, v, status) in enumerate(zip(ks, views, statuses)):
            if status == EXISTS:
                self.counters["puts_idempotent"] += 1
                continue
            if status == CONFLICT:
                self._abort_local(ks[i:], statuses[i:])
                raise KeyExistsError("a different value is stored under this key in the cluster", key=k[:64])
            try:
                self._node.registrar.note_put([k])
                self.local.put(k, v, overwrite=overwrite)
            except BaseException:
                self._abort_local(ks[i:], statuses[i:])
                raise
        self._node.registrar.flush(self.config.flush_timeout_s)
        self.counters["puts"] += len(ks)

    def _abort_local(self, ks: List[bytes], statuses: List[int]) -> None:
        assert self._node is not None
        placed = [k for k, s in zip(ks, statuses) if s == PLACED]
        if placed:
            try:
                self._master.abort_put(self._node.node_id, placed)
            except GdskvError as exc:
                log.debug("gdskv: abort_put failed: %s", exc)

    def _put_remote(self, ks: List[bytes], views: List[memoryview], crcs: List[int]) -> None:
        plan = self._master.prepare_put("", ks, [v.nbytes for v in views], crcs)
        groups: Dict[int, List[int]] = collections.defaultdict(list)
        for i, (k, status) in enumerate(zip(ks, plan.status)):
            if status == CONFLICT:
                self._abort(plan, ks)
                raise KeyExistsError("a different value is stored under this key in the cluster", key=k[:64])
            if status == EXISTS:
                self.counters["puts_idempotent"] += 1
            else:
                groups[plan.node_index[i]].append(i)
        for node_index, idx in groups.items():
            node = plan.nodes[node_index]
            try:
                statuses = self._transport.write(
                    node.address, [ks[i] for i in idx], [views[i] for i in idx], [crcs[i] for i in idx]
                )
            except GdskvError:
                self._abort(plan, ks)
                raise
            for i, status in zip(idx, statuses):
                if status != ItemStatus.OK:
                    self._abort(plan, ks)
                    raise _write_error(status, ks[i], node)
        self.counters["puts"] += len(ks)

    # ================================================================== reads

    def get(self, key: Key) -> Optional[bytearray]:
        """A new buffer with the value of ``key``, or None on a miss."""
        return self.batch_get([key])[0]

    def batch_get(self, keys: Sequence[Key]) -> List[Optional[bytearray]]:
        self._check_open()
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        out: List[Optional[bytearray]] = [None] * len(ks)
        remote = list(range(len(ks)))
        if self.local is not None:
            remote = []
            for i, k in enumerate(ks):
                value = self.local.get(k)
                if value is None:
                    remote.append(i)
                else:
                    out[i] = value
            self._count_local([k for i, k in enumerate(ks) if out[i] is not None])
        if remote:
            rks = [ks[i] for i in remote]
            located = self._fetcher.locate(rks)
            bufs = [bytearray(max(1, loc[0].size)) if loc else bytearray(1) for loc in located]
            sizes = self._fetcher.fetch_into(rks, [memoryview(b) for b in bufs], located)
            for i, buf, n in zip(remote, bufs, sizes):
                if n is not None:
                    out[i] = buf if n == len(buf) else buf[:n]
            self._count_remote(sizes)
        return out

    def get_into(self, key: Key, out: Any) -> Optional[int]:
        """Copy the value of ``key`` into ``out``; its size, or None on a miss."""
        return self.batch_get_into([key], [out])[0]

    def batch_get_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> List[Optional[int]]:
        """``get_into`` for many keys; remote ones in one lookup and one transfer per peer."""
        self._check_open()
        if len(sequence_arg(keys, "keys")) != len(sequence_arg(outs, "outs")):
            raise InvalidValueError("keys and outs differ in length", keys=len(keys), outs=len(outs))
        ks = [encode_key(k) for k in keys]
        views = [byte_view(o, writable=True, what="out") for o in outs]
        results: List[Optional[int]] = [None] * len(ks)
        if self.local is not None:
            results = self.local.batch_get_into(ks, views)
            self._count_local([k for k, n in zip(ks, results) if n is not None])
        remote = [i for i, n in enumerate(results) if n is None]
        if remote:
            rks = [ks[i] for i in remote]
            sizes = self._fetcher.fetch_into(rks, [views[i] for i in remote], self._fetcher.locate(rks))
            for i, n in zip(remote, sizes):
                results[i] = n
            self._count_remote(sizes)
        return results

    def _count_local(self, hit_keys: List[bytes]) -> None:
        self.counters["local_hits"] += len(hit_keys)
        if hit_keys and self._node is not None:
            self._node.report_access(hit_keys)

    def _count_remote(self, sizes: List[Optional[int]]) -> None:
        hits = sum(1 for n in sizes if n is not None)
        self.counters["remote_hits"] += hits
        self.counters["misses"] += len(sizes) - hits

    # ================================================================== queries

    def exists(self, key: Key) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        self._check_open()
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        found = self.local.batch_exists(ks) if self.local is not None else [False] * len(ks)
        ask = [i for i, f in enumerate(found) if not f]
        if ask:
            located = self._fetcher.locate([ks[i] for i in ask], count_access=False)
            for i, replicas in zip(ask, located):
                found[i] = bool(replicas)
        return found

    def remove(self, key: Key) -> bool:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[Key]) -> List[bool]:
        """Remove everywhere; returns, per key, whether it was stored."""
        self._check_open()
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        existed, deferred = remove_everywhere(
            self._master, self._transport, ks, node=self._node, flush_timeout_s=self.config.flush_timeout_s
        )
        self.counters["remove_deferred"] += deferred
        return existed

    # ================================================================== cluster

    def prefetch(self, keys: Sequence[Key], node: str) -> List[bool]:
        """Ask ``node`` (a node id or a data address) to pull ``keys`` into its own store;
        per key, whether it holds the key now."""
        self._check_open()
        ks = [encode_key(k) for k in sequence_arg(keys, "keys")]
        address = self._address_of(node)
        statuses = self._transport.pull(address, ks)
        return [s == ItemStatus.OK for s in statuses]

    def _address_of(self, node: str) -> str:
        for view in self.nodes():
            if node in (view.node_id, view.address):
                return view.address
        raise InvalidValueError("no such node on the master", node=node)

    def nodes(self) -> List[NodeView]:
        """Every node the master knows (with usage and remaining lease)."""
        return self._master.list_nodes()[0]

    def stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"client": dict(self.counters), "fetch": dict(self._fetcher.counters),
                               "transport": self._transport.stats()}
        if self._node is not None:
            out["node"] = self._node.stats()
        return out

    # ================================================================== lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("client is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._node is not None:
            self._node.close()
        else:
            self._transport.close()
            self._master.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()


def _write_error(status: ItemStatus, key: bytes, node: NodeView) -> GdskvError:
    where = {"key": key[:64], "node": node.node_id, "address": node.address}
    if status == ItemStatus.EXISTS:
        return KeyExistsError("a different value is stored under this key on the node", **where)
    if status == ItemStatus.NO_SPACE:
        return NoSpaceError("the node has no room for the value", **where)
    if status == ItemStatus.CORRUPT:
        return CorruptionError("the value was damaged on its way to the node", **where)
    if status == ItemStatus.INVALID:
        return InvalidValueError("the node refused the value", **where)
    return RemoteError("the node failed to store the value", status=status.name, **where)
