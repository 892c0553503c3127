"""The file-per-key backend itself: the index, writes, reads, eviction and removal over
the shard tree (:mod:`.tree`), made durable as :mod:`.sync` says, with evicted files
reused as :mod:`.evicted` says (see the package docstring).

A write makes each file under a temporary name (through the I/O engine, ``O_DIRECT`` where
allowed), makes it durable, renames it into place and makes the renames durable; only then
does it return. ``remove`` unlinks the file and fsyncs its directory.

Reads go through a cache of open descriptors (:mod:`~gdskv.tiers.backends.open_files`): a
write keeps each new file's descriptor (after its rename it is the record's file), a read
that finds none opens one, and up to ``open_files`` of them stay open, least recently used
first out (by default half of the process's descriptor limit). Opening and closing a file
around each 4 KiB read cost about as much CPU as the read itself. A descriptor leaves the
cache when its key is overwritten, removed or evicted, and is closed once no read is using
it; when the process runs out of descriptors the cached ones no read is using are closed
and the open tried again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from gdskv.config_fields import FILE_PER_KEY_SYNC_MODES, check_choice
from gdskv.errors import GdskvError, InvalidValueError, IoError, NoSpaceError, StoreClosedError
from gdskv.gds.aligned import preallocate
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest
from gdskv.tiers.backends.base import ReadItem, RecordReader, RecoveryReport, StorageBackend, WriteItem
from gdskv.tiers.backends.file_per_key import sync as _sync
from gdskv.tiers.backends.file_per_key.evicted import EvictedFiles
from gdskv.tiers.backends.file_per_key.sync import PendingDirs, Syncer, wait_all
from gdskv.tiers.backends.file_per_key.tree import ShardTree, load_record
from gdskv.tiers.backends.files import TMP_SUFFIX, fit_reused_file, unlink_quietly
from gdskv.tiers.backends.open_files import Handle, OpenFiles, default_limit
from gdskv.tiers.backends.record import HeadBlocks, IndexEntry, record_buffers, record_size

log = logging.getLogger(__name__)

_READ = IoOp.READ

#: Bytes of records whose files are created before their writes are submitted together.
SUBMIT_BYTES = 8 << 20


class FilePerKeyBackend(StorageBackend):
    """One record file per object in a two-level hash-sharded tree."""

    name = "file_per_key"
    subdir = "files"
    #: 2: the 16 x 16 shard tree. 1: ``<h[0:2]>/<h[2:4]>/``, moved into the tree at open;
    #: a gdskv of layout 1 would look for every file where it no longer is.
    layout_version = 2

    def __init__(self, root: Path, engine: IoEngine, *, open_files: Optional[int] = None, sync: str = "filesystem", **common: Any) -> None:
        """``common``: the options every backend takes (see :class:`StorageBackend`).

        ``open_files``: descriptors kept open for reads (None: half of the process's
        ``RLIMIT_NOFILE``, at most 65536; 0: open and close a file around every read).

        ``sync``: how a write makes its files durable. ``"filesystem"`` (the default): one
        ``syncfs(2)`` once the batch's data is written, the renames, and one more, so a
        batch costs the same few flushes of the device's cache whatever its number of files;
        it also writes back whatever else is dirty on that filesystem, which costs nothing
        on a disk the store has to itself. ``"file"``: an fdatasync per file and an fsync per
        changed directory, side by side, which touches nothing else. Where ``syncfs`` is not
        available, ``"filesystem"`` falls back to ``"file"`` (logged; ``stats()`` shows the
        mode in use)."""
        check_choice("file_per_key sync mode", sync, FILE_PER_KEY_SYNC_MODES)
        super().__init__(root, engine, **common)
        #: The sync mode in use.
        self.sync = _sync.mode_in_use(sync)
        self._objects: Dict[bytes, IndexEntry] = {}
        #: Open descriptors of record files by key, tagged with the record's seq (lock held).
        self._open = OpenFiles(default_limit() if open_files is None else open_files)
        self._tree = ShardTree(self.dir)
        self._used = 0
        self._next_seq = 1
        #: Writes run one at a time (the store has one offloader; a backend used directly
        #: from several threads must not let one write's eviction take another's new file,
        #: nor two writes of a key share its temporary name). close() waits for it.
        self._wlock = threading.Lock()
        #: Directories whose changes are not known to be durable: an eviction's, until its
        #: write's first syncfs ("filesystem" mode), and those a remove, an eviction or a
        #: dropped replica could not fsync. A remove() fsyncs them before it returns (lock held).
        self._pending_dirs = PendingDirs()
        #: Evicted objects' files: spares to overwrite, and those not deleted yet.
        self._evicted = EvictedFiles(self._pending_dirs)
        #: The store directory's descriptor for syncfs, and the sync threads.
        self._syncer = Syncer(self.dir, self.sync, self._with_descriptors)
        self.counters = {
            "files_written": 0,
            "bytes_written": 0,
            "objects_evicted": 0,
            "files_reused": 0,
            "corrupt_reads": 0,
            "read_errors": 0,
        }

    def path_of(self, key: bytes) -> Path:
        """Where the record of ``key`` lives (inside the store directory, whatever the key)."""
        return self._tree.path_of(key)

    def path_str(self, key: bytes) -> str:
        """:meth:`path_of` as a string, built without ``pathlib`` (the read path's form)."""
        return self._tree.path_str(key)

    # ------------------------------------------------------------------ recovery

    def recover(self) -> RecoveryReport:
        """Make the shard tree; index every intact record file; delete temporary and
        corrupt ones; move files found outside their place (the older layout) into it,
        keeping the newest where a key is found twice; remove the older layout's emptied
        directories. Files whose names are neither a record's nor a temporary's, and
        directories not of either layout, are left alone."""
        self._tree.make(self._syncer.fsync_dirs)
        with self._lock:
            self._syncer.open_descriptor()
        report = RecoveryReport()
        with RecordReader(self.engine) as reader:
            full = reader if self.verify_on_open == "full" else None
            found, stale_dirs, old_tree = self._tree.scan(lambda path: load_record(self.engine, path, full), report)
        moves = [(path, place) for key, (_, path) in found.items() if (place := self.path_of(key)) != path]
        self._tree.move_into_place(moves, stale_dirs, self._syncer.fsync_dirs)
        if old_tree:
            self._tree.remove_old_tree()
        for entry, _ in sorted(found.values(), key=lambda f: f[0].seq):
            self._objects[entry.key] = entry
            self._policy.insert(entry.key)
            self._used += record_size(len(entry.key), entry.value_len)
            self._next_seq = max(self._next_seq, entry.seq + 1)
        report.objects = report.containers = len(self._objects)
        report.bytes = sum(e.value_len for e in self._objects.values())
        if report.dropped_torn or report.dropped_corrupt:
            log.warning(
                "gdskv: recovery dropped %d torn and %d corrupt files in %s",
                report.dropped_torn, report.dropped_corrupt, self.dir,
            )
        return report

    # ------------------------------------------------------------------ writes

    def write(self, items: Sequence[WriteItem]) -> List[bytes]:
        """Write each item to its own file (temporary name, sync, rename, sync: see
        ``sync``); return keys evicted to make room. Writes run one at a time.

        The renames and the index update happen in one hold of the lock, so the index and
        the paths never disagree: a read, an eviction, a remove or a check always finds at
        a key's path the file its index entry describes. The new values are readable from
        then on, before the syncs that make the renames durable end (the write returns
        after those). A shard directory removed behind the store's back is made again by
        the write that needs it."""
        if not items:
            return []
        with self._wlock:
            return self._write(items)

    def _write(self, items: Sequence[WriteItem]) -> List[bytes]:
        if len({key for key, _, _ in items}) != len(items):  # one file per key: the last wins
            items = list({key: (key, value, crc) for key, value, crc in items}.values())
        sizes = [record_size(len(key), value.nbytes) for key, value, _ in items]
        if sum(sizes) > self.capacity:
            raise NoSpaceError("batch larger than the NVMe tier", needed=sum(sizes), capacity=self.capacity)
        finals = [self._tree.path_str(key) for key, _, _ in items]  # (strings: pathlib costs here)
        tmps = [final + TMP_SUFFIX for final in finals]
        #: Directories that gain a shard directory (the parents of new shards), fsynced side
        #: by side with the new files' directories before the write returns.
        changed_dirs: Set[Path] = set()
        per_file = self.sync == "file"
        with self._lock:
            self._check_open()
            self._syncer.open_descriptor()
            if per_file:
                evicted, reused = self._make_room(sum(sizes), tmps, changed_dirs)
            else:  # ready spares become the first items' files, once the eviction is done
                reused = min(len(self._evicted.ready), len(tmps))
                evicted, _ = self._make_room(sum(sizes), (), changed_dirs, spares_taken=reused)
                self._evicted.take(tmps, reused)
            first_seq = self._next_seq
            self._next_seq += len(items)
            self._used += sum(sizes)  # reserved; released if the write fails
        entries: List[IndexEntry] = []
        fds: List[int] = []  # fds[i]: item i's file, open (under tmps[i] until renamed)
        overwrote: List[bool] = []  # overwrote[i]: item i's file is an evicted one (reused)
        submitted: List[Tuple[IoFuture, int]] = []  # (future, index of its first request)
        syncs: List["concurrent.futures.Future[None]"] = []
        heads: Optional[HeadBlocks] = None
        renamed = 0  # files renamed into place: from then on they are what the paths hold
        written_ok = False
        try:
            heads = HeadBlocks(len(key) for key, _, _ in items)  # (may fail: MemoryError)
            # Files are created and their writes submitted a group at a time, so the device
            # is busy with one group while the next one's files are created.
            requests: List[IoRequest] = []
            group_start = group_bytes = 0
            for i, (key, value, crc) in enumerate(items):
                reusing = i < reused  # an evicted file, renamed to this temporary name (or a spare)
                fd = self._open_reused(i, tmps, finals) if reusing else None
                if fd is None:
                    reusing = False
                    fd = self._tree.create(tmps[i], changed_dirs, self._open_file)
                fds.append(fd)
                overwrote.append(reusing)
                if reusing:
                    fit_reused_file(fd, sizes[i])  # the record covers every byte
                else:
                    preallocate(fd, sizes[i])
                head = heads.encode(key, value.nbytes, first_seq + i, crc)
                requests.append(IoRequest.write(fd, 0, *record_buffers(head, value), path=tmps[i]))
                entries.append(IndexEntry(key, head.nbytes, value.nbytes, first_seq + i, crc))
                group_bytes += sizes[i]
                if group_bytes >= SUBMIT_BYTES or i == 0 or i == len(items) - 1:
                    submitted.append((self.engine.submit(requests[group_start:]), group_start))
                    group_start, group_bytes = len(requests), 0
            if self._evicted.to_settle:  # while the device works
                with self._lock:
                    self._evicted.settle()
            # "file": each file is fdatasynced as soon as its write completes, while the
            # others are still being written, and the syncs run side by side.
            # "filesystem": one syncfs once every write has completed.
            failure: Optional[BaseException] = None
            for future, first in submitted:
                for j, outcome in future.as_completed():
                    if isinstance(outcome, BaseException):
                        failure = failure or outcome
                    elif failure is None and per_file:
                        syncs.append(self._syncer.fdatasync(fds[first + j]))
            wait_all(syncs)
            if failure is not None:
                raise failure
            if not per_file:
                self._sync_batch()
            with self._lock:
                try:
                    for tmp, final in zip(tmps, finals):
                        self._tree.rename(tmp, final, changed_dirs)
                        renamed += 1
                finally:  # what was renamed is what its path holds now: the index takes it
                    self._index(entries[:renamed], fds[:renamed], finals, sizes)
                    self.counters["files_reused"] += sum(overwrote[:renamed])
            if per_file:
                self._syncer.fsync_dirs({Path(f).parent for f in finals} | changed_dirs | self._tree.unsynced)
            else:
                self._syncer.syncfs()
            self._tree.unsynced.clear()
            written_ok = True
        except BaseException as exc:  # (a MemoryError too: the offloader retries the batch)
            if self._evicted.to_settle:
                with self._lock:
                    self._evicted.settle()
            for future, _ in submitted:  # nothing may still write from or into a file we drop
                future.outcomes()
            concurrent.futures.wait(syncs)
            for tmp in tmps[renamed : max(reused, len(fds))]:  # reused files not yet opened too
                unlink_quietly(tmp)
            with self._lock:
                self._used -= sum(sizes[renamed:])
            # The files renamed into place (their data synced) are indexed, though the write
            # failed: memory and disk agree, and a retry of the write overwrites them.
            if self._tree.unsynced:  # else the next write fsyncs them
                with contextlib.suppress(OSError):
                    self._syncer.fsync_dirs(self._tree.unsynced)
                    self._tree.unsynced.clear()
            if not per_file:  # this write's evictions waited for its syncfs, which did not come
                with self._lock:
                    pending = self._pending_dirs.snapshot()
                with contextlib.suppress(OSError, RuntimeError):  # else a remove() fsyncs them
                    self._syncer.fsync_dirs(pending)
                    with self._lock:
                        self._pending_dirs.settle(pending)
            if isinstance(exc, GdskvError) or not isinstance(exc, OSError):
                raise
            raise IoError(f"record file write failed: {exc.strerror}", path=str(exc.filename or self.dir), errno=exc.errno) from exc
        finally:
            if heads is not None:
                heads.close()
            if not written_ok:
                for fd in fds[renamed:]:  # the others belong to the index now
                    os.close(fd)
        return evicted

    def _index(self, entries: List[IndexEntry], fds: List[int], finals: List[str], sizes: List[int]) -> None:
        """Index the files of ``entries`` (item ``i``'s descriptor ``fds[i]``, just renamed
        into place at ``finals[i]``, ``sizes[i]`` bytes already counted in ``_used``) and
        cache their descriptors. Lock held, since before the renames."""
        for entry, fd, final in zip(entries, fds, finals):
            self._evicted.undeleted.pop(entry.key, None)  # the rename replaced it
            older = self._objects.get(entry.key)
            if older is not None:  # the rename replaced its file
                self._used -= record_size(len(older.key), older.value_len)
                self._policy.remove(entry.key)
            self._objects[entry.key] = entry
            self._policy.insert(entry.key)
            if self._closed:
                os.close(fd)
            else:  # after its rename the descriptor is the record's file: reads use it
                self._open.add(entry.key, fd, entry.seq, final, pinned=False)
        self.counters["files_written"] += len(entries)
        self.counters["bytes_written"] += sum(sizes[: len(entries)])

    def _open_reused(self, i: int, tmps: List[str], finals: List[str]) -> Optional[int]:
        """Open the reused file ``tmps[i]`` for writing. One deleted behind the store's back
        (or its shard directory) is replaced by the item's own temporary name, and None
        returned: the caller creates that file. Raises OSError."""
        try:
            return self._open_file(tmps[i], os.O_RDWR, lock_held=False)
        except FileNotFoundError:
            log.warning("gdskv: reused file %s is gone; creating a new file instead", tmps[i])
            tmps[i] = finals[i] + TMP_SUFFIX
            return None

    def _sync_batch(self) -> None:
        """The syncfs after a batch's data is written: it also makes durable every rename
        and unlink of the evictions before it, so their spares become ready and their
        directories need no fsync by a remove() any more. Raises OSError."""
        with self._lock:
            covered = self._pending_dirs.snapshot()
            spares = len(self._evicted.unready)
        self._syncer.syncfs()
        with self._lock:
            self._pending_dirs.settle(covered)
            self._evicted.make_ready(spares)

    def _make_room(
        self, nbytes: int, reuse_as: Sequence[str], changed_dirs: Set[Path], spares_taken: int = 0
    ) -> Tuple[List[bytes], int]:
        """Evict objects in policy order until ``nbytes`` more fit. Lock held.

        The victims are chosen first; :attr:`evict_listener` hears all of them before any
        file goes (two-phase eviction). When even evicting every listed object would
        not make room (the rest of the cap is reserved by writes in flight),
        :class:`NoSpaceError` is raised and nothing is evicted. Then their entries go, and
        their files are reused (as the first of ``reuse_as``, the write's temporary names),
        kept as spares (beyond the first ``spares_taken`` ready ones, which the write takes)
        or deleted, as :meth:`EvictedFiles.dispose` says. Returns the evicted keys and how
        many files were reused."""
        evicted: List[bytes] = self._victims_to_fit(nbytes, self._used)
        if not evicted:
            return evicted, 0
        if self.evict_listener is not None:
            self.evict_listener(list(evicted))  # before the bytes go (two-phase eviction)
        victims: List[Tuple[bytes, int, bool]] = []
        for key in evicted:
            busy = self._open.busy(key)  # (before the entry and its descriptor go)
            victims.append((key, record_size(len(key), self._objects[key].value_len), busy))
            self._drop_entry(key)
        self.counters["objects_evicted"] += len(evicted)
        reused = self._evicted.dispose(victims, nbytes, spares_taken, reuse_as, changed_dirs, self._tree, self._syncer)
        return evicted, reused

    def _victim_size(self, key: bytes) -> int:
        """The bytes of ``key``'s record (one being read is evicted too: see :meth:`_make_room`)."""
        return record_size(len(key), self._objects[key].value_len)

    def _drop_entry(self, key: bytes) -> None:
        """Forget ``key`` (index, policy, bytes used, cached descriptor); the caller deletes
        or reuses its file. Lock held."""
        entry = self._objects.pop(key)
        self._policy.remove(key)
        self._used -= record_size(len(key), entry.value_len)
        self._open.discard(key)

    def _unlink(self, key: bytes) -> Path:
        """Delete the file of ``key``, then forget it. Lock held. Returns the file's
        directory. Raises OSError, the key kept, when the file cannot be deleted (a file
        already gone is fine)."""
        path = self.path_of(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._drop_entry(key)
        return path.parent

    # ------------------------------------------------------------------ reads

    def _entry_of(self, key: bytes) -> Optional[IndexEntry]:
        return self._objects.get(key)

    def _plan_reads(
        self, items: Sequence[ReadItem], start: int, end: int, plan: List[Tuple[int, IndexEntry]], pins: List[Handle]
    ) -> List[IoRequest]:
        """Requests for ``items[start:end]``, each on its file's cached descriptor or one
        opened for it (lock held: an eviction cannot unlink a file between lookup and open).
        Each descriptor is pinned until :meth:`_unpin_reads`.

        A file that cannot be opened is a miss, counted in ``read_errors``. Only a file that
        is gone (ENOENT: an overwrite renames over it atomically, and remove and eviction
        unlink it under the lock held here, so it is really gone) drops the replica; any
        other failure (EMFILE, EACCES, EIO, ...) may pass, and the intact file is kept."""
        requests: List[IoRequest] = []
        objects, pin, touch = self._objects, self._open.pin, self._policy.touch  # (the 4 KiB path)
        for i in range(start, end):
            key, out = items[i]
            entry = objects.get(key)
            if entry is None:
                continue
            size = entry.value_len
            if out.nbytes < size:
                raise InvalidValueError("output buffer smaller than the value", key=key[:64], size=size, got=out.nbytes)
            handle = pin(key, entry.seq)
            if handle is None:
                try:
                    handle = self._pin_file(entry)
                except OSError as exc:
                    self.counters["read_errors"] += 1
                    if exc.errno == errno.ENOENT:
                        log.warning("gdskv: dropping replica of %r: its file %s is gone", key[:64], exc.filename)
                        self._forget(entry)
                    else:
                        log.warning("gdskv: cannot open %s (keeping the replica): %s", exc.filename, exc)
                    continue
            touch(key)
            plan.append((i, entry))
            pins.append(handle)
            requests.append(IoRequest(_READ, handle.fd, entry.value_offset, (out if out.nbytes == size else out[:size],), handle.path, handle.direct))
        return requests

    def _pin_file(self, entry: IndexEntry) -> Handle:
        """The descriptor of the file of ``entry``, cached or opened for it, pinned until
        :meth:`_unpin_reads` (lock held: an eviction cannot unlink the file between lookup
        and open). Raises OSError (with the path) when it cannot be opened."""
        handle = self._open.pin(entry.key, entry.seq)
        if handle is None:
            path = self._tree.path_str(entry.key)
            fd = self._open_file(path, os.O_RDONLY, lock_held=True)
            handle = self._open.add(entry.key, fd, entry.seq, path, pinned=True)
        return handle

    def _pin_record(self, entry: IndexEntry) -> Tuple[Handle, int, str, int]:
        handle = self._pin_file(entry)
        return handle, handle.fd, handle.path, 0

    def _unpin_reads(self, pins: List[Handle]) -> None:
        unpin = self._open.unpin
        for handle in pins:
            unpin(handle)

    def _open_file(self, path: "str | Path", flags: int, *, lock_held: bool) -> int:
        """Open a record file through the engine (see :meth:`_with_descriptors`)."""
        return self._with_descriptors(self.engine.open_file, path, flags, 0o644, lock_held=lock_held)

    def _with_descriptors(self, call: Callable[..., Any], *args: Any, lock_held: bool) -> Any:
        """``call(*args)``, which opens a descriptor; when the process is out of them
        (EMFILE, ENFILE), close the cached ones no read is using and try once more. The
        cache holds up to half of the process's limit, so anything here that opens a file
        must make room this way. Raises OSError."""
        try:
            return call(*args)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            if lock_held:
                closed = self._open.shed()
            else:
                with self._lock:
                    closed = self._open.shed()
            if not closed:
                raise
            log.info("gdskv: out of file descriptors; closed %d cached ones of %s", closed, self.dir)
        return call(*args)

    def _drop_corrupt(self, entry: IndexEntry, why: str) -> None:
        """The read or check of ``entry`` (through its own file: see :meth:`_pin_file`)
        failed for ``why``: drop it, unless a write replaced it meanwhile. Lock held."""
        if self._objects.get(entry.key) is entry:
            log.warning("gdskv: dropping replica of %r in %s: %s", entry.key[:64], self.path_of(entry.key), why)
            self._forget(entry)

    def _forget(self, entry: IndexEntry) -> None:
        """Drop the replica ``entry``, still the key's current one, and its file. Lock held.
        Since a write renames and indexes in one hold of the lock, the key's path holds the
        file of ``entry``. One that cannot be deleted stays, entry and all (logged)."""
        try:
            parent = self._unlink(entry.key)
        except OSError as exc:
            log.warning("gdskv: could not delete %s: %s", self.path_of(entry.key), exc)
            return
        try:
            _sync.fsync_dir(parent)
        except OSError:
            self._pending_dirs.add(parent)  # fsynced by the next remove()

    # ------------------------------------------------------------------ the rest

    def remove(self, key: bytes) -> bool:
        """Delete the file of ``key`` and fsync its directory; returns whether it was there.

        A file that cannot be deleted raises IoError and the key stays. Every directory whose
        changes are not known to be durable (see :class:`PendingDirs`: an eviction waiting
        for its write's syncfs, an fsync that failed here or after an eviction or a dropped
        replica) is fsynced too, so that a removal, or an eviction a remove() relies on when
        it finds a key absent, is durable once remove() returns; a remove() running at the
        same time fsyncs them as well rather than count on this one."""
        with self._lock:
            self._check_open()
            found = key in self._objects
            try:
                if found:
                    self._pending_dirs.add(self._unlink(key))
                else:  # evicted, but its file is still there, or not yet handled by the write in progress
                    self._evicted.remove_leftover(key, self._unlink_leftover)
            except OSError as exc:
                raise IoError(f"could not delete the record file: {exc.strerror}", path=str(exc.filename), errno=exc.errno) from exc
            pending = self._pending_dirs.snapshot()
        if pending:
            try:
                self._syncer.fsync_dirs(pending)
            except (OSError, RuntimeError) as exc:  # they stay pending, for the next remove()
                if isinstance(exc, RuntimeError):  # the sync threads were shut down by close()
                    raise StoreClosedError("backend closed during remove()", path=str(self.dir)) from exc
                raise IoError(f"could not make the removal durable: {exc.strerror}", path=str(exc.filename or self.dir), errno=exc.errno) from exc
            with self._lock:
                self._pending_dirs.settle(pending)
        return found

    def _unlink_leftover(self, path: Path) -> None:
        """Delete the file an evicted key left at ``path`` (one already gone is fine) and make
        its directory pending. Lock held; raises OSError."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._pending_dirs.add(path.parent)

    @property
    def used_bytes(self) -> int:
        return self._used

    def layout_stats(self) -> Dict[str, int]:
        return {
            "open_files": len(self._open),
            "open_files_limit": self._open.limit,
            "open_file_hits": self._open.hits,
            "open_file_opens": self._open.opens,
            "sync": self.sync,
            **self._evicted.stats(),
        }

    def close(self) -> None:
        """Refuse new work and close the cached descriptors (one a read is using closes
        when that read ends)."""
        with self._wlock, self._lock:  # after the write in progress, if any
            self._closed = True
            self._open.clear()
            self._syncer.close_descriptor()
            self._evicted.close()
        self._syncer.shutdown()

