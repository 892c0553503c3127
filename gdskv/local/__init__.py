"""Standalone mode on one host: a node's store served to every process on it.

``gdskv-node --socket PATH`` runs a :class:`~gdskv.local.server.LocalServer` beside (or
without) the cluster; a process attaches with :func:`gdskv.attach` and gets an
:class:`~gdskv.local.client.AttachedStore`, which speaks :class:`gdskv.KVStore`. Values move
through shared memory (the node's DRAM arena and read staging area), control messages
through the socket (:mod:`gdskv.local.protocol`); what a process holds is given back when
its connection ends, however it ended (:mod:`gdskv.local.session`).
"""

from gdskv.local.client import AttachedStore, attach
from gdskv.local.server import SOCKET_NAME, LocalServer, default_socket_path

__all__ = ["AttachedStore", "LocalServer", "SOCKET_NAME", "attach", "default_socket_path"]
