"""gdskv.attach: the store API of a node's store, from this process, through shared memory."""

from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pytest

import gdskv
from attach_fixtures import served, sock_dir  # noqa: F401 - fixtures
from conftest import block
from gdskv.kvstore import KVStore
from gdskv.local import LocalServer

MiB = 1 << 20


def test_an_attached_store_speaks_the_whole_api(served):
    store, server = served()
    with gdskv.attach(server.path) as kv:
        assert isinstance(kv, KVStore)
        a, b = block(1, 300_000), block(2, 1000)
        kv.put("a", a)
        kv.batch_put(["b", b"c"], [b, np.frombuffer(a, np.uint8)])
        assert store.get("a") == a  # the node's store holds it: one store, two processes' view
        assert kv.get("a") == a and kv.get("missing") is None
        assert kv.batch_get(["b", "missing", "c"]) == [bytearray(b), None, bytearray(a)]
        out = bytearray(400_000)
        assert kv.get_into("a", out) == len(a) and out[: len(a)] == a
        outs = [bytearray(1000), bytearray(300_000)]
        assert kv.batch_get_into(["b", "c"], outs) == [1000, 300_000]
        assert outs[0] == b and outs[1] == a
        assert kv.exists("a") and not kv.exists("missing")
        assert kv.batch_exists(["a", "missing"]) == [True, False]
        assert kv.remove("a") is True and kv.remove("a") is False
        assert kv.batch_remove(["b", "missing"]) == [True, False]
        assert not store.exists("b")
        stats = kv.stats()
        assert stats["attached"]["socket"] == str(server.path)
        assert stats["dram"]["capacity"] == store.stats()["dram"]["capacity"]
    assert server.stats()["pins"] == 0


def test_errors_are_the_embedded_stores_own(served):
    store, server = served()
    with gdskv.attach(server.path) as kv:
        kv.put("k", block(3, 5000))
        kv.put("k", block(3, 5000))  # the same bytes again: a no-op
        with pytest.raises(gdskv.KeyExistsError):
            kv.put("k", block(4, 5000))
        kv.put("k", block(4, 5000), overwrite=True)
        assert kv.get("k") == block(4, 5000)
        with pytest.raises(gdskv.InvalidValueError, match="smaller than the value"):
            kv.get_into("k", bytearray(10))
        with pytest.raises(gdskv.ValueTooLargeError):
            kv.put("huge", bytes(9 * MiB))  # the DRAM tier is 8 MiB
        with pytest.raises(gdskv.InvalidKeyError):
            kv.get("")
        with pytest.raises(gdskv.InvalidValueError):
            kv.batch_put(["a", "b"], [b"1"])
        assert kv.get("k") == block(4, 5000)  # nothing of that changed what is stored
    kv.close()
    with pytest.raises(gdskv.StoreClosedError):
        kv.get("k")


def test_values_on_nvme_come_through_the_read_staging_area(served):
    store, server = served(dram="4MiB", ssd="64MiB")
    with gdskv.attach(server.path) as kv:
        values = {f"v{i}": block(10 + i, MiB) for i in range(12)}  # 12 MiB through 4 MiB of DRAM
        for k, v in values.items():
            kv.put(k, v)
        store.flush()
        before = store.stats()["nvme"]["hits"]
        got = kv.batch_get(list(values))
        assert got == [bytearray(v) for v in values.values()]
        assert store.stats()["nvme"]["hits"] >= 8  # at most 4 of the 12 MiB were still in DRAM
        assert before == 0
    assert server.staging.used == 0  # given back once copied out (at the latest at close)


def test_flush_waits_for_the_nodes_offloads(served):
    store, server = served(dram="8MiB", ssd="64MiB", offload="watermark")
    with gdskv.attach(server.path) as kv:
        kv.put("a", block(20, 100_000))
        kv.flush(timeout=30)
        assert store.parts.nvme.lookup(b"a") is None  # watermark policy: nothing due yet
        store.offload(["a"])
        kv.flush()
        assert store.parts.nvme.lookup(b"a") is not None
        with pytest.raises(gdskv.InvalidValueError):
            kv.flush(timeout=-1)


def test_a_full_staging_area_sends_the_value_inline(served):
    store, server = served(dram="4MiB", ssd="64MiB", staging_bytes=1 * MiB)
    with gdskv.attach(server.path) as kv:
        values = [block(30 + i, 3 * MiB // 2) for i in range(6)]
        kv.batch_put([f"v{i}" for i in range(6)], values)
        store.flush()
        assert kv.batch_get([f"v{i}" for i in range(6)]) == [bytearray(v) for v in values]


def test_the_socket_is_private_unless_told(served, sock_dir, tmp_path):
    _, server = served()
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    store = gdskv.open(tmp_path / "other", dram="4MiB", ssd=0, dram_shared=True)
    with LocalServer(store, sock_dir / "g.sock", mode=0o660) as group:
        group.start()
        assert stat.S_IMODE(os.stat(group.path).st_mode) == 0o660
    assert not (sock_dir / "g.sock").exists()  # removed at close
    store.close()


def test_a_live_socket_is_not_taken_over_and_a_stale_one_is(served, sock_dir, tmp_path):
    _, server = served()
    other = gdskv.open(tmp_path / "other", dram="4MiB", ssd=0, dram_shared=True)
    try:
        with pytest.raises(gdskv.ConfigError, match="another node serves"):
            LocalServer(other, server.path).start()
        import socket as so

        stale = sock_dir / "stale.sock"
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.bind(str(stale))
        s.close()  # a socket file nobody listens on: a node that died
        with LocalServer(other, stale) as replacement:
            replacement.start()
            with gdskv.attach(stale) as kv:
                kv.put("x", b"1")
    finally:
        other.close()


def test_a_store_without_a_shared_arena_cannot_be_served(tmp_path, sock_dir):
    with gdskv.open(tmp_path / "private", dram="4MiB", ssd=0) as store:
        with pytest.raises(gdskv.ConfigError, match="shared DRAM arena"):
            LocalServer(store, sock_dir / "p.sock")


def test_no_node_is_a_clear_error(sock_dir):
    with pytest.raises(gdskv.NodeUnavailableError, match="no node serves"):
        gdskv.attach(sock_dir / "nobody.sock")


def test_threads_share_one_attached_store(served):
    store, server = served(dram="16MiB", ssd=0)
    kv = gdskv.attach(server.path, connections=3)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(40):
                v = block(t * 1000 + i, 20_000 + i)
                kv.put(f"t{t}-{i}", v)
                assert kv.get(f"t{t}-{i}") == v
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    assert kv.stats()["attached"]["connections"] <= 3
    kv.close()
    assert len(store) == 240


def test_a_batch_larger_than_a_quarter_of_the_arena_goes_in_rounds(served):
    store, server = served(dram="8MiB", ssd="64MiB")
    with gdskv.attach(server.path) as kv:
        values = [block(50 + i, MiB) for i in range(20)]  # 20 MiB in one call, 8 MiB of DRAM
        kv.batch_put([f"b{i}" for i in range(20)], values)
        store.flush()
        assert kv.batch_get([f"b{i}" for i in range(20)]) == [bytearray(v) for v in values]
