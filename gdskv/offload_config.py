"""The offloader's config: when values go from DRAM to NVMe, and in what batches.

A frozen, keyword-only dataclass validated on construction (a :class:`ConfigError` names the
field). A store's is ``StoreConfig.offloader``, built from the flat fields ``offload``
(:attr:`OffloaderConfig.policy`), ``high_watermark``, ``low_watermark``, ``bucket_bytes``,
``bucket_max_keys``, ``bucket_max_age_s`` and ``offload_retry_s`` (see :mod:`gdskv.config`).
The store's :class:`~gdskv.store.offloader.Offloader` is configured by it, given besides
only the NVMe tier's byte cap; the promoter takes its ``high_watermark``.
"""

from __future__ import annotations

import dataclasses

from gdskv.config_fields import MiB, check_bytes, check_choice, check_finite, check_positive, check_wait
from gdskv.errors import ConfigError

#: When values go to NVMe (see OffloaderConfig.policy).
OFFLOAD_POLICIES = ("eager", "watermark")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloaderConfig:
    """When the offloader writes DRAM objects to NVMe, and how it batches them."""

    #: When values go to NVMe: "eager" (every put, in the background) or "watermark" (only
    #: when DRAM crosses ``high_watermark``, down to ``low_watermark``). Default "eager".
    policy: str = "eager"
    #: DRAM usage fraction that starts watermark offload and gates promotion. Default 0.9.
    high_watermark: float = 0.9
    #: DRAM usage fraction that watermark offload evicts down to. Default 0.7.
    low_watermark: float = 0.7
    #: A batch (a bucket, for the bucket backend) is sealed once it holds this many
    #: bytes... Default 64 MiB.
    bucket_bytes: int = 64 * MiB
    #: ...or this many objects... Default 1024.
    bucket_max_keys: int = 1024
    #: ...or once its oldest object has waited this long (seconds), so no key is left
    #: behind in a partly filled batch. Default 0.2.
    bucket_max_age_s: float = 0.2
    #: After a failed batch (I/O error, full disk), offload pauses this long (seconds)
    #: before retrying; the objects stay in DRAM meanwhile. Default 1.0.
    offload_retry_s: float = 1.0

    def __post_init__(self) -> None:
        check_choice("offload policy", self.policy, OFFLOAD_POLICIES, field="policy")
        check_finite("high_watermark", self.high_watermark)
        check_finite("low_watermark", self.low_watermark)
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low <= high <= 1",
                low_watermark=self.low_watermark,
                high_watermark=self.high_watermark,
            )
        object.__setattr__(self, "bucket_bytes", check_positive("bucket_bytes", check_bytes("bucket_bytes", self.bucket_bytes)))
        check_positive("bucket_max_keys", self.bucket_max_keys)
        check_wait("bucket_max_age_s", self.bucket_max_age_s, positive=True)
        check_wait("offload_retry_s", self.offload_retry_s)
