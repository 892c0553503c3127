"""The master's registry alone (no gRPC): leases, replicas, placement, removal, hotness.

Time is passed in explicitly, so lease expiry is exercised without sleeping.
"""

import pytest

from gdskv.errors import InvalidKeyError, InvalidValueError, NoSpaceError, UnknownNodeError
from gdskv.master._proto import master_pb2 as pb
from gdskv.master.config import MasterConfig
from gdskv.master.model import (
    COMPLETE,
    CONFLICT,
    DRAM,
    EVICTING,
    EXISTS,
    HBM,
    NVME,
    PLACED,
    REGISTER,
    UNREGISTER,
    WRITING,
    NodeView,
    ReplicaBatch,
    Usage,
)
from gdskv.master.registry import Registry

LEASE = 10.0
MiB = 1 << 20


@pytest.fixture
def reg():
    r = Registry(MasterConfig(lease_s=LEASE, promote_threshold=3, offload_threshold=3, promotions_per_heartbeat=2))
    for name, dram in (("a", 100 * MiB), ("b", 50 * MiB), ("c", 10 * MiB)):
        r.register_node(NodeView(name, f"127.0.0.1:{ord(name)}", dram_capacity=dram), now=0.0)
    return r


def register(reg, node, tier, keys, size=100, crc=7, now=0.0):
    return reg.update_replicas(node, [ReplicaBatch(REGISTER, tier, list(keys), [size] * len(keys), [crc] * len(keys))], now)


def replicas(reg, key, now=0.0):
    """[(node_id, tier)] of the readable replicas of ``key``, in the order handed out."""
    r = reg.lookup([key], False, now)
    return [(r.nodes[r.node_index[j]].node_id, r.tiers[j]) for j in range(r.counts[0])]


def test_model_numbers_match_the_proto_enums():
    assert (HBM, DRAM, NVME) == (pb.HBM, pb.DRAM, pb.NVME)
    assert (WRITING, COMPLETE, EVICTING) == (pb.WRITING, pb.COMPLETE, pb.EVICTING)
    assert (REGISTER, UNREGISTER) == (pb.REGISTER, pb.UNREGISTER)
    assert (PLACED, EXISTS, CONFLICT) == (pb.PLACED, pb.EXISTS, pb.CONFLICT)


def test_lookup_returns_complete_replicas_best_tier_first(reg):
    register(reg, "a", NVME, [b"k"])
    register(reg, "b", DRAM, [b"k"])
    assert replicas(reg, b"k") == [("b", DRAM), ("a", NVME)]
    r = reg.lookup([b"k", b"absent"], False, 0.0)
    assert r.counts == [2, 0] and r.sizes == [100, 100] and r.crcs == [7, 7]


def test_expired_lease_hides_replicas_and_grace_forgets_the_node(reg):
    register(reg, "a", DRAM, [b"k"])
    register(reg, "b", NVME, [b"k"])
    reg.heartbeat("b", Usage(), [], [], now=8.0)  # b renews, a does not
    assert replicas(reg, b"k", now=LEASE + 1) == [("b", NVME)]
    assert reg.expire(now=LEASE + 1) == 0  # a (and c) are dead but within their grace
    assert reg.expire(now=2 * LEASE + 1) == 2
    assert [n.node_id for n in reg.list_nodes(2 * LEASE + 1)[0]] == ["b"]
    with pytest.raises(UnknownNodeError):
        reg.heartbeat("a", Usage(), [], [], now=2 * LEASE + 2)
    assert replicas(reg, b"k", now=8.5) == [("b", NVME)]


def test_registering_again_resets_the_nodes_replicas(reg):
    register(reg, "a", DRAM, [b"k1", b"k2"])
    reg.register_node(NodeView("a", "127.0.0.1:1"), now=1.0)
    assert replicas(reg, b"k1", now=1.0) == []
    assert reg.list_nodes(1.0)[1] == 0  # no objects left


def test_a_different_value_from_another_node_is_refused(reg):
    register(reg, "a", DRAM, [b"k"], crc=1)
    assert register(reg, "b", DRAM, [b"k"], crc=2) == (0, 0, [b"k"])
    assert replicas(reg, b"k") == [("a", DRAM)]


def test_a_node_replacing_its_own_value_drops_its_stale_records(reg):
    register(reg, "a", DRAM, [b"k"], crc=1)
    register(reg, "a", NVME, [b"k"], crc=1)
    register(reg, "a", DRAM, [b"k"], size=5, crc=2)  # overwritten locally
    r = reg.lookup([b"k"], False, 0.0)
    assert r.counts == [1] and r.crcs == [2] and r.sizes == [5]


def test_unregister_one_tier_or_every_tier(reg):
    register(reg, "a", DRAM, [b"k"])
    register(reg, "a", NVME, [b"k"])
    reg.update_replicas("a", [ReplicaBatch(UNREGISTER, DRAM, [b"k"])], 0.0)
    assert replicas(reg, b"k") == [("a", NVME)]
    reg.update_replicas("a", [ReplicaBatch(UNREGISTER, 0, [b"k"])], 0.0)
    assert replicas(reg, b"k") == []
    assert reg.list_nodes(0.0)[1] == 0


def test_batches_apply_in_order(reg):
    batches = [
        ReplicaBatch(REGISTER, DRAM, [b"x"], [10], [1]),
        ReplicaBatch(UNREGISTER, DRAM, [b"x"]),
        ReplicaBatch(REGISTER, NVME, [b"x"], [10], [1]),
    ]
    assert reg.update_replicas("a", batches, 0.0) == (2, 1, [])
    assert replicas(reg, b"x") == [("a", NVME)]


def test_prepare_put_places_on_the_node_with_the_most_free_dram(reg):
    res = reg.prepare_put("", [b"p1", b"p2"], [60 * MiB, 60 * MiB], [1, 2], 0.0)
    placed = [res.nodes[i].node_id for i in res.node_index]
    assert res.status == [PLACED, PLACED] and placed == ["a", "b"]  # a's free room shrinks after p1
    assert replicas(reg, b"p1") == []  # WRITING is never handed out
    register(reg, "a", DRAM, [b"p1"], size=60 * MiB, crc=1)
    assert replicas(reg, b"p1") == [("a", DRAM)]
    again = reg.prepare_put("", [b"p1", b"p1"], [60 * MiB, 1], [1, 1], 0.0)
    assert again.status == [EXISTS, CONFLICT]


def test_a_write_in_progress_blocks_a_different_value_and_can_be_aborted(reg):
    reg.prepare_put("b", [b"w"], [10], [1], 0.0)
    assert reg.prepare_put("", [b"w"], [10], [2], 0.0).status == [CONFLICT]
    same = reg.prepare_put("", [b"w"], [10], [1], 0.0)  # the same value may be written twice
    assert same.status == [PLACED] and same.nodes[0].node_id == "a"
    assert reg.abort_put("b", [b"w"]) == 1
    assert reg.prepare_put("", [b"w"], [10], [2], 0.0).status == [CONFLICT]  # a still writes it
    assert reg.abort_put("a", [b"w"]) == 1
    assert reg.prepare_put("", [b"w"], [10], [2], 0.0).status == [PLACED]


def test_stale_write_reservations_expire(reg):
    reg.prepare_put("c", [b"w"], [10], [1], 0.0)
    reg.heartbeat("c", Usage(), [], [], now=50.0)
    reg.heartbeat("c", Usage(), [], [], now=59.0)
    reg.expire(now=61.0)  # writing_timeout_s = 60
    assert reg.prepare_put("c", [b"w"], [10], [2], 61.0).status == [PLACED]


def test_placing_on_an_unknown_or_no_node_fails(reg):
    with pytest.raises(UnknownNodeError):
        reg.prepare_put("zz", [b"k"], [1], [1], 0.0)
    empty = Registry()
    with pytest.raises(NoSpaceError, match="no live node"):
        empty.prepare_put("", [b"k"], [1], [1], 0.0)


def test_remove_hides_the_key_and_queues_a_task_for_each_holder(reg):
    register(reg, "a", DRAM, [b"k"])
    register(reg, "b", NVME, [b"k"])
    res = reg.remove([b"k", b"absent"], 0.0)
    assert res.existed == [True, False]
    assert sorted(res.nodes[i].node_id for i in res.holder_node_index) == ["a", "b"]
    assert replicas(reg, b"k") == []
    assert reg.heartbeat("a", Usage(), [], [], 1.0).remove == [b"k"]
    reg.update_replicas("a", [ReplicaBatch(UNREGISTER, 0, [b"k"])], 1.0)
    assert reg.heartbeat("b", Usage(), [], [], 1.0).remove == [b"k"]


def test_a_put_after_remove_cancels_the_pending_removal(reg):
    register(reg, "a", DRAM, [b"k"])
    reg.remove([b"k"], 0.0)
    assert reg.prepare_put("a", [b"k"], [100], [9], 0.0).status == [PLACED]
    register(reg, "a", DRAM, [b"k"], crc=9)
    assert reg.heartbeat("a", Usage(), [], [], 1.0).remove == []
    assert replicas(reg, b"k", 1.0) == [("a", DRAM)]


def test_a_late_registration_of_a_removed_value_does_not_bring_it_back(reg):
    register(reg, "a", DRAM, [b"k"])
    reg.remove([b"k"], 0.0)
    register(reg, "a", NVME, [b"k"])  # an offload that finished after the removal
    assert replicas(reg, b"k") == []
    assert reg.heartbeat("a", Usage(), [], [], 1.0).remove == [b"k"]  # still to be removed
    assert reg.counters["echoes_ignored"] == 1


def test_hot_nvme_only_objects_get_rate_limited_promotion_tasks(reg):
    keys = [b"h1", b"h2", b"h3"]
    register(reg, "b", NVME, keys)
    for _ in range(3):
        reg.lookup(keys, True, 1.0)
    assert reg.heat(b"h1", 1.0) == 3
    first = reg.heartbeat("b", Usage(), [], [], 1.0).promote
    second = reg.heartbeat("b", Usage(), [], [], 1.0).promote
    assert len(first) == 2 and len(second) == 1 and set(first + second) == set(keys)
    reg.lookup(keys, True, 1.0)  # already tasked: no duplicates
    assert reg.heartbeat("b", Usage(), [], [], 1.0).promote == []
    register(reg, "b", DRAM, [b"h1"])  # promoted
    assert replicas(reg, b"h1", 1.0)[0] == ("b", DRAM)


def test_hot_dram_only_objects_get_offload_tasks_and_heat_decays(reg):
    register(reg, "a", DRAM, [b"d"])
    reg.report_access([b"d"], [3], now=0.0)
    assert reg.heartbeat("a", Usage(), [], [], 0.0).offload == [b"d"]
    half_life = reg.config.heat_half_life_s
    assert reg.heat(b"d", 2 * half_life) == pytest.approx(0.75)


def test_heartbeat_accesses_feed_hotness(reg):
    register(reg, "b", NVME, [b"x"])
    assert reg.heartbeat("b", Usage(dram_used=1), [b"x"], [5], now=0.0).promote == [b"x"]


@pytest.mark.parametrize(
    "batch, error",
    [
        (ReplicaBatch(REGISTER, DRAM, [b""], [1], [1]), InvalidKeyError),
        (ReplicaBatch(REGISTER, DRAM, [b"x" * 4097], [1], [1]), InvalidKeyError),
        (ReplicaBatch(REGISTER, DRAM, [b"k"], [0], [1]), InvalidValueError),
        (ReplicaBatch(REGISTER, DRAM, [b"k"], [1 << 62], [1]), InvalidValueError),
        (ReplicaBatch(REGISTER, DRAM, [b"k", b"j"], [1], [1]), InvalidValueError),
        (ReplicaBatch(REGISTER, 9, [b"k"], [1], [1]), InvalidValueError),
        (ReplicaBatch(REGISTER, 0, [b"k"], [1], [1]), InvalidValueError),
        (ReplicaBatch(7, DRAM, [b"k"]), InvalidValueError),
    ],
)
def test_bad_batches_are_refused_whole(reg, batch, error):
    good = ReplicaBatch(REGISTER, DRAM, [b"good"], [1], [1])
    with pytest.raises(error):
        reg.update_replicas("a", [good, batch], 0.0)
    assert replicas(reg, b"good") == []  # the good batch before it was not applied either


def test_bad_input_on_the_other_calls(reg):
    with pytest.raises(InvalidValueError, match="too many"):
        Registry(MasterConfig(max_batch_keys=2)).lookup([b"a", b"b", b"c"], False, 0.0)
    with pytest.raises(InvalidKeyError):
        reg.lookup([b""], False, 0.0)
    with pytest.raises(InvalidValueError):
        reg.prepare_put("", [b"k"], [-1], [1], 0.0)
    with pytest.raises(InvalidValueError):
        reg.heartbeat("a", Usage(), [b"k"], [], 0.0)
    with pytest.raises(InvalidValueError):
        reg.register_node(NodeView("", "x:1"), 0.0)
    with pytest.raises(InvalidValueError):
        reg.register_node(NodeView("n", ""), 0.0)
    with pytest.raises(UnknownNodeError):
        reg.update_replicas("nobody", [], 0.0)
    with pytest.raises(UnknownNodeError):
        reg.abort_put("nobody", [b"k"])
    assert reg.deregister_node("nobody") is False
