"""The file-per-key backend: one file per object, for debugging and inspection.

Layout under ``<store>/files/``::

    <h[0]>/<h[1]>/<h>.rec      h = hex XXH3-128 of the key

Each file holds exactly one record (see :mod:`record`: header, key, value at 4 KiB), so
``ls`` and ``xxd`` show what is stored, and the key is read from the file header, never
from the path. File names come from a hash of the key, so no key — ``../x``, ``/etc``,
NUL bytes, 4 KiB of anything — can name a path outside the store directory.

The tree has a fixed 16 x 16 = 256 shard directories, all made when the store is opened:
a write never creates a directory (on the test VM, making a new object's shard directories
took about 0.4 ms, 40% of what writing a 2 MiB object took), and the tree does not grow with the objects. Files found
elsewhere under ``files/`` when the store opens (the ``<h[0:2]>/<h[2:4]>/`` tree of
earlier versions) are moved to their place.

A write makes each file under a temporary name (through the I/O engine, ``O_DIRECT`` where
allowed), makes it durable, renames it into place and makes the renames durable; only then
does the write return. By default (``sync="filesystem"``) each of those two steps is one
``syncfs(2)`` for the whole batch (then an fsync of the store directory: see
:meth:`FilePerKeyBackend._syncfs`), so a batch flushes the device's cache a fixed number of
times, where syncing file by file (``sync="file"``: each file fdatasynced as soon as its own
write completes, then every directory whose entries changed fsynced, side by side on a few
threads) costs a flush per file on a filesystem without a journal.
Recovery deletes leftover temporary files and drops record files whose header, checksum or
name does not match their content (files of other names, and any file outside the shard
directories of either layout, are left alone). ``remove`` unlinks the file and fsyncs its
directory.
Eviction is object-level (FIFO or LRU) under the byte cap; every file counts its record size.
Writes into a full tier overwrite evicted files in place (:func:`fit_reused_file`) instead
of creating files, as the bucket backend does, but never one a read is using. In "file"
mode a write takes its own victims' files as its temporary files, once their directories
are fsynced. In "filesystem" mode its victims' files are renamed to spare names
(``<shard>/spare-<n>.tmp``) once its own writes are submitted, and the *next* write takes
them, since the first syncfs of this one has made those renames durable by then: no
eviction waits for a sync of its own.
The spares take at most about one write's bytes of disk beyond the cap (``spare_bytes`` in
:meth:`stats`); close() deletes them, and so does an open, as temporary files.

Reads go through a cache of open descriptors (:mod:`open_files`): a write keeps each new
file's descriptor (after its rename it is the record's file), a read that finds none opens
one, and up to ``open_files`` of them stay open, least recently used first out (by default
half of the process's descriptor limit). Opening and closing a file around each 4 KiB read
cost about as much CPU as the read itself. A descriptor leaves the cache when its key is
overwritten, removed or evicted, and is closed once no read is using it; when the process
runs out of descriptors the cached ones no read is using are closed and the open tried again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import xxhash

from gdskv.config_fields import FILE_PER_KEY_SYNC_MODES, check_choice
from gdskv.errors import CorruptionError, GdskvError, InvalidValueError, IoError, NoSpaceError, StoreClosedError
from gdskv.gds.aligned import preallocate
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest
from gdskv.tiers.backends.base import TRANSIENT_ERRNOS, ObjectInfo, ReadItem, RecoveryReport, StorageBackend, WriteItem
from gdskv.tiers.backends.files import TMP_SUFFIX, fit_reused_file, fsync_dir, syncfs, syncfs_available, unlink_quietly
from gdskv.tiers.backends.open_files import Handle, OpenFiles, default_limit
from gdskv.tiers.backends.record import (
    RECORD_HEADER,
    HeadBlocks,
    IndexEntry,
    checksum,
    decode_head,
    head_size,
    record_buffers,
    record_size,
)

log = logging.getLogger(__name__)

_READ = IoOp.READ

SUFFIX = ".rec"
#: The hex digits that name the shard directories of each of the tree's two levels.
SHARD_DIGITS = "0123456789abcdef"
#: Files (and directories) of one batch synced at once.
SYNC_THREADS = 16
#: Bytes of records whose files are created before their writes are submitted together.
SUBMIT_BYTES = 8 << 20
#: Names of spare files (evicted objects' files kept for later writes to overwrite):
#: ``<shard>/spare-<n>.tmp``, deleted at open as every temporary file is.
SPARE_PREFIX = "spare-"


def file_name(key: bytes) -> str:
    """The file name of ``key``: the hex XXH3-128 of the key, never the key itself."""
    return xxhash.xxh3_128_hexdigest(key) + SUFFIX


class FilePerKeyBackend(StorageBackend):
    """One record file per object in a two-level hash-sharded tree."""

    name = "file_per_key"
    subdir = "files"
    #: 2: the 16 x 16 shard tree. 1: ``<h[0:2]>/<h[2:4]>/``, moved into the tree at open;
    #: a gdskv of layout 1 would look for every file where it no longer is.
    layout_version = 2

    def __init__(
        self,
        root: Path,
        engine: IoEngine,
        *,
        capacity: int,
        eviction: str = "fifo",
        verify_on_open: str = "index",
        open_files: Optional[int] = None,
        sync: str = "filesystem",
    ) -> None:
        """``open_files``: descriptors kept open for reads (None: half of the process's
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
        super().__init__(root, engine, capacity=capacity, eviction=eviction, verify_on_open=verify_on_open)
        if sync == "filesystem" and not syncfs_available():
            log.info("gdskv: syncfs is not available here; file_per_key syncs file by file")
            sync = "file"
        #: The sync mode in use.
        self.sync = sync
        #: A descriptor of the store directory that ``syncfs`` is called on in "filesystem"
        #: mode (opened by recover(), or else by the first write; only writes use it).
        self._sync_fd: Optional[int] = None
        self._objects: Dict[bytes, IndexEntry] = {}
        #: Open descriptors of record files by key, tagged with the record's seq (lock held).
        self._open = OpenFiles(default_limit() if open_files is None else open_files)
        self._dir_str = str(self.dir)
        self._used = 0
        self._next_seq = 1
        #: Directories that gained an entry when a write made a shard directory again (one
        #: removed behind the store's back) and are not fsynced yet (that write failed, and
        #: so did its fsync of them): the next write fsyncs them with its own. Only writes
        #: (one at a time, under ``_wlock``) and the open touch it.
        self._unsynced_dirs: Set[Path] = set()
        #: Writes run one at a time (the store has one offloader; a backend used directly
        #: from several threads must not let one write's eviction take another's new file,
        #: nor two writes of a key share its temporary name). close() waits for it.
        self._wlock = threading.Lock()
        #: Directories whose changes are not known to be durable: an eviction's, until its
        #: write's first syncfs ("filesystem" mode), and those a remove, an eviction or a
        #: dropped replica could not fsync. A remove() fsyncs them before it returns (lock held).
        self._pending_dirs = PendingDirs()
        #: Files of evicted objects that could not be deleted (EIO, EROFS, an immutable
        #: file), by key: no longer indexed, but a reopen would find them and bring the key
        #: back. Each eviction tries them again, a remove() of the key must delete its file
        #: (or raise), and a new write of the key replaces it (lock held).
        self._undeleted: Dict[bytes, Path] = {}
        #: "filesystem" mode: files of evicted objects renamed to spare names, (path, bytes).
        #: A write overwrites ready ones in place instead of creating files; this write's
        #: evictions add unready ones, which become ready once a syncfs has made their
        #: renames durable (a file must not take new bytes while its victim's name may still
        #: name it after a crash). Each write keeps them to its own bytes, give or take one
        #: file (writes only, under ``_wlock``).
        self._spares: List[Tuple[str, int]] = []
        self._unready_spares: List[Tuple[str, int]] = []
        self._spares_made = 0
        #: "filesystem" mode: the objects the write in progress evicted whose files are to
        #: become spares, by key: (path, record bytes). The write renames them once its
        #: writes are submitted, so the device works meanwhile (:meth:`_settle_evicted_files`);
        #: a remove() of such a key deletes its file itself (lock held).
        self._evicted_files: Dict[bytes, Tuple[str, int]] = {}
        #: Threads that run a batch's fsyncs side by side (each mostly waits on the device).
        self._syncer = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="gdskv-fsync")
        #: The same for an eviction's directory fsyncs, which a write waits for holding the
        #: lock: nothing on these threads takes the lock (jobs on ``_syncer`` may, to shed
        #: descriptors on EMFILE, and could fill it while the lock holder waits).
        self._locked_syncer = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="gdskv-fsync-evict")
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
        return Path(self.path_str(key))

    def path_str(self, key: bytes) -> str:
        """:meth:`path_of` as a string, built without ``pathlib`` (the read path's form)."""
        name = file_name(key)
        return f"{self._dir_str}/{name[0]}/{name[1]}/{name}"

    # ------------------------------------------------------------------ recovery

    def recover(self) -> RecoveryReport:
        """Make the shard tree; index every intact record file; delete temporary and
        corrupt ones; move files found outside their place (the older layout) into it,
        keeping the newest where a key is found twice; remove the older layout's emptied
        directories. Files whose names are neither a record's nor a temporary's, and
        directories not of either layout, are left alone."""
        self._make_tree()
        with self._lock:
            self._open_sync_descriptor()
        report = RecoveryReport()
        found: Dict[bytes, Tuple[IndexEntry, Path]] = {}
        stale_dirs: Set[Path] = set()  # where an older copy of a key was deleted
        old_tree = False  # whether directories of the older layout are there
        for dirpath, _dirs, names in os.walk(self.dir):
            here = Path(dirpath)
            layout, depth = self._layout_of(here)
            old_tree = old_tree or layout == 1
            if names and (layout is None or depth != 2):  # not where either layout keeps files
                log.warning("gdskv: %s is not a shard directory; leaving its files alone", here)
                continue
            for name in names:
                path = here / name
                if name.startswith(SPARE_PREFIX) and name.endswith(TMP_SUFFIX):  # no object's
                    unlink_quietly(path)
                    continue
                if name.endswith(TMP_SUFFIX):
                    unlink_quietly(path)
                    report.dropped_torn += 1
                    continue
                if not name.endswith(SUFFIX):  # not the store's: someone put it there
                    log.warning("gdskv: %s is not a record file; leaving it alone", path)
                    continue
                try:
                    entry = self._load(path)
                except FileNotFoundError:
                    continue  # gone since the directory was listed
                if entry is None:
                    unlink_quietly(path)
                    report.dropped_corrupt += 1
                    continue
                other = found.get(entry.key)
                if other is not None:  # the same key in both layouts: the newest wins
                    if other[0].seq != entry.seq:
                        older, newer = (other, (entry, path)) if other[0].seq < entry.seq else ((entry, path), other)
                        log.info("gdskv: %s is an older copy of the record in %s; deleting it", older[1], newer[1])
                    else:  # one file under two names (a move that stopped): keep its place
                        older, newer = (other, (entry, path)) if path == self.path_of(entry.key) else ((entry, path), other)
                    unlink_quietly(older[1])
                    stale_dirs.add(older[1].parent)
                    entry, path = newer
                found[entry.key] = (entry, path)
        moves = [(path, place) for key, (_, path) in found.items() if (place := self.path_of(key)) != path]
        self._move_into_place(moves, stale_dirs)
        if old_tree:
            self._remove_old_tree()
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

    def _make_tree(self) -> None:
        """Create the shard directories that are missing, then fsync the store directory,
        ``files/`` and the first level: every directory that may have gained an entry, by
        this open or by one that stopped before its fsyncs. Raises IoError."""
        try:
            for first in SHARD_DIGITS:
                for second in SHARD_DIGITS:
                    self._make_shard(self.dir / first / second, set())
            self._fsync_dirs([self.dir.parent, self.dir] + [self.dir / first for first in SHARD_DIGITS])
        except OSError as exc:
            raise IoError(f"cannot create the shard directories: {exc.strerror}", path=str(exc.filename or self.dir), errno=exc.errno) from exc
        self._unsynced_dirs.clear()

    def _layout_of(self, path: Path) -> Tuple[Optional[int], int]:
        """``(layout, depth)`` of the directory ``path`` under ``files/``: layout 2 for the
        shard tree (``<h[0]>/<h[1]>``), 1 for the older one (``<h[0:2]>/<h[2:4]>``), None
        for ``files/`` itself and any other directory; depth 2 for a leaf."""
        parts = path.relative_to(self.dir).parts
        for layout, width in ((2, 1), (1, 2)):
            if 1 <= len(parts) <= 2 and all(len(p) == width and all(c in SHARD_DIGITS for c in p) for p in parts):
                return layout, len(parts)
        return None, len(parts)

    def _move_into_place(self, moves: List[Tuple[Path, Path]], also_sync: Set[Path]) -> None:
        """Give each record file found outside its place the name :meth:`path_of` gives it,
        then fsync the directories involved and ``also_sync``. Raises IoError.

        Each file is linked at its place, and those directories are fsynced, before its old
        name is unlinked: a rename is not crash-safe where the filesystem may write its two
        directory entries back in either order (ext4 without a journal), and this way the
        file has a durable name at every moment. A file left with both names is found twice
        by the next open, which keeps the name at its place."""
        if not moves and not also_sync:
            return
        try:
            for found_at, place in moves:
                try:
                    os.link(found_at, place)
                except OSError as exc:
                    # EEXIST: not a record of its key (recovery removed those); the others:
                    # a filesystem without hard links. A rename is what is left.
                    if exc.errno not in (errno.EEXIST, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                        raise
                    os.replace(found_at, place)
            self._fsync_dirs({place.parent for _, place in moves})
            for found_at, _ in moves:
                with contextlib.suppress(FileNotFoundError):  # replaced above
                    os.unlink(found_at)
            self._fsync_dirs({found_at.parent for found_at, _ in moves} | also_sync)
        except OSError as exc:
            raise IoError(f"cannot move a record file into place: {exc.strerror}", path=str(exc.filename or self.dir), errno=exc.errno) from exc
        if moves:
            log.info("gdskv: moved %d record files of an older layout into place in %s", len(moves), self.dir)

    def _remove_old_tree(self) -> None:
        """Remove the older layout's directories that are empty (once their files have
        moved), and fsync what held them."""
        emptied: Set[Path] = set()
        for dirpath, _dirs, _names in os.walk(self.dir, topdown=False):
            path = Path(dirpath)
            if self._layout_of(path)[0] == 1:
                with contextlib.suppress(OSError):
                    path.rmdir()  # only an empty one goes
                    emptied.add(path.parent)
        for parent in emptied:
            if parent.exists():
                _fsync_dir_quietly(parent)

    def _load(self, path: Path) -> Optional[IndexEntry]:
        """The entry of one record file, or None if it is not an intact record of its name.
        A file that cannot be read for now (EIO, EMFILE, ...) is not judged: IoError, and
        the open fails with nothing deleted. A file gone meanwhile raises FileNotFoundError."""
        try:
            with open(path, "rb") as f:
                head = f.read(RECORD_HEADER.size)
                header = decode_head(head, path=str(path))
                key = f.read(header.key_len)
                if len(key) != header.key_len or file_name(key) != path.name:
                    raise CorruptionError("file name does not match the key inside", path=str(path))
                value_at = head_size(header.key_len)
                size = os.fstat(f.fileno()).st_size
                if size < value_at + header.value_len:
                    raise CorruptionError("record file shorter than its header says", path=str(path), got=size)
                if self.verify_on_open == "full":
                    f.seek(value_at)
                    if checksum(key, f.read(header.value_len)) != header.crc:
                        raise CorruptionError("value checksum mismatch", path=str(path))
        except CorruptionError as exc:  # (a newer format's FormatVersionError goes through)
            log.warning("gdskv: dropping %s: %s", path, exc)
            return None
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise IoError(f"cannot read a record file at open: {exc.strerror}", path=str(path), errno=exc.errno) from exc
        return IndexEntry(key, value_at, header.value_len, header.seq, header.crc)

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
        finals = [self.path_str(key) for key, _, _ in items]  # (strings: pathlib costs here)
        tmps = [final + TMP_SUFFIX for final in finals]
        #: Directories that gain a shard directory (the parents of new shards), fsynced side
        #: by side with the new files' directories before the write returns.
        changed_dirs: Set[Path] = set()
        per_file = self.sync == "file"
        with self._lock:
            self._check_open()
            self._open_sync_descriptor()
            if per_file:
                evicted, reused = self._make_room(sum(sizes), tmps, changed_dirs)
            else:  # ready spares become the first items' files, once the eviction is done
                reused = min(len(self._spares), len(tmps))
                evicted, _ = self._make_room(sum(sizes), (), changed_dirs, spares_taken=reused)
                self._take_spares(tmps, reused)
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
                    fd = self._create_file(tmps[i], changed_dirs)
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
            if self._evicted_files:  # while the device works
                with self._lock:
                    self._settle_evicted_files()
            # "file": each file is fdatasynced as soon as its write completes, while the
            # others are still being written, and the syncs run side by side.
            # "filesystem": one syncfs once every write has completed.
            failure: Optional[BaseException] = None
            for future, first in submitted:
                for j, outcome in future.as_completed():
                    if isinstance(outcome, BaseException):
                        failure = failure or outcome
                    elif failure is None and per_file:
                        syncs.append(self._syncer.submit(os.fdatasync, fds[first + j]))
            _wait_all(syncs)
            if failure is not None:
                raise failure
            if not per_file:
                self._sync_batch()
            with self._lock:
                try:
                    for tmp, final in zip(tmps, finals):
                        self._rename(tmp, final, changed_dirs)
                        renamed += 1
                finally:  # what was renamed is what its path holds now: the index takes it
                    self._index(entries[:renamed], fds[:renamed], finals, sizes)
                    self.counters["files_reused"] += sum(overwrote[:renamed])
            if per_file:
                self._fsync_dirs({Path(f).parent for f in finals} | changed_dirs | self._unsynced_dirs)
            else:
                self._syncfs()
            self._unsynced_dirs.clear()
            written_ok = True
        except BaseException as exc:  # (a MemoryError too: the offloader retries the batch)
            if self._evicted_files:
                with self._lock:
                    self._settle_evicted_files()
            for future, _ in submitted:  # nothing may still write from or into a file we drop
                future.outcomes()
            concurrent.futures.wait(syncs)
            for tmp in tmps[renamed : max(reused, len(fds))]:  # reused files not yet opened too
                unlink_quietly(tmp)
            with self._lock:
                self._used -= sum(sizes[renamed:])
            # The files renamed into place (their data synced) are indexed, though the write
            # failed: memory and disk agree, and a retry of the write overwrites them.
            if self._unsynced_dirs:  # else the next write fsyncs them
                with contextlib.suppress(OSError):
                    self._fsync_dirs(self._unsynced_dirs)
                    self._unsynced_dirs.clear()
            if not per_file:  # this write's evictions waited for its syncfs, which did not come
                with self._lock:
                    pending = self._pending_dirs.snapshot()
                with contextlib.suppress(OSError, RuntimeError):  # else a remove() fsyncs them
                    self._fsync_dirs(pending)
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
            self._undeleted.pop(entry.key, None)  # the rename replaced it
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

    def _rename(self, src: "str | Path", dst: str, changed_dirs: Set[Path]) -> None:
        """Rename the file ``src`` to ``dst``, making the shard directory of ``dst`` again
        when it was removed behind the store's back (see :meth:`_make_shard`): a reused
        file or a spare lives in another shard than the object it is renamed for. Lock
        held; raises OSError (FileNotFoundError: ``src`` is gone)."""
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            shard = Path(dst).parent
            if shard.is_dir():
                raise
            self._make_shard(shard, changed_dirs)
            os.replace(src, dst)

    def _take_spares(self, tmps: List[str], count: int) -> None:
        """Make the first ``count`` ready spare files the temporary files of the first items
        (``tmps[i]`` replaced by a spare's path). Lock held."""
        for i in range(count):
            tmps[i] = self._spares[i][0]
        del self._spares[:count]

    def _settle_evicted_files(self) -> None:
        """Rename each file :meth:`_make_room` chose to become a spare to its spare name (or
        delete it, when another name links to it too or the rename fails); their
        directories wait, as pending ones, for the write's first syncfs (see
        :class:`PendingDirs`). Lock held."""
        for key, (path, size) in self._evicted_files.items():
            if not (_only_name(path) and self._make_spare(path, size)):
                self._delete_evicted_file(key, Path(path))
            self._pending_dirs.add(Path(os.path.dirname(path)))
        self._evicted_files.clear()

    def _make_spare(self, path: str, nbytes: int) -> bool:
        """Rename the evicted file ``path`` (``nbytes`` long) to a spare name in its own
        directory; returns whether it was renamed. Lock held."""
        spare = f"{os.path.dirname(path)}/{SPARE_PREFIX}{self._spares_made}{TMP_SUFFIX}"
        try:
            os.replace(path, spare)
        except OSError:
            return False
        self._spares_made += 1
        self._unready_spares.append((spare, nbytes))
        return True

    def _sync_batch(self) -> None:
        """The syncfs after a batch's data is written: it also makes durable every rename
        and unlink of the evictions before it, so their spares become ready and their
        directories need no fsync by a remove() any more. Raises OSError."""
        with self._lock:
            covered = self._pending_dirs.snapshot()
            spares = len(self._unready_spares)
        self._syncfs()
        with self._lock:
            self._pending_dirs.settle(covered)
            self._spares += self._unready_spares[:spares]
            del self._unready_spares[:spares]

    def _create_file(self, path: str, changed_dirs: Set[Path]) -> int:
        """Create (or truncate) the temporary file ``path`` and return its descriptor. The
        shard tree is made when the store opens; a shard directory removed since is made
        again (and added to ``changed_dirs``). Raises OSError."""
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            return self._open_file(path, flags, lock_held=False)
        except FileNotFoundError:
            self._make_shard(Path(path).parent, changed_dirs)
            return self._open_file(path, flags, lock_held=False)

    def _make_shard(self, shard: Path, changed_dirs: Set[Path]) -> None:
        """Create the shard directory ``shard`` (and its parent) where missing. Each
        directory that holds one of them goes into ``changed_dirs`` (the caller must fsync
        it, whoever made the entry: its file hangs from it) and, before the entry is made,
        into ``_unsynced_dirs``, which the caller clears once it has fsynced them."""
        if shard.is_dir():
            return
        for directory in (shard.parent, shard):
            self._unsynced_dirs.add(directory.parent)
            changed_dirs.add(directory.parent)
            with contextlib.suppress(FileExistsError):  # made meanwhile by another process
                directory.mkdir()

    def _make_room(
        self, nbytes: int, reuse_as: Sequence[str], changed_dirs: Set[Path], spares_taken: int = 0
    ) -> Tuple[List[bytes], int]:
        """Evict objects in policy order until ``nbytes`` more fit. Lock held.

        The victims are chosen first; :attr:`evict_listener` hears all of them before any
        file goes (two-phase eviction). When even evicting every listed object would
        not make room (the rest of the cap is reserved by writes in flight),
        :class:`NoSpaceError` is raised and nothing is evicted.

        The victims' files are not deleted but reused where they can be: in "file" mode the
        file of each victim that no read is using is renamed to the next of ``reuse_as``
        (the write's temporary names; a shard directory removed behind the store's back is
        made again here), to be overwritten in place (see :func:`fit_reused_file`); in
        "filesystem" mode it is to become a spare file while the spares hold less than
        ``nbytes`` (besides the first ``spares_taken`` ready ones, which the write takes):
        it goes into ``_evicted_files``, and the write renames it to a spare name once its
        own writes are submitted (:meth:`_settle_evicted_files`). The others are unlinked
        here. A crash leaves a reused or spare file under a temporary name, which recovery
        deletes (a victim whose file the write had not renamed yet may come back, as after
        any crash before its eviction was synced). In "file" mode the victims' directories
        are fsynced (side by side; one whose fsync fails by the next ``remove()``, and then
        no victim's file is reused: they are deleted) before the lock is released; in
        "filesystem" mode they wait for the write's first syncfs, and a ``remove()`` before
        it fsyncs them itself (and deletes a victim's file not yet renamed). Either way a
        ``remove()`` that finds a victim absent returns only once the victim cannot come
        back after a crash, and no reused file takes new bytes while its victim's name may
        still name it. Directories that
        gained a shard directory made here are added to ``changed_dirs``, which the write
        fsyncs before it returns. Returns the evicted keys and how many files were reused
        (the first of ``reuse_as``)."""
        evicted: List[bytes] = []
        freed = 0
        for key in self._policy.ordered():
            if self._used - freed + nbytes <= self.capacity:
                break
            evicted.append(key)
            freed += record_size(len(key), self._objects[key].value_len)
        if self._used - freed + nbytes > self.capacity:
            raise NoSpaceError("NVMe tier full of in-flight writes", needed=nbytes, used=self._used, capacity=self.capacity)
        if not evicted:
            return evicted, 0
        if self.evict_listener is not None:
            self.evict_listener(list(evicted))  # before the bytes go (two-phase eviction)
        reused = 0
        spare_room = nbytes - sum(size for _, size in self._spares[spares_taken:] + self._unready_spares)
        victim_dirs: Set[Path] = set()
        for key in evicted:
            in_use = self._open.busy(key)  # (before the entry and its descriptor go)
            size = record_size(len(key), self._objects[key].value_len)
            self._drop_entry(key)
            if self.sync == "filesystem" and not in_use and spare_room > 0:
                self._evicted_files[key] = (self.path_str(key), size)  # a spare, once the writes are out
                spare_room -= size
                continue
            path = self.path_of(key)
            victim_dirs.add(path.parent)
            if not in_use and reused < len(reuse_as) and _only_name(path) and self._move_file(path, reuse_as[reused], changed_dirs):
                reused += 1
            else:
                self._delete_evicted_file(key, path)
        for key, path in list(self._undeleted.items()):  # the ones that could not be deleted before
            if _delete(path):
                del self._undeleted[key]
                victim_dirs.add(path.parent)
        self.counters["objects_evicted"] += len(evicted)
        if self.sync == "filesystem":
            # Made durable by the write's first syncfs (see _sync_batch), or by a remove()
            # that comes before it.
            self._pending_dirs.update(victim_dirs)
            return evicted, reused
        # Plain fsyncs: the lock is held here, so they cannot shed cached descriptors on
        # EMFILE (that takes the lock); one that fails is left to the next remove().
        syncs = {d: self._locked_syncer.submit(fsync_dir, d) for d in victim_dirs}
        concurrent.futures.wait(list(syncs.values()))
        failed = False
        for directory, sync in syncs.items():
            if sync.exception() is not None:
                log.warning("gdskv: could not fsync %s after an eviction: %s", directory, sync.exception())
                self._pending_dirs.add(directory)
                failed = True
        if failed and reused:  # a victim's old name may still name its file: none takes new bytes
            for tmp in reuse_as[:reused]:
                unlink_quietly(tmp)
            reused = 0
        return evicted, reused

    def _delete_evicted_file(self, key: bytes, path: Path) -> None:
        """Delete the file of the evicted ``key``; one that cannot be deleted is listed in
        ``_undeleted``, for later evictions and a remove() of the key. Lock held."""
        if not _delete(path):
            log.warning("gdskv: could not delete the file of evicted %r (%s); tried again later", key[:64], path)
            self._undeleted[key] = path

    def _move_file(self, path: Path, to: str, changed_dirs: Set[Path]) -> bool:
        """:meth:`_rename` ``path`` to ``to``; returns whether it was moved."""
        try:
            self._rename(path, to, changed_dirs)
        except OSError:
            return False
        return True

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

    def lookup(self, key: bytes) -> Optional[ObjectInfo]:
        with self._lock:
            entry = self._objects.get(key)
            return None if entry is None else ObjectInfo(entry.value_len, entry.crc)

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
                path = self.path_str(key)
                try:
                    fd = self._open_file(path, os.O_RDONLY, lock_held=True)
                except OSError as exc:
                    self.counters["read_errors"] += 1
                    if exc.errno == errno.ENOENT:
                        log.warning("gdskv: dropping replica of %r: its file %s is gone", key[:64], path)
                        self._forget(entry)
                    else:
                        log.warning("gdskv: cannot open %s (keeping the replica): %s", path, exc)
                    continue
                handle = self._open.add(key, fd, entry.seq, path, pinned=True)
            touch(key)
            plan.append((i, entry))
            pins.append(handle)
            requests.append(IoRequest(_READ, handle.fd, entry.value_offset, (out if out.nbytes == size else out[:size],), handle.path, handle.direct))
        return requests

    def _unpin_reads(self, pins: List[Handle]) -> None:
        unpin = self._open.unpin
        for handle in pins:
            unpin(handle)

    def _open_file(self, path: "str | Path", flags: int, *, lock_held: bool) -> int:
        """Open a record file through the engine (see :meth:`_with_descriptors`)."""
        return self._with_descriptors(self.engine.open_file, path, flags, 0o644, lock_held=lock_held)

    def _open_sync_descriptor(self) -> None:
        """Open the store directory's descriptor that :meth:`_syncfs` uses, in "filesystem"
        mode and unless it is open (lock held). Raises IoError."""
        if self.sync != "filesystem" or self._sync_fd is not None:
            return
        try:
            self._sync_fd = self._with_descriptors(os.open, self._dir_str, os.O_RDONLY | os.O_DIRECTORY, lock_held=True)
        except OSError as exc:
            raise IoError(f"cannot open the store directory: {exc.strerror}", path=self._dir_str, errno=exc.errno) from exc

    def _syncfs(self) -> None:
        """Make everything written on the store's filesystem durable (see ``sync``);
        raises OSError. Called by a write (under ``_wlock``)."""
        assert self._sync_fd is not None
        try:
            syncfs(self._sync_fd)
            # On a filesystem without a journal (ext2, ext4 without one), syncfs starts
            # writing the metadata blocks (inodes, directories), flushes the device's cache,
            # and only then waits for those writes (the kernel's sync_filesystem:
            # sync_blockdev_nowait, ->sync_fs(wait), sync_blockdev): they may still sit in
            # the cache. An fsync of the directory flushes it again, after them (ext4
            # without a journal flushes on every fsync).
            os.fsync(self._sync_fd)
        except OSError as exc:
            exc.filename = exc.filename or self._dir_str
            raise

    def _fsync_dir(self, path: Path) -> None:
        """fsync a directory (see :meth:`_with_descriptors`); the lock is not held. One that
        is gone (a shard removed behind the store's back) has nothing left to sync."""
        with contextlib.suppress(FileNotFoundError):
            self._with_descriptors(fsync_dir, path, lock_held=False)

    def _fsync_dirs(self, paths: Iterable[Path]) -> None:
        """fsync directories side by side on the sync threads; raise the first OSError once
        all have ended. The lock is not held."""
        _wait_all([self._syncer.submit(self._fsync_dir, path) for path in paths])

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

    def _drop_read(self, pin: Handle, entry: IndexEntry, why: str) -> None:
        """The read of ``entry`` (planned under the lock, so through its own file) failed
        for ``why``: drop it, unless a write replaced it meanwhile. Lock held."""
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
            fsync_dir(parent)
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
                elif key in self._undeleted:  # evicted, but its file is still there
                    self._unlink_leftover(self._undeleted[key])
                    del self._undeleted[key]
                elif key in self._evicted_files:  # evicted by the write in progress, its file not yet handled
                    self._unlink_leftover(Path(self._evicted_files[key][0]))
                    del self._evicted_files[key]
            except OSError as exc:
                raise IoError(f"could not delete the record file: {exc.strerror}", path=str(exc.filename), errno=exc.errno) from exc
            pending = self._pending_dirs.snapshot()
        if pending:
            try:
                self._fsync_dirs(pending)
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

    def check(self) -> List[bytes]:
        """Verify every file (header, name, value checksum); drop and return corrupt keys.

        The files are read outside the lock, so a write may replace one meanwhile; a failed
        entry is dropped only if it is still current (then its path holds its file: a write
        renames and indexes in one hold of the lock). A file that cannot be read for now
        (:data:`TRANSIENT_ERRNOS`: out of descriptors, ...) is not judged."""
        with self._lock:
            snapshot = list(self._objects.values())
        failed = []
        for entry in snapshot:
            why = self._verify_file(entry)
            if why is not None:
                failed.append((entry, why))
        corrupt: List[bytes] = []
        with self._lock:
            for entry, why in failed:
                if self._objects.get(entry.key) is not entry:
                    continue  # removed, overwritten or evicted meanwhile: not corrupt
                log.warning("gdskv: corrupt object %r: %s", entry.key[:64], why)
                self._forget(entry)
                corrupt.append(entry.key)
            self.counters["corrupt_reads"] += len(corrupt)
        return corrupt

    def _verify_file(self, entry: IndexEntry) -> Optional[str]:
        """Why the file of ``entry`` does not hold it (header, key, seq, value checksum), or
        None when it does. Reads the file without the lock."""
        path = self.path_of(entry.key)
        try:
            fd = self._with_descriptors(os.open, path, os.O_RDONLY, lock_held=False)
            with os.fdopen(fd, "rb") as f:
                header = decode_head(f.read(RECORD_HEADER.size), path=str(path))
                key = f.read(header.key_len)
                f.seek(entry.value_offset)
                value = f.read(entry.value_len)
            if (key, header.seq) != (entry.key, entry.seq) or checksum(key, value) != entry.crc:
                raise CorruptionError("record does not match the index", path=str(path))
        except CorruptionError as exc:
            return str(exc)
        except OSError as exc:
            if exc.errno in TRANSIENT_ERRNOS:
                log.warning("gdskv: check() could not read %s for now: %s", path, exc)
                return None
            return str(exc)
        return None

    @property
    def used_bytes(self) -> int:
        return self._used

    def layout_stats(self) -> Dict[str, int]:
        return {
            "open_files": len(self._open),
            "open_files_limit": self._open.limit,
            "open_file_hits": self._open.hits,
            "open_file_opens": self._open.opens,
            "undeleted_files": len(self._undeleted),
            "sync": self.sync,
            "spare_files": len(self._spares) + len(self._unready_spares),
            "spare_bytes": sum(size for _, size in self._spares + self._unready_spares),
        }

    def close(self) -> None:
        """Refuse new work and close the cached descriptors (one a read is using closes
        when that read ends)."""
        with self._wlock, self._lock:  # after the write in progress, if any
            self._closed = True
            self._open.clear()
            if self._sync_fd is not None:
                os.close(self._sync_fd)
                self._sync_fd = None
            for spare, _ in self._spares + self._unready_spares:  # else the next open deletes them
                unlink_quietly(spare)
            self._spares.clear()
            self._unready_spares.clear()
        self._syncer.shutdown(wait=True)
        self._locked_syncer.shutdown(wait=True)


class PendingDirs:
    """Directories whose changed entries (an unlink, an eviction's rename) are not known to be
    durable, each with the number of its latest change. Callers hold the backend's lock.

    A sync covers the changes made before it began: take a :meth:`snapshot` first, sync, then
    :meth:`settle` it, which forgets only the directories no change reached meanwhile.
    Nothing is forgotten before its sync ends, so a second caller (a remove() running beside
    another) sees the directories still pending and syncs them itself."""

    def __init__(self) -> None:
        self._dirs: Dict[Path, int] = {}
        self._changes = 0

    def add(self, directory: Path) -> None:
        self._changes += 1
        self._dirs[directory] = self._changes

    def update(self, directories: Iterable[Path]) -> None:
        for directory in directories:
            self.add(directory)

    def snapshot(self) -> Dict[Path, int]:
        return dict(self._dirs)

    def settle(self, synced: Dict[Path, int]) -> None:
        for directory, change in synced.items():
            if self._dirs.get(directory) == change:
                del self._dirs[directory]


def _wait_all(futures: Sequence["concurrent.futures.Future[None]"]) -> None:
    """Wait for every future, then raise the first one's error, if any."""
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def _delete(path: "str | Path") -> bool:
    """Unlink ``path``; whether it is gone (a file already gone is)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _only_name(path: "str | Path") -> bool:
    """Whether ``path`` is a regular file that no other name links to: only such a victim's
    file may be overwritten in place for a new object (a hard-linked copy of the store, or
    a record that is a symlink to a file elsewhere, must not take another key's bytes)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _fsync_dir_quietly(path: Path) -> None:
    try:
        fsync_dir(path)
    except OSError:
        pass
