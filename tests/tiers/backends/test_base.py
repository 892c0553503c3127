"""What every backend shares (``gdskv/tiers/backends/base.py``): the one rule that judges a
record read back against its index entry (:func:`verify`), and ``check()`` on every
backend x engine: what is corrupt is dropped and counted, what cannot be read for now is
kept, and nothing intact is judged."""

from __future__ import annotations

import errno
import struct

import pytest

from backend_io import every_backend, items, read, value_location  # noqa: F401 - every_backend: a fixture
from conftest import block
from gdskv.errors import CorruptionError, IoError, StoreClosedError
from gdskv.gds import make_engine
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.base import verify
from gdskv.tiers.backends.record import FORMAT_VERSION, RECORD_HEADER, IndexEntry, checksum, encode_head

KEY, VALUE, SEQ = b"key", block(3, 5000), 7
ENTRY = IndexEntry(KEY, 4096, len(VALUE), SEQ, checksum(KEY, VALUE))


def head(key: bytes = KEY, value_len: int = len(VALUE), seq: int = SEQ, crc: int = ENTRY.crc) -> bytearray:
    return bytearray(encode_head(key, value_len, seq, crc))


def test_an_intact_record_verifies():
    assert verify(head(), memoryview(VALUE), ENTRY, path="p", offset=0) is None


@pytest.mark.parametrize(
    "record, value, why",
    [
        (head(key=b"kez"), VALUE, "another key"),
        (head(seq=SEQ + 1), VALUE, "disagrees with the index"),
        (head(value_len=len(VALUE) - 1), VALUE[:-1], "disagrees with the index"),
        (head(crc=ENTRY.crc ^ 1), VALUE, "disagrees with the index"),
        (head(), VALUE[:-1], "shorter than its index"),
        (head(), VALUE[:-1] + b"\x00", "value checksum mismatch"),
        (bytearray(b"GKVX") + head()[4:], VALUE, "bad record magic"),
        (head()[:20], VALUE, "truncated record header"),
    ],
    ids=["key", "seq", "length", "crc", "short value", "value", "magic", "truncated"],
)
def test_each_disagreement_is_a_corruption_error_with_its_context(record, value, why):
    with pytest.raises(CorruptionError, match=why) as info:
        verify(record, memoryview(value), ENTRY, path="the/file", offset=8192)
    assert info.value.context["path"] == "the/file" and info.value.context["offset"] == 8192


def test_a_record_of_a_newer_format_than_its_index_is_corrupt():
    record = head()
    fields = list(RECORD_HEADER.unpack_from(record))
    fields[1] = FORMAT_VERSION + 1
    packed = struct.pack("<4sHHQIQI", *fields[:-1])
    import crc32c

    RECORD_HEADER.pack_into(record, 0, *fields[:-1], crc32c.crc32c(packed))
    with pytest.raises(CorruptionError, match="newer format") as info:
        verify(record, memoryview(VALUE), ENTRY)
    assert info.value.context["got"] == FORMAT_VERSION + 1


@pytest.fixture
def backend(every_backend):
    return every_backend


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


STORED = {f"k{i}".encode(): block(i, 3000 + 1000 * i) for i in range(6)}


def test_check_drops_and_counts_only_what_is_corrupt(backend):
    backend.write(items(STORED))
    flip(*value_location(backend, b"k2"))
    header_path, value_offset = value_location(backend, b"k4")
    flip(header_path, value_offset - 4096 + RECORD_HEADER.size + 1)  # its key, in the head block
    assert sorted(backend.check()) == [b"k2", b"k4"]
    assert backend.stats()["corrupt_reads"] == 2 and backend.lookup(b"k2") is None and backend.lookup(b"k4") is None
    assert all(read(backend, k, len(v)) == v for k, v in STORED.items() if k not in (b"k2", b"k4"))
    assert backend.check() == [] and backend.stats()["corrupt_reads"] == 2


def test_check_reads_through_the_engine_and_keeps_what_it_cannot_read_for_now(backend, monkeypatch):
    backend.write(items(STORED))
    flip(*value_location(backend, b"k2"))
    seen = []
    real = backend.engine.submit

    def out_of_descriptors(requests):
        seen.extend(requests)
        raise IoError("read failed", path=requests[0].path, errno=errno.EMFILE)

    monkeypatch.setattr(backend.engine, "submit", out_of_descriptors)
    assert backend.check() == []  # not judged, not even the corrupt one
    assert len(seen) == len(STORED) and backend.stats()["corrupt_reads"] == 0 and len(backend) == len(STORED)
    monkeypatch.setattr(backend.engine, "submit", real)
    assert backend.check() == [b"k2"]


def test_check_judges_a_record_that_cannot_be_read_at_all(backend, monkeypatch):
    backend.write(items({b"k0": STORED[b"k0"]}))
    monkeypatch.setattr(backend.engine, "submit", lambda requests: (_ for _ in ()).throw(IoError("read failed", errno=errno.EIO)))
    assert backend.check() == [b"k0"] and len(backend) == 0


def test_check_after_close_is_a_store_closed_error(backend):
    backend.write(items({b"k0": STORED[b"k0"]}))
    backend.close()
    with pytest.raises(StoreClosedError):
        backend.check()


def test_a_full_verification_at_open_drops_a_corrupt_record(backend, tmp_path):
    backend.write(items(STORED))
    flip(*value_location(backend, b"k3"))
    backend.close()
    engine = make_engine(backend.engine.name, direct=True)
    again = make_backend(backend.name, tmp_path, engine, capacity=64 << 20, verify_on_open="full")
    report = again.recover()
    assert report.dropped_corrupt == 1 and b"k3" not in again and len(again) == len(STORED) - 1
    assert all(read(again, k, len(v)) == v for k, v in STORED.items() if k != b"k3")
    again.close()
    engine.close()


@pytest.mark.parametrize("name", ["bucket", "file_per_key"])
def test_a_write_that_no_eviction_can_make_room_for_evicts_nothing(tmp_path, direct_psync, name):
    """With the rest of the cap reserved by writes in flight, a write fails with
    NoSpaceError before it evicts anything: the victims are chosen first, in one place."""
    from gdskv.errors import NoSpaceError
    from gdskv.tiers.backends.record import record_size

    capacity = 8 * record_size(2, 5000)
    be = make_backend(name, tmp_path, direct_psync, capacity=capacity)
    be.recover()
    heard = []
    be.evict_listener = heard.extend
    be.write(items({b"k0": STORED[b"k0"]}))
    be.write(items({b"k1": STORED[b"k1"]}))
    reserved = capacity - 3 * record_size(2, 4000)  # k0 and k1 take one each: one is free
    with be._lock:
        be._used += reserved  # by writes in flight
    with pytest.raises(NoSpaceError, match="in-flight writes"):
        be.write(items({b"k2": block(9, 40_000)}))  # more than the free one and both victims
    assert heard == [] and sorted(be.keys()) == [b"k0", b"k1"]
    assert read(be, b"k0", len(STORED[b"k0"])) == STORED[b"k0"]
    be.write(items({b"k2": block(9, 5000)}))  # this one fits once the oldest goes
    assert heard == [b"k0"] and sorted(be.keys()) == [b"k1", b"k2"]
    with be._lock:
        be._used -= reserved
    be.close()
