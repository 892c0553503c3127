"""NVMe storage backends (on-disk layouts), selected by name.

:func:`make_backend` builds one; an unknown name raises :class:`ConfigError` listing the
valid ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

from gdskv.errors import ConfigError
from gdskv.gds.engine import IoEngine
from gdskv.tiers.backends.base import ObjectInfo, RecoveryReport, StorageBackend
from gdskv.tiers.backends.bucket import BucketBackend

BACKENDS: Dict[str, Callable[..., StorageBackend]] = {
    "bucket": BucketBackend,
}


def make_backend(name: str, root: Path, engine: IoEngine, **options) -> StorageBackend:
    """Build the backend registered as ``name`` over directory ``root``."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ConfigError("unknown backend", got=name, valid=", ".join(sorted(BACKENDS))) from None
    return factory(root, engine, **options)


__all__ = ["BACKENDS", "BucketBackend", "ObjectInfo", "RecoveryReport", "StorageBackend", "make_backend"]
