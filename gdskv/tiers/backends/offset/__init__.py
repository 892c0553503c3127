"""The offset backend: every object in one preallocated file, placed by an offset allocator.

Layout under ``<store>/offset/``::

    data          ``capacity`` bytes, preallocated (fallocate); records (see
                  :mod:`gdskv.tiers.backends.record`) at 4 KiB-aligned offsets chosen by
                  :class:`~gdskv.tiers.allocator.OffsetAllocator`
    checkpoint    the index: a base, written atomically (temporary file, fsync, rename),
    delta-*       and what changed after it (see :mod:`.checkpoints`)

Eviction is object-level (FIFO or LRU) under the byte cap; ``evict_listener`` hears of the
victims before their space can be given to a new record, also when the write that evicted
them then fails.

Durability without writing the index on every write. A checkpoint lists every live object
(a base lists them all; a delta what changed since the checkpoint before it, see
:mod:`.checkpoints`) and a *window*: free extents (about ``window_bytes``, plus room for the
batch that caused the checkpoint) where the records of the next writes will go; its header
carries the *watermark*, the highest sequence number it covers (stored in the index format's
bucket-id field; window extents are entries with an empty key, which no object has). Until
the next checkpoint:

- a write places its records inside the window only (first fit), writes them through the
  I/O engine, fdatasyncs the file, and then makes them visible; a batch that does not fit
  the window takes a new checkpoint first (which evicts, in policy order, enough objects to
  leave a fresh window free);
- ``remove`` writes a *tombstone* record (flag, no value) into the window;
- space that objects leave (overwritten, removed, dropped) is reused only after the next
  checkpoint, which no longer lists them, is durable. A checkpoint frees that space (and
  evicts) before it is written, so it empties the window first and sets the new one only
  once it is durable: after a checkpoint that failed (no room, an I/O error), nothing is
  written into the file until one succeeds; the next write or remove takes one first.

Reopening loads the checkpoint (the base, then its deltas in order), scans only the last
one's window (:mod:`.window`) for records newer than its watermark (each verified: header
checksum, key and value CRC32C), applies them in sequence order (a record replaces an older
one of its key; a tombstone removes it), rebuilds the allocator from the survivors, and
writes a fresh base (deleting the deltas). Its watermark, and every sequence
number after it, is above every one recovery saw (listed objects, and every header in the
window that checks, tombstones and torn records included), so a number is never reused and
a later scan never prefers a stale record. So every write acknowledged as durable
survives a crash, and a removed key never comes back. A value that itself contains a whole
valid record newer than the watermark could be mistaken for one in the window scan; only
an adversarial value can do that.

Without a usable checkpoint (a damaged or missing base, or a damaged delta, or one missing
from the sequence), recovery starts empty, since the file
alone cannot tell live records from removed or superseded ones; and it empties the data
file (truncated, preallocated again, fsynced) before its first checkpoint, because the new
records restart at sequence number 1 and a later window scan would take the old ones for
newer. A crash before that checkpoint is durable leaves no usable one, so the next open
empties the file again. A checkpoint that exists but cannot be read now (an I/O error)
fails the open with :class:`IoError` and touches nothing: it may be readable later.

Readers pin the record they read, so a checkpoint never hands its space to a new write
while a read is in flight; eviction passes over pinned records (evicting one would free
nothing until its read ends), and a write that finds no room without them fails with
NoSpaceError, leaving them stored.

Each concept is a module of its own:

- :mod:`.checkpoints`: the checkpoint files' format (a base, its deltas, their names) and
  reading them back;
- :mod:`.window`: the window (picking it from the free extents, and scanning it at open);
- :mod:`.checkpoint_log`: what the next checkpoint writes (the index's changes since the
  last, a base or a delta), the keys the checkpoint on disk still lists, and writing it;
- :mod:`.recovery`: the open's steps before the index is rebuilt (the checkpoint loaded,
  or deleted when unusable; the data file opened, emptied where it must be; the window's
  records replayed);
- :mod:`.backend`: :class:`OffsetBackend` itself: the index, writes, removes, reads and
  eviction, when a checkpoint is taken and the space and window it sets, and the rebuild
  of the index at open.
"""

from gdskv.tiers.backends.offset.backend import OffsetBackend

__all__ = ["OffsetBackend"]
