"""The master's data model as its callers see it: tier, state and op numbers, node views,
replica batches and the results of the batch calls.

Pure data (no gRPC, no locks), shared by the registry, the gRPC service and the client.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

# Tier and state numbers: the values of the proto enums (checked by a test).
HBM, DRAM, NVME = 1, 2, 3
TIERS = (HBM, DRAM, NVME)
WRITING, COMPLETE, EVICTING = 1, 2, 3
REGISTER, UNREGISTER = 1, 2
PLACED, EXISTS, CONFLICT = 1, 2, 3



@dataclasses.dataclass(frozen=True)
class NodeView:
    """A node as the master describes it (and as a node describes itself when registering)."""

    node_id: str
    address: str
    transport: str = "tcp"
    dram_capacity: int = 0
    dram_used: int = 0
    nvme_capacity: int = 0
    nvme_used: int = 0
    lease_remaining_s: float = 0.0
    replicas: int = 0


@dataclasses.dataclass
class ReplicaBatch:
    op: int
    tier: int  # 0 with UNREGISTER: every tier
    keys: Sequence[bytes]
    sizes: Sequence[int] = ()
    crcs: Sequence[int] = ()


@dataclasses.dataclass
class LookupResult:
    counts: List[int]
    node_index: List[int]
    tiers: List[int]
    sizes: List[int]
    crcs: List[int]
    nodes: List[NodeView]


@dataclasses.dataclass
class PlaceResult:
    status: List[int]
    node_index: List[int]
    nodes: List[NodeView]


@dataclasses.dataclass
class RemoveResult:
    existed: List[bool]
    holder_key_index: List[int]
    holder_node_index: List[int]
    nodes: List[NodeView]


@dataclasses.dataclass
class Tasks:
    offload: List[bytes]
    promote: List[bytes]
    remove: List[bytes]


@dataclasses.dataclass(frozen=True)
class Usage:
    dram_used: int = 0
    dram_capacity: int = 0
    nvme_used: int = 0
    nvme_capacity: int = 0
