"""gdskv.connect: the Store API over a cluster, with a local store (this process is a node)
and as a thin client, against a real gRPC master on 127.0.0.1:0."""

import time

import numpy as np
import pytest

import gdskv
from conftest import block
from gdskv.errors import ConfigError, InvalidValueError, KeyExistsError, NoSpaceError, StoreClosedError
from gdskv.master.config import MasterConfig
from gdskv.master.server import MasterServer

KiB = 1024


@pytest.fixture
def master():
    server = MasterServer("127.0.0.1:0", MasterConfig(lease_s=1.0, heartbeat_s=0.1))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def connect(tmp_path, master):
    """connect(name) -> a client with a local store named ``name``; connect() -> thin."""
    opened = []

    def _connect(name=None, **options):
        store = None
        if name is not None:
            store = gdskv.open(tmp_path / name, dram="2MiB", ssd="16MiB", bucket_max_age_s=0.01)
        client = gdskv.connect(master.address, local=store, heartbeat_s=0.1, **options)
        opened.append((client, store))
        if client.node is not None:
            assert client.node.wait_registered(10)
        return client

    yield _connect
    for client, store in opened:
        client.close()
        if store is not None:
            store.close()


def test_a_local_put_is_read_by_a_thin_client_and_by_another_node(connect):
    a = connect("a")
    thin = connect()
    b = connect("b")
    values = {f"k{i}": block(i, 30 * KiB) for i in range(10)}
    a.batch_put(list(values), list(values.values()))
    assert a.local.get("k3") == values["k3"]  # it went into a's own store
    for client in (thin, b, a):
        got = client.batch_get(list(values) + ["absent"])
        assert [bytes(g) for g in got[:-1]] == list(values.values()) and got[-1] is None
    out = np.zeros(30 * KiB, dtype=np.uint8)
    assert b.get_into("k0", out) == 30 * KiB and out.tobytes() == values["k0"]
    assert b.batch_get_into(["k1", "absent"], [bytearray(30 * KiB), bytearray(1)]) == [30 * KiB, None]
    assert b.stats()["client"]["remote_hits"] >= 2 and not b.local.exists("k0")


def test_a_thin_put_lands_on_the_node_with_the_most_free_dram(connect):
    big = connect("big")
    thin = connect()
    thin.put("t", b"thin value")
    assert big.local.get("t") == b"thin value"
    assert thin.get("t") == b"thin value"


def test_same_value_is_a_no_op_and_a_different_one_needs_overwrite(connect):
    a = connect("a")
    b = connect("b")
    a.put("k", b"one")
    b.put("k", b"one")  # the cluster has it already
    assert not b.local.exists("k")
    with pytest.raises(KeyExistsError):
        b.put("k", b"two")
    b.put("k", b"two", overwrite=True)
    assert a.get("k") == b"two" and not a.local.exists("k")


def test_exists_and_remove_across_clients(connect):
    a = connect("a")
    thin = connect()
    a.put("k", b"v")
    assert thin.batch_exists(["k", "absent"]) == [True, False]
    assert thin.remove("k") is True
    assert not a.local.exists("k")
    assert thin.exists("k") is False and a.exists("k") is False
    assert thin.remove("k") is False


def test_an_out_smaller_than_the_remote_value_is_invalid(connect):
    a = connect("a")
    thin = connect()
    a.put("k", block(1, 10 * KiB))
    with pytest.raises(InvalidValueError, match="smaller"):
        thin.get_into("k", bytearray(100))
    with pytest.raises(InvalidValueError):
        thin.batch_get_into(["k"], [bytearray(1), bytearray(1)])


def test_a_peer_that_vanished_is_a_clean_miss(connect, master):
    a = connect("a")
    thin = connect()
    a.put("k", b"v" * 1000)
    a.node.close(deregister=False)  # gone without a word: its lease still runs
    assert thin.get("k") is None
    assert thin.stats()["fetch"]["peer_errors"] >= 1
    deadline = time.monotonic() + 10
    while thin.exists("k") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not thin.exists("k")  # the lease ran out


def test_thin_put_without_nodes_and_bad_options(connect):
    thin = connect()
    with pytest.raises(NoSpaceError, match="no live node"):
        thin.put("k", b"v")
    with pytest.raises(ConfigError):
        connect(no_such_option=1)
    with pytest.raises(ConfigError):
        connect(connections=0)
    thin.close()
    with pytest.raises(StoreClosedError):
        thin.get("k")
