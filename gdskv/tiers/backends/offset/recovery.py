"""The offset backend's open: what is read, checked and prepared before its index is rebuilt.

:meth:`~gdskv.tiers.backends.offset.backend.OffsetBackend.recover` calls these in order:

- :func:`remove_temporaries`: checkpoint files that a write cut short left under their
  temporary names;
- :func:`load_checkpoint`: the checkpoint on disk (the base with its deltas applied), or
  None when there is no usable one; its files are then deleted
  (:func:`drop_unusable_checkpoint`);
- :func:`open_data_file`: the data file, opened and preallocated; emptied first when there
  is no usable checkpoint;
- :func:`replay_window`: the records the window holds past the checkpoint, applied over
  the objects it lists.

The backend then claims each surviving record's space and writes a fresh base. Why each
step is there, and what a crash between two of them leaves, is in the package docstring.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, List, Optional

from gdskv.errors import ConfigError, CorruptionError, FormatVersionError, IoError, NoSpaceError
from gdskv.gds.engine import IoEngine
from gdskv.tiers.backends.base import RecoveryReport
from gdskv.tiers.backends.files import fsync_dir, unlink_quietly
from gdskv.tiers.backends.offset.checkpoints import BASE_FILE, Checkpoint, delta_files, is_temporary, read_checkpoint
from gdskv.tiers.backends.offset.window import Extent, scan_window
from gdskv.tiers.backends.record import FLAG_TOMBSTONE, IndexEntry

log = logging.getLogger("gdskv.tiers.backends.offset")


def remove_temporaries(directory: Path) -> None:
    """Delete the checkpoint files in ``directory`` that are still under their temporary
    names (a write cut short). Raises IoError when the directory cannot be listed."""
    try:
        temporaries = [path for path in directory.iterdir() if is_temporary(path.name)]
    except OSError as exc:
        raise IoError(f"cannot list the checkpoint files: {exc.strerror}", path=str(directory), errno=exc.errno) from exc
    for path in temporaries:
        unlink_quietly(path)


def load_checkpoint(directory: Path, capacity: int, report: RecoveryReport) -> Optional[Checkpoint]:
    """The checkpoint in ``directory`` (the base with its deltas applied); None when there
    is no usable one, and the data file must be emptied: its files are then deleted
    (:func:`drop_unusable_checkpoint`) and a damaged one is counted in ``report``.

    Raises FormatVersionError for a newer format, IoError when a checkpoint file cannot be
    read now (it may be readable later: nothing is touched), and ConfigError when the store
    was made with more than ``capacity``."""
    try:
        checkpoint = read_checkpoint(directory, capacity=capacity)
    except FormatVersionError:
        raise
    except CorruptionError as exc:
        # Without its index the file cannot tell live records from removed ones: start
        # empty rather than bring back what was removed.
        log.warning("gdskv: damaged checkpoint, dropping every object of %s: %s", directory, exc)
        report.dropped_corrupt += 1
        drop_unusable_checkpoint(directory)
        return None
    except OSError as exc:  # it may be readable later: fail the open, touch nothing
        raise IoError(f"cannot read the checkpoint: {exc.strerror}", path=str(exc.filename or directory / BASE_FILE), errno=exc.errno) from exc
    if checkpoint is None:
        # A new store, or one that crashed before its first checkpoint was durable (one
        # is written at open before any write), or a checkpoint deleted from beside its
        # data: the data file cannot be trusted either way.
        drop_unusable_checkpoint(directory)
        return None
    if checkpoint.capacity > capacity:
        # Records past the new end would be lost, and with them tombstones that keep
        # removed keys from coming back: refuse, and touch nothing.
        raise ConfigError(
            "an offset store cannot shrink: open it with its capacity or more, or remove its "
            "directory to start an empty one", path=str(directory), stored=checkpoint.capacity, requested=capacity,
        )
    return checkpoint


def drop_unusable_checkpoint(directory: Path) -> None:
    """Delete the checkpoint's files, durably, before a store without a usable one
    starts over: its sequence numbers restart, and a later base could take an old delta
    for its own. The base goes first (durably): a base left without its deltas would
    be taken for the whole state by the next open, should this one stop before its new
    base is written, and the keys they removed would come back. (A damaged base without
    deltas is left: the next open finds it damaged again.) Raises IoError."""
    try:
        stale = delta_files(directory)
        if not stale:
            return
        (directory / BASE_FILE).unlink(missing_ok=True)
        fsync_dir(directory)
        for _base, _n, path in stale:
            path.unlink(missing_ok=True)
        fsync_dir(directory)
    except OSError as exc:
        raise IoError(f"cannot delete an unusable checkpoint: {exc.strerror}", path=str(directory), errno=exc.errno) from exc


def open_data_file(engine: IoEngine, path: Path, capacity: int, *, empty: bool) -> int:
    """Open (or create) the data file at ``path`` through ``engine`` and preallocate it to
    ``capacity``; return its descriptor.

    With ``empty`` (no usable checkpoint), a file that holds anything is first cut to
    zero length, reallocated and fsynced, before the fresh checkpoint (watermark 0) is
    written: its old records, removed and superseded ones included, carry sequence
    numbers that the new ones would restart below, so a later window scan could bring
    them back. A crash before that checkpoint leaves no usable one either, and the next
    open empties the file again."""
    try:
        fd = engine.open_file(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise IoError(f"cannot open the data file: {exc.strerror}", path=str(path), errno=exc.errno) from exc
    try:
        if empty and os.fstat(fd).st_size:
            log.warning("gdskv: no usable checkpoint, emptying the data file %s", path)
            os.ftruncate(fd, 0)
    except OSError as exc:
        os.close(fd)
        raise IoError(f"cannot empty the data file: {exc.strerror}", path=str(path), errno=exc.errno) from exc
    try:
        if os.fstat(fd).st_size < capacity:
            os.posix_fallocate(fd, 0, capacity)
    except OSError as exc:
        os.close(fd)
        raise NoSpaceError(
            "cannot preallocate the offset backend's file", path=str(path),
            capacity=capacity, errno=exc.errno,
        ) from exc
    if empty:
        try:
            os.fsync(fd)  # the emptied file is durable before a checkpoint can follow it
        except OSError as exc:
            os.close(fd)
            raise IoError(f"cannot sync the data file: {exc.strerror}", path=str(path), errno=exc.errno) from exc
    return fd


def replay_window(
    engine: IoEngine, fd: int, path: str, entries: Dict[bytes, IndexEntry], window: List[Extent], watermark: int, report: RecoveryReport
) -> int:
    """Apply to ``entries`` (what the checkpoint lists) the records newer than
    ``watermark`` that the scan of ``window`` finds (:func:`scan_window`), in sequence
    order: a record replaces an older one of its key, a tombstone removes it. Returns the
    highest sequence number of any header the scan met. Raises IoError when part of the
    window cannot be read."""
    found, newest = scan_window(engine, fd, path, window, watermark, report)
    for seq, flags, entry in sorted(found, key=lambda f: f[0]):
        current = entries.get(entry.key)
        if current is not None and current.seq >= seq:
            continue
        if flags & FLAG_TOMBSTONE:
            entries.pop(entry.key, None)
        else:
            entries[entry.key] = entry
    return newest
