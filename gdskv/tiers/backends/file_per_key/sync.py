"""How the file-per-key backend makes its files and directories durable.

A write makes each file under a temporary name, makes it durable, renames it into place
and makes the renames durable; only then does it return. Two modes (``sync``):

- ``"filesystem"`` (the default): each of those two steps is one ``syncfs(2)`` for the
  whole batch, then an fsync of the store directory (see :meth:`Syncer.syncfs`), so a
  batch flushes the device's cache a fixed number of times whatever its number of files.
  It also writes back whatever else is dirty on that filesystem, which costs nothing on a
  disk the store has to itself. Where ``syncfs`` is not available the backend falls back
  to ``"file"`` (:func:`mode_in_use`, logged).
- ``"file"``: each file fdatasynced as soon as its own write completes, then every
  directory whose entries changed fsynced, side by side on :data:`SYNC_THREADS` threads;
  this touches nothing else, but costs a flush per file on a filesystem without a journal.

Directories whose changed entries (an unlink, an eviction's rename) are not known to be
durable yet are kept in :class:`PendingDirs`; a ``remove()`` fsyncs them before it
returns.

Every sync of the backend goes through this module's ``fsync_dir`` and ``syncfs`` (tests
replace them here to watch or fail them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

from gdskv.errors import IoError
from gdskv.tiers.backends.files import fsync_dir, syncfs, syncfs_available

log = logging.getLogger(__name__)

#: Files (and directories) of one batch synced at once.
SYNC_THREADS = 16


def mode_in_use(requested: str) -> str:
    """The sync mode a backend asked for ``requested`` uses on this machine: ``"file"``
    where ``syncfs`` is not available (logged), else ``requested``."""
    if requested == "filesystem" and not syncfs_available():
        log.info("gdskv: syncfs is not available here; file_per_key syncs file by file")
        return "file"
    return requested


class Syncer:
    """One backend's syncs: the store directory's descriptor that ``syncfs`` is called on
    ("filesystem" mode), and the threads that run a batch's fsyncs side by side.

    ``with_descriptors(call, *args, lock_held=)`` runs a call that opens a descriptor,
    closing the backend's cached ones and trying again when the process is out of them."""

    def __init__(self, directory: Path, mode: str, with_descriptors: Callable[..., Any]) -> None:
        #: The sync mode in use.
        self.mode = mode
        self._dir_str = str(directory)
        self._with_descriptors = with_descriptors
        #: Opened by the backend's recover(), or else by its first write; only writes use it.
        self.fd: Optional[int] = None
        #: Threads that run a batch's fsyncs side by side (each mostly waits on the device).
        self._pool = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="gdskv-fsync")
        #: The same for an eviction's directory fsyncs, which a write waits for holding the
        #: backend's lock: nothing on these threads takes the lock (jobs on ``_pool`` may, to
        #: shed descriptors on EMFILE, and could fill it while the lock holder waits).
        self._locked_pool = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="gdskv-fsync-evict")

    def open_descriptor(self) -> None:
        """Open the store directory's descriptor that :meth:`syncfs` uses, in "filesystem"
        mode and unless it is open (the backend's lock held). Raises IoError."""
        if self.mode != "filesystem" or self.fd is not None:
            return
        try:
            self.fd = self._with_descriptors(os.open, self._dir_str, os.O_RDONLY | os.O_DIRECTORY, lock_held=True)
        except OSError as exc:
            raise IoError(f"cannot open the store directory: {exc.strerror}", path=self._dir_str, errno=exc.errno) from exc

    def syncfs(self) -> None:
        """Make everything written on the store's filesystem durable; raises OSError.
        Called by a write (one at a time)."""
        assert self.fd is not None
        try:
            syncfs(self.fd)
            # On a filesystem without a journal (ext2, ext4 without one), syncfs starts
            # writing the metadata blocks (inodes, directories), flushes the device's cache,
            # and only then waits for those writes (the kernel's sync_filesystem:
            # sync_blockdev_nowait, ->sync_fs(wait), sync_blockdev): they may still sit in
            # the cache. An fsync of the directory flushes it again, after them (ext4
            # without a journal flushes on every fsync).
            os.fsync(self.fd)
        except OSError as exc:
            exc.filename = exc.filename or self._dir_str
            raise

    def fdatasync(self, fd: int) -> "concurrent.futures.Future[None]":
        """fdatasync ``fd`` on a sync thread."""
        return self._pool.submit(os.fdatasync, fd)

    def fsync_dir(self, path: Path) -> None:
        """fsync a directory (out of descriptors: see ``with_descriptors``); the backend's
        lock is not held. One that is gone (a shard removed behind the store's back) has
        nothing left to sync."""
        with contextlib.suppress(FileNotFoundError):
            self._with_descriptors(fsync_dir, path, lock_held=False)

    def fsync_dirs(self, paths: Iterable[Path]) -> None:
        """fsync directories side by side on the sync threads; raise the first OSError once
        all have ended (RuntimeError once :meth:`shutdown`). The lock is not held."""
        wait_all([self._pool.submit(self.fsync_dir, path) for path in paths])

    def fsync_dirs_locked(self, paths: Iterable[Path]) -> Dict[Path, BaseException]:
        """fsync directories side by side with the backend's lock held: plain fsyncs, on
        threads that never take the lock (they cannot shed cached descriptors on EMFILE).
        Returns the error of each one that failed."""
        syncs = {path: self._locked_pool.submit(fsync_dir, path) for path in paths}
        concurrent.futures.wait(list(syncs.values()))
        return {path: exc for path, sync in syncs.items() if (exc := sync.exception()) is not None}

    def close_descriptor(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def shutdown(self) -> None:
        """Wait for the syncs in flight and stop the threads."""
        self._pool.shutdown(wait=True)
        self._locked_pool.shutdown(wait=True)


class PendingDirs:
    """Directories whose changed entries (an unlink, an eviction's rename) are not known to be
    durable, each with the number of its latest change. Callers hold the backend's lock.

    A sync covers the changes made before it began: take a :meth:`snapshot` first, sync, then
    :meth:`settle` it, which forgets only the directories no change reached meanwhile.
    Nothing is forgotten before its sync ends, so a second caller (a remove() running beside
    another) sees the directories still pending and syncs them itself."""

    def __init__(self) -> None:
        self._dirs: Dict[Path, int] = {}
        self._changes = 0

    def add(self, directory: Path) -> None:
        self._changes += 1
        self._dirs[directory] = self._changes

    def update(self, directories: Iterable[Path]) -> None:
        for directory in directories:
            self.add(directory)

    def snapshot(self) -> Dict[Path, int]:
        return dict(self._dirs)

    def settle(self, synced: Dict[Path, int]) -> None:
        for directory, change in synced.items():
            if self._dirs.get(directory) == change:
                del self._dirs[directory]


def wait_all(futures: Sequence["concurrent.futures.Future[None]"]) -> None:
    """Wait for every future, then raise the first one's error, if any."""
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def fsync_dir_quietly(path: Path) -> None:
    try:
        fsync_dir(path)
    except OSError:
        pass
