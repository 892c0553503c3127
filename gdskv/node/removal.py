"""Removing keys from the whole cluster: the master first, then every holder.

The master stops handing the keys out and names their holders; each holder is told to
delete them over the data plane, and one that cannot be reached finds the removal in its
mailbox (the master left it there). The caller's own node, when it has one, removes its
copies through its provider, so its registrar unregisters them, and waits until the master
has heard. Used by :meth:`gdskv.Client.batch_remove` and by the socket of a cluster node
(:class:`gdskv.local.reach.ClusterReach`).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Dict, List, Optional, Sequence

from gdskv.errors import GdskvError
from gdskv.transport import ItemStatus

log = logging.getLogger(__name__)


def remove_everywhere(
    master: Any, transport: Any, keys: Sequence[bytes], *, node: Optional[Any] = None, flush_timeout_s: float = 10.0,
) -> "tuple[List[bool], int]":
    """Per key, whether it was stored anywhere; and how many removals were left to holders'
    mailboxes (a holder out of reach). ``node``: the caller's own :class:`gdskv.node.Node`."""
    ks = list(keys)
    res = master.remove(ks)
    existed = list(res.existed)
    holders: Dict[int, List[int]] = collections.defaultdict(list)
    for ki, ni in zip(res.holder_key_index, res.holder_node_index):
        holders[ni].append(ki)
    self_id = node.node_id if node is not None else None
    deferred = 0
    for ni, idx in holders.items():
        holder = res.nodes[ni]
        if holder.node_id == self_id:
            continue
        try:
            transport.remove(holder.address, [ks[i] for i in idx])
        except GdskvError as exc:  # its mailbox has the removal too
            deferred += len(idx)
            log.info("gdskv: %s will remove %d key(s) from its mailbox: %s", holder.address, len(idx), exc)
    if node is not None:
        statuses = node.provider.remove(ks)
        existed = [e or s == ItemStatus.OK for e, s in zip(existed, statuses)]
        node.registrar.flush(flush_timeout_s)
    return existed, deferred
