"""A process attached to a cluster node reaches the KV of the other nodes through it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gdskv
from attach_fixtures import sock_dir  # noqa: F401 - fixture
from conftest import block

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster"))
from cluster_harness import Cluster, Proc, wait_until  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    c.start_master()
    yield c
    c.close()


def start_attachable_node(cluster: Cluster, name: str, socket: Path) -> Proc:
    proc = Proc([
        "gdskv.node", "--master", cluster.master_address, "--socket", str(socket), "--dram", "8MiB",
        "--ssd", f"{cluster.tmp / name}:64MiB", "--set", "bucket_max_age_s=0.01", "--set", "bucket_bytes=1MiB",
        "--heartbeat-s", "0.1",
    ])
    proc.wait_event("listening")
    assert proc.wait_event("attachable")["socket"] == str(socket)
    cluster.nodes[name] = proc
    return proc


def test_an_engine_on_host_b_reads_what_an_engine_on_host_a_put(cluster, sock_dir):
    start_attachable_node(cluster, "a", sock_dir / "a.sock")
    start_attachable_node(cluster, "b", sock_dir / "b.sock")
    values = {f"page-{i}": block(i, 200_000) for i in range(6)}
    with gdskv.attach(sock_dir / "a.sock") as on_a, gdskv.attach(sock_dir / "b.sock") as on_b:
        on_a.batch_put(list(values), list(values.values()))
        wait_until(lambda: all(on_b.batch_exists(list(values))), what="the master to know a's replicas")
        assert on_b.exists("page-0") and not on_b.exists("nowhere")
        out = bytearray(200_000)
        assert on_b.get_into("page-0", out) == 200_000 and out == values["page-0"]  # pulled from a
        assert on_b.batch_get(list(values)) == [bytearray(v) for v in values.values()]
        assert on_b.stats()["dram"]["objects"] == 6  # now b's own: the next read here is local
        assert on_b.stats()["local"]["pulled_from_peers"] == 6
        assert on_b.get("nowhere") is None


def test_without_a_master_in_reach_reads_are_local_only(cluster, sock_dir):
    start_attachable_node(cluster, "a", sock_dir / "a.sock")
    with gdskv.attach(sock_dir / "a.sock") as kv:
        kv.put("here", b"h" * 1000)
        cluster.master.kill9()
        assert kv.get("here") == b"h" * 1000
        assert kv.get("elsewhere") is None and kv.exists("elsewhere") is False


def test_a_remove_through_a_cluster_node_removes_the_key_everywhere(cluster, sock_dir):
    start_attachable_node(cluster, "a", sock_dir / "a.sock")
    start_attachable_node(cluster, "b", sock_dir / "b.sock")
    with gdskv.attach(sock_dir / "a.sock") as on_a, gdskv.attach(sock_dir / "b.sock") as on_b:
        on_a.put("gone", block(9, 50_000))
        wait_until(lambda: on_b.exists("gone"), what="the master to know a's replica")
        assert on_b.get("gone") == block(9, 50_000)  # now on both nodes
        assert on_b.remove("gone") is True
        assert not on_a.exists("gone") and not on_b.exists("gone")  # neither node, nor the master, lists it
        assert on_a.get("gone") is None and on_b.get("gone") is None
