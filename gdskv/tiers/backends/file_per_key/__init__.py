"""The file-per-key backend: one file per object, for debugging and inspection.

Every object is one record file in a hash-named shard tree under ``<store>/files/``, so
``ls`` and ``xxd`` show what is stored; the on-disk format is the one every backend writes
(:mod:`gdskv.tiers.backends.record`).

Why a package of its own concepts rather than a trimmed module: what makes this backend
large is not inspection but what a store needs from any backend that one may serve from —
durable writes in two sync modes (``filesystem``, one ``syncfs`` per batch; ``file``, an
fsync per file and directory), crash safety for every rename and unlink, reuse of evicted
files so a full tier does not create and delete a file per write, a cache of open
descriptors, and the move of an older layout into the current one. Each is tested, and
stores that use it rely on it, so trimming it would change what those stores get (or drop
the tests that say so). Instead each concept is a module of its own, named after it:

- :mod:`.tree`: where each key's file is (the 16 x 16 shard tree, file names from a hash
  of the key), the scan at open and the move of the older layout's files into place;
- :mod:`.sync`: how files and directories are made durable (the two sync modes, the sync
  threads, directories whose changes are not durable yet);
- :mod:`.evicted`: what becomes of an evicted object's file (reused by the write that
  evicted it, a spare that a later write overwrites, or deleted; files that could not be
  deleted);
- :mod:`.backend`: :class:`FilePerKeyBackend` itself: the index, writes, reads, eviction
  and removal, over the three above. Reads and verification are the shared ones of
  :mod:`gdskv.tiers.backends.base`; descriptors are cached by
  :mod:`gdskv.tiers.backends.open_files`.
"""

from gdskv.tiers.backends.file_per_key.backend import FilePerKeyBackend
from gdskv.tiers.backends.file_per_key.sync import SYNC_THREADS
from gdskv.tiers.backends.file_per_key.tree import SHARD_DIGITS, SPARE_PREFIX, SUFFIX, file_name

__all__ = ["FilePerKeyBackend", "SHARD_DIGITS", "SPARE_PREFIX", "SUFFIX", "SYNC_THREADS", "file_name"]
