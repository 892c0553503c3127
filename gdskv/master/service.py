"""The gRPC face of the master: proto messages in, :class:`Registry` calls, proto messages out.

Error mapping (every error status carries a message naming the field and the value):

- :class:`UnknownNodeError` -> ``NOT_FOUND`` "unknown node" (the node must register again);
- :class:`InvalidKeyError`, :class:`InvalidValueError` -> ``INVALID_ARGUMENT``;
- :class:`NoSpaceError` -> ``RESOURCE_EXHAUSTED`` (no live node to place a value on);
- any other :class:`GdskvError` -> ``FAILED_PRECONDITION``; anything else -> ``INTERNAL``
  (logged). A failing request changes nothing and the server keeps serving.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, List

import grpc

from gdskv.errors import GdskvError, InvalidKeyError, InvalidValueError, NoSpaceError, UnknownNodeError
from gdskv.master._proto import master_pb2 as pb
from gdskv.master._proto import master_pb2_grpc as pb_grpc
from gdskv.master.model import NodeView, ReplicaBatch, Usage
from gdskv.master.registry import Registry

log = logging.getLogger(__name__)

_STATUS = (
    (UnknownNodeError, grpc.StatusCode.NOT_FOUND),
    (InvalidKeyError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoSpaceError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (GdskvError, grpc.StatusCode.FAILED_PRECONDITION),
)


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn gdskv errors into gRPC statuses; keep the server up whatever happens."""

    @functools.wraps(method)
    def wrapper(self: "MasterService", request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except GdskvError as exc:
            for cls, code in _STATUS:
                if isinstance(exc, cls):
                    self.registry.counters[f"errors_{code.name.lower()}"] += 1
                    context.abort(code, str(exc))
            raise  # unreachable: GdskvError is in the table
        except (ValueError, TypeError, OverflowError) as exc:
            self.registry.counters["errors_invalid_argument"] += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method.__name__}: {exc}")
        except Exception as exc:  # the process must survive any bad request
            log.exception("gdskv-master: %s failed", method.__name__)
            self.registry.counters["errors_internal"] += 1
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: {type(exc).__name__}: {exc}")

    return wrapper


def node_info(view: NodeView) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=view.node_id,
        data_address=view.address,
        transport=view.transport,
        dram_capacity=view.dram_capacity,
        dram_used=view.dram_used,
        nvme_capacity=view.nvme_capacity,
        nvme_used=view.nvme_used,
        lease_remaining_s=view.lease_remaining_s,
        replicas=view.replicas,
    )


def _infos(views: List[NodeView]) -> List[pb.NodeInfo]:
    return [node_info(v) for v in views]


class MasterService(pb_grpc.MasterServicer):
    """Implements ``gdskv.master.v1.Master`` on a :class:`Registry`."""

    def __init__(self, registry: Registry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.clock = clock

    @_rpc
    def RegisterNode(self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext) -> pb.RegisterNodeResponse:
        n = request.node
        view = NodeView(
            node_id=n.node_id,
            address=n.data_address,
            transport=n.transport or "tcp",
            dram_capacity=n.dram_capacity,
            dram_used=n.dram_used,
            nvme_capacity=n.nvme_capacity,
            nvme_used=n.nvme_used,
        )
        self.registry.register_node(view, self.clock())
        cfg = self.registry.config
        return pb.RegisterNodeResponse(lease_s=cfg.lease_s, heartbeat_s=cfg.effective_heartbeat_s)

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        usage = Usage(request.dram_used, request.dram_capacity, request.nvme_used, request.nvme_capacity)
        tasks = self.registry.heartbeat(
            request.node_id, usage, list(request.accessed_keys), list(request.accessed_counts), self.clock()
        )
        return pb.HeartbeatResponse(
            lease_s=self.registry.config.lease_s,
            offload_keys=tasks.offload,
            promote_keys=tasks.promote,
            remove_keys=tasks.remove,
        )

    @_rpc
    def DeregisterNode(self, request: pb.NodeRef, context: grpc.ServicerContext) -> pb.Empty:
        self.registry.deregister_node(request.node_id)
        return pb.Empty()

    @_rpc
    def UpdateReplicas(self, request: pb.UpdateReplicasRequest, context: grpc.ServicerContext) -> pb.UpdateReplicasResponse:
        batches = [
            ReplicaBatch(b.op, b.tier, list(b.keys), list(b.sizes), list(b.crcs)) for b in request.batches
        ]
        registered, unregistered, conflicts = self.registry.update_replicas(request.node_id, batches, self.clock())
        return pb.UpdateReplicasResponse(registered=registered, unregistered=unregistered, conflicts=conflicts)

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        r = self.registry.lookup(list(request.keys), request.count_access, self.clock())
        return pb.LookupResponse(
            replica_counts=r.counts,
            node_index=r.node_index,
            tier=r.tiers,
            size=r.sizes,
            crc=r.crcs,
            nodes=_infos(r.nodes),
        )

    @_rpc
    def PreparePut(self, request: pb.PreparePutRequest, context: grpc.ServicerContext) -> pb.PreparePutResponse:
        r = self.registry.prepare_put(
            request.node_id, list(request.keys), list(request.sizes), list(request.crcs), self.clock()
        )
        return pb.PreparePutResponse(status=r.status, node_index=r.node_index, nodes=_infos(r.nodes))

    @_rpc
    def AbortPut(self, request: pb.AbortPutRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.registry.abort_put(request.node_id, list(request.keys))
        return pb.Empty()

    @_rpc
    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.RemoveResponse:
        r = self.registry.remove(list(request.keys), self.clock())
        return pb.RemoveResponse(
            existed=r.existed,
            holder_key_index=r.holder_key_index,
            holder_node_index=r.holder_node_index,
            nodes=_infos(r.nodes),
        )

    @_rpc
    def ReportAccess(self, request: pb.ReportAccessRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.registry.report_access(list(request.keys), list(request.counts), self.clock())
        return pb.Empty()

    @_rpc
    def ListNodes(self, request: pb.ListNodesRequest, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        views, objects, replicas = self.registry.list_nodes(self.clock())
        return pb.ListNodesResponse(
            nodes=_infos(views),
            objects=objects,
            replicas=replicas,
            counters={k: int(v) for k, v in self.registry.counters.items()},
        )
