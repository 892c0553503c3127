"""Data-plane framing: round trips, and every way a frame can be malformed."""

import pytest

from gdskv.errors import ProtocolError
from gdskv.transport.frames import (
    ITEM_REPLY,
    REQUEST,
    RESPONSE,
    ItemStatus,
    Limits,
    LimitError,
    Op,
    Status,
    decode_item,
    decode_request_body,
    decode_request_header,
    decode_response_header,
    decode_statuses,
    encode_item,
    encode_request,
    encode_response,
    encode_statuses,
)

LIMITS = Limits()


def request_bytes(keys=(b"alpha", b"b"), sizes=(10, 20), crcs=(1, 2), op=Op.READ, rid=7):
    head, body, crc = encode_request(op, rid, list(keys), list(sizes), list(crcs))
    return bytearray(head), bytearray(body + crc)


def test_request_round_trip():
    head, body = request_bytes()
    op, rid, count, body_len = decode_request_header(head, LIMITS)
    assert (op, rid, count, body_len) == (Op.READ, 7, 2, len(body))
    assert decode_request_body(body, count, LIMITS) == ([b"alpha", b"b"], [10, 20], [1, 2])


@pytest.mark.parametrize("offset", range(REQUEST.size))
def test_any_flipped_header_byte_is_detected(offset):
    head, _ = request_bytes()
    head[offset] ^= 0x40
    with pytest.raises(ProtocolError):
        decode_request_header(head, LIMITS)


def test_flipped_body_bytes_and_trailing_bytes_are_detected():
    _, body = request_bytes()
    for offset in (0, 20, len(body) - 5, len(body) - 1):
        bad = bytearray(body)
        bad[offset] ^= 1
        with pytest.raises(ProtocolError, match="checksum"):
            decode_request_body(bad, 2, LIMITS)
    with pytest.raises(ProtocolError):
        decode_request_body(body, 1, LIMITS)  # the table says fewer keys than there are bytes


def test_limits_are_limit_errors():
    small = Limits(max_count=1, max_key_bytes=4)
    head, body = request_bytes(keys=(b"abcdef",), sizes=(1,), crcs=(0,))
    op, rid, count, body_len = decode_request_header(head, LIMITS)
    with pytest.raises(LimitError, match="too long"):
        decode_request_body(body, count, small)
    head, _ = request_bytes()
    with pytest.raises(LimitError, match="too many keys"):
        decode_request_header(head, small)


def test_response_and_item_headers():
    raw = encode_response(Status.OK, 9, 3)
    assert decode_response_header(raw, 9) == (Status.OK, 3, 0)
    with pytest.raises(ProtocolError, match="another request"):
        decode_response_header(raw, 10)
    bad = bytearray(raw)
    bad[0] = ord("X")
    with pytest.raises(ProtocolError, match="magic"):
        decode_response_header(bad, 9)
    assert len(raw) == RESPONSE.size
    item = encode_item(ItemStatus.OK, 2, 5, 1 << 40, 0xDEADBEEF)
    assert len(item) == ITEM_REPLY.size
    assert decode_item(item) == (ItemStatus.OK, 2, 5, 1 << 40, 0xDEADBEEF)
    bad = bytearray(item)
    bad[8] ^= 1  # the size
    with pytest.raises(ProtocolError, match="item header"):
        decode_item(bad)


def test_status_table():
    raw = encode_statuses([ItemStatus.OK, ItemStatus.MISS])
    assert decode_statuses(raw) == [0, 1]
    with pytest.raises(ProtocolError):
        decode_statuses(b"\x00\x02" + raw[2:])
