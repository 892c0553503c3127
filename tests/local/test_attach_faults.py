"""Attached processes that misbehave or die, and nodes that die: real processes, SIGKILL,
hostile bytes on the socket. The node keeps serving, gives back what a dead process held,
and nothing stored changes; no partial value is ever read."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import gdskv
from attach_fixtures import node_daemon, served, sock_dir, wait_for  # noqa: F401 - fixtures
from conftest import block
from gdskv.local import protocol as p

MiB = 1 << 20


def raw_client(path) -> socket.socket:
    """A connection past the handshake, speaking the protocol by hand."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    p.send_frame(s, p.HELLO, p.HELLO_BODY.pack(p.MAGIC, p.VERSION, p.DEST_HOST))
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 2)
    for fd in fds:
        os.close(fd)
    assert data[4] == p.OK and len(fds) == 2
    return s


def reply(s: socket.socket):
    return p.FrameReader(s).read()


def keys_body(*keys: bytes) -> bytes:
    return p.COUNT.pack(len(keys)) + b"".join(p.KEY_LEN.pack(len(k)) for k in keys) + b"".join(keys)


def test_bad_requests_get_an_error_reply_and_the_connection_goes_on(served):
    store, server = served()
    store.put("kept", block(1, 5000))
    s = raw_client(server.path)
    bad = [
        (77, b""),  # an unknown operation
        (p.GET, b"\x01"),  # too short for its count
        (p.GET, p.COUNT.pack(p.MAX_ITEMS + 1)),  # too many items
        (p.GET, p.COUNT.pack(1) + p.GET_ITEM.pack(4, 10)),  # a key announced, not sent
        (p.GET, p.COUNT.pack(1) + p.GET_ITEM.pack(0, 10)),  # an empty key
        (p.GET, p.COUNT.pack(1) + p.GET_ITEM.pack(4, 10) + b"keptXX"),  # trailing bytes
        (p.GET, p.COUNT.pack(1) + p.GET_ITEM.pack(4, 10) + b"kept"),  # room smaller than the value
        (p.RESERVE, p.RESERVE_HEAD.pack(5, 0)),  # overwrite neither 0 nor 1
        (p.RESERVE, p.RESERVE_HEAD.pack(0, 1) + p.RESERVE_ITEM.pack(1, 0, 0) + b"z"),  # size 0
        (p.RESERVE, p.RESERVE_HEAD.pack(0, 1) + p.RESERVE_ITEM.pack(1, 1 << 40, 0) + b"z"),  # larger than DRAM
        (p.RESERVE, p.RESERVE_HEAD.pack(0, 1) + p.RESERVE_ITEM.pack(4, 5000, 0) + b"kept"),  # another value, no overwrite
        (p.COMMIT, p.COUNT.pack(1) + p.ID.pack(12345)),  # a slot it does not hold
        (p.STATS, b"x"),
        (p.EXISTS, p.COUNT.pack(2) + p.KEY_LEN.pack(1)),
    ]
    for op, body in bad:
        p.send_frame(s, op, body)
        code, err = reply(s)
        if code == p.OK and op == p.RESERVE:  # an item refused: no slot granted, its error after
            assert p.COUNT.unpack_from(err)[0] == 0, body
            err = err[2 * p.COUNT.size :]
        else:
            assert code == p.ERROR, (op, body)
        doc = json.loads(bytes(err))
        assert doc["type"] in ("ProtocolError", "InvalidValueError", "ValueTooLargeError", "KeyExistsError"), doc
    p.send_frame(s, p.EXISTS, keys_body(b"kept", b"nope"))  # the same connection still serves
    code, body = reply(s)
    assert (code, bytes(body)) == (p.OK, b"\x01\x00")
    s.close()
    assert store.get("kept") == block(1, 5000) and len(store) == 1
    assert server.stats()["slots"] == 0 and store.stats()["dram"]["used_bytes"] == 5056


@pytest.mark.parametrize("case", ["unknown release", "huge header", "not hello", "bad magic"])
def test_requests_that_cannot_be_answered_in_order_close_the_connection(served, case):
    store, server = served()
    store.put("kept", b"v" * 100)
    if case in ("not hello", "bad magic"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(server.path))
        if case == "not hello":
            p.send_frame(s, p.STATS)
        else:
            p.send_frame(s, p.HELLO, p.HELLO_BODY.pack(b"notgdskv", p.VERSION, 1))
    else:
        s = raw_client(server.path)
        if case == "unknown release":
            p.send_frame(s, p.RELEASE, p.COUNT.pack(1) + p.ID.pack(99))
        else:
            s.sendall(p.HEADER.pack(0xFFFFFFFF, p.GET))  # 4 GiB announced: never allocated
    reader = p.FrameReader(s)
    code, err = reader.read()
    assert code == p.ERROR and json.loads(bytes(err))["type"] == "ProtocolError"
    with pytest.raises(p.Disconnected):
        reader.read()
    s.close()
    with gdskv.attach(server.path) as kv:  # the node still serves, and holds what it held
        assert kv.get("kept") == b"v" * 100
    wait_for(lambda: server.sessions == 0, what="the sessions to end")


def test_a_client_of_another_protocol_version_is_refused_clearly(node_daemon, monkeypatch):
    node = node_daemon()
    monkeypatch.setattr(p, "VERSION", p.VERSION + 1)
    with pytest.raises(gdskv.FormatVersionError, match="attach protocol version 1, the client 2"):
        gdskv.attach(node.socket)
    monkeypatch.undo()
    with gdskv.attach(node.socket) as kv:
        kv.put("ok", b"1")


CHILD = textwrap.dedent("""
    import sys, time, numpy as np, gdskv
    sock, mode = sys.argv[1], sys.argv[2]
    kv = gdskv.attach(sock)
    def value(i, size):
        v = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
        v[:8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
        return v
    if mode == "stuck-in-put":  # reserve, copy half, never commit
        def half_then_hang(rows_conn, rows, views):
            for (kind, offset, _), view in zip(rows, views):
                rows_conn.mapping.arena[offset : offset + view.nbytes // 2] = np.frombuffer(view, np.uint8)[: view.nbytes // 2]
            print("reserved", flush=True)
            time.sleep(600)
        kv._copy_in = half_then_hang
        kv.put("partial", value(1, 1 << 20))
    elif mode == "holding-pins":
        assert kv.get("held") is not None  # its pin is given back with the next request: none comes
        print("holding", flush=True)
        time.sleep(600)
    else:  # busy: puts and gets until killed
        i = 0
        while True:
            i += 1
            kv.batch_put([f"busy-{i}-{j}" for j in range(4)], [value(i * 10 + j, 300_000 + j) for j in range(4)])
            for j in range(4):
                got = kv.get(f"busy-{i}-{j}")
                assert got is None or bytes(got) == value(i * 10 + j, 300_000 + j).tobytes()
            print(i, flush=True)
""")


def start_child(socket_path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(socket_path), mode], stdout=subprocess.PIPE, text=True)


def node_figures(kv):
    stats = kv.stats()
    return stats["dram"]["used_bytes"], stats["local"]["pins"], stats["local"]["slots"], stats["local"]["attached"]


def test_a_client_killed_in_the_middle_of_a_put_leaves_nothing(node_daemon):
    node = node_daemon(dram="8MiB", ssd="0")
    with gdskv.attach(node.socket) as kv:
        kv.put("before", b"b" * 1000)
        used_before = node_figures(kv)[0]
        child = start_child(node.socket, "stuck-in-put")
        assert child.stdout.readline().strip() == "reserved"
        used, _, slots, _ = node_figures(kv)
        assert slots == 1 and used > used_before  # the slot holds its room, and is invisible:
        assert kv.get("partial") is None and not kv.exists("partial")
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        wait_for(lambda: node_figures(kv)[1:] == (0, 0, 1), what="the node to abort the dead client's slot")
        assert node_figures(kv)[0] == used_before
        assert kv.get("partial") is None
        assert kv.get("before") == b"b" * 1000


def test_a_client_killed_while_holding_pins_gives_them_back(node_daemon):
    node = node_daemon(dram="8MiB", ssd="0")
    with gdskv.attach(node.socket) as kv:
        kv.put("held", block(2, 2 * MiB))
        child = start_child(node.socket, "holding-pins")
        assert child.stdout.readline().strip() == "holding"
        assert node_figures(kv)[1] == 1
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        wait_for(lambda: node_figures(kv)[1:] == (0, 0, 1), what="the node to release the dead client's pins")
        assert kv.remove("held")
        assert node_figures(kv)[0] == 0  # freed: no pin was left behind


def test_clients_killed_at_random_points_leave_only_whole_values(node_daemon):
    node = node_daemon(dram="4MiB", ssd="64MiB")
    import random

    rng = random.Random(5)
    for _ in range(4):
        child = start_child(node.socket, "busy")
        for _ in range(rng.randint(1, 6)):
            assert child.stdout.readline()  # some rounds of puts and gets done
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    with gdskv.attach(node.socket) as kv:
        wait_for(lambda: node_figures(kv)[1:] == (0, 0, 1), what="every dead client's session to end")
        keys = [f"busy-{i}-{j}" for i in range(1, 40) for j in range(4)]
        found = 0
        for k, got in zip(keys, kv.batch_get(keys)):
            if got is None:
                continue
            found += 1
            i, j = (int(x) for x in k.split("-")[1:])
            assert bytes(got[:8]) == (i * 10 + j).to_bytes(8, "little")
            assert len(got) == 300_000 + j
        assert found >= 4
        kv.batch_remove(keys)
        wait_for(lambda: node_figures(kv)[0] == 0, what="the arena to be empty again")


def test_a_node_that_dies_is_reported_and_attached_again_when_it_is_back(node_daemon):
    node = node_daemon(dram="8MiB", ssd="64MiB")
    kv = gdskv.attach(node.socket)
    kv.put("durable", block(3, 100_000))
    node.stop()  # SIGTERM: its DRAM objects go to SSD first
    with pytest.raises(gdskv.NodeUnavailableError):
        kv.get("durable")
    with pytest.raises(gdskv.NodeUnavailableError):
        kv.get("durable")  # still gone: each call tries again
    node.start()
    assert kv.get("durable") == block(3, 100_000)  # the same object attaches again
    kv.put("after", b"x")
    node.kill()
    with pytest.raises(gdskv.NodeUnavailableError):
        kv.put("lost?", b"y")
    node.start()  # the SIGKILLed node's SSD data is there
    assert kv.get("durable") == block(3, 100_000)
    kv.close()


def test_a_forked_child_attaches_on_its_own(served):
    store, server = served()
    kv = gdskv.attach(server.path)
    kv.put("parent", b"p")
    pid = os.fork()
    if pid == 0:  # the child: the parent's connections and mapping are not inherited
        code = 1
        try:
            kv.put("child", b"c")
            code = 0 if kv.get("parent") == b"p" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert kv.get("child") == b"c" and kv.get("parent") == b"p"
    kv.close()
