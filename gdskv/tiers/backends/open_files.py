"""A bounded cache of open file descriptors, one per key, that readers pin.

The file-per-key backend reads each object from its own file; opening and closing that
file around every 4 KiB read costs more CPU than the read itself. :class:`OpenFiles` keeps
the descriptors of recently written or read files open, least recently used first out,
up to a limit.

A descriptor is *pinned* while a read is in flight on it. A pinned handle is never pushed
out of the cache (the cache may hold more than its limit meanwhile), so a key with a read in
flight through its current handle is :meth:`OpenFiles.busy`: the owner must not reuse that
file. (One case escapes: in the file-per-key backend, a read that opens a key's path just
after an overwrite renamed a new file there, before the index changed, tags the new file
with the old record's number; the write's own handle then replaces it. That read checks
the new bytes against the old record and is a miss whatever happens to the file.) Dropping a key (its file was replaced, removed or evicted) never closes a pinned
descriptor: its last reader does, in :meth:`OpenFiles.unpin`. Each handle carries a *tag*
(the record's sequence number), so a handle of an older file is never served for a newer
record of the same key.

Not thread-safe: the owner calls it with its own lock held.
"""

from __future__ import annotations

import os
import resource
from collections import OrderedDict
from typing import List, Optional

from gdskv.gds.aligned import is_direct_fd

#: The most descriptors kept by default, whatever the process's limit.
DEFAULT_MAX = 65536


def default_limit() -> int:
    """Descriptors a cache keeps by default: half of this process's soft ``RLIMIT_NOFILE``
    (the rest is left to sockets, other files and other stores), at most :data:`DEFAULT_MAX`."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX
    return max(0, min(DEFAULT_MAX, soft // 2))


class Handle:
    """One open descriptor of one key's file, and what requests on it need to say."""

    __slots__ = ("fd", "tag", "path", "direct", "pins", "cached")

    def __init__(self, fd: int, tag: int, path: str) -> None:
        self.fd = fd
        self.tag = tag
        self.path = path  # for error messages
        self.direct = is_direct_fd(fd)  # asked once, not by the engine on every read
        self.pins = 0
        self.cached = True  # False once dropped from the cache; the last unpin closes it


class OpenFiles:
    """Up to ``limit`` open descriptors by key, least recently used evicted first."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._handles: "OrderedDict[bytes, Handle]" = OrderedDict()
        self.hits = 0
        self.opens = 0

    def __len__(self) -> int:
        return len(self._handles)

    def pin(self, key: bytes, tag: int) -> Optional[Handle]:
        """The cached handle of ``key`` with ``tag``, pinned and made most recent; None when
        there is none (a handle of another tag is dropped)."""
        handle = self._handles.get(key)
        if handle is None:
            return None
        if handle.tag != tag:
            self.discard(key)
            return None
        self._handles.move_to_end(key)
        handle.pins += 1
        self.hits += 1
        return handle

    def busy(self, key: bytes) -> bool:
        """Whether a read is in flight on the current file of ``key``."""
        handle = self._handles.get(key)
        return handle is not None and handle.pins > 0

    def add(self, key: bytes, fd: int, tag: int, path: str, *, pinned: bool) -> Handle:
        """Take ownership of ``fd``, the file of ``key`` at ``path`` with ``tag``; it
        replaces any older handle of the key. Pinned when ``pinned``. Then the least
        recently used handles that are not pinned leave until at most ``limit`` remain."""
        self.discard(key)
        handle = Handle(fd, tag, path)
        if pinned:
            handle.pins = 1
            self.opens += 1
        self._handles[key] = handle
        self._trim(self.limit)
        return handle

    def unpin(self, handle: Handle) -> None:
        """End one read on ``handle``; close it if it has left the cache and this was the
        last, or if the cache holds more than its limit."""
        handle.pins -= 1
        if handle.pins:
            return
        if not handle.cached:
            os.close(handle.fd)
        elif len(self._handles) > self.limit:
            self._trim(self.limit)

    def _trim(self, keep: int) -> int:
        """Close the least recently used handles no read is using while more than ``keep``
        are held; returns how many were closed."""
        excess = len(self._handles) - keep
        if excess <= 0:
            return 0
        idle: List[bytes] = []
        for key, handle in self._handles.items():  # oldest first; pinned ones are few
            if handle.pins == 0:
                idle.append(key)
                if len(idle) == excess:
                    break
        for key in idle:
            self._retire(self._handles.pop(key))
        return len(idle)

    def discard(self, key: bytes) -> None:
        """Drop the handle of ``key``, if any (closed now, or by its last reader)."""
        handle = self._handles.pop(key, None)
        if handle is not None:
            self._retire(handle)

    def shed(self) -> int:
        """Close every handle no read is using (for when the process runs out of
        descriptors); returns how many. Pinned ones stay: they cannot be closed yet, and
        their keys must stay :meth:`busy`."""
        return self._trim(0)

    def clear(self) -> None:
        """Drop every handle."""
        handles, self._handles = self._handles, OrderedDict()
        for handle in handles.values():
            self._retire(handle)

    @staticmethod
    def _retire(handle: Handle) -> None:
        handle.cached = False
        if handle.pins == 0:
            os.close(handle.fd)
