"""The cluster as it runs: a gdskv-master and gdskv-node processes on loopback, driven by
clients in the test process. Crashes are SIGKILL; restarts reuse the node's directory (and
the master's port)."""

import random
import socket
import threading

import grpc
import pytest

import gdskv
from cluster_harness import LEASE_S, Cluster, wait_until
from conftest import block
from gdskv.master._proto import master_pb2 as pb
from gdskv.master.model import DRAM, NVME
from gdskv.transport import TcpTransport
from gdskv.transport.frames import Op, encode_request

KiB = 1024
MiB = 1 << 20


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def values_for(prefix, count, size, seed=0):
    return {f"{prefix}{i:03d}": block(seed + i, size) for i in range(count)}


def replica_tiers(client, keys, node_id=None):
    """Per key, the tiers of its readable replicas (on ``node_id`` only, if given)."""
    res = client._master.lookup([k.encode() for k in keys], count_access=False)
    out, pos = [], 0
    for count in res.counts:
        out.append(sorted(res.tiers[j] for j in range(pos, pos + count)
                          if node_id is None or res.nodes[res.node_index[j]].node_id == node_id))
        pos += count
    return out


def read_direct(address, values):
    """Read straight from one node's data plane: what that node itself holds."""
    with TcpTransport(connections=2) as t:
        keys = [k.encode() for k in values]
        outs = [memoryview(bytearray(len(v))) for v in values.values()]
        sizes = t.read(address, keys, outs)
    return {k: (bytes(o) if n is not None else None) for k, o, n in zip(values, outs, sizes)}


def verify_reads(client, values):
    got = client.batch_get(list(values))
    for (key, value), g in zip(values.items(), got):
        assert g is not None, f"{key} missing"
        assert bytes(g) == value, f"{key} differs"


# ---------------------------------------------------------------- one cluster, three nodes


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A master and node A holding 24 blocks (most of them on SSD only), then B and C."""
    c = Cluster(tmp_path_factory.mktemp("three"))
    try:
        c.start_master()
        c.start_node("a", dram="8MiB")
        client = gdskv.connect(c.master_address)
        values = values_for("blk", 24, 512 * KiB)
        client.batch_put(list(values), list(values.values()))
        wait_until(lambda: all(NVME in t for t in replica_tiers(client, values, c.node_id("a"))), what="A's SSD copies")
        starters = [threading.Thread(target=c.start_node, args=(name,)) for name in ("b", "c")]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        yield c, client, values
        client.close()
    finally:
        c.close()


def test_blocks_put_on_a_are_read_byte_exact_from_b(three):
    c, client, values = three
    a, b = c.node_id("a"), c.node_id("b")
    tiers = replica_tiers(client, values, a)
    ssd_only = {k: v for (k, v), t in zip(values.items(), tiers) if t == [NVME]}
    in_dram = {k: v for (k, v), t in zip(values.items(), tiers) if DRAM in t}
    assert len(ssd_only) >= 8 and in_dram, tiers  # A's 8 MiB DRAM cannot hold 12 MiB
    assert all(t == [] for t in replica_tiers(client, values, b))
    # B pulls every block from A: DRAM ones from A's memory, SSD-only ones from A's NVMe.
    assert client.prefetch(list(values), node=b) == [True] * len(values)
    assert read_direct(c.address("b"), values) == values
    assert all(t for t in replica_tiers(client, values, b))  # every block has a replica on B now
    verify_reads(client, values)


def test_a_thin_client_reads_peer_dram_and_peer_nvme(three):
    c, client, values = three
    fresh = values_for("thin", 4, 256 * KiB, seed=500)
    client.batch_put(list(fresh), list(fresh.values()))
    verify_reads(client, fresh)
    before = dict(client._fetcher.counters)
    verify_reads(client, values)
    hits = {k: client._fetcher.counters[k] - before.get(k, 0) for k in ("hits_tier2", "hits_tier3")}
    assert hits["hits_tier2"] + hits["hits_tier3"] == len(values)


def test_exists_and_remove_are_consistent_on_every_node(three):
    c, client, values = three
    doomed = dict(list(values.items())[:4])
    keys = list(doomed)
    client.prefetch(keys, node=c.node_id("c"))
    assert client.batch_exists(keys + ["never"]) == [True] * 4 + [False]
    assert client.batch_remove(keys + ["never"]) == [True] * 4 + [False]
    assert client.batch_exists(keys) == [False] * 4
    assert client.batch_get(keys) == [None] * 4
    for name in ("a", "b", "c"):
        assert set(read_direct(c.address(name), doomed).values()) == {None}, name
    assert client.batch_remove(keys) == [False] * 4
    with gdskv.connect(c.master_address) as other:
        assert other.batch_exists(keys) == [False] * 4


def test_bad_input_everywhere_leaves_every_server_up(three):
    c, client, values = three
    with grpc.insecure_channel(c.master_address) as channel:
        raw_lookup = channel.unary_unary("/gdskv.master.v1.Master/Lookup")
        with pytest.raises(grpc.RpcError):
            raw_lookup(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)  # a length running past the end
        heartbeat = channel.unary_unary("/gdskv.master.v1.Master/Heartbeat",
                                        request_serializer=pb.HeartbeatRequest.SerializeToString,
                                        response_deserializer=pb.HeartbeatResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            heartbeat(pb.HeartbeatRequest(node_id="nobody"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        update = channel.unary_unary("/gdskv.master.v1.Master/UpdateReplicas",
                                     request_serializer=pb.UpdateReplicasRequest.SerializeToString,
                                     response_deserializer=pb.UpdateReplicasResponse.FromString)
        huge = pb.ReplicaBatch(op=pb.REGISTER, tier=pb.DRAM, keys=[b"k"], sizes=[(1 << 64) - 1], crcs=[0])
        with pytest.raises(grpc.RpcError) as info:
            update(pb.UpdateReplicasRequest(node_id=c.node_id("a"), batches=[huge]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    host, port = c.address("a").rsplit(":", 1)
    head, body, crc = encode_request(Op.WRITE, 1, [b"partial"], [4 * MiB], [0])
    for frame in (b"GARBAGE" * 10, head[:10], head + body[:2], head + body + crc + b"x" * 1000,
                  b"".join(encode_request(Op.READ, 2, [b"k"] * 70000, [1] * 70000, [0] * 70000))):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(frame)
    assert not client.exists("partial")
    assert len(client.nodes()) == 3
    verify_reads(client, dict(list(values.items())[4:]))


# ---------------------------------------------------------------- crashes


def test_a_killed_node_drops_out_after_its_lease_and_comes_back_from_its_ssd(cluster):
    cluster.start_master()
    cluster.start_node("a", dram="16MiB")
    cluster.start_node("b", dram="4MiB")
    client = gdskv.connect(cluster.master_address)
    try:
        values = values_for("k", 8, 256 * KiB, seed=100)
        client.batch_put(list(values), list(values.values()))
        a = cluster.node_id("a")
        wait_until(lambda: all(NVME in t for t in replica_tiers(client, values, a)), what="A's SSD copies")
        cluster.nodes["a"].kill9()
        wait_until(lambda: all(t == [] for t in replica_tiers(client, values)), timeout=10 * LEASE_S,
                   what="A's replicas to stop being handed out")
        assert client.batch_get(list(values)) == [None] * len(values)
        info = cluster.start_node("a", dram="16MiB")  # same directory, new process
        assert info["objects"] >= len(values)
        assert all(t == [NVME] for t in replica_tiers(client, values, info["node_id"]))
        verify_reads(client, values)
    finally:
        client.close()


def test_a_restarted_master_finds_every_ssd_block_without_node_restarts(cluster):
    address = cluster.start_master()
    cluster.start_node("a", dram="16MiB")
    cluster.start_node("b", dram="4MiB")
    client = gdskv.connect(address)
    try:
        values = values_for("m", 8, 256 * KiB, seed=200)
        client.batch_put(list(values), list(values.values()))
        wait_until(lambda: all(NVME in t for t in replica_tiers(client, values)), what="SSD copies")
        pids = {name: proc.popen.pid for name, proc in cluster.nodes.items()}
        cluster.master.kill9()
        cluster.start_master(address)
        wait_until(lambda: all(NVME in t for t in replica_tiers(client, values)), timeout=20,
                   what="the nodes to re-register with the new master")
        verify_reads(client, values)
        assert {name: proc.popen.pid for name, proc in cluster.nodes.items()} == pids
        assert all(proc.popen.poll() is None for proc in cluster.nodes.values())
        more = values_for("after", 3, 64 * KiB, seed=300)
        client.batch_put(list(more), list(more.values()))
        verify_reads(client, more)
    finally:
        client.close()


def test_readers_racing_evictions_get_the_block_or_a_clean_miss(cluster):
    cluster.start_master()
    cluster.start_node("small", dram="2MiB", ssd="0")  # DRAM only: an eviction deletes the block
    writer = gdskv.connect(cluster.master_address)
    reader = gdskv.connect(cluster.master_address, verify_transfers=False)  # wrong bytes would show
    outcomes = {"hit": 0, "miss": 0, "wrong": []}
    written = []
    done = threading.Event()
    lock = threading.Lock()

    def read_loop(seed):
        rng = random.Random(seed)
        while not done.is_set():
            with lock:
                n = len(written)
                if n < 24:
                    keys = []
                else:  # the newest, one around the eviction edge, one surely evicted
                    keys = [written[-1], written[rng.randrange(n - 18, n - 12)], written[n - 24]]
            if not keys:
                done.wait(0.005)
                continue
            for key, got in zip(keys, reader.batch_get(keys)):
                with lock:
                    if got is None:
                        outcomes["miss"] += 1
                    elif bytes(got) == block(int(key[1:]), 128 * KiB):
                        outcomes["hit"] += 1
                    else:
                        outcomes["wrong"].append(key)

    readers = [threading.Thread(target=read_loop, args=(s,)) for s in range(2)]
    for t in readers:
        t.start()
    try:
        for i in range(72):  # 9 MiB through a 2 MiB DRAM tier
            key = f"r{i}"
            writer.put(key, block(i, 128 * KiB))
            with lock:
                written.append(key)
    finally:
        done.set()
        for t in readers:
            t.join()
        writer.close()
        reader.close()
    assert outcomes["wrong"] == []
    assert outcomes["hit"] > 0 and outcomes["miss"] > 0, outcomes


def test_a_replica_whose_value_outgrew_its_record_is_a_stale_replica_not_an_error(cluster):
    """A reader locates a key (the master lists its size), then the key is overwritten with
    a larger value before the read: the holder's answer does not fit the room the record
    asked for. That replica is stale for this read, as one that lost the key is; it is not
    the caller's error (before, fetch_into raised InvalidValueError for an out with room to
    spare). An out with room for the new value gets it, checked by its holder's CRC."""
    master = cluster.start_master()
    cluster.start_node("a")
    client = gdskv.connect(master)
    try:
        client.put("k", b"a" * 100)
        located = client._fetcher.locate([b"k"])  # noqa: SLF001 - the lookup half of a get
        assert [r.size for r in located[0]] == [100]
        client.put("k", b"b" * 200, overwrite=True)
        exact = memoryview(bytearray(100))  # the room the record says the value needs
        assert client._fetcher.fetch_into([b"k"], [exact], located) == [None]  # noqa: SLF001
        roomy = memoryview(bytearray(4096))
        assert client._fetcher.fetch_into([b"k"], [roomy], located) == [200]  # noqa: SLF001
        assert bytes(roomy[:200]) == b"b" * 200
        assert client.get("k") == b"b" * 200
    finally:
        client.close()


def test_a_key_removed_while_its_holder_was_down_stays_removed_when_it_restarts(cluster):
    """A node is killed; a client removes a key only that node holds (the removal waits in
    the master for the node). The node restarts on the same directory: it comes back with
    the same id (kept in its store directory), and the key does not come back with it: the
    master keeps the pending removal, takes the node's re-registration of the key for an
    echo, and the node deletes its copy."""
    cluster.start_master()
    first = cluster.start_node("a")
    client = gdskv.connect(cluster.master_address)
    try:
        client.put("K", b"v" * 1000)
        wait_until(lambda: NVME in replica_tiers(client, {"K": None}, first["node_id"])[0], what="K on A's SSD")
        cluster.nodes["a"].kill9()
        assert client.remove("K") is True
        again = cluster.start_node("a")
        assert again["node_id"] == first["node_id"]
        assert again["objects"] >= 1  # it registered K again
        assert not client.exists("K") and client.get("K") is None
        wait_until(lambda: cluster_holds_nothing(client), what="A to delete its copy of K")
        assert client.get("K") is None
    finally:
        client.close()


def cluster_holds_nothing(client) -> bool:
    return all(n.replicas == 0 for n in client.nodes())
