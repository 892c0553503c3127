"""NVMe storage backends (on-disk layouts), selected by name.

Each backend's options, their checks and its construction live in its config
(:mod:`gdskv.backend_config`): ``BucketConfig(capacity=...).build(root, engine)``.
:data:`BACKENDS` holds the backend classes by registered name; :func:`make_backend` builds
one by name (an unknown name, or an option that backend does not take, raises
:class:`ConfigError` listing the valid ones). The names are those of
:data:`gdskv.config.BACKENDS`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Type

from gdskv.backend_config import backend_config
from gdskv.gds.engine import IoEngine
from gdskv.tiers.backends.base import ObjectInfo, RecoveryReport, StorageBackend
from gdskv.tiers.backends.bucket import BucketBackend
from gdskv.tiers.backends.file_per_key import FilePerKeyBackend
from gdskv.tiers.backends.offset import OffsetBackend

BACKENDS: Dict[str, Type[StorageBackend]] = {
    "bucket": BucketBackend,
    "file_per_key": FilePerKeyBackend,
    "offset": OffsetBackend,
}


def make_backend(name: str, root: "str | os.PathLike[str]", engine: IoEngine, **options: Any) -> StorageBackend:
    """Build the backend registered as ``name`` over directory ``root`` with ``options``,
    the fields of its config (``capacity``, ``eviction``, ``verify_on_open``, and its own:
    ``window_bytes`` for offset, ``sync`` and ``open_files`` for file_per_key)."""
    return backend_config(name, **options).build(root, engine)


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
