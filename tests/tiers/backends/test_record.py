"""The index encoding byte for byte, written out by hand from the format's fields: a change
to the encoder that changes a byte of what is on disk fails here."""

from __future__ import annotations

import struct

import crc32c

from gdskv.tiers.backends.record import IndexEntry, decode_index, encode_index, encode_keys


def test_an_index_is_its_header_then_each_entry_and_its_key():
    entries = [
        IndexEntry(b"k1", 4096, 65536, 7, 0xDEADBEEF),
        IndexEntry(b"", 8192, 0, 0, 0),
        IndexEntry(b"a longer key \x00\xff", 1 << 40, (1 << 33) + 5, (1 << 63) + 1, 1),
    ]
    body = b"".join(
        struct.pack("<QQQII", e.value_offset, e.value_len, e.seq, e.crc, len(e.key)) + e.key for e in entries
    )
    head = struct.pack("<4sHHQIQI", b"GKVI", 1, 0, 42, len(entries), 1 << 41, crc32c.crc32c(body))
    expected = head + struct.pack("<I", crc32c.crc32c(head)) + body
    assert encode_index(42, 1 << 41, entries) == expected
    assert encode_index(42, 1 << 41, iter(entries)) == expected  # any iterable
    assert decode_index(expected) == (42, 1 << 41, entries)
    empty = struct.pack("<4sHHQIQI", b"GKVI", 1, 0, 3, 0, 0, crc32c.crc32c(b""))
    assert encode_index(3, 0, []) == empty + struct.pack("<I", crc32c.crc32c(empty))


def test_an_index_of_keys_alone_is_an_index_of_entries_whose_other_fields_are_zero():
    keys = [b"gone-1", b"", b"gone-1", b"a much longer key \x00" * 5]
    expected = encode_index(9, 0, [IndexEntry(key, 0, 0, 0, 0) for key in keys])
    assert encode_keys(9, keys) == expected
    assert encode_keys(9, iter(keys)) == expected
    assert encode_keys(9, []) == encode_index(9, 0, [])
