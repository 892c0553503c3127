"""NVMe storage backends (on-disk layouts), selected by name.

:func:`make_backend` builds one; an unknown name raises :class:`ConfigError` listing the
valid ones. The names must match :data:`gdskv.config.BACKENDS` (a test checks that they
agree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

from gdskv.errors import ConfigError
from gdskv.gds.engine import IoEngine
from gdskv.tiers.backends.base import ObjectInfo, RecoveryReport, StorageBackend
from gdskv.tiers.backends.bucket import BucketBackend
from gdskv.tiers.backends.file_per_key import FilePerKeyBackend
from gdskv.tiers.backends.offset import OffsetBackend

BACKENDS: Dict[str, Callable[..., StorageBackend]] = {
    "bucket": BucketBackend,
    "file_per_key": FilePerKeyBackend,
    "offset": OffsetBackend,
}


def make_backend(name: str, root: Path, engine: IoEngine, **options) -> StorageBackend:
    """Build the backend registered as ``name`` over directory ``root``."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ConfigError("unknown backend", got=name, valid=", ".join(sorted(BACKENDS))) from None
    return factory(root, engine, **options)


__all__ = [
    "BACKENDS",
    "BucketBackend",
    "FilePerKeyBackend",
    "ObjectInfo",
    "OffsetBackend",
    "RecoveryReport",
    "StorageBackend",
    "make_backend",
]
