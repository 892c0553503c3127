"""The master over real gRPC on 127.0.0.1:0: every RPC, its batch splitting, and its error
statuses for bad input; the server keeps serving after each."""

import grpc
import pytest

from gdskv.errors import InvalidValueError, MasterUnavailableError, RemoteError, UnknownNodeError
from gdskv.master._proto import master_pb2 as pb
from gdskv.master.client import MasterClient
from gdskv.master.config import MasterConfig
from gdskv.master.model import DRAM, EXISTS, NVME, PLACED, REGISTER, NodeView, ReplicaBatch, Usage
from gdskv.master.server import MasterServer


@pytest.fixture
def master():
    server = MasterServer("127.0.0.1:0", MasterConfig(lease_s=30.0))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(master):
    c = MasterClient(master.address, timeout_s=5.0, max_keys_per_rpc=100)
    c.register_node(NodeView("n1", "127.0.0.1:1", dram_capacity=1 << 30))
    c.register_node(NodeView("n2", "127.0.0.1:2", dram_capacity=1 << 20))
    yield c
    c.close()


def verify_alive(client):
    nodes, _, _, _ = client.list_nodes()
    assert {n.node_id for n in nodes} >= {"n1", "n2"}


def test_batches_larger_than_one_rpc_round_trip(client):
    keys = [b"key-%05d" % i for i in range(1050)]  # 11 RPCs of at most 100 keys
    reg, unreg, conflicts = client.update_replicas(
        "n1", [ReplicaBatch(REGISTER, DRAM, keys, list(range(1, 1051)), [3] * 1050)]
    )
    assert (reg, unreg, conflicts) == (1050, 0, [])
    client.update_replicas("n2", [ReplicaBatch(REGISTER, NVME, keys[:150], list(range(1, 151)), [3] * 150)])
    res = client.lookup(keys + [b"absent"])
    assert res.counts == [2] * 150 + [1] * 900 + [0]
    assert [n.node_id for n in res.nodes] == ["n1", "n2"]
    assert res.sizes[:2] == [1, 1] and res.tiers[:2] == [DRAM, NVME]
    assert [res.nodes[i].node_id for i in res.node_index[:2]] == ["n1", "n2"]


def test_put_plan_remove_and_heartbeat_tasks(client):
    plan = client.prepare_put("", [b"a", b"b"], [10, 10], [1, 2])
    assert plan.status == [PLACED, PLACED] and plan.nodes[0].node_id == "n1"
    client.update_replicas("n1", [ReplicaBatch(REGISTER, DRAM, [b"a"], [10], [1])])
    client.abort_put("n1", [b"b"])
    assert client.prepare_put("n2", [b"a"], [10], [1]).status == [EXISTS]
    removed = client.remove([b"a", b"zz"])
    assert removed.existed == [True, False]
    assert [removed.nodes[i].node_id for i in removed.holder_node_index] == ["n1"]
    tasks = client.heartbeat("n1", Usage(dram_used=5, dram_capacity=1 << 30))
    assert tasks.remove == [b"a"]
    client.report_access([b"a"], [1])


def test_unknown_node_is_not_found(client):
    with pytest.raises(UnknownNodeError):
        client.heartbeat("ghost", Usage())
    with pytest.raises(UnknownNodeError):
        client.update_replicas("ghost", [ReplicaBatch(REGISTER, DRAM, [b"k"], [1], [1])])
    with pytest.raises(UnknownNodeError):
        client.prepare_put("ghost", [b"k"], [1], [1])
    client.deregister_node("ghost")  # idempotent
    verify_alive(client)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.lookup([b""]),
        lambda c: c.lookup([b"x" * 5000]),
        lambda c: c.update_replicas("n1", [ReplicaBatch(REGISTER, DRAM, [b"k"], [0], [1])]),
        lambda c: c.update_replicas("n1", [ReplicaBatch(REGISTER, DRAM, [b"k"], [(1 << 64) - 1], [1])]),  # -1 on the wire
        lambda c: c.update_replicas("n1", [ReplicaBatch(REGISTER, 42, [b"k"], [1], [1])]),
        lambda c: c.update_replicas("n1", [ReplicaBatch(REGISTER, DRAM, [b"k", b"j"], [1], [1])]),
        lambda c: c.prepare_put("", [b"k"], [1 << 50], [1]),
        lambda c: c.report_access([b"k", b"j"], [1]),
        lambda c: c.register_node(NodeView("", "127.0.0.1:9")),
    ],
)
def test_bad_arguments_are_invalid_argument_and_the_master_stays_up(client, call):
    with pytest.raises(RemoteError) as info:
        call(client)
    assert info.value.context["code"] == "INVALID_ARGUMENT"
    assert info.value.context["details"]
    verify_alive(client)


def test_values_protobuf_cannot_encode_are_refused_before_sending(client):
    with pytest.raises(InvalidValueError, match="cannot encode"):
        client.prepare_put("", [b"k"], [-1], [1])
    with pytest.raises(InvalidValueError):
        client.lookup(["not-bytes"])


def test_garbage_request_bytes_get_an_error_status(master, client):
    with grpc.insecure_channel(master.address) as channel:
        raw = channel.unary_unary("/gdskv.master.v1.Master/Lookup")  # no serializer: bytes in, bytes out
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff garbage", timeout=5)
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        reply = pb.LookupResponse.FromString(raw(pb.LookupRequest(keys=[b"k"]).SerializeToString(), timeout=5))
        assert list(reply.replica_counts) == [0]
    verify_alive(client)


def test_an_unreachable_master_is_master_unavailable():
    server = MasterServer("127.0.0.1:0")
    address = server.start()
    server.stop()
    with MasterClient(address, timeout_s=0.5) as c:
        with pytest.raises(MasterUnavailableError):
            c.lookup([b"k"])
        c.close()
        with pytest.raises(MasterUnavailableError, match="closed"):
            c.lookup([b"k"])
