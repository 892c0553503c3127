"""Configuration of a node and of a cluster client: one frozen, keyword-only dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from gdskv.config import check_choice
from gdskv.errors import ConfigError

TRANSPORTS = ("tcp",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How a node (or a :func:`gdskv.connect` client) talks to the master and to peers."""

    #: host:port the node's data server listens on (port 0: any free port). Default
    #: "127.0.0.1:0".
    listen: str = "127.0.0.1:0"
    #: Address peers should use to reach this node, when it differs from the bound one
    #: (NAT, 0.0.0.0). Default: the bound address.
    advertise: Optional[str] = None
    #: This node's id on the master. Default: random, chosen at start.
    node_id: Optional[str] = None
    #: Data-plane transport: "tcp". Default "tcp".
    transport: str = "tcp"
    #: Connections per peer (a large batch is split across them). Default 4.
    connections: int = 4
    #: Check every value received from a peer against its CRC32C. Default True.
    verify_transfers: bool = True
    #: Deadline of one call to the master (seconds). Default 10.
    rpc_timeout_s: float = 10.0
    #: Deadline of one data-plane socket operation (seconds). Default 30.
    transfer_timeout_s: float = 30.0
    #: How long an eviction waits for the master to drop the replica first (two-phase
    #: eviction); past it the bytes go anyway and a reader may get a clean miss. Default 2.
    evict_wait_s: float = 2.0
    #: How long a put waits for the master to record the new replica. Default 10.
    flush_timeout_s: float = 10.0
    #: Heartbeat period until the master says otherwise (seconds). Default 1.
    heartbeat_s: float = 1.0

    def __post_init__(self) -> None:
        check_choice("transport", self.transport, TRANSPORTS)
        if not isinstance(self.connections, int) or isinstance(self.connections, bool) or self.connections < 1:
            raise ConfigError("must be a positive integer", field="connections", got=self.connections)
        for name in ("rpc_timeout_s", "transfer_timeout_s", "evict_wait_s", "flush_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError("must be a positive number of seconds", field=name, got=value)
        for name in ("listen", "advertise"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or ":" not in value):
                raise ConfigError("must be host:port", field=name, got=value)

    def replace(self, **changes: Any) -> "ClusterConfig":
        return dataclasses.replace(self, **changes)
