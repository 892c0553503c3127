"""The config of each NVMe storage backend: the options that backend takes, validated, and
``build()``.

- :class:`BucketConfig`: sealed bucket files, bucket-level eviction;
- :class:`OffsetConfig`: one preallocated file, checkpoint + window recovery;
- :class:`FilePerKeyConfig`: one file per object (for debugging), with its sync mode.

Each is a frozen, keyword-only dataclass validated on construction (a :class:`ConfigError`
names the field), whose fields are its backend's keyword arguments; ``build(root, engine)``
constructs the backend over the store directory ``root`` with them, importing it only then
(``_backend()``), so this module imports no backend. :data:`BACKEND_CONFIGS`
registers them by name; :func:`backend_config` picks one by name. A store builds the one
``StoreConfig.backend`` names from the flat fields (see :mod:`gdskv.config`): it needs to
know no backend's own options.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Optional, Type

from gdskv.config_fields import (
    EVICTION_POLICIES,
    FILE_PER_KEY_SYNC_MODES,
    GiB,
    check_bytes,
    check_choice,
    check_count,
    construct,
    registered,
)

if TYPE_CHECKING:  # no backend is imported at run time before build()
    from gdskv.gds.engine import IoEngine
    from gdskv.tiers.backends.base import StorageBackend

#: Open-time verification of sealed data: "index" (index checksums and file sizes) or
#: "full" (also every value's checksum).
VERIFY_MODES = ("index", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """What every backend takes. Subclasses add their own options and :meth:`build`."""

    #: The name the backend is registered under (and the store directory records).
    name: ClassVar[str] = ""

    #: Byte cap of the backend's files. Default 20 GiB.
    capacity: int = 20 * GiB
    #: Eviction when the cap is reached: "fifo" or "lru" (of buckets for the bucket
    #: backend, of objects for the others). Default "fifo".
    eviction: str = "fifo"
    #: Open-time verification: "index" (index checksums and file sizes; values are
    #: verified on every read) or "full" (also every value's checksum). Default "index".
    verify_on_open: str = "index"

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", check_bytes("capacity", self.capacity))
        check_choice("eviction policy", self.eviction, EVICTION_POLICIES, field="eviction")
        check_choice("verify_on_open mode", self.verify_on_open, VERIFY_MODES, field="verify_on_open")

    def build(self, root: "str | os.PathLike[str]", engine: "IoEngine") -> "StorageBackend":
        """Construct the backend in store directory ``root``, moving bytes with ``engine``:
        each field of the config is one of its keyword arguments."""
        options = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return self._backend()(Path(root), engine, **options)

    @staticmethod
    def _backend() -> "Type[StorageBackend]":
        """The backend class this config builds (imported only now)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketConfig(BackendConfig):
    """Sealed bucket files (a data file and its index each), evicted a bucket at a time."""

    name: ClassVar[str] = "bucket"

    @staticmethod
    def _backend() -> "Type[StorageBackend]":
        from gdskv.tiers.backends.bucket import BucketBackend

        return BucketBackend


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffsetConfig(BackendConfig):
    """One preallocated file (at least 4 KiB), recovered from a checkpoint and a window."""

    name: ClassVar[str] = "offset"

    #: Bytes of free space each checkpoint sets aside for the writes until the next one
    #: (the window: all that recovery scans past the checkpoint). Default None: 1/16 of
    #: the capacity, within [4 MiB, 256 MiB].
    window_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_bytes is not None:
            object.__setattr__(self, "window_bytes", check_bytes("window_bytes", self.window_bytes))

    @staticmethod
    def _backend() -> "Type[StorageBackend]":
        from gdskv.tiers.backends.offset import OffsetBackend

        return OffsetBackend


@dataclasses.dataclass(frozen=True, kw_only=True)
class FilePerKeyConfig(BackendConfig):
    """One file per object, for debugging."""

    name: ClassVar[str] = "file_per_key"

    #: How a write makes its files durable: "filesystem" (one syncfs(2) after the data,
    #: one after the renames: the same few device cache flushes a batch, whatever its
    #: number of files; it also writes back whatever else is dirty on that filesystem) or
    #: "file" (an fdatasync per file and an fsync per directory, side by side). Default
    #: "filesystem".
    sync: str = "filesystem"
    #: Descriptors kept open for reads: None for half of the process's RLIMIT_NOFILE (at
    #: most 65536), 0 to open and close a file around every read. Default None.
    open_files: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("file_per_key sync mode", self.sync, FILE_PER_KEY_SYNC_MODES, field="sync")
        if self.open_files is not None:
            check_count("open_files", self.open_files)

    @staticmethod
    def _backend() -> "Type[StorageBackend]":
        from gdskv.tiers.backends.file_per_key import FilePerKeyBackend

        return FilePerKeyBackend


#: The backend configs by registered name (gdskv.tiers.backends.BACKENDS holds the classes
#: they build, under the same names).
BACKEND_CONFIGS: Dict[str, Type[BackendConfig]] = {
    cls.name: cls for cls in (BucketConfig, FilePerKeyConfig, OffsetConfig)
}


def backend_config(name: str, **options: Any) -> BackendConfig:
    """The config of the backend registered as ``name``, with ``options`` (its own fields;
    an unknown name or option is a ConfigError listing the valid ones)."""
    cls = registered("backend", name, BACKEND_CONFIGS)
    return construct(cls, options, what=f"the {name} backend")
