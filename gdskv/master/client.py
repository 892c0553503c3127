"""A typed, batching client of the master, used by nodes and by :func:`gdskv.connect`.

Every method takes whole batches and splits them into RPCs of at most ``max_keys_per_rpc``
keys. gRPC failures become :mod:`gdskv.errors` exceptions:

- ``NOT_FOUND`` -> :class:`UnknownNodeError` (register again);
- ``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` -> :class:`MasterUnavailableError`;
- ``RESOURCE_EXHAUSTED`` -> :class:`NoSpaceError`;
- anything else -> :class:`RemoteError` carrying the status code and the master's message.

The channel reconnects quickly (backoff capped at ``reconnect_backoff_max_s``) so that a
restarted master is found again within about a second.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from gdskv.errors import InvalidValueError, MasterUnavailableError, NoSpaceError, RemoteError, UnknownNodeError
from gdskv.master._proto import master_pb2 as pb
from gdskv.master._proto import master_pb2_grpc as pb_grpc
from gdskv.master.model import (
    LookupResult,
    NodeView,
    PlaceResult,
    RemoveResult,
    ReplicaBatch,
    Tasks,
    Usage,
)

MAX_MESSAGE_BYTES = 256 << 20


def node_view(info: pb.NodeInfo) -> NodeView:
    return NodeView(
        node_id=info.node_id,
        address=info.data_address,
        transport=info.transport or "tcp",
        dram_capacity=info.dram_capacity,
        dram_used=info.dram_used,
        nvme_capacity=info.nvme_capacity,
        nvme_used=info.nvme_used,
        lease_remaining_s=info.lease_remaining_s,
        replicas=info.replicas,
    )


def _typed(method: Callable[..., Any]) -> Callable[..., Any]:
    """A value protobuf cannot encode (a negative size, a str key) is an InvalidValueError."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise InvalidValueError(f"cannot encode {method.__name__} request: {exc}") from None

    return wrapper


class MasterClient:
    """Batch calls to the master at ``address`` ("host:port"). Thread-safe; ``close()`` is idempotent."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        max_keys_per_rpc: int = 10_000,
        reconnect_backoff_max_s: float = 1.0,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_keys_per_rpc = max_keys_per_rpc
        backoff_ms = int(reconnect_backoff_max_s * 1000)
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
                ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
                ("grpc.enable_retries", 0),
            ],
        )
        self._stub = pb_grpc.MasterStub(self._channel)
        self._closed = False

    # ------------------------------------------------------------------ plumbing

    def _call(self, name: str, request: Any, timeout: Optional[float] = None) -> Any:
        if self._closed:
            raise MasterUnavailableError("master client is closed", master=self.address)
        try:
            return getattr(self._stub, name)(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as exc:
            raise _error(exc, name, self.address) from None

    def _chunks(self, n: int) -> List[Tuple[int, int]]:
        step = max(1, self.max_keys_per_rpc)
        return [(i, min(n, i + step)) for i in range(0, n, step)] or [(0, 0)]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> "MasterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ nodes

    @_typed
    def register_node(self, view: NodeView) -> Tuple[float, float]:
        """Join (or rejoin, resetting this node's replicas); returns (lease_s, heartbeat_s)."""
        info = pb.NodeInfo(
            node_id=view.node_id,
            data_address=view.address,
            transport=view.transport,
            dram_capacity=view.dram_capacity,
            dram_used=view.dram_used,
            nvme_capacity=view.nvme_capacity,
            nvme_used=view.nvme_used,
        )
        reply = self._call("RegisterNode", pb.RegisterNodeRequest(node=info))
        return reply.lease_s, reply.heartbeat_s

    @_typed
    def heartbeat(
        self, node_id: str, usage: Usage, accessed: Sequence[bytes] = (), counts: Sequence[int] = (),
        timeout: Optional[float] = None,
    ) -> Tasks:
        reply = self._call(
            "Heartbeat",
            pb.HeartbeatRequest(
                node_id=node_id,
                dram_used=usage.dram_used,
                dram_capacity=usage.dram_capacity,
                nvme_used=usage.nvme_used,
                nvme_capacity=usage.nvme_capacity,
                accessed_keys=accessed,
                accessed_counts=counts,
            ),
            timeout,
        )
        return Tasks(list(reply.offload_keys), list(reply.promote_keys), list(reply.remove_keys))

    def deregister_node(self, node_id: str, timeout: Optional[float] = None) -> None:
        self._call("DeregisterNode", pb.NodeRef(node_id=node_id), timeout)

    def list_nodes(self) -> Tuple[List[NodeView], int, int, Dict[str, int]]:
        """(nodes, objects, replicas, counters)."""
        reply = self._call("ListNodes", pb.ListNodesRequest())
        return [node_view(n) for n in reply.nodes], reply.objects, reply.replicas, dict(reply.counters)

    # ------------------------------------------------------------------ replicas

    @_typed
    def update_replicas(
        self, node_id: str, batches: Sequence[ReplicaBatch], timeout: Optional[float] = None
    ) -> Tuple[int, int, List[bytes]]:
        """Apply ordered register/unregister runs; returns (registered, unregistered, conflicts)."""
        registered = unregistered = 0
        conflicts: List[bytes] = []
        for group in self._batch_groups(batches):
            request = pb.UpdateReplicasRequest(
                node_id=node_id,
                batches=[
                    pb.ReplicaBatch(op=b.op, tier=b.tier, keys=b.keys, sizes=b.sizes, crcs=b.crcs) for b in group
                ],
            )
            reply = self._call("UpdateReplicas", request, timeout)
            registered += reply.registered
            unregistered += reply.unregistered
            conflicts.extend(reply.conflicts)
        return registered, unregistered, conflicts

    def _batch_groups(self, batches: Sequence[ReplicaBatch]) -> List[List[ReplicaBatch]]:
        """Split runs so that one RPC carries at most ``max_keys_per_rpc`` keys, order kept."""
        groups: List[List[ReplicaBatch]] = [[]]
        room = self.max_keys_per_rpc
        for b in batches:
            start = 0
            while start < len(b.keys) or (start == 0 and not b.keys):
                take = min(room, len(b.keys) - start)
                end = start + take
                sizes = b.sizes[start:end] if b.sizes else ()
                crcs = b.crcs[start:end] if b.crcs else ()
                groups[-1].append(ReplicaBatch(b.op, b.tier, b.keys[start:end], sizes, crcs))
                room -= take
                start = end
                if room == 0:
                    groups.append([])
                    room = self.max_keys_per_rpc
                if not b.keys:
                    break
        return [g for g in groups if g]

    @_typed
    def lookup(self, keys: Sequence[bytes], *, count_access: bool = True) -> LookupResult:
        """Readable replicas of each key, best first (see ``LookupResponse`` in the proto)."""
        out = LookupResult([], [], [], [], [], [])
        table: Dict[str, int] = {}
        for lo, hi in self._chunks(len(keys)):
            reply = self._call("Lookup", pb.LookupRequest(keys=keys[lo:hi], count_access=count_access))
            remap = _merge_nodes(reply.nodes, table, out.nodes)
            out.counts.extend(reply.replica_counts)
            _extend(out.node_index, reply.node_index, remap)
            out.tiers.extend(reply.tier)
            out.sizes.extend(reply.size)
            out.crcs.extend(reply.crc)
        return out

    @_typed
    def prepare_put(
        self, node_id: str, keys: Sequence[bytes], sizes: Sequence[int], crcs: Sequence[int]
    ) -> PlaceResult:
        """Reserve WRITING replicas (on ``node_id``, or where the master picks when empty)."""
        out = PlaceResult([], [], [])
        table: Dict[str, int] = {}
        for lo, hi in self._chunks(len(keys)):
            reply = self._call(
                "PreparePut",
                pb.PreparePutRequest(node_id=node_id, keys=keys[lo:hi], sizes=sizes[lo:hi], crcs=crcs[lo:hi]),
            )
            remap = _merge_nodes(reply.nodes, table, out.nodes)
            out.status.extend(reply.status)
            _extend(out.node_index, reply.node_index, remap)
        return out

    @_typed
    def abort_put(self, node_id: str, keys: Sequence[bytes]) -> None:
        for lo, hi in self._chunks(len(keys)):
            self._call("AbortPut", pb.AbortPutRequest(node_id=node_id, keys=keys[lo:hi]))

    @_typed
    def remove(self, keys: Sequence[bytes]) -> RemoveResult:
        out = RemoveResult([], [], [], [])
        table: Dict[str, int] = {}
        for lo, hi in self._chunks(len(keys)):
            reply = self._call("Remove", pb.RemoveRequest(keys=keys[lo:hi]))
            remap = _merge_nodes(reply.nodes, table, out.nodes)
            out.existed.extend(reply.existed)
            out.holder_key_index.extend(lo + i for i in reply.holder_key_index)
            _extend(out.holder_node_index, reply.holder_node_index, remap)
        return out

    @_typed
    def report_access(self, keys: Sequence[bytes], counts: Sequence[int]) -> None:
        for lo, hi in self._chunks(len(keys)):
            self._call("ReportAccess", pb.ReportAccessRequest(keys=keys[lo:hi], counts=counts[lo:hi]))


def _merge_nodes(infos: Sequence[pb.NodeInfo], table: Dict[str, int], nodes: List[NodeView]) -> Optional[List[int]]:
    """Append unseen nodes to ``nodes``; return a remap of reply indexes (None: identity)."""
    remap: List[int] = []
    identity = True
    for i, info in enumerate(infos):
        idx = table.get(info.node_id)
        if idx is None:
            idx = table[info.node_id] = len(nodes)
            nodes.append(node_view(info))
        remap.append(idx)
        identity = identity and idx == i
    return None if identity else remap


def _extend(out: List[int], indexes: Sequence[int], remap: Optional[List[int]]) -> None:
    if remap is None:
        out.extend(indexes)
    else:
        out.extend(remap[i] for i in indexes)


def _error(exc: grpc.RpcError, call: str, address: str) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownNodeError("master does not know this node", call=call, master=address, details=details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return MasterUnavailableError("master unreachable", call=call, master=address, code=code.name, details=details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoSpaceError("master cannot place the values", call=call, master=address, details=details)
    return RemoteError(
        "master refused the request", call=call, master=address, code=code.name if code else None, details=details
    )
