"""When an offload batch is due, and how much one takes: pure functions.

The store's :class:`~gdskv.store.offloader.Offloader` and the trace simulator
(:mod:`gdskv.trace.simulator`) both decide with these, so a simulated run batches exactly as
the store does. ``cfg`` is the offloader's config, an
:class:`~gdskv.offload_config.OffloaderConfig` (a store's is ``StoreConfig.offloader``); the
one figure of another tier they need, the NVMe tier's byte cap, is passed on its own.
"""

from __future__ import annotations

from gdskv.offload_config import OffloaderConfig


def batch_full(queued_bytes: int, queued_keys: int, cfg: OffloaderConfig) -> bool:
    """Whether the queue holds a whole bucket: ``bucket_bytes`` of values or
    ``bucket_max_keys`` keys."""
    return queued_bytes >= cfg.bucket_bytes or queued_keys >= cfg.bucket_max_keys


def keys_per_full_batch(value_size: int, cfg: OffloaderConfig) -> int:
    """How many queued values of ``value_size`` bytes each make the queue full
    (:func:`batch_full`): the smallest ``n >= 1`` with ``batch_full(n * value_size, n, cfg)``."""
    by_bytes = -(-cfg.bucket_bytes // value_size) if value_size > 0 else cfg.bucket_max_keys
    return max(1, min(cfg.bucket_max_keys, by_bytes))


def batch_due(queued_bytes: int, queued_keys: int, oldest_age_s: float, cfg: OffloaderConfig, *, waited_for: bool) -> bool:
    """Whether a batch is to be written now: the queue is not empty and it is full
    (:func:`batch_full`), or its oldest object waited ``bucket_max_age_s``, or someone waits
    for the queue (``waited_for``: a flush, a put under back-pressure, close)."""
    if queued_keys == 0:
        return False
    return batch_full(queued_bytes, queued_keys, cfg) or oldest_age_s >= cfg.bucket_max_age_s or waited_for


def batch_limit_bytes(cfg: OffloaderConfig, ssd_bytes: int) -> int:
    """The most record bytes one batch takes: a bucket, but never more than a quarter of the
    SSD tier (``ssd_bytes``, its byte cap), so that writing one evicts only a part of what is
    there (a single larger object still goes alone)."""
    return min(cfg.bucket_bytes, ssd_bytes // 4)
