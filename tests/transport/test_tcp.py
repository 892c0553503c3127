"""The TCP data plane on loopback: byte-exact batches over several connections, and faults on
both sides (truncated frames, disconnects mid-transfer, oversized or malformed requests,
lying peers). Servers stay up; clients get GdskvError subclasses."""

import socket
import threading

import pytest

from conftest import block
from gdskv.errors import (
    CorruptionError,
    InvalidValueError,
    PeerDisconnectedError,
    ProtocolError,
    RemoteError,
    TransportError,
)
from gdskv.transport import ItemStatus, Limits, TcpServer, TcpTransport
from gdskv.transport.frames import (
    ITEM_REPLY,
    REQUEST,
    RESPONSE,
    Op,
    Status,
    decode_response_header,
    encode_item,
    encode_request,
    encode_response,
    value_crc,
)
from gdskv.transport.memory import MemoryProvider

KiB = 1024


@pytest.fixture
def served():
    provider = MemoryProvider()
    server = TcpServer(provider, "127.0.0.1:0", limits=Limits(max_count=1000, max_write_bytes=8 << 20), timeout_s=5)
    server.start()
    yield provider, server
    server.close()


@pytest.fixture
def transport():
    t = TcpTransport(connections=3, timeout_s=5, split_bytes=64 * KiB)
    yield t
    t.close()


def put_all(transport, address, values):
    keys = list(values)
    views = [memoryview(values[k]) for k in keys]
    return transport.write(address, keys, views, [value_crc(k, v) for k, v in zip(keys, views)])


def verify_alive(transport, server):
    transport.ping(server.address)


def test_batches_round_trip_byte_exact_over_several_connections(served, transport):
    provider, server = served
    values = {b"k%03d" % i: block(i, (i % 7 + 1) * 37 * KiB) for i in range(40)}
    assert put_all(transport, server.address, values) == [ItemStatus.OK] * 40
    keys = list(values) + [b"absent"]
    outs = [memoryview(bytearray(len(values.get(k, b"x")) + 100)) for k in keys]
    sizes = transport.read(server.address, keys, outs)
    assert sizes[-1] is None
    for k, out, n in zip(keys[:-1], outs, sizes):
        assert n == len(values[k]) and bytes(out[:n]) == values[k]
    assert server.stats()["op_read"] >= 3  # the batch went out as several requests, in parallel
    assert transport.remove(server.address, [b"k000", b"absent"]) == [True, False]
    assert transport.read(server.address, [b"k000"], [memoryview(bytearray(10))]) == [None]


def test_writes_report_per_key_outcomes(served, transport):
    provider, server = served
    put_all(transport, server.address, {b"a": b"one"})
    view = memoryview(b"two")
    assert transport.write(server.address, [b"a", b"b"], [view, view], [value_crc(b"a", view), 12345]) == [
        ItemStatus.EXISTS,
        ItemStatus.CORRUPT,
    ]


def test_a_value_larger_than_its_out_is_invalid_and_nothing_breaks(served, transport):
    provider, server = served
    put_all(transport, server.address, {b"big": block(1, 10 * KiB), b"small": b"xyz"})
    outcomes = transport.read_many([(server.address, [b"big", b"small"], [memoryview(bytearray(100))] * 2)])[0]
    assert isinstance(outcomes[0], InvalidValueError) and outcomes[1] == 3
    with pytest.raises(InvalidValueError):
        transport.read(server.address, [b"big"], [memoryview(bytearray(100))])
    verify_alive(transport, server)


def test_a_value_damaged_in_transit_is_a_corruption_error(served, transport):
    provider, server = served
    put_all(transport, server.address, {b"k": b"payload"})
    provider.values[b"k"] = b"paYload"  # the owner's bytes no longer match the checksum it sends
    with pytest.raises(CorruptionError):
        transport.read(server.address, [b"k"], [memoryview(bytearray(7))])
    transport.verify = False
    assert transport.read(server.address, [b"k"], [memoryview(bytearray(7))]) == [7]


def test_an_unreachable_peer_is_a_transport_error(transport):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(TransportError, match="cannot connect"):
        transport.read(f"127.0.0.1:{port}", [b"k"], [memoryview(bytearray(1))])


def test_a_pooled_connection_to_a_restarted_peer_is_replaced(transport):
    provider = MemoryProvider()
    first = TcpServer(provider, "127.0.0.1:0")
    first.start()
    put_all(transport, first.address, {b"k": b"v"})
    assert transport.read(first.address, [b"k"], [memoryview(bytearray(1))]) == [1]
    address = first.address
    first.close()
    second = TcpServer(provider, address)
    second.start()
    try:
        assert transport.read(address, [b"k"], [memoryview(bytearray(1))]) == [1]
        assert transport.stats().get("stale_retries", 0) >= 1
    finally:
        second.close()


# ---------------------------------------------------------------- a misbehaving client


def raw_connect(server):
    host, port = server.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_peer(sock):
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread request bytes still in its buffer
        return True


def read_response(sock, request_id=0):
    head = b""
    while len(head) < RESPONSE.size:
        chunk = sock.recv(RESPONSE.size - len(head))
        if not chunk:
            break
        head += chunk
    status, count, message_len = decode_response_header(head, request_id)
    message = sock.recv(message_len) if message_len else b""
    return status, message


def test_server_survives_truncated_requests_and_mid_request_disconnects(served, transport):
    provider, server = served
    head, body, crc = encode_request(Op.READ, 1, [b"k"], [10], [0])
    for cut in (head[:5], head, head + body[:3]):
        with raw_connect(server) as sock:
            sock.sendall(cut)
        verify_alive(transport, server)
    head, body, crc = encode_request(Op.WRITE, 2, [b"k"], [1 << 20], [0])
    with raw_connect(server) as sock:  # a writer that disconnects in the middle of its value
        sock.sendall(head + body + crc + b"x" * 1000)
    verify_alive(transport, server)
    assert b"k" not in provider.values


@pytest.mark.parametrize(
    "frame, status, pattern",
    [
        (b"JUNK" + bytes(REQUEST.size - 4), Status.BAD_REQUEST, "magic"),
        (encode_request(Op.READ, 0, [b"k"] * 1001, [1] * 1001, [0] * 1001), Status.TOO_LARGE, "too many"),
        (encode_request(Op.WRITE, 0, [b"k"], [1 << 40], [0]), Status.TOO_LARGE, "value size"),
        (encode_request(Op.WRITE, 0, [b"a", b"b"], [5 << 20, 5 << 20], [0, 0]), Status.TOO_LARGE, "too large"),
        (encode_request(Op(1), 0, [], [], []), None, None),  # a ping: fine
        (encode_request(99, 0, [b"k"], [1], [0]), Status.UNSUPPORTED, "unknown op"),
    ],
)
def test_bad_requests_get_an_error_status_then_the_connection_closes(served, transport, frame, status, pattern):
    provider, server = served
    data = frame if isinstance(frame, bytes) else b"".join(frame)
    with raw_connect(server) as sock:
        sock.sendall(data)
        got, message = read_response(sock)
        if status is None:
            assert got == Status.OK
        else:
            assert got == status and pattern in message.decode()
            assert closed_by_peer(sock)
    verify_alive(transport, server)


def test_a_corrupted_header_byte_is_refused(served, transport):
    provider, server = served
    head, body, crc = encode_request(Op.READ, 0, [b"k"], [1], [0])
    bad = bytearray(head)
    bad[12] ^= 0xFF  # request id: the header checksum no longer matches
    with raw_connect(server) as sock:
        sock.sendall(bytes(bad) + body + crc)
        got, message = read_response(sock)
    assert got == Status.BAD_REQUEST and b"checksum" in message
    verify_alive(transport, server)


def test_a_provider_failure_is_an_internal_error_status(served, transport):
    provider, server = served

    def broken(keys):
        raise RuntimeError("disk on fire")

    provider.remove = broken
    with pytest.raises(RemoteError, match="INTERNAL"):
        transport.remove(server.address, [b"k"])
    verify_alive(transport, server)


# ---------------------------------------------------------------- a misbehaving peer


class FakePeer:
    """Accepts one connection at a time and answers each request with ``reply(request_id)``;
    with ``stall``, then keeps the connection open without sending more until closed."""

    def __init__(self, reply, stall=False):
        self.reply = reply
        self.stall = threading.Event() if stall else None
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = conn.recv(REQUEST.size, socket.MSG_WAITALL)
                if len(head) < REQUEST.size:
                    continue
                body_len = int.from_bytes(head[20:28], "little")
                conn.recv(body_len, socket.MSG_WAITALL)
                request_id = int.from_bytes(head[8:16], "little")
                conn.sendall(self.reply(request_id))
                if self.stall is not None:
                    self.stall.wait(10)

    def close(self):
        if self.stall is not None:
            self.stall.set()
        self.sock.close()


def ok_item(rid, value, size=None, index=0, crc=None):
    size = len(value) if size is None else size
    crc = value_crc(b"k", value) if crc is None else crc
    return encode_response(Status.OK, rid, 1) + encode_item(ItemStatus.OK, 2, index, size, crc)


@pytest.mark.parametrize(
    "reply, error, pattern",
    [
        (lambda rid: ok_item(rid, b"x" * 4096)[:-1], PeerDisconnectedError, "item header"),  # truncated item header
        (lambda rid: ok_item(rid, b"x" * 4096) + b"x" * 1000, PeerDisconnectedError, "value"),  # disconnect mid-value
        (lambda rid: b"", PeerDisconnectedError, "response header"),
        (lambda rid: b"NOPE" + bytes(RESPONSE.size - 4), ProtocolError, "magic"),
        (lambda rid: encode_response(Status.OK, rid + 1, 1), ProtocolError, "another request"),
        (lambda rid: encode_response(Status.OK, rid, 2), ProtocolError, "item count"),
        (lambda rid: ok_item(rid, b"x" * 8192) + b"x" * 8192, ProtocolError, "more bytes than"),
        (lambda rid: ok_item(rid, b"x", index=5) + b"x", ProtocolError, "index"),
        (lambda rid: encode_response(Status.OK, rid, 1) + b"\x00" * ITEM_REPLY.size, ProtocolError, "item header checksum"),
        (lambda rid: encode_response(Status.TOO_LARGE, rid, 0, b"no thanks"), RemoteError, "TOO_LARGE"),
    ],
)
def test_a_lying_or_vanishing_peer_is_detected(reply, error, pattern):
    peer = FakePeer(reply)
    transport = TcpTransport(connections=1, timeout_s=5)
    try:
        with pytest.raises(error) as info:
            transport.read(peer.address, [b"k"], [memoryview(bytearray(4096))])
        assert pattern in str(info.value)
    finally:
        transport.close()
        peer.close()


def test_a_peer_that_stalls_mid_value_times_out():
    peer = FakePeer(lambda rid: ok_item(rid, b"x" * 4096)[:-1], stall=True)
    stalled = FakePeer(lambda rid: ok_item(rid, b"x" * 4096) + b"x" * 100, stall=True)
    transport = TcpTransport(connections=1, timeout_s=0.2)
    try:
        for p in (peer, stalled):
            with pytest.raises(TransportError, match="timed out"):
                transport.read(p.address, [b"k"], [memoryview(bytearray(4096))])
    finally:
        transport.close()
        peer.close()
        stalled.close()
