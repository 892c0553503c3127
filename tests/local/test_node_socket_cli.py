"""gdskv-node --socket as a daemon: what it prints, what it refuses, when it exits."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import gdskv
from attach_fixtures import node_daemon, sock_dir  # noqa: F401 - fixtures

NODE = [sys.executable, "-m", "gdskv.node"]


def test_a_node_needs_a_master_or_a_socket(tmp_path):
    done = subprocess.run([*NODE, "--dram", "4MiB", "--ssd", f"{tmp_path}:0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--master" in done.stderr and "--socket" in done.stderr


def test_bad_socket_options_are_refused(tmp_path, sock_dir):
    for extra in (["--socket-mode", "999"], ["--exit-when-idle", "-1"]):
        done = subprocess.run(
            [*NODE, "--socket", str(sock_dir / "n.sock"), "--dram", "4MiB", "--ssd", f"{tmp_path}:0", *extra],
            capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 2 and "error" in done.stderr, extra


def test_the_default_socket_is_in_the_store_directory(sock_dir):
    store_dir = sock_dir / "kv"  # (short: a socket path has at most 107 bytes)
    proc = subprocess.Popen([*NODE, "--socket", "--socket-mode", "660", "--dram", "4MiB", "--ssd", f"{store_dir}:16MiB"],
                            stdout=subprocess.PIPE, text=True)
    try:
        event = json.loads(proc.stdout.readline())
        assert event == {"event": "attachable", "socket": str(store_dir / "node.sock")}
        assert stat.S_IMODE(os.stat(event["socket"]).st_mode) == 0o660
        with gdskv.attach(store_dir) as kv:  # the store directory names the socket too
            kv.put("k", b"v")
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    assert not (store_dir / "node.sock").exists()
    with gdskv.open(store_dir, dram="4MiB", ssd="16MiB") as store:  # closed cleanly: on SSD
        assert store.get("k") == b"v"


def test_a_node_told_to_exit_when_idle_does_so_once_its_last_client_leaves(node_daemon):
    node = node_daemon("idle", "--exit-when-idle", "1")
    kv = gdskv.attach(node.socket)
    kv.put("k", b"v")
    time.sleep(1.6)
    assert node.proc.poll() is None  # a process is attached: not idle
    kv.close()
    assert node.proc.wait(30) == 0
    assert json.loads(node.proc.stdout.readline())["event"] == "idle"


def test_set_takes_booleans_numbers_and_words():
    from gdskv.node.cli import parse_sets

    assert parse_sets(["direct_io=false", "dram_huge_pages=on", "bucket_bytes=1048576", "put_timeout_s=2.5", "eviction=lru"]) == {
        "direct_io": False, "dram_huge_pages": True, "bucket_bytes": 1048576, "put_timeout_s": 2.5, "eviction": "lru",
    }
