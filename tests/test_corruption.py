"""Corruption: damaged bytes on disk are reported as misses and counted, never served.

Each scenario writes a store, damages real files the way a failing disk would (a flipped
byte in a value, a record header, the padding, an index; a truncated or deleted file) and
checks that the damaged object is a miss, that the damage is counted (stats, recovery
report or check()), that every other object still reads back byte-exact, and that the
store keeps saying so across a reopen.
"""

from __future__ import annotations

import json
import os

import pytest

import gdskv
from conftest import block
from gdskv.errors import ConfigError, FormatVersionError
from gdskv.tiers.backends.record import FORMAT_VERSION, INDEX_HEADER, RECORD_HEADER, align_up
from ondisk import data_files, disk_objects, flip, index_files, locate, set_index_version, truncate

KiB = 1024
SIZES = [5000, 100 * KiB, 4096, 30 * KiB + 7, 64 * KiB, 1, 70 * KiB, 12345, 8 * KiB, 50 * KiB, 3, 90 * KiB]
VALUES = {f"k{i}": block(i, size) for i, size in enumerate(SIZES)}
OPTIONS = dict(dram="4MiB", ssd="64MiB", bucket_bytes=256 * KiB, bucket_max_age_s=0.02, promote_after_reads=0)


def open_store(path, **options):
    return gdskv.open(path, **{**OPTIONS, **options})


@pytest.fixture
def store_dir(tmp_path):
    """A closed store holding VALUES on SSD, in several buckets."""
    path = tmp_path / "store"
    with open_store(path) as store:
        for key, value in VALUES.items():
            store.put(key, value)
        store.flush()
    assert len(index_files(path)) >= 3
    return path


def bucket_mates(path, victim: str):
    """Keys that share the victim's bucket (the victim excluded)."""
    where = locate(path, victim)
    return sorted(k.decode() for k, loc in disk_objects(path).items() if loc.data == where.data and k != victim.encode())


def verify_others(store, gone):
    """Every key not in ``gone`` reads back byte-exact (get, get_into, batch); ``gone`` misses."""
    keys = sorted(VALUES)
    for key in keys:
        got = store.get(key)
        if key in gone:
            assert got is None, f"{key} should be a miss"
        else:
            assert got == VALUES[key], f"{key} read back wrong"
    outs = [bytearray(len(VALUES[k])) for k in keys]
    sizes = store.batch_get_into(keys, outs)
    for key, out, size in zip(keys, outs, sizes):
        if key in gone:
            assert size is None
        else:
            assert size == len(VALUES[key]) and out == VALUES[key]
    assert len(store) == len(VALUES) - len(gone)


# ---------------------------------------------------------------- data files


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_value_byte_is_a_counted_miss_and_the_replica_is_dropped(store_dir, where):
    victim = "k1"
    loc = locate(store_dir, victim)
    n = loc.entry.value_len
    flip(loc.data, loc.entry.value_offset + {"first": 0, "middle": n // 2, "last": n - 1}[where])
    mates = bucket_mates(store_dir, victim)
    assert mates, "the victim shares its bucket, so the test shows its neighbours survive"
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 0  # index-level verification cannot see it
        assert store.get(victim) is None
        out = bytearray(n)
        assert store.get_into(victim, out) is None  # dropped: now simply absent
        s = store.stats()
        assert s["nvme"]["corrupt_reads"] == 1 and s["gets"]["misses"] == 2
        assert not store.exists(victim)
        verify_others(store, gone={victim})
        assert store.check().ok
    with open_store(store_dir) as store:  # the drop was durable
        assert store.recovery.dropped_corrupt == 0
        verify_others(store, gone={victim})


def test_flipped_value_byte_is_dropped_at_open_with_full_verification(store_dir):
    victim = "k4"
    loc = locate(store_dir, victim)
    flip(loc.data, loc.entry.value_offset + 1000)
    with open_store(store_dir, verify_on_open="full") as store:
        assert store.recovery.dropped_corrupt == 1
        verify_others(store, gone={victim})
        assert store.stats()["nvme"]["corrupt_reads"] == 0  # never even read
    with open_store(store_dir, verify_on_open="full") as store:
        assert store.recovery.dropped_corrupt == 0
        verify_others(store, gone={victim})


@pytest.mark.parametrize(
    "field,offset",
    [
        ("magic", 0),
        ("version", 4),
        ("seq", 8),
        ("key_len", 16),
        ("value_len", 20),
        ("crc", 28),
        ("header_crc", 32),
        ("key", RECORD_HEADER.size),
    ],
)
def test_flipped_record_header_byte_is_found_by_check_and_full_verification(store_dir, field, offset):
    victim = "k7"
    loc = locate(store_dir, victim)
    flip(loc.data, loc.record_start + offset)
    with open_store(store_dir) as store:
        # Reads go by the index and verify the value, which is intact: right bytes or a miss.
        got = store.get(victim)
        assert got is None or got == VALUES[victim]
        report = store.check()
        assert report.corrupt_keys == [victim.encode()]
        assert store.stats()["nvme"]["corrupt_reads"] == 1
        assert store.get(victim) is None
        verify_others(store, gone={victim})
    with open_store(store_dir) as store:
        verify_others(store, gone={victim})
    flip(loc.data, loc.record_start + offset)  # heal the byte: the index no longer names it
    with open_store(store_dir) as store:
        assert store.get(victim) is None


def test_flipped_record_header_byte_is_dropped_at_open_with_full_verification(store_dir):
    victim = "k7"
    loc = locate(store_dir, victim)
    flip(loc.data, loc.record_start + 20)  # value_len
    with open_store(store_dir, verify_on_open="full") as store:
        assert store.recovery.dropped_corrupt == 1
        verify_others(store, gone={victim})


@pytest.mark.parametrize("where", ["after_key", "after_value"])
def test_flipped_padding_byte_harms_nothing(store_dir, where):
    victim = "k0"  # 5000 bytes: its value is followed by padding up to 8 KiB
    loc = locate(store_dir, victim)
    if where == "after_key":
        offset = loc.record_start + RECORD_HEADER.size + len(victim) + 10
    else:
        offset = loc.entry.value_offset + align_up(loc.entry.value_len) - 1
    assert offset < loc.entry.value_offset or offset >= loc.entry.value_offset + loc.entry.value_len
    flip(loc.data, offset)
    with open_store(store_dir, verify_on_open="full") as store:
        assert store.recovery.dropped_corrupt == 0
        verify_others(store, gone=set())
        assert store.check().ok  # no false alarm
        assert store.stats()["nvme"]["corrupt_reads"] == 0


def test_check_finds_and_drops_corrupt_values_of_an_open_store(store_dir):
    victims = ["k2", "k9"]
    with open_store(store_dir) as store:
        assert store.get("k5") == VALUES["k5"]  # the data files are open now
        for victim in victims:
            loc = locate(store_dir, victim)
            flip(loc.data, loc.entry.value_offset + loc.entry.value_len // 3)
        report = store.check()
        assert sorted(report.corrupt_keys) == [v.encode() for v in victims]
        assert report.nvme_objects == len(VALUES)
        assert not report.ok
        assert store.stats()["nvme"]["corrupt_reads"] == 2
        verify_others(store, gone=set(victims))
        assert store.check().ok  # dropped: the second pass is clean
    with open_store(store_dir) as store:
        verify_others(store, gone=set(victims))


def test_deleted_data_file_is_dropped_at_open(store_dir):
    victim = "k3"
    gone = {victim, *bucket_mates(store_dir, victim)}
    loc = locate(store_dir, victim)
    os.unlink(loc.data)
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 1
        assert not loc.index.exists()  # the orphaned index went with it
        verify_others(store, gone=gone)


@pytest.mark.parametrize("cut", ["last_byte", "inside_victim", "empty"])
def test_truncated_data_file_is_dropped_at_open(store_dir, cut):
    victim = "k3"
    gone = {victim, *bucket_mates(store_dir, victim)}
    loc = locate(store_dir, victim)
    size = {"last_byte": loc.data.stat().st_size - 1, "inside_victim": loc.entry.value_offset + 10, "empty": 0}[cut]
    truncate(loc.data, size)
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 1
        assert not loc.data.exists() and not loc.index.exists()
        verify_others(store, gone=gone)


def test_data_file_deleted_under_an_open_store_gives_misses_then_check_drops_the_rest(store_dir):
    victim = "k3"
    mates = bucket_mates(store_dir, victim)
    loc = locate(store_dir, victim)
    with open_store(store_dir) as store:
        os.unlink(loc.data)
        assert store.get(victim) is None
        assert store.stats()["nvme"]["read_errors"] == 1
        for key in VALUES:
            if key != victim and key not in mates:
                assert store.get(key) == VALUES[key]
        report = store.check()
        assert sorted(report.corrupt_keys) == sorted(k.encode() for k in [victim, *mates])
        verify_others(store, gone={victim, *mates})
        assert not loc.index.exists()  # the bucket's last key is gone: so is its index
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 0
        verify_others(store, gone={victim, *mates})


def test_data_file_truncated_under_an_open_store_gives_misses(store_dir):
    victim = "k3"
    loc = locate(store_dir, victim)
    entries = disk_objects(store_dir)
    cut = loc.entry.value_offset + loc.entry.value_len // 2
    mates = bucket_mates(store_dir, victim)
    past_cut = {k for k in mates if entries[k.encode()].entry.value_offset + len(VALUES[k]) > cut}
    assert past_cut and past_cut != set(mates), "neighbours on both sides of the cut"
    with open_store(store_dir) as store:
        assert store.get(victim) == VALUES[victim]  # the file is open from here on
        truncate(loc.data, cut)
        assert store.get(victim) is None
        s = store.stats()["nvme"]
        assert s["read_errors"] + s["corrupt_reads"] == 1
        verify_others(store, gone={victim, *past_cut})  # neighbours before the cut still read
        assert store.check().ok  # what failed to read was dropped already
    with open_store(store_dir) as store:
        # The index still promises bytes past the cut: the bucket is damaged. Whatever of it
        # is served must be exact; the rest of the store is untouched.
        for key in VALUES:
            got = store.get(key)
            if key in {victim, *past_cut}:
                assert got is None
            elif key in mates:
                assert got is None or got == VALUES[key]
            else:
                assert got == VALUES[key]


# ---------------------------------------------------------------- index files


@pytest.mark.parametrize(
    "offset",
    [0, 4, 8, 16, 20, 28, INDEX_HEADER.size - 1, INDEX_HEADER.size + 3, INDEX_HEADER.size + 33, -1],
    ids=["magic", "version", "bucket_id", "count", "data_len", "entries_crc", "header_crc", "entry_offset", "entry_key", "last_byte"],
)
def test_flipped_index_byte_drops_its_bucket_and_nothing_else(store_dir, offset):
    victim = "k3"
    loc = locate(store_dir, victim)
    gone = {victim, *bucket_mates(store_dir, victim)}
    flip(loc.index, offset % loc.index.stat().st_size)
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 1
        assert store.recovery.objects == len(VALUES) - len(gone)
        assert not loc.index.exists() and not loc.data.exists()
        verify_others(store, gone=gone)
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 0
        verify_others(store, gone=gone)


@pytest.mark.parametrize("cut", [0, 10, INDEX_HEADER.size, INDEX_HEADER.size + 20, -1])
def test_truncated_index_drops_its_bucket(store_dir, cut):
    victim = "k3"
    loc = locate(store_dir, victim)
    gone = {victim, *bucket_mates(store_dir, victim)}
    truncate(loc.index, cut % loc.index.stat().st_size)
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 1
        verify_others(store, gone=gone)


def test_index_copied_over_another_buckets_is_refused(store_dir):
    first, second = index_files(store_dir)[:2]
    objects = disk_objects(store_dir)
    gone = {k.decode() for k, loc in objects.items() if loc.index == second}
    second.write_bytes(first.read_bytes())  # a valid index, under the wrong name
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 1
        verify_others(store, gone=gone)


# ---------------------------------------------------------------- format versions


def test_newer_format_in_gdskv_json_is_refused_and_nothing_is_touched(store_dir):
    meta = store_dir / "gdskv.json"
    original = meta.read_text()
    doc = json.loads(original)
    doc["format_version"] = FORMAT_VERSION + 1
    meta.write_text(json.dumps(doc))
    before = sorted(p.name for p in (store_dir / "buckets").iterdir())
    with pytest.raises(FormatVersionError) as info:
        open_store(store_dir)
    assert info.value.context["got"] == FORMAT_VERSION + 1
    assert info.value.context["supported"] == FORMAT_VERSION
    assert sorted(p.name for p in (store_dir / "buckets").iterdir()) == before
    meta.write_text(original)
    with open_store(store_dir) as store:  # the refusal released the lock and kept the data
        verify_others(store, gone=set())


def test_a_file_per_key_store_records_its_layout_and_upgrades_an_older_one(tmp_path, store_dir):
    """``gdskv.json`` carries the backend's layout version (2 for ``file_per_key``'s 16 x 16
    tree, 1 for the others). A store of the older layout opens with every object (its files
    moved into the tree) and is marked 2, so that an older gdskv refuses it rather than look
    for its files where they no longer are; a newer layout is refused, nothing touched."""
    assert json.loads((store_dir / "gdskv.json").read_text())["format_version"] == 1  # bucket
    path = tmp_path / "fpk"
    with open_store(path, backend="file_per_key") as store:
        for key, value in VALUES.items():
            store.put(key, value)
        store.flush()
    meta = path / "gdskv.json"
    doc = json.loads(meta.read_text())
    assert doc["format_version"] == 2
    files = path / "files"
    for record in list(files.glob("*/*/*.rec")):  # back to the older tree, as it wrote them
        name = record.name
        old = files / name[0:2] / name[2:4] / name
        old.parent.mkdir(parents=True, exist_ok=True)
        os.replace(record, old)
    meta.write_text(json.dumps({**doc, "format_version": 1}))
    assert len(list(files.glob("??/??/*.rec"))) == len(VALUES)
    with open_store(path, backend="file_per_key") as store:
        for key, value in VALUES.items():
            assert store.get(key) == value
    assert json.loads(meta.read_text())["format_version"] == 2
    assert sorted(len(p.name) for p in files.iterdir()) == [1] * 16

    meta.write_text(json.dumps({**doc, "format_version": 3}))
    before = sorted(str(p) for p in files.rglob("*"))
    with pytest.raises(FormatVersionError) as info:
        open_store(path, backend="file_per_key")
    assert (info.value.context["supported"], info.value.context["got"]) == (2, 3)
    assert sorted(str(p) for p in files.rglob("*")) == before


def test_newer_format_in_an_index_is_refused_and_nothing_is_touched(store_dir):
    index = index_files(store_dir)[1]
    original = index.read_bytes()
    set_index_version(index, FORMAT_VERSION + 1)
    before = sorted(p.name for p in (store_dir / "buckets").iterdir())
    with pytest.raises(FormatVersionError) as info:
        open_store(store_dir)
    assert info.value.context["path"] == str(index)
    assert sorted(p.name for p in (store_dir / "buckets").iterdir()) == before
    index.write_bytes(original)
    with open_store(store_dir) as store:
        assert store.recovery.dropped_corrupt == 0
        verify_others(store, gone=set())


@pytest.mark.parametrize("text", ["", "{", '{"format": "gdskv"}', '{"format_version": "x", "backend": "bucket"}'])
def test_unreadable_gdskv_json_is_a_config_error(store_dir, text):
    (store_dir / "gdskv.json").write_text(text)
    with pytest.raises(ConfigError, match="unreadable store metadata"):
        open_store(store_dir)


def test_data_files_without_index_are_all_counted(store_dir):
    # Unsealing every bucket (as a crash between data and index would) drops everything.
    for index in index_files(store_dir):
        index.unlink()
    n = len(data_files(store_dir))
    with open_store(store_dir) as store:
        assert store.recovery.dropped_torn == n and store.recovery.objects == 0
        assert data_files(store_dir) == []
        verify_others(store, gone=set(VALUES))


# ---------------------------------------------------------------- check() and DRAM copies


@pytest.mark.parametrize("offload,origin", [("eager", "offloaded"), ("eager", "promoted"), ("watermark", "promoted")])
def test_check_dropping_a_corrupt_ssd_copy_keeps_the_good_dram_copy(tmp_path, offload, origin):
    # The object is in DRAM and on SSD (offloaded after its put, or promoted after reads);
    # its SSD copy rots. check() drops that copy, and the intact DRAM copy must not count
    # as backed by SSD any more: it is written again (at once under eager offload, at close
    # under watermark) instead of being lost at eviction or close.
    path = tmp_path / "store"
    victim = "k4"
    with open_store(path, offload=offload) as store:
        for key, value in VALUES.items():
            if origin == "promoted" or key != victim:
                store.put(key, value)
    with open_store(path, offload=offload, promote_after_reads=1) as store:
        if origin == "promoted":
            assert store.get(victim) == VALUES[victim]
            assert store.stats()["promoted"] == 1
        else:
            store.put(victim, VALUES[victim])
            store.flush()
        loc = locate(path, victim)
        flip(loc.data, loc.entry.value_offset + 7)
        report = store.check()
        assert report.corrupt_keys == [victim.encode()]
        assert store.get(victim) == VALUES[victim]  # served from DRAM
        store.flush()
        if offload == "eager":
            assert locate(path, victim).data != loc.data  # written again, in a new bucket
    with open_store(path) as store:
        verify_others(store, gone=set())
