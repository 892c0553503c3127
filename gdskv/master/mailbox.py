"""Per-node task mailboxes, handed out with heartbeats.

Three kinds of task, each a set of keys kept in arrival order:

- ``offload``: copy a DRAM-only object to the node's SSD (it is hot and has no SSD copy);
- ``promote``: copy an NVMe-only object back into the node's DRAM (it is hot);
- ``remove``: delete every local replica of a key that a client removed.

A task is handed out at most once (``take``) and may be cancelled before that (``cancel``):
a removal is cancelled when the node registers a new replica of the key, so a removal
queued before a re-put cannot delete the new value.
"""

from __future__ import annotations

from typing import Dict, List

KINDS = ("offload", "promote", "remove")


class Mailbox:
    """The pending tasks of one node. Not locked: the registry's lock covers it."""

    __slots__ = ("offload", "promote", "remove")

    def __init__(self) -> None:
        self.offload: Dict[bytes, None] = {}
        self.promote: Dict[bytes, None] = {}
        self.remove: Dict[bytes, None] = {}

    def put(self, kind: str, key: bytes) -> None:
        getattr(self, kind)[key] = None

    def cancel(self, kind: str, key: bytes) -> bool:
        return getattr(self, kind).pop(key, 0) is None

    def take(self, kind: str, limit: int) -> List[bytes]:
        """Remove and return up to ``limit`` keys of ``kind``, oldest first."""
        queue: Dict[bytes, None] = getattr(self, kind)
        if len(queue) <= limit:
            keys = list(queue)
            queue.clear()
            return keys
        keys = []
        for key in queue:
            if len(keys) == limit:
                break
            keys.append(key)
        for key in keys:
            del queue[key]
        return keys

    def __len__(self) -> int:
        return len(self.offload) + len(self.promote) + len(self.remove)
