"""A node around an in-process store, against a real gRPC master on 127.0.0.1:0:
registration of what the SSD holds, two-phase eviction, re-registration after a master
restart, mailbox tasks (removal, promotion, offload), pull."""

import time

import pytest

import gdskv
from conftest import block
from gdskv.master.config import MasterConfig
from gdskv.master.model import DRAM, NVME, Tasks
from gdskv.master.server import MasterServer
from gdskv.node import ClusterConfig, Node
from gdskv.store import StoreListener
from gdskv.transport import ItemStatus
from gdskv.transport.frames import value_crc
from gdskv.types import Tier

KiB = 1024


def wait_until(predicate, timeout=10.0, what="condition"):
    """Poll a condition that another thread or process makes true (a sync point with a deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def master():
    server = MasterServer("127.0.0.1:0", MasterConfig(lease_s=2.0, heartbeat_s=0.1, promote_threshold=2))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def make_node(tmp_path, master):
    made = []

    def _make(name="n", master_address=None, **options):
        options.setdefault("dram", "1MiB")
        options.setdefault("ssd", "16MiB")
        options.setdefault("bucket_max_age_s", 0.01)
        options.setdefault("put_timeout_s", 5.0)
        store = gdskv.open(tmp_path / name, **options)
        node = Node(store, master_address or master.address, ClusterConfig(heartbeat_s=0.1, evict_wait_s=5.0))
        node.start()
        made.append((node, store))
        assert node.wait_registered(10)
        return node, store

    yield _make
    for node, store in made:
        node.close()
        store.close()


def tiers_on(master, key, node_id):
    r = master.registry.lookup([key], False, time.monotonic())
    return sorted(r.tiers[j] for j in range(r.counts[0]) if r.nodes[r.node_index[j]].node_id == node_id)


def test_a_node_registers_what_its_ssd_holds_at_start(tmp_path, master, make_node):
    store = gdskv.open(tmp_path / "n", dram="1MiB", ssd="16MiB")
    for i in range(5):
        store.put(f"k{i}", block(i, 10 * KiB))
    store.close()  # drains to SSD
    node, store = make_node("n")
    assert node.registrar.counters["resync_objects"] == 5
    for i in range(5):
        assert tiers_on(master, f"k{i}".encode(), node.node_id) == [NVME]


def test_puts_offloads_and_evictions_reach_the_master_in_order(master, make_node):
    node, store = make_node(dram="256KiB")
    store.put("a", block(1, 64 * KiB))
    assert node.registrar.flush(5)
    assert tiers_on(master, b"a", node.node_id) == [DRAM]
    store.flush()
    wait_until(lambda: tiers_on(master, b"a", node.node_id) == [DRAM, NVME], what="the NVMe replica")
    for i in range(8):
        store.put(f"b{i}", block(10 + i, 64 * KiB))
        store.flush()
    assert node.registrar.flush(5)
    assert tiers_on(master, b"a", node.node_id) == [NVME]  # evicted from DRAM, still on SSD


def test_the_master_drops_a_replica_before_the_store_frees_it(master, make_node):
    node, store = make_node(dram="256KiB")
    seen = []

    class Probe(StoreListener):  # runs after the node's registrar (listeners run in order)
        def on_evicting(self, tier, keys):
            for key in keys:
                seen.append((tier, tiers_on(master, key, node.node_id)))

    store.add_listener(Probe())
    for i in range(10):
        store.put(f"k{i}", block(i, 64 * KiB))
        store.flush()
    dram_evictions = [t for tier, t in seen if tier is Tier.DRAM]
    assert dram_evictions, "nothing was evicted"
    assert all(DRAM not in t for t in dram_evictions)


def test_a_restarted_master_gets_everything_back_without_a_node_restart(master, make_node):
    node, store = make_node()
    for i in range(20):
        store.put(f"k{i}", block(i, 4 * KiB))
    store.flush()
    assert node.registrar.flush(5)
    address = master.address
    master.stop()
    replacement = MasterServer(address, MasterConfig(lease_s=2.0, heartbeat_s=0.1))
    replacement.start()
    try:
        wait_until(lambda: all(tiers_on(replacement, f"k{i}".encode(), node.node_id) for i in range(20)),
                   what="re-registration with the new master")
        wait_until(lambda: node.registrar.counters["resyncs"] >= 2, what="the resync to be counted")
    finally:
        replacement.stop()


def test_mailbox_removal_runs_unless_the_key_was_stored_again(master, make_node):
    node, store = make_node()
    store.put("gone", b"x" * 100)
    store.put("kept", b"y" * 100)
    assert node.registrar.flush(5)
    issued = time.monotonic()
    store.remove("kept")  # a client removed it here directly...
    value = memoryview(b"z" * 100)  # ...and a thin client put it again before the task ran
    assert node.provider.write([b"kept"], [value], [value_crc(b"kept", value)]) == [ItemStatus.OK]
    node.run_tasks(Tasks([], [], [b"gone", b"kept"]), issued_after=issued)
    assert not store.exists("gone") and store.get("kept") == b"z" * 100
    assert node.registrar.flush(5)
    assert tiers_on(master, b"gone", node.node_id) == []


def test_removal_from_the_master_reaches_the_node_through_its_mailbox(master, make_node):
    node, store = make_node()
    store.put("k", b"v" * 10)
    assert node.registrar.flush(5)
    master.registry.remove([b"k"], time.monotonic())
    wait_until(lambda: not store.exists("k"), what="the removal task")
    wait_until(lambda: master.registry.list_nodes(time.monotonic())[1] == 0, what="the EVICTING record to go")


def test_a_hot_ssd_only_object_is_promoted(master, make_node):
    node, store = make_node(dram="256KiB", promote_after_reads=0)
    for i in range(8):
        store.put(f"k{i}", block(i, 64 * KiB))
        store.flush()
    for i in range(5, 8):
        store.remove(f"k{i}")  # room below the DRAM watermark
    cold = next(f"k{i}".encode() for i in range(8) if tiers_on(master, f"k{i}".encode(), node.node_id) == [NVME])
    master.registry.lookup([cold, cold], True, time.monotonic())
    master.registry.lookup([cold], True, time.monotonic())
    wait_until(lambda: DRAM in tiers_on(master, cold, node.node_id), what="the promotion")
    assert node.counters["tasks_promoted"] == 1


def test_pull_fetches_from_peers_into_the_store(master, make_node):
    a, store_a = make_node("a")
    b, store_b = make_node("b")
    values = {f"p{i}": block(i, 20 * KiB) for i in range(6)}
    for key, value in values.items():
        store_a.put(key, value)
    store_a.flush()
    assert a.registrar.flush(5)
    statuses = b.pull([k.encode() for k in values] + [b"absent"])
    assert [s.name for s in statuses] == ["OK"] * 6 + ["MISS"]
    for key, value in values.items():
        assert store_b.get(key) == value
        assert DRAM in tiers_on(master, key.encode(), b.node_id)
