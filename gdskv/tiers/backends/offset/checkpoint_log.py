"""What the offset backend's next checkpoint writes, and which checkpoints are on disk.

A checkpoint is a base (every object) or a delta of the last base (what changed since the
checkpoint before it): :mod:`.checkpoints` says how each is encoded. Between two
checkpoints :class:`CheckpointLog` keeps:

- the index's changes since the last durable checkpoint (a key's new entry, or the key
  gone), which the next delta lists;
- the keys gone from the index (evicted, removed, dropped) that the checkpoint on disk
  still lists and no durable tombstone outranks: a remove of such a key takes a checkpoint,
  or the key would come back at the next open;
- which base is on disk and how many deltas of it, and so whether the next checkpoint is a
  base (at open, after a base that failed, and as :func:`base_is_due` says).

The backend decides when a checkpoint is taken and what its window and watermark are
(``OffsetBackend._checkpoint``). It takes one from the log (:meth:`CheckpointLog.take`),
has it written (:meth:`CheckpointLog.write`), and then tells the log whether that
succeeded (:meth:`~CheckpointLog.written`) or not (:meth:`~CheckpointLog.failed`). Every
method but :meth:`~CheckpointLog.write` and :meth:`~CheckpointLog.delete_stale_deltas`
runs with the backend's lock held.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from gdskv.tiers.backends.files import unlink_quietly, write_file_atomic
from gdskv.tiers.backends.offset.checkpoints import BASE_FILE, base_is_due, delta_files, delta_name, encode_base, encode_delta
from gdskv.tiers.backends.offset.window import Extent
from gdskv.tiers.backends.record import IndexEntry

log = logging.getLogger("gdskv.tiers.backends.offset")


@dataclasses.dataclass
class Taken:
    """A checkpoint taken from the log (:meth:`CheckpointLog.take`) and not durable yet."""

    #: A base (it lists every object), else a delta of the base on disk.
    base: bool
    #: The highest sequence number it covers.
    watermark: int
    #: A base's objects (a delta's are in ``changes``).
    listed: List[IndexEntry]
    #: What changed since the checkpoint before it: key -> its new entry, or None (gone).
    changes: Dict[bytes, Optional[IndexEntry]]
    #: The keys dropped when it was taken (key -> the number of that drop): once it is
    #: durable, the checkpoint on disk no longer lists them.
    unlisted: Dict[bytes, int]


class CheckpointLog:
    """The bookkeeping between two checkpoints of the offset store in ``directory`` (see
    the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.base_path = directory / BASE_FILE
        #: Index changes since the last durable checkpoint: key -> its new entry, or None
        #: (evicted, removed, dropped). The next delta lists them.
        self.changed: Dict[bytes, Optional[IndexEntry]] = {}
        #: Keys gone from the index that the checkpoint on disk still lists and no durable
        #: tombstone outranks: key -> the number of its latest drop.
        self.dropped: Dict[bytes, int] = {}
        self._drops = itertools.count()
        self.base = 0  # watermark of the base on disk, which names its deltas
        self.deltas = 0  # deltas written since that base
        self.delta_bytes = 0
        self.base_bytes = 0
        #: The next checkpoint is a base: at open, and after a base write failed (it may
        #: still have landed, and deltas named for the base before would then be stale).
        self.base_due = True

    # -- what the index does (lock held)

    def put(self, entry: IndexEntry) -> None:
        """``entry`` is its key's current replica now."""
        self.changed[entry.key] = entry

    def gone(self, key: bytes) -> None:
        """``key`` left the index (evicted, removed, dropped); the checkpoint on disk may
        still list it."""
        self.changed[key] = None
        self.dropped[key] = next(self._drops)

    def still_listed(self, key: bytes) -> bool:
        """Whether ``key``, gone from the index, may still be listed by the checkpoint on
        disk (no checkpoint since, nor a durable tombstone)."""
        return key in self.dropped

    def outranked(self, key: bytes) -> None:
        """A durable tombstone of ``key`` outranks what the checkpoint on disk lists."""
        self.dropped.pop(key, None)

    def restart(self) -> None:
        """At open: the next checkpoint lists what recovery found, in full (a base; the
        deltas read then go)."""
        self.changed.clear()
        self.base_due = True

    # -- a checkpoint

    def base_next(self) -> bool:
        """Whether the next checkpoint is a base. Lock held."""
        return self.base_due or base_is_due(self.deltas, self.delta_bytes, self.base_bytes)

    def take(self, watermark: int, listed: Optional[Iterable[IndexEntry]]) -> Taken:
        """The checkpoint covering sequence numbers up to ``watermark``: a base of every
        object in ``listed``, or (``listed`` None) a delta of the changes so far. A change
        after this goes into the next one. Lock held."""
        changes, self.changed = self.changed, {}
        return Taken(listed is not None, watermark, [] if listed is None else list(listed), changes, dict(self.dropped))

    def write(self, taken: Taken, capacity: int, window: Sequence[Extent]) -> int:
        """Write ``taken``, with ``window``, atomically; return its size in bytes. Without
        the lock. Whatever this raises (an IoError; a MemoryError or an interrupt), call
        :meth:`failed`."""
        if taken.base:
            path, data = self.base_path, encode_base(taken.watermark, capacity, taken.listed, window)
        else:
            added = [entry for entry in taken.changes.values() if entry is not None]
            gone = [key for key, entry in taken.changes.items() if entry is None]
            path = self.dir / delta_name(self.base, self.deltas + 1)
            data = encode_delta(self.base, taken.watermark, capacity, added, gone, window)
        write_file_atomic(path, data)
        return len(data)

    def failed(self, taken: Taken) -> None:
        """The write of ``taken`` failed: its changes go into the next checkpoint (where a
        key changed again since, the newer change wins). Lock held.

        The file may have landed all the same (its directory's fsync failed). A delta
        that did is written again, under the same name, by the next checkpoint. A base
        that did has a new watermark, which the deltas named for the base before do not
        match: so after a failed base the next checkpoint is a base too."""
        for key, entry in taken.changes.items():
            self.changed.setdefault(key, entry)
        self.base_due = self.base_due or taken.base

    def written(self, taken: Taken, nbytes: int) -> None:
        """``taken`` (``nbytes`` long) is durable. Lock held; a base then calls
        :meth:`delete_stale_deltas`, without it."""
        for key, drop in taken.unlisted.items():  # the checkpoint on disk does not list them any more
            if self.dropped.get(key) == drop:  # (dropped again meanwhile: it may list that one)
                del self.dropped[key]
        if taken.base:
            self.base, self.deltas, self.delta_bytes, self.base_bytes = taken.watermark, 0, 0, nbytes
            self.base_due = False
        else:
            self.deltas += 1
            self.delta_bytes += nbytes

    def delete_stale_deltas(self) -> None:
        """Delete the deltas of earlier bases, which the base just written lists in full.
        Best effort: one left behind is never applied to another base (it names its own),
        and the next base, or open, tries again."""
        try:
            for of_base, _n, stale in delta_files(self.dir):
                if of_base != self.base:
                    unlink_quietly(stale)
        except OSError as exc:
            log.warning("gdskv: could not list old checkpoint deltas in %s: %s", self.dir, exc)
