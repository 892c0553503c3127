"""What the processes attached to a cluster node reach beyond its store: the other nodes.

A node started with both ``--socket`` and ``--master`` hands its socket a
:class:`ClusterReach`. An attached process then sees the cluster through its local node: an
``exists`` of a key the node does not hold asks the master whether another node does, and a
read of such a key pulls it from the best replica into the node's store first (verified
against its CRC, registered with the master), then serves it from there like any local value:
the next read on this host is a local hit. A master that cannot be reached makes those keys
misses (one warning until it answers again), never an error of the attached process.

:class:`NoReach` is the null part: a node alone on its host reaches nothing more.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Sequence

from gdskv.errors import GdskvError
from gdskv.transport import ItemStatus

log = logging.getLogger(__name__)


class NoReach:
    """A node without a cluster: nothing beyond its store."""

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        return [False] * len(keys)

    def pull(self, keys: Sequence[bytes]) -> int:
        return 0

    def remove(self, store: Any, keys: Sequence[bytes]) -> List[bool]:
        """Remove ``keys`` from the node's store (all there is)."""
        return store.batch_remove(list(keys))


class ClusterReach:
    """The other nodes of ``node``'s cluster (a :class:`gdskv.node.Node`), see the module docstring."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._warned = False
        self.pulled = 0

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        """Per key, whether another node holds a readable replica."""
        try:
            located = self._node.fetcher.locate(list(keys), count_access=False)
        except GdskvError as exc:
            self._unreachable(exc)
            return [False] * len(keys)
        self._reached()
        return [bool(replicas) for replicas in located]

    def pull(self, keys: Sequence[bytes]) -> int:
        """Fetch what other nodes hold of ``keys`` into the node's store; how many came."""
        try:
            statuses = self._node.pull(list(keys))
        except GdskvError as exc:
            self._unreachable(exc)
            return 0
        self._reached()
        came = sum(1 for s in statuses if s is ItemStatus.OK)
        with self._lock:
            self.pulled += came
        return came

    def remove(self, store: Any, keys: Sequence[bytes]) -> List[bool]:
        """Remove ``keys`` from the whole cluster (:mod:`gdskv.node.removal`), so that no
        node is still listed for them; with the master out of reach, from this node's store
        only (its registrar unregisters them once the master is back)."""
        from gdskv.node.removal import remove_everywhere  # (the cluster's modules bring in gRPC)

        node = self._node
        try:
            existed, _ = remove_everywhere(
                node.master, node.transport, list(keys), node=node, flush_timeout_s=node.config.flush_timeout_s
            )
        except GdskvError as exc:
            self._unreachable(exc)
            return [s is ItemStatus.OK for s in node.provider.remove(list(keys))]
        self._reached()
        return existed

    def _unreachable(self, exc: GdskvError) -> None:
        with self._lock:
            warn, self._warned = not self._warned, True
        if warn:
            log.warning("gdskv-node: the cluster is out of reach; attached processes get local values only: %s", exc)

    def _reached(self) -> None:
        if self._warned:
            with self._lock:
                self._warned = False
            log.warning("gdskv-node: the cluster is in reach again")
