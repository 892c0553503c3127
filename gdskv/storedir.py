"""The store directory: its lock (one process at a time) and its format metadata.

The lock is an exclusive ``flock`` on ``LOCK``; the process that holds it writes its pid
into the file, so that one refused (:class:`StoreLockedError`, with ``holder_pid``) can
say which process has the store (:func:`lock_holder`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from gdskv.config import StoreConfig
from gdskv.errors import ConfigError, FormatVersionError, IoError, StoreLockedError
from gdskv.tiers.backends.files import write_file_atomic
from gdskv.tiers.backends.record import FORMAT_VERSION

log = logging.getLogger(__name__)

META_FILE = "gdskv.json"
LOCK_FILE = "LOCK"


def open_store_directory(path: Path, config: StoreConfig) -> int:
    """Create or validate the store directory, take its lock, check its format."""
    if path.exists() and not path.is_dir():
        raise ConfigError("store path exists and is not a directory", path=str(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise IoError(f"cannot open store directory: {exc.strerror}", path=str(path), errno=exc.errno) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        holder = lock_holder(path)
        context = {"path": str(path)} if holder is None else {"path": str(path), "holder_pid": holder}
        raise StoreLockedError("store directory is open in another process", **context) from None
    try:
        _record_holder(fd)
        _check_meta(path / META_FILE, config)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _record_holder(fd: int) -> None:
    """Write this process's pid into the lock file it holds (best effort: the lock is the
    flock, the pid only names its holder)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        log.debug("gdskv: cannot record the lock holder: %s", exc)


def lock_holder(path: "str | os.PathLike[str]") -> "int | None":
    """The pid of the process that holds (or last held) the lock of the store directory
    ``path``, as it recorded it; None when none is recorded."""
    try:
        raw = (Path(path) / LOCK_FILE).read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def stored_backend(path: Path) -> "str | None":
    """The backend the store in directory ``path`` was created with (its ``gdskv.json``);
    None when there is no readable one (no store there yet)."""
    try:
        return _read_meta(Path(path) / META_FILE)[2]
    except ConfigError:
        return None


def _read_meta(meta_path: Path) -> "tuple[dict, int, str]":
    """``(metadata, format_version, backend)`` of a store's ``gdskv.json``; ConfigError
    when it cannot be read or lacks them."""
    try:
        meta = json.loads(meta_path.read_text())
        return meta, int(meta["format_version"]), str(meta["backend"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("unreadable store metadata", path=str(meta_path), cause=str(exc)) from exc


def store_format_version(backend: str) -> int:
    """The ``format_version`` this gdskv writes for a store of ``backend``: the backend's
    layout version (see :attr:`StorageBackend.layout_version`), at least the records'
    :data:`FORMAT_VERSION`."""
    from gdskv.tiers.backends import BACKENDS  # the backends import this package's helpers

    factory = BACKENDS.get(backend)
    return max(FORMAT_VERSION, getattr(factory, "layout_version", FORMAT_VERSION))


def _check_meta(meta_path: Path, config: StoreConfig) -> None:
    """Create the metadata of a new store; check an existing store's (its backend, and a
    format this gdskv can read). A store of an older layout is marked with the new version
    before its backend opens (and moves its files): from then on an older gdskv refuses
    it, rather than miss everything it would look for in the old places."""
    supported = store_format_version(config.backend)
    if not meta_path.exists():
        meta = {"format": "gdskv", "format_version": supported, "backend": config.backend}
        write_file_atomic(meta_path, json.dumps(meta, indent=2).encode())
        return
    meta, version, backend = _read_meta(meta_path)
    if backend != config.backend:
        raise ConfigError("store was created with another backend", path=str(meta_path), stored=backend, requested=config.backend)
    if version > supported:
        raise FormatVersionError(
            "store written by a newer gdskv format", path=str(meta_path), supported=supported, got=version
        )
    if version < supported:
        meta["format_version"] = supported
        write_file_atomic(meta_path, json.dumps(meta, indent=2).encode())
        log.info("gdskv: %s: store format %d upgraded to %d; older gdskv versions cannot open it", meta_path.parent, version, supported)
