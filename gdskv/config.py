"""Store configuration: the flat fields users set, and the config of each component.

:class:`StoreConfig` is the user-facing edge: one frozen, keyword-only dataclass of flat
fields (``gdskv.open`` keywords, ``GDSKV_*`` variables, the command line's options all name
them), validated on construction. Construction maps them onto the config of each pluggable
component, which validates its own fields and builds it:

- ``config.offloader``: :class:`~gdskv.offload_config.OffloaderConfig`;
- ``config.io``: the :mod:`gdskv.io_config` of the engine ``io_engine`` names;
- ``config.nvme_backend``: the :mod:`gdskv.backend_config` of the backend ``backend`` names.

:data:`OFFLOADER_FIELDS`, :data:`IO_FIELDS` and :data:`BACKEND_FIELDS` say which flat field
sets which component field; a component's ConfigError names the flat field the user wrote.

Sizes are bytes inside the library; strings such as ``"8GiB"`` are parsed at the edge with
:func:`parse_size`. Environment overrides (``GDSKV_*``) are read in one place,
:func:`env_overrides`, and applied by :func:`gdskv.open`.

This module imports the component configs, never the components.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Type, TypeVar

from gdskv.backend_config import BACKEND_CONFIGS, VERIFY_MODES, BackendConfig
from gdskv.config_fields import (
    EVICTION_POLICIES,
    FILE_PER_KEY_SYNC_MODES,
    MAX_WAIT_S,
    GiB,
    KiB,
    MiB,
    Size,
    TiB,
    check_bytes,
    check_choice,
    check_count,
    check_flag,
    check_wait,
    format_size,
    parse_size,
)
from gdskv.errors import ConfigError
from gdskv.io_config import ENGINE_CONFIGS, MAX_IO_DEPTH, MAX_IO_THREADS, EngineConfig
from gdskv.offload_config import OFFLOAD_POLICIES, OffloaderConfig

#: The smallest DRAM tier: one allocation unit of its arena (capacities are rounded down to
#: whole units of 64 bytes).
MIN_DRAM_BYTES = 64

#: Registered names: those of gdskv.tiers.backends.BACKENDS and gdskv.gds.ENGINES.
BACKENDS = tuple(sorted(BACKEND_CONFIGS))
IO_ENGINES = tuple(sorted(ENGINE_CONFIGS))

#: The flat fields each component's config is built from: flat name -> that config's field.
#: A component takes those of its fields it has (psync has no ``depth``).
OFFLOADER_FIELDS = {
    "offload": "policy",
    "high_watermark": "high_watermark",
    "low_watermark": "low_watermark",
    "bucket_bytes": "bucket_bytes",
    "bucket_max_keys": "bucket_max_keys",
    "bucket_max_age_s": "bucket_max_age_s",
    "offload_retry_s": "offload_retry_s",
}
IO_FIELDS = {
    "io_threads": "threads",
    "io_depth": "depth",
    "io_read_inflight_bytes": "read_inflight_bytes",
    "direct_io": "direct",
}
BACKEND_FIELDS = {
    "ssd_bytes": "capacity",
    "ssd_eviction": "eviction",
    "verify_on_open": "verify_on_open",
    "file_per_key_sync": "sync",
}

C = TypeVar("C")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Everything that shapes a :class:`gdskv.Store`. All sizes are in bytes.

    The offloader's, the I/O engine's and the NVMe backend's fields are checked by their
    own configs (``offloader``, ``io``, ``nvme_backend``); a flat field of an engine or a
    backend not chosen is checked by the configs that take it, so a bad value is refused
    whichever is chosen.
    """

    #: Capacity of the host DRAM tier (one arena allocated once). Default 2 GiB.
    dram_bytes: int = 2 * GiB
    #: Ask the kernel to back the DRAM arena with transparent huge pages (MADV_HUGEPAGE):
    #: O_DIRECT transfers from huge pages need far fewer scatter-gather segments
    #: (docs/ssd-path.md). Turn off where huge-page faults stall (direct compaction on a
    #: fragmented host) more than offload speed matters; the I/O engines' staging (a few
    #: MiB per thread, allocated once) keeps the advice. Default True.
    dram_huge_pages: bool = True
    #: Map the DRAM arena as shared memory (a memfd) that processes attached to a node map
    #: too (:mod:`gdskv.local`); ``gdskv-node --socket`` sets it. Default False.
    dram_shared: bool = False
    #: Byte cap of the NVMe tier (the backend's ``capacity``); 0 disables it (a DRAM-only
    #: cache). Default 20 GiB.
    ssd_bytes: int = 20 * GiB
    #: Capacity of the GPU (HBM) tier: one device pool allocated at open; 0 disables it
    #: (device buffers are then refused). Needs a CUDA device (torch). Default 0.
    hbm_bytes: int = 0
    #: CUDA device index of the HBM tier's pool. Default 0.
    hbm_device: int = 0
    #: Object-level eviction in HBM (into DRAM): "lru" or "fifo". Default "lru".
    hbm_eviction: str = "lru"
    #: Keep a copy in HBM of what a device buffer read from DRAM or NVMe, when the HBM
    #: tier has free room for it (nothing is evicted for it). Default True.
    hbm_promote: bool = True
    #: Object-level eviction in DRAM: "lru" or "fifo". Default "lru".
    eviction: str = "lru"
    #: Eviction on NVMe (the backend's ``eviction``): "fifo" or "lru". Default "fifo".
    ssd_eviction: str = "fifo"
    #: When values go to SSD (the offloader's ``policy``): "eager" (every put, in the
    #: background) or "watermark" (only when DRAM crosses ``high_watermark``, down to
    #: ``low_watermark``). Default "eager".
    offload: str = "eager"
    #: DRAM usage fraction that starts watermark offload and gates promotion. Default 0.9.
    high_watermark: float = 0.9
    #: DRAM usage fraction that watermark offload evicts down to. Default 0.7.
    low_watermark: float = 0.7
    #: Storage layout on NVMe: "bucket" (sealed bucket files), "offset" (one preallocated
    #: file) or "file_per_key" (one file per object, for debugging). Default "bucket".
    backend: str = "bucket"
    #: How the "file_per_key" backend makes a write's files durable (its ``sync``):
    #: "filesystem" (one syncfs(2) after the data, one after the renames: the same few
    #: device cache flushes a batch, whatever its number of files; it also writes back
    #: whatever else is dirty on that filesystem) or "file" (an fdatasync per file and an
    #: fsync per directory, side by side). Default "filesystem".
    file_per_key_sync: str = "filesystem"
    #: I/O engine that moves bytes to and from NVMe: "auto" (io_uring when this machine
    #: allows it, else psync; stats() says which and why), "uring", "psync" or "kvikio".
    #: Default "auto".
    io_engine: str = "auto"
    #: Worker threads of the psync engine (kvikio's thread pool; the engines' ``threads``).
    #: Default 4.
    io_threads: int = 4
    #: Requests in flight per io_uring (one ring per thread; the engines' ``depth``).
    #: Default 64.
    io_depth: int = 64
    #: Bytes of large reads (not the small reads of a few KiB) in flight per io_uring:
    #: more waits, so a deep queue of large reads does not slow the disk down (the
    #: engines' ``read_inflight_bytes``). Default 4 MiB.
    io_read_inflight_bytes: int = 4 * MiB
    #: Open NVMe files with O_DIRECT where the filesystem allows it (buffered otherwise;
    #: the engines' ``direct``). Default True.
    direct_io: bool = True
    #: A bucket is sealed once it holds this many bytes... Default 64 MiB.
    bucket_bytes: int = 64 * MiB
    #: ...or this many objects... Default 1024.
    bucket_max_keys: int = 1024
    #: ...or once its oldest object has waited this long (seconds), so no key is left
    #: behind in a partly filled bucket. Default 0.2.
    bucket_max_age_s: float = 0.2
    #: An NVMe-only object read this many times is promoted back into DRAM (0 = never).
    #: Default 2.
    promote_after_reads: int = 2
    #: After a failed offload batch (I/O error, full disk), offload pauses this long
    #: (seconds) before retrying; the objects stay in DRAM meanwhile. Default 1.0.
    offload_retry_s: float = 1.0
    #: How long a put waits for DRAM space before raising NoSpaceError (seconds). Default 10.
    put_timeout_s: float = 10.0
    #: Open-time verification of sealed buckets: "index" (index checksums and file sizes;
    #: values are verified on every read) or "full" (also every value's checksum). Default "index".
    verify_on_open: str = "index"

    def __post_init__(self) -> None:
        for name in ("dram_bytes", "hbm_bytes"):
            object.__setattr__(self, name, check_bytes(name, getattr(self, name)))
        if self.dram_bytes < MIN_DRAM_BYTES:
            raise ConfigError(f"the DRAM tier needs at least {MIN_DRAM_BYTES} bytes", field="dram_bytes", got=self.dram_bytes)
        check_wait("put_timeout_s", self.put_timeout_s)
        check_choice("eviction policy", self.eviction, EVICTION_POLICIES, field="eviction")
        check_choice("hbm eviction policy", self.hbm_eviction, EVICTION_POLICIES, field="hbm_eviction")
        if not isinstance(self.hbm_device, int) or isinstance(self.hbm_device, bool) or self.hbm_device < 0:
            raise ConfigError("must be a CUDA device index >= 0", field="hbm_device", got=self.hbm_device)
        check_flag("hbm_promote", self.hbm_promote)
        check_flag("dram_huge_pages", self.dram_huge_pages)
        check_flag("dram_shared", self.dram_shared)
        check_count("promote_after_reads", self.promote_after_reads)
        check_choice("backend", self.backend, BACKENDS, field="backend")
        check_choice("io engine", self.io_engine, IO_ENGINES, field="io_engine")
        object.__setattr__(self, "_offloader", self._component(OffloaderConfig, OFFLOADER_FIELDS))
        object.__setattr__(self, "_io", self._chosen(ENGINE_CONFIGS, self.io_engine, IO_FIELDS))
        object.__setattr__(self, "_nvme_backend", self._chosen(BACKEND_CONFIGS, self.backend, BACKEND_FIELDS))

    @property
    def offloader(self) -> OffloaderConfig:
        """The offloader's config, from :data:`OFFLOADER_FIELDS`."""
        return self._offloader  # type: ignore[attr-defined]

    @property
    def io(self) -> EngineConfig:
        """The config of the I/O engine ``io_engine`` names, from :data:`IO_FIELDS`;
        ``config.io.build(directory)`` builds the engine."""
        return self._io  # type: ignore[attr-defined]

    @property
    def nvme_backend(self) -> BackendConfig:
        """The config of the NVMe backend ``backend`` names, from :data:`BACKEND_FIELDS`;
        ``config.nvme_backend.build(root, engine)`` builds the backend."""
        return self._nvme_backend  # type: ignore[attr-defined]

    @property
    def has_ssd(self) -> bool:
        return self.ssd_bytes > 0

    @property
    def has_hbm(self) -> bool:
        return self.hbm_bytes > 0

    def replace(self, **changes: Any) -> "StoreConfig":
        """Return a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def _chosen(self, registry: Mapping[str, Type[C]], name: str, fields: Mapping[str, str]) -> C:
        """The config of component ``name`` of ``registry``; the others are built too, and
        dropped, so that each checks the flat fields it takes."""
        built = {key: self._component(cls, fields) for key, cls in registry.items()}
        return built[name]

    def _component(self, cls: Type[C], fields: Mapping[str, str]) -> C:
        """``cls`` built from the flat fields it takes (``fields``: flat name -> its field).
        Its ConfigError names the flat field; the normalised values (``"8GiB"`` -> bytes)
        are written back to the flat fields."""
        own = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        taken = {flat: name for flat, name in fields.items() if name in own}
        try:
            config = cls(**{name: getattr(self, flat) for flat, name in taken.items()})
        except ConfigError as exc:
            raise _in_flat_terms(exc, {name: flat for flat, name in taken.items()}) from None
        for flat, name in taken.items():
            object.__setattr__(self, flat, getattr(config, name))
        return config


def _in_flat_terms(exc: ConfigError, flat: Mapping[str, str]) -> ConfigError:
    """``exc`` with the component's field names replaced by the flat ones they came from."""
    context: Dict[str, Any] = {flat.get(key, key): value for key, value in exc.context.items()}
    if context.get("field") in flat:
        context["field"] = flat[context["field"]]
    return ConfigError(exc.message, **context)


__all__ = [
    "BACKENDS",
    "BACKEND_FIELDS",
    "EVICTION_POLICIES",
    "FILE_PER_KEY_SYNC_MODES",
    "GiB",
    "IO_ENGINES",
    "IO_FIELDS",
    "KiB",
    "MAX_IO_DEPTH",
    "MAX_IO_THREADS",
    "MAX_WAIT_S",
    "MIN_DRAM_BYTES",
    "MiB",
    "OFFLOADER_FIELDS",
    "OFFLOAD_POLICIES",
    "Size",
    "StoreConfig",
    "TiB",
    "VERIFY_MODES",
    "check_choice",
    "env_overrides",
    "format_size",
    "parse_size",
]


#: Environment variables read by :func:`env_overrides`, and the field each sets.
ENV_FIELDS = {
    "GDSKV_DRAM": "dram_bytes",
    "GDSKV_SSD": "ssd_bytes",
    "GDSKV_HBM": "hbm_bytes",
    "GDSKV_EVICTION": "eviction",
    "GDSKV_SSD_EVICTION": "ssd_eviction",
    "GDSKV_OFFLOAD": "offload",
    "GDSKV_BACKEND": "backend",
    "GDSKV_FILE_PER_KEY_SYNC": "file_per_key_sync",
    "GDSKV_IO_ENGINE": "io_engine",
    "GDSKV_IO_THREADS": "io_threads",
    "GDSKV_IO_DEPTH": "io_depth",
    "GDSKV_IO_READ_INFLIGHT": "io_read_inflight_bytes",
    "GDSKV_DIRECT_IO": "direct_io",
    "GDSKV_DRAM_HUGE_PAGES": "dram_huge_pages",
}

_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_overrides(environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """Read the ``GDSKV_*`` variables of :data:`ENV_FIELDS` into config field values."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var, field in ENV_FIELDS.items():
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        if field.endswith("_bytes"):
            out[field] = parse_size(raw, field=var)
        elif field in ("io_threads", "io_depth"):
            try:
                out[field] = int(raw)
            except ValueError:
                raise ConfigError("must be an integer", field=var, got=raw) from None
        elif field in ("direct_io", "dram_huge_pages"):
            if raw.strip().lower() not in _BOOLS:
                raise ConfigError("must be a boolean (1/0, true/false, yes/no, on/off)", field=var, got=raw)
            out[field] = _BOOLS[raw.strip().lower()]
        else:
            out[field] = raw
    return out
