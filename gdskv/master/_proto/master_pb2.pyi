from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    HBM: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    NVME: _ClassVar[Tier]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    WRITING: _ClassVar[ReplicaState]
    COMPLETE: _ClassVar[ReplicaState]
    EVICTING: _ClassVar[ReplicaState]

class ReplicaOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_UNSPECIFIED: _ClassVar[ReplicaOp]
    REGISTER: _ClassVar[ReplicaOp]
    UNREGISTER: _ClassVar[ReplicaOp]

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_UNSPECIFIED: _ClassVar[PutStatus]
    PLACED: _ClassVar[PutStatus]
    EXISTS: _ClassVar[PutStatus]
    CONFLICT: _ClassVar[PutStatus]
TIER_UNSPECIFIED: Tier
HBM: Tier
DRAM: Tier
NVME: Tier
STATE_UNSPECIFIED: ReplicaState
WRITING: ReplicaState
COMPLETE: ReplicaState
EVICTING: ReplicaState
OP_UNSPECIFIED: ReplicaOp
REGISTER: ReplicaOp
UNREGISTER: ReplicaOp
PUT_UNSPECIFIED: PutStatus
PLACED: PutStatus
EXISTS: PutStatus
CONFLICT: PutStatus

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "data_address", "transport", "dram_capacity", "dram_used", "nvme_capacity", "nvme_used", "lease_remaining_s", "replicas")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NVME_USED_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_address: str
    transport: str
    dram_capacity: int
    dram_used: int
    nvme_capacity: int
    nvme_used: int
    lease_remaining_s: float
    replicas: int
    def __init__(self, node_id: _Optional[str] = ..., data_address: _Optional[str] = ..., transport: _Optional[str] = ..., dram_capacity: _Optional[int] = ..., dram_used: _Optional[int] = ..., nvme_capacity: _Optional[int] = ..., nvme_used: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., replicas: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("lease_s", "heartbeat_s")
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    heartbeat_s: float
    def __init__(self, lease_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "dram_used", "dram_capacity", "nvme_used", "nvme_capacity", "accessed_keys", "accessed_counts")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NVME_USED_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ACCESSED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ACCESSED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    dram_used: int
    dram_capacity: int
    nvme_used: int
    nvme_capacity: int
    accessed_keys: _containers.RepeatedScalarFieldContainer[bytes]
    accessed_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., dram_used: _Optional[int] = ..., dram_capacity: _Optional[int] = ..., nvme_used: _Optional[int] = ..., nvme_capacity: _Optional[int] = ..., accessed_keys: _Optional[_Iterable[bytes]] = ..., accessed_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_s", "offload_keys", "promote_keys", "remove_keys")
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_KEYS_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    offload_keys: _containers.RepeatedScalarFieldContainer[bytes]
    promote_keys: _containers.RepeatedScalarFieldContainer[bytes]
    remove_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_s: _Optional[float] = ..., offload_keys: _Optional[_Iterable[bytes]] = ..., promote_keys: _Optional[_Iterable[bytes]] = ..., remove_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NodeRef(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaBatch(_message.Message):
    __slots__ = ("op", "tier", "keys", "sizes", "crcs")
    OP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CRCS_FIELD_NUMBER: _ClassVar[int]
    op: ReplicaOp
    tier: Tier
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    crcs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op: _Optional[_Union[ReplicaOp, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., crcs: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateReplicasRequest(_message.Message):
    __slots__ = ("node_id", "batches")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    batches: _containers.RepeatedCompositeFieldContainer[ReplicaBatch]
    def __init__(self, node_id: _Optional[str] = ..., batches: _Optional[_Iterable[_Union[ReplicaBatch, _Mapping]]] = ...) -> None: ...

class UpdateReplicasResponse(_message.Message):
    __slots__ = ("registered", "unregistered", "conflicts")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    UNREGISTERED_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    registered: int
    unregistered: int
    conflicts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, registered: _Optional[int] = ..., unregistered: _Optional[int] = ..., conflicts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "count_access")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COUNT_ACCESS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    count_access: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., count_access: bool = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("replica_counts", "node_index", "tier", "size", "crc", "nodes")
    REPLICA_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    replica_counts: _containers.RepeatedScalarFieldContainer[int]
    node_index: _containers.RepeatedScalarFieldContainer[int]
    tier: _containers.RepeatedScalarFieldContainer[Tier]
    size: _containers.RepeatedScalarFieldContainer[int]
    crc: _containers.RepeatedScalarFieldContainer[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, replica_counts: _Optional[_Iterable[int]] = ..., node_index: _Optional[_Iterable[int]] = ..., tier: _Optional[_Iterable[_Union[Tier, str]]] = ..., size: _Optional[_Iterable[int]] = ..., crc: _Optional[_Iterable[int]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class PreparePutRequest(_message.Message):
    __slots__ = ("node_id", "keys", "sizes", "crcs")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CRCS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    crcs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., crcs: _Optional[_Iterable[int]] = ...) -> None: ...

class PreparePutResponse(_message.Message):
    __slots__ = ("status", "node_index", "nodes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[PutStatus]
    node_index: _containers.RepeatedScalarFieldContainer[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, status: _Optional[_Iterable[_Union[PutStatus, str]]] = ..., node_index: _Optional[_Iterable[int]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class AbortPutRequest(_message.Message):
    __slots__ = ("node_id", "keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("existed", "holder_key_index", "holder_node_index", "nodes")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_KEY_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOLDER_NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    existed: _containers.RepeatedScalarFieldContainer[bool]
    holder_key_index: _containers.RepeatedScalarFieldContainer[int]
    holder_node_index: _containers.RepeatedScalarFieldContainer[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, existed: _Optional[_Iterable[bool]] = ..., holder_key_index: _Optional[_Iterable[int]] = ..., holder_node_index: _Optional[_Iterable[int]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class ReportAccessRequest(_message.Message):
    __slots__ = ("keys", "counts")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "objects", "replicas", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    objects: int
    replicas: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., objects: _Optional[int] = ..., replicas: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...
