"""The bucket backend (default): objects grouped into sealed, immutable bucket files.

Layout under ``<store>/buckets/``::

    <id:016x>.data    records (see :mod:`record`), values 4 KiB-aligned
    <id:016x>.index   the bucket's index; its presence *seals* the bucket

A write builds one bucket from a batch: the records go to ``.data.tmp`` and, while they are
in flight, the index to ``.index.tmp`` (fsynced, on a helper thread); once the records are written the data file
is fdatasynced, both files are renamed into place (data first) and the directory is
fsynced, and only then does the write return. So the index is never in place before the
data it lists is durable. Recovery trusts only sealed buckets: a data file without an
index, or any ``.tmp``, is a torn write and is deleted.

Removing a key rewrites its bucket's index without it (atomically), so a reopen never brings
it back; a bucket whose last key is removed is deleted. Eviction is bucket-level (FIFO or
LRU over bucket ids) under the byte cap. Readers pin a bucket so its file descriptor is not
closed under them; an evicted bucket's files are unlinked at once and the descriptor closed
when the last reader leaves. When a write evicts, though, the data file of the first evicted
bucket that nobody is reading becomes the new bucket's ``.data.tmp`` (its index is unlinked
first) and is overwritten in place: a full tier, the steady state of a cache, writes into
blocks the filesystem has allocated already (``files_reused`` in the stats).

Data files are opened through the I/O engine (``O_DIRECT`` where the engine and filesystem
allow it); the engine handles alignment, so records are handed to it as they are.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from gdskv.errors import (
    CorruptionError,
    FormatVersionError,
    GdskvError,
    InvalidValueError,
    IoError,
    NoSpaceError,
)
from gdskv.gds.aligned import preallocate
from gdskv.gds.engine import IoEngine, IoOp, IoRequest
from gdskv.tiers.backends.base import ReadItem, RecordReader, RecoveryReport, StorageBackend, WriteItem, transient
from gdskv.tiers.backends.coalesce import coalesced_writes
from gdskv.tiers.backends.files import TMP_SUFFIX, fit_reused_file, fsync_dir, unlink_quietly, write_file_atomic, write_file_synced
from gdskv.tiers.backends.record import (
    HeadBlocks,
    IndexEntry,
    decode_index,
    encode_index,
    record_buffers,
    record_size,
    record_start,
)

log = logging.getLogger(__name__)

_READ = IoOp.READ

DATA_SUFFIX = ".data"
INDEX_SUFFIX = ".index"


class _Bucket:
    """One sealed bucket: its files, live entries and readers."""

    def __init__(self, bucket_id: int, directory: Path, data_len: int) -> None:
        self.id = bucket_id
        self.data_path = directory / f"{bucket_id:016x}{DATA_SUFFIX}"
        self.index_path = directory / f"{bucket_id:016x}{INDEX_SUFFIX}"
        self.path = str(self.data_path)  # for error messages, made once
        self.data_len = data_len
        self.entries: Dict[bytes, IndexEntry] = {}
        self.fd: Optional[int] = None
        self.readers = 0
        self.evicted = False

    def open_fd(self, engine: IoEngine) -> int:
        if self.fd is None:
            self.fd = engine.open_file(self.data_path, os.O_RDONLY)
        return self.fd

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class BucketBackend(StorageBackend):
    """Sealed bucket files with bucket-level eviction. See the module docstring."""

    name = "bucket"

    subdir = "buckets"

    def __init__(self, root: Path, engine: IoEngine, **common: Any) -> None:
        """``common``: the options every backend takes (see :class:`StorageBackend`)."""
        super().__init__(root, engine, **common)
        self._buckets: Dict[int, _Bucket] = {}
        self._objects: Dict[bytes, _Bucket] = {}
        #: Buckets whose index on disk still lists a key a newer bucket holds (its rewrite
        #: failed); see :meth:`_supersede`.
        self._stale_indexes: Set[int] = set()
        #: A bucket's files were deleted (by an eviction or a remove) and the directory not
        #: fsynced since, as far as the lock shows: the next remove() fsyncs it before it
        #: returns (:meth:`_sync_dir`).
        self._dir_unsynced = False
        self._used = 0
        self._next_bucket = 1
        self._next_seq = 1
        #: Writes each new bucket's index while its data is in flight.
        self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gdskv-seal")
        self.counters = {
            "buckets_written": 0,
            "files_reused": 0,
            "bytes_written": 0,
            "buckets_evicted": 0,
            "objects_evicted": 0,
            "corrupt_reads": 0,
            "read_errors": 0,
        }

    # ------------------------------------------------------------------ recovery

    def recover(self) -> RecoveryReport:
        """Rebuild the index from sealed buckets; delete torn and corrupt ones."""
        report = RecoveryReport()
        names = sorted(os.listdir(self.dir))
        for name in names:
            if name.endswith(TMP_SUFFIX):
                unlink_quietly(self.dir / name)
                report.dropped_torn += 1
        indexed = {n[: -len(INDEX_SUFFIX)] for n in names if n.endswith(INDEX_SUFFIX)}
        for name in names:
            if name.endswith(DATA_SUFFIX) and name[: -len(DATA_SUFFIX)] not in indexed:
                unlink_quietly(self.dir / name)  # data written, never sealed
                report.dropped_torn += 1
        newest: Dict[bytes, Tuple[_Bucket, IndexEntry]] = {}
        for stem in sorted(indexed):
            bucket = self._load_bucket(stem, report)
            if bucket is None:
                continue
            self._buckets[bucket.id] = bucket
            self._next_bucket = max(self._next_bucket, bucket.id + 1)
            for entry in bucket.entries.values():
                self._next_seq = max(self._next_seq, entry.seq + 1)
                seen = newest.get(entry.key)
                if seen is None or seen[1].seq < entry.seq:
                    newest[entry.key] = (bucket, entry)
        stale: set[int] = set()
        for bucket in self._buckets.values():
            for key in list(bucket.entries):
                if newest[key][0] is not bucket:  # superseded by a later write of the key
                    del bucket.entries[key]
                    stale.add(bucket.id)
        for bucket_id in sorted(self._buckets):
            bucket = self._buckets[bucket_id]
            if self.verify_on_open == "full":
                report.dropped_corrupt += self._verify_bucket(bucket)
                if bucket_id in stale or report.dropped_corrupt:
                    stale.add(bucket_id)
            if not bucket.entries:
                self._delete_files(bucket)
                del self._buckets[bucket_id]
                continue
            if bucket_id in stale:
                self._persist_index(bucket)
            self._policy.insert(bucket_id)
            self._used += bucket.data_len
            for key in bucket.entries:
                self._objects[key] = bucket
        report.containers = len(self._buckets)
        report.objects = len(self._objects)
        report.bytes = sum(e.value_len for b in self._buckets.values() for e in b.entries.values())
        if report.dropped_torn or report.dropped_corrupt:
            log.warning(
                "gdskv: recovery dropped %d torn and %d corrupt buckets/objects in %s",
                report.dropped_torn, report.dropped_corrupt, self.dir,
            )
        return report

    def _load_bucket(self, stem: str, report: RecoveryReport) -> Optional[_Bucket]:
        index_path = self.dir / (stem + INDEX_SUFFIX)
        data_path = self.dir / (stem + DATA_SUFFIX)
        try:
            bucket_id, data_len, entries = decode_index(index_path.read_bytes(), path=str(index_path))
            if int(stem, 16) != bucket_id:
                raise CorruptionError("index names another bucket", path=str(index_path), got=bucket_id)
            actual = data_path.stat().st_size if data_path.exists() else -1
            if actual < data_len:
                raise CorruptionError("bucket data missing or short", path=str(data_path), expected=data_len, got=actual)
        except FormatVersionError:
            raise
        except (CorruptionError, ValueError, OSError) as exc:
            log.warning("gdskv: dropping bucket %s: %s", stem, exc)
            unlink_quietly(index_path)
            unlink_quietly(data_path)
            report.dropped_corrupt += 1
            return None
        bucket = _Bucket(bucket_id, self.dir, data_len)
        bucket.entries = {e.key: e for e in entries}
        return bucket

    def _verify_bucket(self, bucket: _Bucket) -> int:
        """Read and verify every record of ``bucket`` (as ``check()`` does); drop the bad
        entries. Returns their count. A data file that cannot be opened for now drops none."""
        try:
            fd = self.engine.open_file(bucket.data_path, os.O_RDONLY)
        except OSError as exc:
            if transient(exc):
                return 0
            log.warning("gdskv: cannot open %s: %s", bucket.data_path, exc)
            bad = list(bucket.entries)
        else:
            bad = []
            try:
                with RecordReader(self.engine) as reader:
                    for key, entry in bucket.entries.items():
                        why = reader.verify(fd, bucket.path, record_start(entry), entry)
                        if why is not None:
                            log.warning("gdskv: corrupt object %r: %s", key[:64], why)
                            bad.append(key)
            finally:
                os.close(fd)
        for key in bad:
            del bucket.entries[key]
        return len(bad)

    # ------------------------------------------------------------------ writes

    def write(self, items: Sequence[WriteItem]) -> List[bytes]:
        """Write ``items`` as one sealed bucket; return keys evicted to make room."""
        if not items:
            return []
        layout: List[Tuple[bytes, memoryview, int, int]] = []
        data_len = 0
        for key, value, crc in items:
            layout.append((key, value, crc, data_len))
            data_len += record_size(len(key), value.nbytes)
        if data_len > self.capacity:
            raise NoSpaceError("batch larger than the NVMe tier", needed=data_len, capacity=self.capacity)
        with self._lock:
            self._check_open()
            bucket = _Bucket(self._next_bucket, self.dir, data_len)
            self._next_bucket += 1
            tmp = bucket.data_path.with_name(bucket.data_path.name + TMP_SUFFIX)
            evicted, reused = self._make_room(data_len, reuse_as=tmp)
            self.counters["files_reused"] += reused
            first_seq = self._next_seq
            self._next_seq += len(items)
            self._used += data_len  # reserved; released if the write fails
        entries = []
        index_tmp = bucket.index_path.with_name(bucket.index_path.name + TMP_SUFFIX)
        try:
            fd = self.engine.open_file(tmp, os.O_RDWR if reused else os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if reused:
                    fit_reused_file(fd, data_len)  # its records cover every byte
                else:
                    preallocate(fd, data_len)  # O_DIRECT writes that extend a file run one at a time
                with HeadBlocks(len(key) for key, _, _ in items) as heads:
                    records = []
                    for i, (key, value, crc, offset) in enumerate(layout):
                        seq = first_seq + i
                        head = heads.encode(key, value.nbytes, seq, crc)
                        records.append((offset, record_buffers(head, value)))
                        entries.append(IndexEntry(key, offset + head.nbytes, value.nbytes, seq, crc))
                    requests = coalesced_writes(fd, records, path=str(tmp))
                    # The index goes to its temporary name (and is fsynced) on the sealer thread
                    # while the data is written; it is renamed into place only once the data is
                    # durable.
                    indexed = self._sealer.submit(write_file_synced, index_tmp, encode_index(bucket.id, data_len, entries))
                    try:
                        self.engine.run(requests)
                        os.fdatasync(fd)
                    finally:
                        concurrent.futures.wait([indexed])  # it may not recreate the file after a cleanup
                    indexed.result()
            finally:
                os.close(fd)
            os.replace(tmp, bucket.data_path)
            os.replace(index_tmp, bucket.index_path)  # sealed
            fsync_dir(self.dir)
        except BaseException as exc:  # (a MemoryError too: the offloader retries the batch)
            unlink_quietly(tmp)
            unlink_quietly(index_tmp)
            unlink_quietly(bucket.index_path)  # unseal first, as when dropping a bucket
            unlink_quietly(bucket.data_path)
            with self._lock:
                self._used -= data_len
            if isinstance(exc, GdskvError) or not isinstance(exc, OSError):
                raise
            raise IoError(f"bucket write failed: {exc.strerror}", path=str(bucket.data_path), errno=exc.errno) from exc
        with self._lock:
            bucket.entries = {e.key: e for e in entries}
            self._buckets[bucket.id] = bucket
            self._policy.insert(bucket.id)
            for key in bucket.entries:
                older = self._objects.get(key)
                if older is not None:
                    self._supersede(older, key)
                self._objects[key] = bucket
            self.counters["buckets_written"] += 1
            self.counters["bytes_written"] += data_len
        return evicted

    def _make_room(self, nbytes: int, reuse_as: Optional[Path] = None) -> Tuple[List[bytes], bool]:
        """Evict whole buckets in policy order (:meth:`_victims_to_fit`) until ``nbytes`` more
        fit; when even all of them would not make room (the rest is reserved by writes in
        flight), raise NoSpaceError and evict nothing. Lock held.

        With ``reuse_as``, the data file of the first evicted bucket nobody is reading is
        renamed there instead of being deleted (see :func:`fit_reused_file`). Returns the evicted keys
        and whether a file was renamed to ``reuse_as``."""
        evicted: List[bytes] = []
        reused = False
        if self._used + nbytes <= self.capacity:
            return evicted, reused
        self._persist_stale_indexes()  # a victim may hold the newest copy of a key they list
        for victim in self._victims_to_fit(nbytes, self._used):
            bucket = self._buckets[victim]
            if self.evict_listener is not None and bucket.entries:
                self.evict_listener(list(bucket.entries))  # before the bytes go (two-phase eviction)
            evicted.extend(bucket.entries)
            self.counters["buckets_evicted"] += 1
            self.counters["objects_evicted"] += len(bucket.entries)
            reused = self._drop_bucket(bucket, None if reused else reuse_as) or reused
        return evicted, reused

    def _victim_size(self, bucket_id: int) -> int:
        """A bucket being read is evicted all the same: its readers keep its descriptor."""
        return self._buckets[bucket_id].data_len

    def _drop_bucket(self, bucket: _Bucket, reuse_as: Optional[Path] = None) -> bool:
        """Remove a bucket from the index and from disk. Lock held. With ``reuse_as`` and
        no reader on the bucket, its data file is renamed there instead of being deleted;
        returns whether it was."""
        for key in bucket.entries:
            if self._objects.get(key) is bucket:
                del self._objects[key]
        bucket.entries = {}
        self._policy.remove(bucket.id)
        self._buckets.pop(bucket.id, None)
        self._used -= bucket.data_len
        bucket.evicted = True
        reused = self._delete_files(bucket, reuse_as if bucket.readers == 0 else None)
        if bucket.readers == 0:
            bucket.close_fd()
        return reused

    def _delete_files(self, bucket: _Bucket, move_data_to: Optional[Path] = None) -> bool:
        """Unseal ``bucket`` and delete its data file, or rename it to ``move_data_to``;
        returns whether it was renamed. Lock held. The directory is left to sync: the next
        remove() syncs it, as a remove of a key evicted here is durable only once these
        unlinks are (the evicting write syncs it too, but only if it succeeds)."""
        unlink_quietly(bucket.index_path)  # unseal first: a crash in between leaves a torn bucket
        self._dir_unsynced = True
        if move_data_to is not None:
            try:
                os.replace(bucket.data_path, move_data_to)
                return True
            except OSError:
                pass
        unlink_quietly(bucket.data_path)
        return False

    def _forget(self, bucket: _Bucket, key: bytes) -> None:
        """Drop ``key`` from ``bucket`` durably (lock held). The disk changes first: when the
        index cannot be rewritten (IoError), nothing changed, and the key is there in memory
        as on disk, so a retried remove finds it again. The last key of a bucket goes with
        the bucket's files; if the directory's fsync after their unlinks fails, the key is
        gone (IoError) and the next remove() fsyncs the directory before it returns."""
        self._persist_stale_indexes()  # an older copy of the key must not be the newest on disk
        rest = [entry for k, entry in bucket.entries.items() if k != key]
        if rest:
            self._persist_index(bucket, rest)
        bucket.entries.pop(key, None)
        if self._objects.get(key) is bucket:
            del self._objects[key]
        if not rest:
            self._drop_bucket(bucket)  # (leaves the directory unsynced)
            self._sync_dir()  # the unlinks, like an index rewrite, must outlive a power loss

    def _sync_dir(self) -> None:
        """fsync the bucket directory if something left it unsynced (lock held). Raises
        IoError, and it stays to be done, when it fails."""
        if self._dir_unsynced:
            try:
                fsync_dir(self.dir)
            except OSError as exc:
                raise IoError(f"could not sync {self.dir}: {exc.strerror}", path=str(self.dir), errno=exc.errno) from exc
            self._dir_unsynced = False

    def _supersede(self, bucket: _Bucket, key: bytes) -> None:
        """Drop ``key`` from ``bucket``: a newer bucket holds it now (lock held). That copy
        wins at recovery (the newest sequence number), so this never fails the write: an
        index that cannot be rewritten now stays listed in ``_stale_indexes`` and is
        rewritten before anything can leave its entry the newest on disk again (a remove,
        an eviction: :meth:`_persist_stale_indexes`)."""
        bucket.entries.pop(key, None)
        if self._objects.get(key) is bucket:
            del self._objects[key]
        if not bucket.entries:
            self._stale_indexes.discard(bucket.id)
            self._drop_bucket(bucket)
            try:
                fsync_dir(self.dir)
            except OSError as exc:  # the newer copy wins while it is there
                log.warning("gdskv: could not sync %s after deleting %s: %s", self.dir, bucket.index_path.name, exc)
            return
        try:
            self._persist_index(bucket)
        except (OSError, GdskvError) as exc:
            self._stale_indexes.add(bucket.id)
            log.warning("gdskv: could not rewrite the index of %s (retried later): %s", bucket.index_path.name, exc)

    def _persist_stale_indexes(self) -> None:
        """Rewrite the indexes that still list keys newer buckets hold (lock held); raises
        IoError while one cannot be written."""
        for bucket_id in sorted(self._stale_indexes):
            bucket = self._buckets.get(bucket_id)
            if bucket is not None:
                self._persist_index(bucket)
            self._stale_indexes.discard(bucket_id)

    def _persist_index(self, bucket: _Bucket, entries: Optional[Iterable[IndexEntry]] = None) -> None:
        """Write ``bucket``'s index listing ``entries`` (default: its entries) atomically."""
        listed = bucket.entries.values() if entries is None else entries
        write_file_atomic(bucket.index_path, encode_index(bucket.id, bucket.data_len, listed))

    # ------------------------------------------------------------------ reads

    def _entry_of(self, key: bytes) -> Optional[IndexEntry]:
        bucket = self._objects.get(key)
        return None if bucket is None else bucket.entries[key]

    def _plan_reads(
        self, items: Sequence[ReadItem], start: int, end: int, plan: List[Tuple[int, IndexEntry]], pins: List[_Bucket]
    ) -> List[IoRequest]:
        """Requests for ``items[start:end]``, each pinning its bucket (lock held)."""
        requests: List[IoRequest] = []
        objects = self._objects
        touch = self._policy.touch
        for i in range(start, end):
            key, out = items[i]
            bucket = objects.get(key)
            if bucket is None:
                continue
            entry = bucket.entries[key]
            size = entry.value_len
            if out.nbytes < size:
                raise InvalidValueError("output buffer smaller than the value", key=key[:64], size=size, got=out.nbytes)
            fd = bucket.fd
            if fd is None:
                try:
                    fd = bucket.open_fd(self.engine)
                except OSError as exc:
                    self.counters["read_errors"] += 1
                    log.warning("gdskv: cannot open %s: %s", bucket.data_path, exc)
                    continue
            bucket.readers += 1
            touch(bucket.id)
            plan.append((i, entry))
            pins.append(bucket)
            requests.append(IoRequest(_READ, fd, entry.value_offset, (out if out.nbytes == size else out[:size],), bucket.path))
        return requests

    def _unpin_reads(self, pins: List[_Bucket]) -> None:
        for bucket in pins:
            bucket.readers -= 1
            if (bucket.evicted or self._closed) and bucket.readers == 0:
                bucket.close_fd()

    def _pin_record(self, entry: IndexEntry) -> Tuple[_Bucket, int, str, int]:
        """Pin the bucket of ``entry`` (opening its data file) as a read does (lock held)."""
        bucket = self._objects[entry.key]
        fd = bucket.fd if bucket.fd is not None else bucket.open_fd(self.engine)
        bucket.readers += 1
        return bucket, fd, bucket.path, record_start(entry)

    def _drop_corrupt(self, entry: IndexEntry, why: str) -> None:
        bucket = self._objects.get(entry.key)
        if bucket is None or bucket.entries.get(entry.key) is not entry:
            return  # removed, overwritten or evicted meanwhile (its file may be gone)
        log.warning(
            "gdskv: dropping replica of %r in %s at offset %d: %s",
            entry.key[:64], bucket.data_path.name, entry.value_offset, why,
        )
        try:
            self._forget(bucket, entry.key)
        except IoError as exc:
            # A miss all the same. The record stays listed, and the next read or check of
            # it fails again and tries again.
            log.warning("gdskv: could not drop the replica of %r: %s", entry.key[:64], exc)

    # ------------------------------------------------------------------ the rest

    def remove(self, key: bytes) -> bool:
        with self._lock:
            self._check_open()
            bucket = self._objects.get(key)
            if bucket is None:
                self._sync_dir()  # an earlier removal made durable first
                return False
            self._forget(bucket, key)
            return True

    @property
    def used_bytes(self) -> int:
        return self._used

    def layout_stats(self) -> dict:
        return {"buckets": len(self._buckets)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for bucket in self._buckets.values():
                if bucket.readers == 0:  # a bucket being read is closed by its last reader
                    bucket.close_fd()
        self._sealer.shutdown(wait=True)
        try:
            fsync_dir(self.dir)
        except OSError:
            pass
