"""Store configuration: one frozen, keyword-only dataclass, validated on construction.

Sizes are bytes inside the library; strings such as ``"8GiB"`` are parsed at the edge with
:func:`parse_size`. Environment overrides (``GDSKV_*``) are read in one place,
:func:`env_overrides`, and applied by :func:`gdskv.open`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

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
    check_finite,
    check_flag,
    check_positive,
    check_wait,
    format_size,
    parse_size,
)
from gdskv.errors import ConfigError

#: The smallest DRAM tier: one allocation unit of its arena (capacities are rounded down to
#: whole units of 64 bytes).
MIN_DRAM_BYTES = 64

OFFLOAD_POLICIES = ("eager", "watermark")
#: Registered names; they must match gdskv.tiers.backends.BACKENDS and gdskv.gds.ENGINES.
BACKENDS = ("bucket", "file_per_key", "offset")
IO_ENGINES = ("auto", "kvikio", "psync", "uring")
#: io_uring refuses a queue of more entries than this (IORING_MAX_ENTRIES).
MAX_IO_DEPTH = 32768
#: More psync threads than this is a mistake, not a setting (each is an OS thread).
MAX_IO_THREADS = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Everything that shapes a :class:`gdskv.Store`. All sizes are in bytes."""

    #: Capacity of the host DRAM tier (one arena allocated once). Default 2 GiB.
    dram_bytes: int = 2 * GiB
    #: Ask the kernel to back the DRAM arena with transparent huge pages (MADV_HUGEPAGE):
    #: O_DIRECT transfers from huge pages need far fewer scatter-gather segments
    #: (docs/ssd-path.md). Turn off where huge-page faults stall (direct compaction on a
    #: fragmented host) more than offload speed matters; the I/O engines' staging (a few
    #: MiB per thread, allocated once) keeps the advice. Default True.
    dram_huge_pages: bool = True
    #: Byte cap of the NVMe tier; 0 disables it (a DRAM-only cache). Default 20 GiB.
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
    #: Bucket-level eviction on NVMe: "fifo" or "lru". Default "fifo".
    ssd_eviction: str = "fifo"
    #: When values go to SSD: "eager" (every put, in the background) or "watermark"
    #: (only when DRAM crosses ``high_watermark``, down to ``low_watermark``). Default "eager".
    offload: str = "eager"
    #: DRAM usage fraction that starts watermark offload and gates promotion. Default 0.9.
    high_watermark: float = 0.9
    #: DRAM usage fraction that watermark offload evicts down to. Default 0.7.
    low_watermark: float = 0.7
    #: Storage layout on NVMe: "bucket" (sealed bucket files), "offset" (one preallocated
    #: file) or "file_per_key" (one file per object, for debugging). Default "bucket".
    backend: str = "bucket"
    #: How the "file_per_key" backend makes a write's files durable: "filesystem" (one
    #: syncfs(2) after the data, one after the renames: the same few device cache flushes
    #: a batch, whatever its number of files; it also writes back whatever else is dirty on
    #: that filesystem) or "file" (an fdatasync per file and an fsync per directory, side
    #: by side). Default "filesystem".
    file_per_key_sync: str = "filesystem"
    #: I/O engine that moves bytes to and from NVMe: "auto" (io_uring when this machine
    #: allows it, else psync; stats() says which and why), "uring" or "psync". Default "auto".
    io_engine: str = "auto"
    #: Worker threads of the psync engine. Default 4.
    io_threads: int = 4
    #: Requests in flight per io_uring (one ring per thread). Default 64.
    io_depth: int = 64
    #: Bytes of large reads (not the small reads of a few KiB) in flight per io_uring:
    #: more waits, so a deep queue of large reads does not slow the disk down. Default 4 MiB.
    io_read_inflight_bytes: int = 4 * MiB
    #: Open NVMe files with O_DIRECT where the filesystem allows it (buffered otherwise).
    #: Default True.
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
        for name in ("dram_bytes", "ssd_bytes", "hbm_bytes", "bucket_bytes", "io_read_inflight_bytes"):
            object.__setattr__(self, name, check_bytes(name, getattr(self, name)))
        if self.dram_bytes < MIN_DRAM_BYTES:
            raise ConfigError(f"the DRAM tier needs at least {MIN_DRAM_BYTES} bytes", field="dram_bytes", got=self.dram_bytes)
        check_finite("high_watermark", self.high_watermark)
        check_finite("low_watermark", self.low_watermark)
        check_wait("bucket_max_age_s", self.bucket_max_age_s, positive=True)
        check_wait("offload_retry_s", self.offload_retry_s)
        check_wait("put_timeout_s", self.put_timeout_s)
        check_choice("eviction policy", self.eviction, EVICTION_POLICIES, field="eviction")
        check_choice("ssd eviction policy", self.ssd_eviction, EVICTION_POLICIES, field="ssd_eviction")
        check_choice("hbm eviction policy", self.hbm_eviction, EVICTION_POLICIES, field="hbm_eviction")
        if not isinstance(self.hbm_device, int) or isinstance(self.hbm_device, bool) or self.hbm_device < 0:
            raise ConfigError("must be a CUDA device index >= 0", field="hbm_device", got=self.hbm_device)
        for flag in ("hbm_promote", "dram_huge_pages", "direct_io"):
            check_flag(flag, getattr(self, flag))
        check_choice("offload policy", self.offload, OFFLOAD_POLICIES, field="offload")
        check_choice("backend", self.backend, BACKENDS, field="backend")
        check_choice("file_per_key sync mode", self.file_per_key_sync, FILE_PER_KEY_SYNC_MODES, field="file_per_key_sync")
        check_choice("io engine", self.io_engine, IO_ENGINES, field="io_engine")
        check_choice("verify_on_open", self.verify_on_open, ("index", "full"), field="verify_on_open")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low <= high <= 1",
                low_watermark=self.low_watermark,
                high_watermark=self.high_watermark,
            )
        check_positive("io_threads", self.io_threads, maximum=MAX_IO_THREADS)
        check_positive("io_depth", self.io_depth, maximum=MAX_IO_DEPTH, why=" (io_uring's largest queue)")
        check_positive("io_read_inflight_bytes", self.io_read_inflight_bytes)
        check_positive("bucket_bytes", self.bucket_bytes)
        check_positive("bucket_max_keys", self.bucket_max_keys)
        check_count("promote_after_reads", self.promote_after_reads)

    @property
    def has_ssd(self) -> bool:
        return self.ssd_bytes > 0

    @property
    def has_hbm(self) -> bool:
        return self.hbm_bytes > 0

    def replace(self, **changes: Any) -> "StoreConfig":
        """Return a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


__all__ = [
    "BACKENDS",
    "EVICTION_POLICIES",
    "FILE_PER_KEY_SYNC_MODES",
    "GiB",
    "IO_ENGINES",
    "KiB",
    "MAX_IO_DEPTH",
    "MAX_IO_THREADS",
    "MAX_WAIT_S",
    "MIN_DRAM_BYTES",
    "MiB",
    "OFFLOAD_POLICIES",
    "Size",
    "StoreConfig",
    "TiB",
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
