"""The offset backend's checkpoints: a base, then deltas of what changed (checkpoints.py).

Every test takes checkpoints by writing past the window (or by closing), drops the backend
as a killed process would, and reopens: the state must be the base with its deltas applied,
a damaged or missing delta must not bring a removed key back, and a checkpoint must cost
what changed, not what is stored."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

import gdskv.tiers.backends.offset.checkpoint_log as checkpoint_log
import gdskv.tiers.backends.offset.recovery as offset_recovery
from backend_io import items
from gdskv.errors import IoError
from gdskv.tiers.backends.offset.checkpoints import (
    MAX_DELTAS,
    MIN_DELTA_BUDGET,
    Checkpoint,
    apply_delta,
    base_is_due,
    delta_files,
    encode_delta,
)
from gdskv.tiers.backends.offset import OffsetBackend
from gdskv.tiers.backends.record import IndexEntry, head_size
from offset_child import value_of
from test_offset import MiB, crash, holds_after_crash, open_backend, take_checkpoint, verify_holds

KiB = 1 << 10


def deltas(root: Path) -> List[Path]:
    return [path for _base, _n, path in delta_files(root / "offset")]


def fill(backend, prefix: str, count: int, size: int = 8 * KiB, seed: int = 0) -> Dict[str, tuple]:
    """Write ``count`` objects one batch each; returns their spec for verify_holds."""
    spec = {}
    for i in range(count):
        key = f"{prefix}{i}"
        backend.write(items({key.encode(): value_of(seed + i, size)}))
        spec[key] = (seed + i, size)
    return spec


def test_a_checkpoint_after_the_first_lists_only_what_changed(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync, capacity=32 * MiB, window_bytes=4 * MiB)
    spec = fill(backend, "old", 200)
    before = backend.counters["checkpoint_bytes"]
    take_checkpoint(backend)  # lists the 200 objects written since the base taken at open
    first = backend.counters["checkpoint_bytes"] - before
    spec.update(fill(backend, "new", 3, seed=500))
    assert backend.remove(b"old7")
    del spec["old7"]
    take_checkpoint(backend)
    second = backend.counters["checkpoint_bytes"] - before - first
    assert len(deltas(tmp_path)) == 2 and second < first / 10  # 3 added, 1 gone: not 202 objects again
    assert backend.counters["checkpoints"] == 3 and backend.counters["checkpoint_seconds"] > 0
    crash(backend)
    again = open_backend(tmp_path, direct_psync, capacity=32 * MiB, window_bytes=4 * MiB)
    verify_holds(again, spec)
    assert not deltas(tmp_path)  # the open took a base of what it found, and dropped the deltas
    again.close()


def test_evictions_overwrites_and_removals_survive_through_deltas(tmp_path, direct_psync):
    """Windows fill again and again (a delta each time), evicting the oldest objects; keys
    are overwritten and removed in between. After a crash the state is exactly what the
    backend held: nothing evicted or removed comes back, every overwrite wins."""
    kw = dict(capacity=4 * MiB, window_bytes=512 * KiB)
    backend = open_backend(tmp_path, direct_psync, **kw)
    for round_ in range(6):
        fill(backend, f"r{round_}-", 40, size=20 * KiB, seed=round_ * 100)
        backend.write(items({b"hot": value_of(round_, 12 * KiB)}))
        backend.remove(f"r{round_}-39".encode())
    assert len(deltas(tmp_path)) > 3
    held = {key.decode(): key for key in backend.keys()}
    expected = {}
    for name in held:
        if name == "hot":
            expected[name] = (5, 12 * KiB)
        else:
            round_, i = name[1:].split("-")
            expected[name] = (int(round_) * 100 + int(i), 20 * KiB)
    assert "r5-39" not in expected and "r0-0" not in expected  # removed; evicted
    holds_after_crash(backend, tmp_path, direct_psync, expected, **kw)


def test_deltas_are_folded_into_a_new_base(tmp_path, direct_psync, monkeypatch):
    monkeypatch.setattr(checkpoint_log, "base_is_due", lambda n, nbytes, base: n >= 3)
    backend = open_backend(tmp_path, direct_psync)
    bases = backend.counters["checkpoint_bases"]  # (the open's)
    spec = {}
    for i in range(3):
        spec.update(fill(backend, f"g{i}-", 2, seed=10 * i))
        take_checkpoint(backend)
    assert len(deltas(tmp_path)) == 3 and backend.layout_stats()["checkpoint_deltas"] == 3
    assert backend.counters["checkpoint_bases"] == bases
    spec.update(fill(backend, "last", 1, seed=99))
    take_checkpoint(backend)  # the fourth: a base, and the deltas go
    assert deltas(tmp_path) == [] and backend.layout_stats()["checkpoint_deltas"] == 0
    assert backend.counters["checkpoint_bases"] == bases + 1
    holds_after_crash(backend, tmp_path, direct_psync, spec)


@pytest.mark.parametrize("damage", ["flip", "delete the first", "truncate"])
def test_a_damaged_or_missing_delta_starts_empty_rather_than_resurrect(tmp_path, direct_psync, damage):
    """The base lists ``gone``; delta 2 says it was removed. Without delta 1 (or with any
    delta damaged) the state after it is unknown: recovery starts empty, as for a damaged
    base, and the data file is emptied so no old record comes back later."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"gone": value_of(1, 5000), b"kept": value_of(2, 5000)}))
    take_checkpoint(backend)
    backend.write(items({b"more": value_of(3, 5000)}))
    take_checkpoint(backend)  # delta 1
    assert backend.remove(b"gone")
    take_checkpoint(backend)  # delta 2
    crash(backend)
    found = deltas(tmp_path)
    first, second = found[0], found[-1]
    if damage == "flip":
        data = bytearray(second.read_bytes())
        data[len(data) // 2] ^= 0xFF
        second.write_bytes(bytes(data))
    elif damage == "delete the first":
        first.unlink()
    else:
        second.write_bytes(second.read_bytes()[:20])
    again = OffsetBackend(tmp_path, direct_psync, capacity=16 * MiB, window_bytes=MiB)
    report = again.recover()
    assert again.keys() == [] and report.dropped_corrupt == 1
    assert deltas(tmp_path) == []
    again.write(items({b"new": value_of(4, 5000)}))
    crash(again)
    last = open_backend(tmp_path, direct_psync)
    verify_holds(last, {"new": (4, 5000)})
    last.close()


def damage_last_delta_after_a_remove(tmp_path, direct_psync) -> None:
    """A store whose base lists ``gone`` and ``kept``; ``gone`` was removed since (its
    tombstone in a window no longer scanned: only a delta says it is gone); then the last
    delta is damaged."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"gone": value_of(1, 5000), b"kept": value_of(2, 5000)}))
    backend.close()
    backend = open_backend(tmp_path, direct_psync)  # a base listing both
    ((start, end),) = backend._window  # noqa: SLF001
    backend.write(items({b"filler": value_of(9, end - start - head_size(6))}))  # fills the base's window
    take_checkpoint(backend)  # delta 1, with a window of its own
    assert backend.remove(b"gone")
    take_checkpoint(backend)  # delta 2: "gone" gone
    take_checkpoint(backend)  # delta 3
    crash(backend)
    last = deltas(tmp_path)[-1]
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))


class Stop(BaseException):
    """A process that dies at this point."""


@pytest.mark.parametrize("how", ["it stops", "its new base fails"])
def test_an_open_cut_short_after_dropping_the_deltas_leaves_no_base_behind(tmp_path, direct_psync, monkeypatch, how):
    """The open that found a damaged delta deletes the deltas. If it then stops (here:
    before the data file is emptied) or cannot write its new base (a full disk), the next
    open must not take the old base alone for the whole state: "gone" would come back."""
    damage_last_delta_after_a_remove(tmp_path, direct_psync)
    if how == "it stops":
        failure = Stop

        def stop(engine, path, capacity, *, empty):
            raise Stop()

        monkeypatch.setattr(offset_recovery, "open_data_file", stop)
    else:
        failure = IoError

        def no_space(path, data, **kwargs):
            raise IoError("no space", path=str(path))

        monkeypatch.setattr(checkpoint_log, "write_file_atomic", no_space)
    with pytest.raises(failure):
        OffsetBackend(tmp_path, direct_psync, capacity=16 * MiB, window_bytes=MiB).recover()
    monkeypatch.undo()
    again = open_backend(tmp_path, direct_psync)
    assert b"gone" not in again.keys()
    again.close()


@pytest.mark.parametrize("where, exc", [
    ("write_file_atomic", IoError("no space", path="checkpoint")),
    ("encode_delta", MemoryError()),
    ("write_file_atomic", KeyboardInterrupt()),
], ids=["IoError", "MemoryError", "KeyboardInterrupt"])
def test_a_checkpoint_cut_short_keeps_its_changes_for_the_next(tmp_path, direct_psync, monkeypatch, where, exc):
    """A full disk, a MemoryError while encoding, an interrupt while writing: the changes
    the failed checkpoint took go into the next one. The base lists "a", its tombstone lies
    in a window no longer scanned: without them "a" (removed) comes back, and "c" (written
    into the space "a" left) is lost."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"a": value_of(1, 5000), b"b": value_of(2, 5000)}))
    take_checkpoint(backend)
    assert backend.remove(b"a")
    real = getattr(checkpoint_log, where)
    armed = [True]

    def fails_once(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_log, where, fails_once)
    with pytest.raises(type(exc)):
        take_checkpoint(backend)
    backend.write(items({b"c": value_of(3, 5000)}))
    take_checkpoint(backend)
    holds_after_crash(backend, tmp_path, direct_psync, {"b": (2, 5000), "c": (3, 5000)})


def test_deltas_of_an_earlier_base_are_never_applied(tmp_path, direct_psync):
    """A delta left from an earlier base (its deletion never reached the disk) names that
    base's watermark: a later base never takes it for its own."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"a": value_of(1, 5000)}))
    take_checkpoint(backend)
    assert backend.remove(b"a")
    take_checkpoint(backend)  # delta 1 of the base at open: "a" gone
    old = deltas(tmp_path)[0].read_bytes()
    old_name = deltas(tmp_path)[0].name
    backend.close()
    again = open_backend(tmp_path, direct_psync)  # a new base; the delta is deleted
    again.write(items({b"a": value_of(2, 5000)}))
    crash(again)
    (tmp_path / "offset" / old_name).write_bytes(old)  # as if its unlink had not landed
    last = open_backend(tmp_path, direct_psync)
    verify_holds(last, {"a": (2, 5000)})
    last.close()


def test_a_base_that_may_have_landed_is_followed_by_a_base(tmp_path, direct_psync, monkeypatch):
    """A base whose directory fsync failed may be on disk all the same, with a new
    watermark: a delta named for the old base would then be stale at the next open, and its
    changes lost. So after a failed base the next checkpoint is a base too."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"a": value_of(1, 5000), b"b": value_of(2, 5000)}))
    real = checkpoint_log.write_file_atomic
    armed = [True]

    def lands_then_fails(path, data, **kwargs):
        real(path, data, **kwargs)
        if armed[0] and path.name == "checkpoint":
            armed[0] = False
            raise IoError("directory fsync failed", path=str(path))

    monkeypatch.setattr(checkpoint_log, "write_file_atomic", lands_then_fails)
    asked = []  # the size rule asks for a base once, after delta 1; the rest are deltas

    def once(n, nbytes, base):
        asked.append(n)
        return n >= 1 and len(asked) == 2

    monkeypatch.setattr(checkpoint_log, "base_is_due", once)
    take_checkpoint(backend)  # delta 1
    with pytest.raises(IoError):
        take_checkpoint(backend)  # a base: on disk, but reported failed
    assert backend.remove(b"a")
    take_checkpoint(backend)  # must be a base: a delta of the old base would be stale
    holds_after_crash(backend, tmp_path, direct_psync, {"b": (2, 5000)})


def test_temporary_checkpoint_files_are_deleted_at_open_and_nothing_else(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.close()
    for name in ("checkpoint.tmp", "delta-0000000000000001-000001.tmp"):
        (tmp_path / "offset" / name).write_bytes(b"torn")
    for name in ("checkpoint-backup.tmp", "notes.tmp"):  # someone's files: left alone
        (tmp_path / "offset" / name).write_bytes(b"mine")
    (tmp_path / "offset" / "delta-0000000000000005-000001").mkdir()  # not a file: not a delta
    again = open_backend(tmp_path, direct_psync)
    assert sorted(p.name for p in (tmp_path / "offset").iterdir()) == [
        "checkpoint", "checkpoint-backup.tmp", "data", "delta-0000000000000005-000001", "notes.tmp",
    ]
    again.close()


def test_an_older_offset_store_is_marked_with_the_new_layout(tmp_path):
    """Stores of the first layout have no deltas and open as they are; from then on their
    gdskv.json says layout 2, so a gdskv that reads only the base refuses them."""
    import json

    import gdskv

    with gdskv.open(tmp_path / "s", dram="8MiB", ssd="16MiB", backend="offset", io_engine="psync") as store:
        store.put("k", b"v" * 5000)
        store.flush()
        store.parts.nvme._checkpoint_log.base_due = True  # noqa: SLF001  (its final checkpoint a base: the first layout's files)
    assert deltas(tmp_path / "s") == []
    meta = tmp_path / "s" / "gdskv.json"
    doc = json.loads(meta.read_text())
    assert doc["format_version"] == 2
    meta.write_text(json.dumps({**doc, "format_version": 1}))
    with gdskv.open(tmp_path / "s", dram="8MiB", ssd="16MiB", backend="offset", io_engine="psync") as store:
        assert store.get("k") == b"v" * 5000
    assert json.loads(meta.read_text())["format_version"] == 2


def test_base_is_due_after_64_deltas_or_once_they_outgrow_the_base():
    assert not base_is_due(0, 0, 10 << 20)
    assert not base_is_due(MAX_DELTAS - 1, 1 << 20, 10 << 20)
    assert base_is_due(MAX_DELTAS, 0, 10 << 20)
    assert base_is_due(2, (10 << 20) + 1, 10 << 20)  # more delta bytes than the base
    assert not base_is_due(2, MIN_DELTA_BUDGET, 1000)  # a small base: the budget's minimum
    assert base_is_due(2, MIN_DELTA_BUDGET + 1, 1000)


def one_delta() -> bytes:
    added = [IndexEntry(b"k", 4096 + 4096, 100, 7, 1234)]
    return encode_delta(5, 9, 1 << 20, added, [b"gone"], [(0, 4096)])


@pytest.mark.parametrize("damage", ["magic", "header crc", "entries", "removed keys", "length", "other base"])
def test_a_damaged_delta_is_corruption(damage):
    from gdskv.errors import CorruptionError
    from gdskv.tiers.backends.offset.checkpoints import DELTA_HEADER

    raw = bytearray(one_delta())
    base = 5
    if damage == "magic":
        raw[0:4] = b"XXXX"
    elif damage == "header crc":
        raw[DELTA_HEADER.size - 1] ^= 1
    elif damage == "entries":
        raw[DELTA_HEADER.size + 40] ^= 1
    elif damage == "removed keys":
        raw[-1] ^= 1
    elif damage == "length":
        raw = raw[: DELTA_HEADER.size + 10]
    else:
        base = 6
    checkpoint = Checkpoint(5, 1 << 20, {b"gone": IndexEntry(b"gone", 0, 1, 1, 1)}, [])
    with pytest.raises(CorruptionError):
        apply_delta(checkpoint, bytes(raw), base=base, path="delta", capacity=1 << 20)


def test_a_delta_applies_its_changes_and_a_newer_format_is_refused():
    import struct

    import crc32c

    from gdskv.errors import FormatVersionError
    from gdskv.tiers.backends.offset.checkpoints import DELTA_HEADER
    from gdskv.tiers.backends.record import FORMAT_VERSION

    checkpoint = Checkpoint(5, 1 << 20, {b"gone": IndexEntry(b"gone", 0, 1, 1, 1)}, [(0, 1 << 20)])
    apply_delta(checkpoint, one_delta(), base=5, path="delta", capacity=1 << 20)
    assert checkpoint.watermark == 9 and checkpoint.window == [(0, 4096)] and checkpoint.newest == 7
    assert list(checkpoint.objects) == [b"k"]

    raw = bytearray(one_delta())
    struct.pack_into("<H", raw, 4, FORMAT_VERSION + 1)
    struct.pack_into("<I", raw, DELTA_HEADER.size - 4, crc32c.crc32c(bytes(raw[: DELTA_HEADER.size - 4])))
    with pytest.raises(FormatVersionError):
        apply_delta(Checkpoint(5, 1 << 20, {}, []), bytes(raw), base=5, path="delta", capacity=1 << 20)


def test_a_delta_lists_its_keys_gone_as_an_index_of_keys_alone():
    """encode_keys writes what encode_index writes for entries whose fields are all 0 (the
    delta's second index), keys of every length, none at all too."""
    from gdskv.tiers.backends.record import decode_index, encode_index, encode_keys

    for keys in ([], [b"a"], [b"a", b"bb", b"a" * 300, b"ccc", b"bb"]):
        raw = encode_keys(7, keys)
        assert raw == encode_index(7, 0, [IndexEntry(key, 0, 0, 0, 0) for key in keys])
        assert [entry.key for entry in decode_index(raw)[2]] == keys
