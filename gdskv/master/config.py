"""Configuration of the master: one frozen, keyword-only dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Any

from gdskv.config import TiB
from gdskv.errors import ConfigError
from gdskv.types import MAX_KEY_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class MasterConfig:
    """Everything that shapes a master. Times are in seconds."""

    #: A node whose last heartbeat is older than this is dead: its replicas are no longer
    #: handed out. Default 10.
    lease_s: float = 10.0
    #: A dead node is forgotten (replicas dropped, late heartbeats answered "unknown node")
    #: this long after its lease ran out. Default: one more lease (None).
    grace_s: float | None = None
    #: How often nodes heartbeat; must leave room for a few missed beats. Default lease / 4.
    heartbeat_s: float | None = None
    #: A WRITING replica (reserved by PreparePut) not completed in this time is dropped.
    #: Default 60.
    writing_timeout_s: float = 60.0
    #: Half-life of the decayed access counters (hotness). Default 60.
    heat_half_life_s: float = 60.0
    #: An NVMe-only object accessed this often (decayed count) gets a promotion task. Default 4.
    promote_threshold: float = 4.0
    #: A DRAM-only object accessed this often gets an offload task (copy to SSD). Default 4.
    offload_threshold: float = 4.0
    #: Promotion tasks handed to one node per heartbeat (the rate limit). Default 64.
    promotions_per_heartbeat: int = 64
    #: Offload tasks handed to one node per heartbeat. Default 256.
    offloads_per_heartbeat: int = 256
    #: Removal tasks handed to one node per heartbeat. Default 10000.
    removals_per_heartbeat: int = 10_000
    #: A task handed out and not acted on is re-issued after this long. Default 30.
    task_timeout_s: float = 30.0
    #: Largest object the master accepts (bytes); larger sizes are INVALID_ARGUMENT. Default 1 TiB.
    max_object_bytes: int = TiB
    #: Most keys in one request. Default 1,000,000.
    max_batch_keys: int = 1_000_000
    #: Longest key (bytes). Default 4096 (the store's limit).
    max_key_bytes: int = MAX_KEY_BYTES

    def __post_init__(self) -> None:
        for name in ("lease_s", "writing_timeout_s", "heat_half_life_s", "task_timeout_s"):
            _positive_number(name, getattr(self, name))
        for name in ("grace_s", "heartbeat_s"):
            if getattr(self, name) is not None:
                _positive_number(name, getattr(self, name))
        if self.heartbeat_s is not None and self.heartbeat_s >= self.lease_s:
            raise ConfigError("heartbeat_s must be shorter than lease_s", heartbeat_s=self.heartbeat_s, lease_s=self.lease_s)
        for name in ("promote_threshold", "offload_threshold"):
            _positive_number(name, getattr(self, name))
        for name in (
            "promotions_per_heartbeat",
            "offloads_per_heartbeat",
            "removals_per_heartbeat",
            "max_object_bytes",
            "max_batch_keys",
            "max_key_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError("must be a non-negative integer", field=name, got=value)

    @property
    def effective_heartbeat_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 4

    @property
    def effective_grace_s(self) -> float:
        return self.grace_s if self.grace_s is not None else self.lease_s

    def replace(self, **changes: Any) -> "MasterConfig":
        return dataclasses.replace(self, **changes)


def _positive_number(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError("must be a positive number", field=name, got=value)
