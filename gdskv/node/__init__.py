"""gdskv-node: a store joined to a cluster (registration, heartbeats, tasks, a data server).

:class:`Node` (in :mod:`gdskv.node.node`) runs around a :class:`gdskv.Store`;
``gdskv-node`` (:mod:`gdskv.node.cli`) runs one as a daemon process. Imported lazily by
:func:`gdskv.connect`, never by ``import gdskv``.
"""

from __future__ import annotations

from gdskv.node.config import ClusterConfig
from gdskv.node.node import Node

__all__ = ["ClusterConfig", "Node"]
