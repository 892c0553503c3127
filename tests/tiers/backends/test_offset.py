"""The offset backend: one preallocated file, checkpoint + window recovery, object eviction."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

from backend_io import items, read
from conftest import block
from gdskv.errors import NoSpaceError
from gdskv.tiers.backends.offset import OffsetBackend
from offset_child import value_of

MiB = 1 << 20
CHILD = Path(__file__).with_name("offset_child.py")


def open_backend(root, direct_psync, **kw) -> OffsetBackend:
    kw.setdefault("capacity", 16 * MiB)
    kw.setdefault("window_bytes", 1 * MiB)
    backend = OffsetBackend(root, direct_psync, **kw)
    backend.recover()
    return backend


def crash(backend: OffsetBackend) -> None:
    """Drop a backend without its final checkpoint, as a killed process would."""
    os.close(backend._fd)  # noqa: SLF001
    backend._fd = None  # noqa: SLF001
    backend._closed = True  # noqa: SLF001


def take_checkpoint(backend: OffsetBackend) -> None:
    with backend._wlock:  # noqa: SLF001
        backend._checkpoint([])  # noqa: SLF001


def holds_after_crash(backend: OffsetBackend, root, direct_psync, expected: "Spec", **kw) -> None:
    """Drop ``backend`` as a killed process would, reopen ``root`` (``kw`` as for
    :func:`open_backend`) and check that it holds exactly ``expected``."""
    crash(backend)
    again = open_backend(root, direct_psync, **kw)
    try:
        verify_holds(again, expected)
    finally:
        again.close()


def test_the_file_is_preallocated(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    st = os.stat(backend.data_path)
    assert st.st_size == 16 * MiB
    assert st.st_blocks * 512 >= 16 * MiB  # space reserved, not a sparse file
    backend.close()


def test_writes_after_the_checkpoint_are_found_by_the_window_scan(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    values = {f"w{i}".encode(): block(i, 1000 + 4321 * i) for i in range(12)}
    backend.write(items(values))
    checkpoints = backend.counters["checkpoints"]
    crash(backend)

    again = open_backend(tmp_path, direct_psync)
    assert len(again) == len(values)
    for key, value in values.items():
        assert read(again, key, len(value)) == value
    assert checkpoints == 1  # only the one at open: every record above came from the scan
    again.close()


def test_a_full_window_takes_a_new_checkpoint(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    first = backend.counters["checkpoints"]
    values = {f"big{i}".encode(): block(50 + i, 300_000) for i in range(8)}  # 2.4 MiB > 1 MiB window
    for key, value in values.items():
        backend.write(items({key: value}))
    assert backend.counters["checkpoints"] > first
    crash(backend)
    again = open_backend(tmp_path, direct_psync)
    assert sorted(again.keys()) == sorted(values)
    again.close()


def test_removal_is_durable_through_a_tombstone(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    values = {b"keep": block(1, 5000), b"gone": block(2, 7000)}
    backend.write(items(values))
    backend.close()  # both in the checkpoint now
    backend = open_backend(tmp_path, direct_psync)
    assert backend.remove(b"gone")
    assert backend.counters["tombstones"] == 1
    crash(backend)  # the checkpoint still lists "gone": only the tombstone says otherwise
    again = open_backend(tmp_path, direct_psync)
    assert again.keys() == [b"keep"]
    crash(again)
    assert open_backend(tmp_path, direct_psync).keys() == [b"keep"]


def test_an_overwrite_wins_after_reopen(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": b"old value"}))
    backend.write(items({b"k": b"new value, longer"}))
    crash(backend)
    again = open_backend(tmp_path, direct_psync)
    assert read(again, b"k", 100) == b"new value, longer"
    again.close()


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_object_level_eviction_order(tmp_path, direct_psync, policy):
    backend = open_backend(tmp_path, direct_psync, capacity=4 * MiB, window_bytes=MiB // 2, eviction=policy)
    values = {f"o{i:02d}".encode(): block(i, 400_000) for i in range(12)}  # ~4.7 MiB through 4 MiB
    keys = list(values)
    for key in keys[:6]:
        backend.write(items({key: values[key]}))
    read(backend, keys[0], 400_000)  # a read makes o00 the most recent under LRU
    evicted = []
    for key in keys[6:]:
        evicted += backend.write(items({key: values[key]}))
    assert backend.used_bytes <= backend.capacity
    assert evicted and all(k not in backend for k in evicted)
    if policy == "fifo":
        assert keys[0] in evicted
    else:
        assert keys[0] not in evicted and keys[1] in evicted
    for key in backend.keys():
        assert read(backend, key, 400_000) == values[key]
    backend.close()


def test_a_checkpoint_evicts_only_what_the_batch_and_a_window_need(tmp_path, direct_psync):
    """In a full file, each batch that takes a checkpoint evicts the oldest objects until the
    batch fits and a window is free after it, and no more: what stays is the rest."""
    capacity, window, size = 4 * MiB, MiB // 2, 60_000  # records of 64 KiB
    backend = open_backend(tmp_path, direct_psync, capacity=capacity, window_bytes=window)
    record = 64 << 10
    for b in range(12):  # 12 batches of 8 records (512 KiB each) through a 4 MiB file
        values = {f"b{b}-{i}".encode(): block(100 * b + i, size) for i in range(8)}
        backend.write(items(values))
        assert backend.used_bytes <= capacity
        if b >= 8:  # the file has filled up: only the batch and a window's worth are freed
            assert backend.used_bytes >= capacity - window - record, (b, backend.used_bytes)
    assert len(backend) >= (capacity - window) // record - 1
    for key in backend.keys():
        assert read(backend, key, size) is not None
    backend.close()


def test_a_torn_record_in_the_window_is_dropped(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"whole": block(1, 9000), b"torn": block(2, 9000)}))
    entry = backend._objects[b"torn"]  # noqa: SLF001
    crash(backend)
    with open(tmp_path / "offset" / "data", "r+b") as f:  # the value never reached the disk
        f.seek(entry.value_offset)
        f.write(bytes(9000))
    again = open_backend(tmp_path, direct_psync)
    assert again.keys() == [b"whole"]
    again.close()


def test_a_corrupt_value_is_a_miss_and_is_dropped(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(3, 50_000)}))
    backend.close()
    backend = open_backend(tmp_path, direct_psync)
    with open(tmp_path / "offset" / "data", "r+b") as f:
        f.seek(backend._objects[b"k"].value_offset + 100)  # noqa: SLF001
        f.write(b"\xff\xfe")
    assert read(backend, b"k", 50_000) is None
    assert backend.counters["corrupt_reads"] == 1 and b"k" not in backend
    backend.close()


def test_an_unreadable_checkpoint_starts_empty_rather_than_resurrect(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"a": block(4, 3000)}))
    backend.close()
    with open(tmp_path / "offset" / "checkpoint", "r+b") as f:
        f.seek(40)
        f.write(b"garbage")
    again = OffsetBackend(tmp_path, direct_psync, capacity=16 * MiB, window_bytes=MiB)
    report = again.recover()
    assert report.dropped_corrupt == 1 and len(again) == 0
    again.write(items({b"b": b"still works"}))
    assert read(again, b"b", 20) == b"still works"
    again.close()


def test_a_batch_larger_than_the_file_is_refused(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync, capacity=2 * MiB, window_bytes=MiB)
    with pytest.raises(NoSpaceError) as info:
        backend.write(items({b"huge": bytes(3 * MiB)}))
    assert info.value.context["capacity"] == 2 * MiB
    backend.close()


def test_preallocation_on_a_full_filesystem_is_a_clear_error(tiny_fs, direct_psync):
    with pytest.raises(NoSpaceError) as info:
        OffsetBackend(tiny_fs, direct_psync, capacity=64 * MiB).recover()
    assert info.value.context["path"].startswith(str(tiny_fs))


def test_reads_see_bytes_through_numpy_outputs(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync)
    value = block(9, 123_457)
    backend.write(items({b"np": value}))
    out = np.zeros(200_000, dtype=np.uint8)
    assert backend.read_batch([(b"np", memoryview(out))]) == [len(value)]
    assert out[: len(value)].tobytes() == value
    backend.close()


def test_close_waits_for_a_read_in_flight(tmp_path, direct_psync):
    import threading

    from gdskv.gds.engine import IoEngine

    class Gated(IoEngine):
        """Holds reads until released: a read stays in flight while close() runs."""

        def __init__(self, inner):
            super().__init__(direct=inner.direct)
            self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

        def open_file(self, path, flags, mode=0o644):
            return self.inner.open_file(path, flags, mode)

        def submit(self, requests):
            if requests and requests[0].op.value == "read" and not self.release.is_set():
                self.entered.set()
                self.release.wait()
            return self.inner.submit(requests)

        def close(self):
            pass

    gated = Gated(direct_psync)
    gated.release.set()
    backend = open_backend(tmp_path, gated)
    value = block(11, 70_000)
    backend.write(items({b"k": value}))
    gated.release.clear()
    got = []
    reader = threading.Thread(target=lambda: got.append(read(backend, b"k", 70_000)))
    reader.start()
    gated.entered.wait()
    backend.close()  # the read holds its record: the file stays open until it is done
    assert backend._fd is not None  # noqa: SLF001
    gated.release.set()
    reader.join()
    assert got == [value] and backend._fd is None  # noqa: SLF001


def test_the_evict_listener_hears_of_each_victim_before_it_goes(tmp_path, direct_psync):
    backend = open_backend(tmp_path, direct_psync, capacity=4 * MiB, window_bytes=MiB // 2)
    heard: List[bytes] = []

    def listener(keys):
        # Called with the lock held, while the victims are still there.
        assert backend._lock.locked() and all(k in backend for k in keys)  # noqa: SLF001
        heard.extend(keys)

    backend.evict_listener = listener
    evicted = []
    for i in range(12):
        evicted += backend.write(items({f"k{i}".encode(): block(i, 500_000)}))
    assert evicted and heard == evicted
    backend.close()


# --------------------------------------------------------------------------- crashes
# A child process (offset_child.py) opens the backend, runs steps and is killed with
# SIGKILL; the files it leaves are reopened here, or by the next child.

Spec = Dict[str, Tuple[int, int]]  # key -> (seed, size) of its value (see offset_child.value_of)


def run_child(path, steps: list, *, capacity: int = 16 * MiB, window_bytes: int = MiB) -> List[str]:
    """Run offset_child.py on ``path`` through ``steps``, SIGKILL it once it says ``ready``
    (or ``tearing``), and return the lines it printed before."""
    options = {"path": str(path), "capacity": capacity, "window_bytes": window_bytes, "steps": steps}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(options)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: List[str] = []
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            if line.strip() in ("ready", "tearing"):
                proc.send_signal(signal.SIGKILL)
                break
            lines.append(line.rstrip())
        proc.kill()  # no-op once killed; ends a child that stopped early
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and "Traceback" not in "\n".join(lines), lines
    return lines


def recovered(lines: List[str]) -> dict:
    return json.loads(next(line for line in lines if line.startswith("recovered "))[len("recovered "):])


def heard(lines: List[str]) -> List[str]:
    return [key for line in lines if line.startswith("heard ") for key in line.split()[1:]]


def verify_holds(backend: OffsetBackend, expected: Spec) -> None:
    """The backend holds exactly ``expected``, byte-exact."""
    assert sorted(backend.keys()) == sorted(k.encode() for k in expected)
    for key, (seed, size) in expected.items():
        assert read(backend, key.encode(), size) == value_of(seed, size), key


def test_writes_after_a_recovery_outrank_what_it_found(tmp_path, direct_psync):
    """Each session recovers from the last one's SIGKILL (its records found only by the
    window scan), overwrites ``k`` and removes the last session's key. Its writes and
    tombstones are numbered above the records recovery found, so the next recovery applies
    them: neither the old value nor the removed key comes back."""
    must: Spec = {}
    for r in range(4):
        steps: list = [["expect", must]]
        steps.append(["write", {"k": (r, 5000), f"x{r}": (100 + r, 7000)}])
        if r:
            steps.append(["remove", f"x{r - 1}"])
        out = run_child(tmp_path, steps)
        assert "expect ok" in out, (r, out)
        assert r == 0 or "removed True" in out
        must = {"k": (r, 5000), f"x{r}": (100 + r, 7000)}
    again = open_backend(tmp_path, direct_psync)
    verify_holds(again, must)
    again.close()


def test_a_torn_record_is_counted_once_and_numbered_past(tmp_path, direct_psync):
    """A record whose header reached the disk but not its value is dropped at the first
    recovery, whose watermark then covers its number: later recoveries skip it."""
    out = run_child(tmp_path, [["write", {"whole": (1, 9000)}], ["tear", {"torn": (2, 9000)}]])
    assert "wrote" in out
    out = run_child(tmp_path, [["expect", {"whole": (1, 9000)}]])
    assert "expect ok" in out and recovered(out)["dropped_torn"] == 1
    again = OffsetBackend(tmp_path, direct_psync, capacity=16 * MiB, window_bytes=MiB)
    assert again.recover().dropped_torn == 0
    verify_holds(again, {"whole": (1, 9000)})
    again.close()


@pytest.mark.parametrize("damage", ["damaged", "missing"])
def test_without_a_checkpoint_old_records_stay_gone(tmp_path, direct_psync, damage):
    """With its checkpoint damaged or missing, recovery starts empty and empties the data
    file: the new records restart at sequence number 1, and a later window scan must not
    take the old ones (a removed key, a superseded value) for newer ones."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": block(1, 5000), b"removed": block(2, 5000), b"old": block(3, 5000)}))
    backend.write(items({b"k": block(4, 5000)}))
    assert backend.remove(b"removed")
    backend.close()
    checkpoint = tmp_path / "offset" / "checkpoint"
    if damage == "damaged":
        data = bytearray(checkpoint.read_bytes())
        data[40] ^= 0xFF
        checkpoint.write_bytes(data)
    else:
        checkpoint.unlink()
    out = run_child(tmp_path, [["expect", {}], ["write", {"new": (5, 3000)}]])
    assert "expect ok" in out and recovered(out)["dropped_corrupt"] == (damage == "damaged")
    for _ in range(2):  # after the SIGKILL, then after a clean close
        again = open_backend(tmp_path, direct_psync)
        verify_holds(again, {"new": (5, 3000)})
        again.close()


def test_a_checkpoint_that_cannot_be_read_fails_the_open_and_touches_nothing(tmp_path, direct_psync):
    """Only a damaged or missing checkpoint empties the data file; one that cannot be read
    now (here: a directory in its place) may be readable later, so the open fails."""
    from gdskv.errors import IoError

    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"k": value_of(1, 5000)}))
    backend.close()
    checkpoint = tmp_path / "offset" / "checkpoint"
    saved = checkpoint.read_bytes()
    data = tmp_path / "offset" / "data"
    before = data.read_bytes()
    checkpoint.unlink()
    checkpoint.mkdir()
    with pytest.raises(IoError):
        open_backend(tmp_path, direct_psync)
    assert data.read_bytes() == before
    checkpoint.rmdir()
    checkpoint.write_bytes(saved)
    again = open_backend(tmp_path, direct_psync)
    verify_holds(again, {"k": (1, 5000)})
    again.close()


def test_a_kill_while_a_batch_checkpoints_loses_nothing_acknowledged(tmp_path, direct_psync):
    """The process dies while the checkpoint of a batch that evicts is written, after every
    write submitted before it has landed: the checkpoint on disk still lists the objects the
    new one evicts, so nothing may have been written into their space yet. Everything
    acknowledged is there, byte-exact; of the batch (its write never returned) only whole
    records can come back."""
    capacity = 4 * MiB
    acknowledged: Spec = {}
    backend = open_backend(tmp_path, direct_psync, capacity=capacity, window_bytes=MiB // 2)
    for b in range(6):  # 6 batches of 8 records of 64 KiB: 3 MiB of the 4
        batch = {f"a{b}-{i}": (100 * b + i, 60_000) for i in range(8)}
        backend.write(items({k.encode(): value_of(*spec) for k, spec in batch.items()}))
        acknowledged.update(batch)
    backend.close()
    batch = {f"new-{i}": (1000 + i, 60_000) for i in range(24)}  # 1.5 MiB, 1 MiB free: it evicts
    out = run_child(tmp_path, [["hang_checkpoints"], ["write", batch]], capacity=capacity, window_bytes=MiB // 2)
    assert "wrote" not in out and heard(out)  # killed inside the write, after evicting
    again = open_backend(tmp_path, direct_psync, capacity=capacity, window_bytes=MiB // 2)
    try:
        keys = {key.decode() for key in again.keys()}
        assert set(acknowledged) <= keys <= set(acknowledged) | set(batch)
        verify_holds(again, {key: acknowledged.get(key) or batch[key] for key in keys})
    finally:
        again.close()


def test_a_failed_checkpoint_leaves_this_epochs_tombstone_alone(tmp_path, direct_psync):
    """A checkpoint frees the space of this epoch's tombstones before it is written. When
    writing it fails, the checkpoint on disk still lists the removed key and needs the
    tombstone: the next write must not land on it, or the key comes back after a crash."""
    backend = open_backend(tmp_path, direct_psync)
    for i, key in enumerate([b"A", b"K", b"B"]):
        backend.write(items({key: value_of(i, 5000)}))
    backend.close()  # A, K, B listed in the checkpoint
    out = run_child(tmp_path, [
        ["remove", "K"],  # a tombstone in the window
        ["fail_checkpoints", 1],
        ["write_fails", {"big": (9, 3 << 19)}],  # larger than the window: a checkpoint, which fails
        ["write", {"C": (7, 12288)}],
    ])
    assert "removed True" in out and "failed IoError" in out and "wrote" in out
    again = open_backend(tmp_path, direct_psync)
    verify_holds(again, {"A": (0, 5000), "B": (2, 5000), "C": (7, 12288)})
    again.close()


def test_removing_a_key_whose_eviction_is_not_durable_yet_makes_it_durable(tmp_path, direct_psync):
    """A checkpoint evicts A and B, then cannot be written: the checkpoint on disk still
    lists them. A remove of A then takes a checkpoint (there is nothing in the index to put
    a tombstone against), or A comes back after a crash though remove() returned."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"A": value_of(1, 5000), b"B": value_of(2, 5000)}))
    backend.close()  # A and B listed in the checkpoint
    out = run_child(tmp_path, [
        ["fail_checkpoints", 1],
        ["write_fails", {"big": (9, 15 * MiB)}],  # evicts A and B, then its checkpoint fails
        ["remove", "A"],
    ])
    assert "failed IoError" in out and sorted(heard(out)) == ["A", "B"]
    assert "removed True" in out
    again = open_backend(tmp_path, direct_psync)
    assert b"A" not in again.keys()
    again.close()


def test_a_failed_remove_is_found_again_by_the_next_one(tmp_path, direct_psync):
    """The tombstone write fails and so does the checkpoint after it: remove() raises, and
    the checkpoint on disk still lists K. The next remove() of K must make that durable
    (before: it found nothing in the index, returned False, and K came back at reopen)."""
    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"K": value_of(1, 5000), b"A": value_of(2, 5000)}))
    backend.close()
    out = run_child(tmp_path, [
        ["fail_writes", 1],
        ["fail_checkpoints", 1],
        ["remove", "K"],
        ["remove", "K"],
        ["remove", "K"],
    ])
    assert out[-3:] == ["remove failed IoError", "removed True", "removed False"], out
    again = open_backend(tmp_path, direct_psync)
    verify_holds(again, {"A": (2, 5000)})
    again.close()


def test_a_checkpoint_without_room_leaves_this_epochs_records_alone(tmp_path, direct_psync):
    """A checkpoint that evicts and then finds no room (a read pins a record, which is not
    evicted: that would free nothing now) raises NoSpaceError with the old checkpoint still
    in force: the evicted keys are reported to the listener, and no later write may land on
    a record of this epoch (here an acknowledged overwrite of K), or the old value of K is
    served after a crash."""
    capacity = 8 * MiB
    backend = open_backend(tmp_path, direct_psync, capacity=capacity)
    backend.write(items({b"P": value_of(1, 1_990_000)}))
    backend.write(items({b"F": value_of(2, 1_500_000)}))
    backend.write(items({b"K": value_of(3, 5000)}))  # K v1, high in the file
    assert backend.remove(b"F")
    backend.close()  # lists P and K v1; the window is low in the file, where F was
    out = run_child(tmp_path, [
        ["write", {"K": (4, 5000)}],  # K v2, in the window
        ["pin", "P", 1_990_000],
        ["write_fails", {"big": (5, 7_000_000)}],  # evicts K (P is pinned: it stays), then gives up
        ["unpin"],
        ["write", {"C": (6, 20000)}],
    ], capacity=capacity)
    assert "failed NoSpaceError" in out and "wrote" in out
    assert sorted(heard(out)) == ["K"]
    again = open_backend(tmp_path, direct_psync, capacity=capacity)
    verify_holds(again, {"P": (1, 1_990_000), "C": (6, 20000)})
    again.close()


def test_a_window_that_cannot_be_read_fails_the_open_and_touches_nothing(tmp_path, direct_psync):
    """The window holds what was acknowledged after the checkpoint, tombstones included. A
    scan that skipped an extent it cannot read (EIO) would bring a removed key back and
    lose acknowledged writes; the open fails instead, and a later open (the disk readable
    again) finds everything."""
    from gdskv.errors import IoError
    from gdskv.gds.faulty import FaultyEngine

    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"A": value_of(1, 5000), b"K": value_of(2, 5000)}))
    backend.close()  # A and K listed in the checkpoint
    out = run_child(tmp_path, [["remove", "K"], ["write", {"C": (3, 7000)}]])  # both in the window
    assert "removed True" in out
    checkpoint = tmp_path / "offset" / "checkpoint"
    data = tmp_path / "offset" / "data"
    before = (checkpoint.read_bytes(), data.read_bytes())
    faulty = FaultyEngine(direct_psync)
    faulty.inject("eio", path_contains="offset/data")
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(IoError):
        OffsetBackend(tmp_path, faulty, capacity=16 * MiB, window_bytes=MiB).recover()
    assert (checkpoint.read_bytes(), data.read_bytes()) == before
    assert len(os.listdir("/proc/self/fd")) == fds  # the data file was closed again
    again = open_backend(tmp_path, direct_psync)
    verify_holds(again, {"A": (1, 5000), "C": (3, 7000)})
    again.close()


def test_an_open_interrupted_during_recovery_leaves_the_store_as_it_was(tmp_path, direct_psync, monkeypatch):
    """Ctrl-C (or any other exception) while the index is rebuilt: the open fails and the
    backend's close(), which the store calls on that path, writes no checkpoint of the
    half-built index (that would drop every object)."""
    import gdskv.tiers.backends.offset.recovery as offset_recovery

    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"A": value_of(1, 5000), b"K": value_of(2, 7000)}))
    backend.close()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(offset_recovery, "scan_window", interrupted)
    half = OffsetBackend(tmp_path, direct_psync, capacity=16 * MiB, window_bytes=MiB)
    with pytest.raises(KeyboardInterrupt):
        half.recover()
    half.close()
    monkeypatch.undo()
    again = open_backend(tmp_path, direct_psync)
    verify_holds(again, {"A": (1, 5000), "K": (2, 7000)})
    again.close()


def test_a_smaller_capacity_is_refused_and_touches_nothing(tmp_path, direct_psync):
    """Records past a smaller end would be lost, tombstones among them (a removed key could
    come back): the open fails with ConfigError, and the store opens again as it was, with
    its capacity or more."""
    from gdskv.errors import ConfigError

    backend = open_backend(tmp_path, direct_psync, capacity=16 * MiB)
    backend.write(items({f"k{i}".encode(): value_of(i, 1 * MiB) for i in range(12)}))
    backend.close()
    files = {p.name: p.read_bytes() for p in (tmp_path / "offset").iterdir()}
    assert OffsetBackend.stored_capacity(tmp_path) == 16 * MiB
    for smaller in (4 * MiB, 15 * MiB):
        with pytest.raises(ConfigError, match="cannot shrink") as info:
            open_backend(tmp_path, direct_psync, capacity=smaller)
        assert info.value.context["stored"] == 16 * MiB and info.value.context["requested"] == smaller
        assert {p.name: p.read_bytes() for p in (tmp_path / "offset").iterdir()} == files
    larger = open_backend(tmp_path, direct_psync, capacity=32 * MiB)
    assert os.stat(larger.data_path).st_size == 32 * MiB
    verify_holds(larger, {f"k{i}": (i, 1 * MiB) for i in range(12)})
    larger.close()
    assert OffsetBackend.stored_capacity(tmp_path) == 32 * MiB


def test_a_removed_key_whose_replica_a_failed_read_dropped_stays_removed(tmp_path, direct_psync):
    """A read fails (EIO) and drops the replica; the checkpoint on disk still lists it. A
    remove() of the key then takes a checkpoint, or the key comes back after a crash."""
    from gdskv.gds.engine import IoOp
    from gdskv.gds.faulty import FaultyEngine

    engine = FaultyEngine(direct_psync)
    backend = OffsetBackend(tmp_path, engine, capacity=16 * MiB, window_bytes=MiB)
    backend.recover()
    backend.write(items({b"K": value_of(1, 5000), b"A": value_of(2, 5000)}))
    backend.close()
    backend = OffsetBackend(tmp_path, engine, capacity=16 * MiB, window_bytes=MiB)
    backend.recover()  # K and A listed in the checkpoint
    engine.inject("eio", op=IoOp.READ, times=1)
    assert read(backend, b"K", 5000) is None and backend.lookup(b"K") is None  # dropped
    assert backend.remove(b"K")
    holds_after_crash(backend, tmp_path, direct_psync, {"A": (2, 5000)})


def test_a_torn_tombstone_never_removes_another_key(tmp_path, direct_psync):
    """Power fails while a tombstone's head block is written and only its first sector
    lands: the scan at reopen reads stale bytes after it as the rest of its key. A
    tombstone now carries its key's CRC, so it is dropped as torn instead of removing a live
    key whose name those stale bytes spell (here: keys sharing a 600-byte prefix)."""
    engine = direct_psync
    backend = open_backend(tmp_path, engine)
    k1, k2 = b"P" * 600 + b"1", b"P" * 600 + b"2"
    backend.write(items({k2: value_of(1, 3000)}))  # k2's first record at offset 0
    backend.write(items({k2: value_of(2, 3000), k1: value_of(3, 3000)}))  # offset 0 deferred
    with backend._wlock:  # noqa: SLF001 - a checkpoint, as a full window or close() takes
        backend._checkpoint([])  # noqa: SLF001 - offset 0 free again, in the window
    real_run = engine.run

    def torn(requests):
        request = requests[0]
        if request.op.value == "write" and len(requests) == 1 and request.nbytes == 4096:  # the tombstone
            fd = os.open(backend.data_path, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes(request.buffers[0][:512]), request.offset)  # its first sector only
                os.fsync(fd)
            finally:
                os.close(fd)
            return [4096]
        return real_run(requests)

    engine.run = torn
    try:
        assert backend.remove(k1)
    finally:
        engine.run = real_run
    crash(backend)
    again = open_backend(tmp_path, direct_psync)
    assert k2 in again.keys() and read(again, k2, 3000) == value_of(2, 3000)
    again.close()


@pytest.mark.parametrize("dropped_before", [False, True], ids=["first drop", "dropped before and written again"])
def test_a_drop_during_a_checkpoint_write_stays_remembered(tmp_path, direct_psync, monkeypatch, dropped_before):
    """A failed read drops K while a checkpoint that lists K is being written. That
    checkpoint must not forget the drop: a remove of K then takes another checkpoint, or K
    comes back after a crash. Also when K had been dropped before and written again: the
    checkpoint clears the first drop's mark, not the second's (before, it cleared both, and
    the remove returned False and wrote nothing)."""
    import threading

    import gdskv.tiers.backends.offset.checkpoint_log as checkpoint_log
    from gdskv.gds.engine import IoOp
    from gdskv.gds.faulty import FaultyEngine

    engine = FaultyEngine(direct_psync)
    backend = OffsetBackend(tmp_path, engine, capacity=16 * MiB, window_bytes=MiB)
    backend.recover()
    backend.write(items({b"K": value_of(1, 5000), b"A": value_of(2, 5000)}))
    if dropped_before:
        engine.inject("eio", op=IoOp.READ, times=1)
        assert read(backend, b"K", 5000) is None  # dropped: the checkpoint on disk still lists it
        backend.write(items({b"K": value_of(3, 5000)}))
    real = checkpoint_log.write_file_atomic
    armed = [True]

    def writing_checkpoint(path, data, **kwargs):
        if armed[0]:
            armed[0] = False
            engine.inject("eio", op=IoOp.READ, times=1)
            reader = threading.Thread(target=lambda: read(backend, b"K", 5000))
            reader.start()
            reader.join(10)
        return real(path, data, **kwargs)

    monkeypatch.setattr(checkpoint_log, "write_file_atomic", writing_checkpoint)
    take_checkpoint(backend)  # (lists K)
    assert backend.lookup(b"K") is None and backend.remove(b"K")
    holds_after_crash(backend, tmp_path, direct_psync, {"A": (2, 5000)})


def test_check_after_close_is_a_store_closed_error(tmp_path, direct_psync):
    from gdskv.errors import StoreClosedError

    backend = open_backend(tmp_path, direct_psync)
    backend.write(items({b"K": value_of(1, 5000)}))
    backend.close()
    with pytest.raises(StoreClosedError):
        backend.check()


def test_a_write_that_fails_before_its_io_gives_its_space_back(tmp_path, direct_psync, monkeypatch):
    """A failure between placing a batch and writing it (no memory for the record heads)
    frees the space placed, as a failed write does: retries do not fill the file."""
    import gdskv.tiers.backends.offset.backend as offset_module

    backend = open_backend(tmp_path, direct_psync, capacity=MiB, window_bytes=256 << 10)
    backend.write(items({b"A": value_of(1, 5000)}))
    used = backend.used_bytes
    real = offset_module.HeadBlocks

    def no_memory(*args, **kwargs):
        raise MemoryError("no memory for the record heads")

    monkeypatch.setattr(offset_module, "HeadBlocks", no_memory)
    for _ in range(300):  # 300 x 8 KiB placed would be more than the file
        with pytest.raises(MemoryError):
            backend.write(items({b"B": value_of(2, 4000)}))
    assert backend.used_bytes == used
    monkeypatch.setattr(offset_module, "HeadBlocks", real)
    backend.write(items({b"B": value_of(2, 4000)}))
    assert read(backend, b"B", 4000) == value_of(2, 4000) and read(backend, b"A", 5000) == value_of(1, 5000)
    backend.close()


def test_a_write_evicts_no_object_a_read_in_flight_holds_to_make_room(tmp_path, direct_psync):
    """Records that reads in flight hold free nothing until the reads end, so a write that
    needs room evicts around them: when the rest is not enough it fails (NoSpaceError),
    and the objects being read stay stored (before, it evicted every one of them first)."""
    import threading

    from gates import Gate
    from gdskv.gds.engine import IoOp
    from gdskv.tiers.backends.record import record_start

    backend = open_backend(tmp_path, direct_psync, capacity=64 << 10, window_bytes=8 << 10)
    keys = [b"k%d" % i for i in range(8)]
    for i, key in enumerate(keys):
        backend.write(items({key: value_of(i, 4096)}))  # 8 KiB records
    stored = sorted(backend.keys(), key=lambda k: record_start(backend._objects[k]))  # noqa: SLF001
    held = stored[::2]
    hold = backend.engine.submit = Gate(backend.engine.submit, lambda requests: requests[0].op is IoOp.READ, times=len(held))
    readers = [threading.Thread(target=read, args=(backend, key, 4096)) for key in held]
    for reader in readers:
        reader.start()
    while len(backend._pins) < len(held):  # noqa: SLF001 - every read planned and in flight
        threading.Event().wait(0.01)
    try:
        try:
            backend.write(items({b"big": value_of(99, 12288)}))  # a 16 KiB record
        except NoSpaceError:
            pass
        assert all(backend.lookup(key) is not None for key in held)
    finally:
        hold.open()
        for reader in readers:
            reader.join(10)
    for key in held:
        assert read(backend, key, 4096) == value_of(keys.index(key), 4096)
    backend.close()
