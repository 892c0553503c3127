"""Find and pull remote replicas: one master lookup per batch, then one transfer per peer.

:meth:`Fetcher.locate` asks the master where each key is (COMPLETE replicas on live nodes,
best tier first) and drops this node's own replicas (the caller has already looked
locally). :meth:`Fetcher.fetch_into` reads every key from its best replica, all peers in
parallel; a key whose replica failed (a clean miss, a dead peer, a checksum mismatch) is
retried on its next replica, and a peer that cannot be reached is skipped for the rest of
the call. A key with no replica left is a miss (None): a cache can recompute what it misses.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Dict, List, Optional, Sequence

from gdskv.errors import GdskvError, InvalidValueError, TransportError
from gdskv.master.client import MasterClient
from gdskv.master.model import NodeView
from gdskv.transport.base import Transport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Located:
    """One readable replica of a key."""

    node: NodeView
    tier: int
    size: int
    crc: int


class Fetcher:
    """Lookup + transfer, shared by :class:`gdskv.node.Node` and :class:`gdskv.client.Client`."""

    def __init__(self, master: MasterClient, transport: Transport, *, self_id: Optional[str] = None) -> None:
        self.master = master
        self.transport = transport
        self.self_id = self_id
        self.counters: collections.Counter[str] = collections.Counter()

    def locate(self, keys: Sequence[bytes], *, count_access: bool = True) -> List[List[Located]]:
        """Readable replicas of each key on other nodes, best first."""
        res = self.master.lookup(keys, count_access=count_access)
        out: List[List[Located]] = []
        pos = 0
        for count in res.counts:
            replicas = []
            for j in range(pos, pos + count):
                node = res.nodes[res.node_index[j]]
                if node.node_id != self.self_id:
                    replicas.append(Located(node, res.tiers[j], res.sizes[j], res.crcs[j]))
            out.append(replicas)
            pos += count
        return out

    def fetch_into(
        self, keys: Sequence[bytes], outs: Sequence[memoryview], located: Sequence[List[Located]]
    ) -> List[Optional[int]]:
        """Fill ``outs[i]`` from the best reachable replica of ``keys[i]``; size or None.

        Raises :class:`InvalidValueError` (before reading anything) when an ``out`` is smaller
        than its value."""
        for key, out, replicas in zip(keys, outs, located):
            if replicas and out.nbytes < replicas[0].size:
                raise InvalidValueError("out is smaller than the value", key=key[:64], size=replicas[0].size, got=out.nbytes)
        results: List[Optional[int]] = [None] * len(keys)
        next_replica = [0] * len(keys)
        pending = [i for i in range(len(keys)) if located[i]]
        dead: set[str] = set()
        while pending:
            groups: Dict[str, List[int]] = collections.defaultdict(list)
            left: List[int] = []
            for i in pending:
                replicas = located[i]
                while next_replica[i] < len(replicas) and replicas[next_replica[i]].node.address in dead:
                    next_replica[i] += 1
                if next_replica[i] < len(replicas):
                    groups[replicas[next_replica[i]].node.address].append(i)
                else:
                    self.counters["misses_exhausted"] += 1
            if not groups:
                break
            requests = [
                (address, [keys[i] for i in idx], [outs[i] for i in idx])
                for address, idx in groups.items()
            ]
            outcomes = self.transport.read_many(requests)  # type: ignore[attr-defined]
            for (address, idx), per_key in zip(groups.items(), outcomes):
                for i, outcome in zip(idx, per_key):
                    replica = located[i][next_replica[i]]
                    if isinstance(outcome, int):
                        results[i] = outcome
                        self.counters[f"hits_tier{replica.tier}"] += 1
                        self.counters["bytes"] += outcome
                        continue
                    if isinstance(outcome, TransportError):
                        dead.add(address)
                        self.counters["peer_errors"] += 1
                        log.info("gdskv: peer %s unusable for this read: %s", address, outcome)
                    elif isinstance(outcome, InvalidValueError):
                        # The holder's value does not fit the out, which has room for the one
                        # the master listed: it holds a newer, larger value. Stale for this
                        # read, as a replica that lost the key is.
                        self.counters["stale_replicas"] += 1
                    elif isinstance(outcome, GdskvError):
                        self.counters["replica_errors"] += 1
                    else:
                        self.counters["stale_replicas"] += 1
                    next_replica[i] += 1
                    left.append(i)
            pending = left
        return results
