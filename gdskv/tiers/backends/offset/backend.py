"""The offset backend itself: the index, writes, removes, reads, eviction and checkpoints
over one preallocated data file (see the package docstring).

A write places its records inside the window only (first fit), writes them through the I/O
engine, fdatasyncs the file, and then makes them visible; a batch that does not fit the
window takes a new checkpoint first. ``remove`` writes a tombstone record into the window.
Space that objects leave is reused only after the next checkpoint, which no longer lists
them, is durable. Readers pin the record they read, so a checkpoint never hands its space
to a new write while a read is in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gdskv.errors import CorruptionError, GdskvError, InvalidValueError, IoError, NoSpaceError
from gdskv.gds.engine import IoEngine, IoOp, IoRequest
from gdskv.tiers.allocator import OffsetAllocator
from gdskv.tiers.backends.base import ReadItem, RecordReader, RecoveryReport, StorageBackend, WriteItem
from gdskv.tiers.backends.coalesce import coalesced_writes
from gdskv.tiers.backends.offset import recovery
from gdskv.tiers.backends.offset.checkpoint_log import CheckpointLog
from gdskv.tiers.backends.offset.checkpoints import BASE_FILE, Checkpoint
from gdskv.tiers.backends.offset.window import default_window, in_window, merge_extents, pick_window
from gdskv.tiers.backends.record import (
    ALIGN,
    FLAG_TOMBSTONE,
    HeadBlocks,
    IndexEntry,
    checksum,
    decode_index,
    encode_head,
    head_size,
    record_buffers,
    record_size,
    record_start,
)

log = logging.getLogger("gdskv.tiers.backends.offset")  # the whole package logs as the one module did

_READ = IoOp.READ

DATA_FILE = "data"


class OffsetBackend(StorageBackend):
    """One preallocated file, object-level eviction, checkpoint + window recovery."""

    name = "offset"
    subdir = "offset"
    layout_version = 2  # checkpoint deltas: a gdskv that reads only the base must refuse the store

    def __init__(self, root: Path, engine: IoEngine, *, capacity: int, window_bytes: Optional[int] = None, **common: Any) -> None:
        """``common``: the other options every backend takes (see :class:`StorageBackend`)."""
        if capacity // ALIGN * ALIGN <= 0:
            raise NoSpaceError("the offset backend needs at least 4 KiB", capacity=capacity)
        # The base sets up dir, engine, policy, _lock (index, allocator, pins: held briefly).
        super().__init__(root, engine, capacity=capacity // ALIGN * ALIGN, **common)
        self.data_path = self.dir / DATA_FILE
        self._path = str(self.data_path)  # for error messages, made once
        self.checkpoint_path = self.dir / BASE_FILE
        #: What the next checkpoint writes, and which are on disk (``_lock``).
        self._checkpoint_log = CheckpointLog(self.dir)
        self.window_bytes = min(window_bytes or default_window(self.capacity), self.capacity)
        self._wlock = threading.Lock()  # writes, removes, checkpoints: one at a time
        self._alloc = OffsetAllocator(self.capacity, alignment=ALIGN)
        self._objects: Dict[bytes, IndexEntry] = {}
        self._deferred: List[int] = []  # record offsets to free after the next checkpoint
        self._pins: Dict[int, int] = {}
        self._window: List[Tuple[int, int]] = []  # sorted (start, end)
        self._watermark = 0
        self._next_seq = 1
        self._fd: Optional[int] = None
        self._closed = False
        self.counters = {
            "bytes_written": 0,
            "objects_evicted": 0,
            "checkpoints": 0,
            "checkpoint_bases": 0,  # of them, bases (each lists every object)
            "checkpoint_bytes": 0,
            "checkpoint_seconds": 0.0,
            "tombstones": 0,
            "corrupt_reads": 0,
            "read_errors": 0,
        }

    @classmethod
    def stored_capacity(cls, root: Path) -> Optional[int]:
        """The capacity of the offset store in ``root`` as its checkpoint records it (the
        size of its data file); None where there is no readable checkpoint."""
        try:
            _watermark, capacity, _listed = decode_index((Path(root) / cls.subdir / BASE_FILE).read_bytes())
        except (OSError, GdskvError):
            return None
        return capacity

    # ------------------------------------------------------------------ recovery

    def recover(self) -> RecoveryReport:
        """Open (or create) the file, rebuild the index, start a fresh checkpoint.

        The next sequence number is above the watermark, every listed object and every
        record header the window scan met (tombstones, torn and cut-off ones included), and
        the fresh checkpoint's watermark covers them all: no later write reuses a number,
        so no later scan can prefer a stale record to an acknowledged one. Without a usable
        checkpoint (missing or damaged) the data file is emptied before that checkpoint
        (see the package docstring)."""
        report = RecoveryReport()
        recovery.remove_temporaries(self.dir)
        # First: a newer format raises before any file is touched.
        checkpoint = recovery.load_checkpoint(self.dir, self.capacity, report)
        if checkpoint is not None:
            self._watermark = checkpoint.watermark
            self._next_seq = max(checkpoint.watermark, checkpoint.newest) + 1
        self._fd = recovery.open_data_file(self.engine, self.data_path, self.capacity, empty=checkpoint is None)
        try:
            self._rebuild(checkpoint, report)
        except BaseException:
            # Not recovered (a window that cannot be read now, an interrupt): close the file
            # and leave everything as it is. close() then writes no checkpoint of a
            # half-built index, which would drop every object.
            with self._lock:
                self._close_fd()
            raise
        if report.dropped_torn or report.dropped_corrupt:
            log.warning(
                "gdskv: recovery dropped %d torn and %d corrupt records in %s",
                report.dropped_torn, report.dropped_corrupt, self.dir,
            )
        return report

    def _rebuild(self, checkpoint: Optional[Checkpoint], report: RecoveryReport) -> None:
        """The index from ``checkpoint`` (None: none) and the window's records past it, then
        a fresh checkpoint (see :meth:`recover`). The data file is open."""
        entries, window = (checkpoint.objects, checkpoint.window) if checkpoint is not None else ({}, [])
        assert self._fd is not None
        newest = recovery.replay_window(self.engine, self._fd, self._path, entries, window, self._watermark, report)
        self._next_seq = max(self._next_seq, newest + 1)
        with RecordReader(self.engine) as reader:
            self._index_recovered(entries, reader, report)
        report.objects = len(self._objects)
        report.bytes = sum(e.value_len for e in self._objects.values())
        report.containers = 1
        with self._wlock:
            self._checkpoint_log.restart()
            self._checkpoint([])

    def _index_recovered(self, entries: Dict[bytes, IndexEntry], reader: RecordReader, report: RecoveryReport) -> None:
        """Claim the space of each recovered entry and index it, oldest first; drop (count)
        one that lies beyond the file or on another's space, or, with ``verify_on_open``
        "full", fails verification."""
        for entry in sorted(entries.values(), key=lambda e: e.seq):
            start = record_start(entry)
            try:
                if start + record_size(len(entry.key), entry.value_len) > self.capacity:
                    raise CorruptionError("record beyond the file's capacity", offset=start)
                self._alloc.claim(start, record_size(len(entry.key), entry.value_len))
            except GdskvError as exc:
                log.warning("gdskv: dropping %r from %s: %s", entry.key[:64], self.data_path, exc)
                report.dropped_corrupt += 1
                continue
            if self.verify_on_open == "full" and not self._verify_record(reader, entry):
                self._alloc.free(start)
                report.dropped_corrupt += 1
                continue
            self._objects[entry.key] = entry
            self._policy.insert(entry.key)

    def _verify_record(self, reader: RecordReader, entry: IndexEntry) -> bool:
        """Whether the record of ``entry`` is intact (see :meth:`RecordReader.verify`)."""
        assert self._fd is not None
        why = reader.verify(self._fd, self._path, record_start(entry), entry)
        if why is not None:
            log.warning("gdskv: corrupt object %r: %s", entry.key[:64], why)
        return why is None

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, sizes: Sequence[int]) -> Tuple[List[int], List[bytes]]:
        """Free what the last epoch left, place ``sizes`` (evicting, in policy order, until
        they fit and a window of ``window_bytes`` is free as well), pick the new window and
        persist it all. Without ``sizes`` nothing is evicted. ``_wlock`` held. Returns the
        batch's offsets and the evicted keys (:attr:`evict_listener` has heard of them).

        The space freed here still holds records that the checkpoint on disk needs (the
        objects it lists, and this epoch's records and tombstones in its window) until the
        new one is durable. So the window is emptied first and set only once the new
        checkpoint is durable: if this raises (:class:`NoSpaceError` after evicting,
        :class:`IoError` writing the checkpoint), nothing more is written into the data file
        until a later checkpoint succeeds, as every write and remove then takes one first."""
        started = time.perf_counter()
        evicted: List[bytes] = []
        with self._lock:
            self._window = []
            still_pinned = []
            for offset in self._deferred:
                if self._pins.get(offset):
                    still_pinned.append(offset)
                else:
                    self._alloc.free(offset)
            self._deferred = still_pinned
            batch = sum(self._alloc.rounded(s) for s in sizes)
            # Free after the batch is placed: a window's worth (all the rest, at most).
            target = max(0, min(self.capacity - batch, self.window_bytes)) if sizes else 0
            # Cannot be enough yet: evict, in one go, what brings the free bytes up to it.
            self._evict(self._victims(target + batch - self._alloc.free_bytes), evicted)
            offsets = self._try_place(sizes)
            while offsets is None or self._alloc.free_bytes < target:  # fragmented, or pinned
                if offsets is not None:
                    for offset in offsets:
                        self._alloc.free(offset)
                victim = self._victims(1)  # the first object whose eviction frees room now
                if not victim:  # what is left is being read: evicting it would free nothing now
                    offsets = self._try_place(sizes)
                    break
                self._evict(victim, evicted)
                offsets = self._try_place(sizes)
            if offsets is None:
                raise NoSpaceError(
                    "no room in the offset backend's file", needed=sum(sizes), free=self._alloc.free_bytes,
                    largest_free=self._alloc.largest_free, capacity=self.capacity, evicted=len(evicted),
                )
            window = pick_window(self._alloc.extents(), self.window_bytes)
            for offset, size in zip(offsets, sizes):
                window.append((offset, offset + self._alloc.rounded(size)))
            window = merge_extents(window)
            base = self._checkpoint_log.base_next()
            if base:
                self._next_seq += 1  # a number no record takes: this base's own, naming its deltas
            # A change or drop after this is in the next checkpoint.
            taken = self._checkpoint_log.take(self._next_seq - 1, self._objects.values() if base else None)
        try:
            nbytes = self._checkpoint_log.write(taken, self.capacity, window)
        except BaseException:  # (an IoError; a MemoryError or an interrupt loses nothing either)
            with self._lock:
                for offset in offsets:
                    self._alloc.free(offset)
                self._checkpoint_log.failed(taken)
            raise
        with self._lock:
            self._checkpoint_log.written(taken, nbytes)
        if base:
            self.counters["checkpoint_bases"] += 1
        self._window = window
        self._watermark = taken.watermark
        self.counters["checkpoints"] += 1
        self.counters["checkpoint_bytes"] += nbytes
        self.counters["checkpoint_seconds"] += time.perf_counter() - started  # (its evictions included)
        if base:
            self._checkpoint_log.delete_stale_deltas()
        return offsets, evicted

    def _try_place(self, sizes: Sequence[int]) -> Optional[List[int]]:
        """Allocate every size or none. ``_lock`` held."""
        offsets: List[int] = []
        for size in sizes:
            offset = self._alloc.allocate(size)
            if offset is None:
                for o in offsets:
                    self._alloc.free(o)
                return None
            offsets.append(offset)
        return offsets

    def _in_window(self, offset: int, size: int) -> bool:
        return in_window(self._window, offset, size)

    def _place(self, sizes: Sequence[int]) -> Tuple[List[int], List[bytes]]:
        """Offsets inside the current window for ``sizes``; checkpoint if they do not fit."""
        with self._lock:
            offsets = self._try_place(sizes)
            if offsets is not None and all(self._in_window(o, self._alloc.rounded(s)) for o, s in zip(offsets, sizes)):
                return offsets, []
            for offset in offsets or []:
                self._alloc.free(offset)
        return self._checkpoint(sizes)

    def _victim_size(self, key: bytes) -> Optional[int]:
        """The bytes of ``key``'s record, or None while a read in flight pins it: evicting
        it would free nothing until the read ends. ``_lock`` held."""
        offset = record_start(self._objects[key])
        return None if self._pins.get(offset) else self._alloc.size_of(offset)

    def _evict(self, keys: List[bytes], evicted: List[bytes]) -> None:
        """Drop ``keys`` to make room, and append them to ``evicted``. ``_lock`` held.

        :attr:`evict_listener` hears of them first, before their space can be given to a
        new record. They stay listed in the checkpoint on disk until the next one."""
        if not keys:
            return
        if self.evict_listener is not None:
            self.evict_listener(list(keys))
        objects, gone, pins = self._objects, self._checkpoint_log.gone, self._pins
        forget, free = self._policy.remove, self._alloc.free  # (per object: a window can evict thousands)
        for key in keys:
            entry = objects.pop(key)
            gone(key)
            forget(key)
            offset = record_start(entry)
            if pins and pins.get(offset):
                self._deferred.append(offset)
            else:
                free(offset)
        evicted.extend(keys)
        self.counters["objects_evicted"] += len(keys)

    # ------------------------------------------------------------------ writes

    def write(self, items: Sequence[WriteItem]) -> List[bytes]:
        """Write ``items`` into the window, durably; return keys evicted to make room."""
        if not items:
            return []
        sizes = [record_size(len(key), value.nbytes) for key, value, _ in items]
        if sum(sizes) > self.capacity:
            raise NoSpaceError("batch larger than the NVMe tier", needed=sum(sizes), capacity=self.capacity)
        with self._wlock:
            self._check_open()
            offsets, evicted = self._place(sizes)
            first_seq = self._next_seq
            self._next_seq += len(items)
            entries, records = [], []
            heads: Optional[HeadBlocks] = None
            try:  # from here on a failure gives the placed space back (_abandon)
                heads = HeadBlocks(len(key) for key, _, _ in items)
                for i, ((key, value, crc), offset) in enumerate(zip(items, offsets)):
                    head = heads.encode(key, value.nbytes, first_seq + i, crc)
                    records.append((offset, record_buffers(head, value)))
                    entries.append(IndexEntry(key, offset + head.nbytes, value.nbytes, first_seq + i, crc))
                records.sort(key=lambda record: record[0])
                requests = coalesced_writes(self._fd, records, path=self._path)
                self.engine.run(requests)
                os.fdatasync(self._fd)  # type: ignore[arg-type]
            except BaseException as exc:  # (a MemoryError too: the offloader retries the batch)
                self._abandon(offsets)
                if isinstance(exc, GdskvError) or not isinstance(exc, OSError):
                    raise
                raise IoError(f"offset write failed: {exc.strerror}", path=str(self.data_path), errno=exc.errno) from exc
            finally:
                if heads is not None:
                    heads.close()
            with self._lock:
                for entry in entries:
                    older = self._objects.get(entry.key)
                    if older is not None:
                        self._deferred.append(record_start(older))
                        self._policy.remove(entry.key)
                    self._objects[entry.key] = entry
                    self._checkpoint_log.put(entry)
                    self._policy.insert(entry.key)
                self.counters["bytes_written"] += sum(sizes)
        return evicted

    def _abandon(self, offsets: List[int]) -> None:
        """A failed write: its records may be partly on disk with sequence numbers above the
        watermark. Checkpoint past them (so a reopen ignores them), then free their space.
        If that checkpoint fails too, the window stays empty (see :meth:`_checkpoint`)."""
        with self._lock:
            self._deferred.extend(offsets)
        try:
            self._checkpoint([])
        except GdskvError as exc:
            log.warning("gdskv: checkpoint after a failed write failed too: %s", exc)

    def remove(self, key: bytes) -> bool:
        """Forget ``key`` durably: a tombstone record in the window (or a checkpoint).

        Returns whether the key was there, in the index or still on disk: a key gone from
        the index that the checkpoint on disk still lists (evicted, or removed, by a call
        whose checkpoint or tombstone failed) takes a checkpoint now, so that it cannot come
        back at the next open. Raises IoError while that cannot be made durable."""
        with self._wlock:
            self._check_open()
            with self._lock:
                entry = self._objects.pop(key, None)
                if entry is None and not self._checkpoint_log.still_listed(key):
                    return False
                if entry is not None:
                    self._checkpoint_log.gone(key)
                    self._policy.remove(key)
                    self._deferred.append(record_start(entry))
            if entry is None:
                self._checkpoint([])
                return True
            size = head_size(len(key))
            with self._lock:
                offsets = self._try_place([size])
                if offsets is not None and not self._in_window(offsets[0], size):
                    self._alloc.free(offsets[0])
                    offsets = None
            if offsets is None:  # no room for a tombstone: a checkpoint (without the key) instead
                self._checkpoint([])
                return True
            seq = self._next_seq
            self._next_seq += 1
            head = encode_head(key, 0, seq, checksum(key, b""), flags=FLAG_TOMBSTONE)  # the key's CRC
            try:
                self.engine.run([IoRequest.write(self._fd, offsets[0], memoryview(head), path=str(self.data_path))])
                os.fdatasync(self._fd)  # type: ignore[arg-type]
            except (OSError, GdskvError) as exc:
                log.warning("gdskv: tombstone write failed, checkpointing instead: %s", exc)
                self._abandon(offsets)
                if self._watermark < seq:
                    raise IoError("could not make the removal durable", key=key[:64], path=str(self.data_path)) from exc
                return True
            with self._lock:
                self._deferred.append(offsets[0])
                self._checkpoint_log.outranked(key)  # by the tombstone just written
            self.counters["tombstones"] += 1
            return True

    # ------------------------------------------------------------------ reads

    def _entry_of(self, key: bytes) -> Optional[IndexEntry]:
        return self._objects.get(key)

    def _plan_reads(
        self, items: Sequence[ReadItem], start: int, end: int, plan: List[Tuple[int, IndexEntry]], pins: List[int]
    ) -> List[IoRequest]:
        """Requests for ``items[start:end]``, each pinning its record's start (lock held)."""
        requests: List[IoRequest] = []
        objects = self._objects
        counts = self._pins
        touch = self._policy.touch
        fd = self._fd
        path = self._path
        for i in range(start, end):
            key, out = items[i]
            entry = objects.get(key)
            if entry is None:
                continue
            size = entry.value_len
            if out.nbytes < size:
                raise InvalidValueError("output buffer smaller than the value", key=key[:64], size=size, got=out.nbytes)
            record = record_start(entry)
            counts[record] = counts.get(record, 0) + 1
            touch(key)
            plan.append((i, entry))
            pins.append(record)
            requests.append(IoRequest(_READ, fd, entry.value_offset, (out if out.nbytes == size else out[:size],), path))  # type: ignore[arg-type]
        return requests

    def _unpin_reads(self, pins: List[int]) -> None:
        counts = self._pins
        for record in pins:
            left = counts[record] - 1
            if left:
                counts[record] = left
            else:
                del counts[record]
        if self._closed and not counts:
            self._close_fd()  # closed while these reads were in flight

    def _pin_record(self, entry: IndexEntry) -> Tuple[int, int, str, int]:
        """Pin the record of ``entry`` as a read does (lock held)."""
        record = record_start(entry)
        self._pins[record] = self._pins.get(record, 0) + 1
        return record, self._fd, self._path, record  # type: ignore[return-value]

    def _drop_corrupt(self, entry: IndexEntry, why: str) -> None:
        if self._objects.get(entry.key) is not entry:
            return  # removed, overwritten or evicted meanwhile
        log.warning("gdskv: dropping replica of %r in %s at offset %d: %s", entry.key[:64], self.data_path, entry.value_offset, why)
        del self._objects[entry.key]
        self._checkpoint_log.gone(entry.key)  # the checkpoint on disk may still list it
        self._policy.remove(entry.key)
        self._deferred.append(record_start(entry))

    # ------------------------------------------------------------------ the rest

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    def layout_stats(self) -> dict:
        return {
            "window_bytes": sum(end - start for start, end in self._window),
            "free_extents": self._alloc.free_extents,
            "checkpoint_deltas": self._checkpoint_log.deltas,  # written since the last base
        }

    def close(self) -> None:
        """Checkpoint (so the next open scans little), then close the file. Idempotent."""
        with self._wlock:
            if self._closed:
                return
            try:
                if self._fd is not None:
                    self._checkpoint([])
            except GdskvError as exc:
                log.warning("gdskv: final checkpoint of %s failed: %s", self.dir, exc)
            with self._lock:
                self._closed = True
                if not self._pins:  # else the last reader closes it
                    self._close_fd()

    def _close_fd(self) -> None:
        """Close the data file. ``_lock`` held."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

