"""Small durable-file helpers shared by the backends."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path
from typing import Callable, Optional

from gdskv.errors import IoError
from gdskv.gds.aligned import preallocate

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """Make renames and unlinks inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_syncfs() -> Optional[Callable[[int], int]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.syncfs
    except (OSError, AttributeError):  # no C library that has it (not Linux, or not glibc/musl)
        return None


_SYNCFS = _load_syncfs()


def syncfs_available() -> bool:
    """Whether this process can call ``syncfs(2)``."""
    return _SYNCFS is not None


def syncfs(fd: int) -> None:
    """``syncfs(2)``: write back every dirty inode and directory of the filesystem that
    holds ``fd`` and flush the device's cache; one call covers a whole batch of new files
    and renames, where an fdatasync per file and an fsync per directory flush the cache
    once each. Without a journal the kernel flushes before it has waited for the last
    metadata blocks it wrote: a caller that needs them durable then fsyncs a file or
    directory of that filesystem (see :meth:`file_per_key.sync.Syncer.syncfs`). Raises OSError: a
    writeback error anywhere on the filesystem since ``fd``'s previous call (kernels >= 5.8
    report these), or OSError(ENOSYS) where it is not available."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available here")
    if _SYNCFS(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def write_file_synced(path: Path, data: bytes) -> None:
    """Create (or truncate) ``path``, write ``data`` and fsync it; raise OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync and rename.

    A crash leaves either the old file or the new one, never a partial file under ``path``.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        write_file_synced(tmp, data)
        os.replace(tmp, path)
        if sync_dir:
            fsync_dir(path.parent)
    except OSError as exc:
        unlink_quietly(tmp)
        raise IoError(f"could not write {path.name}: {exc.strerror}", path=str(path), errno=exc.errno) from exc


def fit_reused_file(fd: int, nbytes: int) -> None:
    """Make a reused data file (an evicted one, renamed to a new temporary name) exactly
    ``nbytes`` long before it is written; raises OSError.

    A write that evicts reuses the evicted file (the steady state of a full tier): its blocks
    are allocated and written already, so the new O_DIRECT writes overwrite them in place,
    with no allocation, no unwritten extents to convert at the fdatasync and no discard of
    freed blocks, which made writes into a full tier markedly faster than new files with the
    old ones deleted (docs/notes/write-path.md has the figures). The caller
    writes every byte up to ``nbytes``, so nothing of the old content is left."""
    size = os.fstat(fd).st_size
    if size > nbytes:
        os.ftruncate(fd, nbytes)
    elif size < nbytes:
        preallocate(fd, nbytes)


def unlink_quietly(path: "str | os.PathLike[str]") -> None:
    """Remove ``path`` if it can be removed; a cleanup step that must not mask the real error."""
    try:
        os.unlink(path)
    except OSError:
        pass
