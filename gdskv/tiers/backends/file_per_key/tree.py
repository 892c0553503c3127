"""Where the file-per-key backend keeps each object: a hash-named 16 x 16 shard tree.

Layout under ``<store>/files/``::

    <h[0]>/<h[1]>/<h>.rec      h = hex XXH3-128 of the key

Each file holds exactly one record (see :mod:`gdskv.tiers.backends.record`: header, key,
value at 4 KiB), so ``ls`` and ``xxd`` show what is stored, and the key is read from the
file header, never from the path. File names come from a hash of the key, so no key —
``../x``, ``/etc``, NUL bytes, 4 KiB of anything — can name a path outside the store
directory.

The tree has a fixed 16 x 16 = 256 shard directories, all made when the store is opened:
a write never creates a directory (making a new object's shard directories cost a large
part of a 2 MiB write: docs/notes/file-per-key-and-filesystem.md), and the tree does not grow
with the objects. A shard removed behind the store's back is made again by the write that
needs it (:meth:`ShardTree.make_shard`). Files found elsewhere under ``files/`` when the
store opens (the ``<h[0:2]>/<h[2:4]>/`` tree of earlier versions, *layout 1*) are moved to
their place (:meth:`ShardTree.move_into_place`).

At open, :meth:`ShardTree.scan` walks the tree: it deletes temporary files, reads every
record file's header through the I/O engine (:func:`load_record`) and drops those whose
header, name or (with a full verification) value does not match; files of other names, and
any file outside the shard directories of either layout, are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import xxhash

from gdskv.errors import CorruptionError, IoError
from gdskv.gds.engine import IoEngine, IoRequest
from gdskv.tiers.backends.base import RecordReader, RecoveryReport
from gdskv.tiers.backends.file_per_key import sync
from gdskv.tiers.backends.files import TMP_SUFFIX, unlink_quietly
from gdskv.tiers.backends.record import RECORD_HEADER, IndexEntry, decode_head, head_size

log = logging.getLogger(__name__)

SUFFIX = ".rec"
#: The hex digits that name the shard directories of each of the tree's two levels.
SHARD_DIGITS = "0123456789abcdef"
#: Names of spare files (evicted objects' files kept for later writes to overwrite, see
#: :mod:`.evicted`): ``<shard>/spare-<n>.tmp``, deleted at open as every temporary file is.
SPARE_PREFIX = "spare-"

#: What :meth:`ShardTree.scan` found: key -> (its entry, the file it is in).
Found = Dict[bytes, Tuple[IndexEntry, Path]]


def file_name(key: bytes) -> str:
    """The file name of ``key``: the hex XXH3-128 of the key, never the key itself."""
    return xxhash.xxh3_128_hexdigest(key) + SUFFIX


class ShardTree:
    """The shard tree under ``root`` (``<store>/files``): names, directories, the scan at
    open and the move of an older layout's files into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root_str = str(root)
        #: Directories that gained an entry when a write made a shard directory again (one
        #: removed behind the store's back) and are not fsynced yet (that write failed, and
        #: so did its fsync of them): the next write fsyncs them with its own and clears
        #: this. Only writes (one at a time) and the open touch it.
        self.unsynced: Set[Path] = set()

    def path_str(self, key: bytes) -> str:
        """Where the record of ``key`` lives, as a string built without ``pathlib`` (the
        read path's form): inside the store directory, whatever the key."""
        name = file_name(key)
        return f"{self._root_str}/{name[0]}/{name[1]}/{name}"

    def path_of(self, key: bytes) -> Path:
        return Path(self.path_str(key))

    def make(self, fsync_dirs: Callable[[Iterable[Path]], None]) -> None:
        """Create the shard directories that are missing, then fsync the store directory,
        ``files/`` and the first level: every directory that may have gained an entry, by
        this open or by one that stopped before its fsyncs. Raises IoError."""
        try:
            for first in SHARD_DIGITS:
                for second in SHARD_DIGITS:
                    self.make_shard(self.root / first / second, set())
            fsync_dirs([self.root.parent, self.root] + [self.root / first for first in SHARD_DIGITS])
        except OSError as exc:
            raise IoError(f"cannot create the shard directories: {exc.strerror}", path=str(exc.filename or self.root), errno=exc.errno) from exc
        self.unsynced.clear()

    def make_shard(self, shard: Path, changed_dirs: Set[Path]) -> None:
        """Create the shard directory ``shard`` (and its parent) where missing. Each
        directory that holds one of them goes into ``changed_dirs`` (the caller must fsync
        it, whoever made the entry: its file hangs from it) and, before the entry is made,
        into :attr:`unsynced`, which the caller clears once it has fsynced them."""
        if shard.is_dir():
            return
        for directory in (shard.parent, shard):
            self.unsynced.add(directory.parent)
            changed_dirs.add(directory.parent)
            with contextlib.suppress(FileExistsError):  # made meanwhile by another process
                directory.mkdir()

    def create(self, path: str, changed_dirs: Set[Path], open_file: Callable[..., int]) -> int:
        """Create (or truncate) the temporary file ``path`` with ``open_file(path, flags,
        lock_held=False)`` and return its descriptor. The shard tree is made when the store
        opens; a shard directory removed since is made again (see :meth:`make_shard`).
        Raises OSError."""
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            return open_file(path, flags, lock_held=False)
        except FileNotFoundError:
            self.make_shard(Path(path).parent, changed_dirs)
            return open_file(path, flags, lock_held=False)

    def rename(self, src: "str | Path", dst: str, changed_dirs: Set[Path]) -> None:
        """Rename the file ``src`` to ``dst``, making the shard directory of ``dst`` again
        when it was removed behind the store's back (see :meth:`make_shard`): a reused file
        or a spare lives in another shard than the object it is renamed for. Raises OSError
        (FileNotFoundError: ``src`` is gone)."""
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            shard = Path(dst).parent
            if shard.is_dir():
                raise
            self.make_shard(shard, changed_dirs)
            os.replace(src, dst)

    def move(self, path: Path, to: str, changed_dirs: Set[Path]) -> bool:
        """:meth:`rename` ``path`` to ``to``; returns whether it was moved."""
        try:
            self.rename(path, to, changed_dirs)
        except OSError:
            return False
        return True

    def layout_of(self, path: Path) -> Tuple[Optional[int], int]:
        """``(layout, depth)`` of the directory ``path`` under ``files/``: layout 2 for the
        shard tree (``<h[0]>/<h[1]>``), 1 for the older one (``<h[0:2]>/<h[2:4]>``), None
        for ``files/`` itself and any other directory; depth 2 for a leaf."""
        parts = path.relative_to(self.root).parts
        for layout, width in ((2, 1), (1, 2)):
            if 1 <= len(parts) <= 2 and all(len(p) == width and all(c in SHARD_DIGITS for c in p) for p in parts):
                return layout, len(parts)
        return None, len(parts)

    def scan(self, load: Callable[[Path], Optional[IndexEntry]], report: RecoveryReport) -> Tuple[Found, Set[Path], bool]:
        """Index every intact record file of either layout (``load``: its entry, None when
        it is not an intact record of its name; FileNotFoundError when it is gone);
        delete temporary and corrupt files (counted in ``report``), and the older copy
        where a key is found twice (the newest wins; one file under two names keeps its
        place). Returns what was found, the directories an older copy was deleted from,
        and whether directories of the older layout are there."""
        found: Found = {}
        stale_dirs: Set[Path] = set()
        old_tree = False
        for dirpath, _dirs, names in os.walk(self.root):
            here = Path(dirpath)
            layout, depth = self.layout_of(here)
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
                    entry = load(path)
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
        return found, stale_dirs, old_tree

    def move_into_place(self, moves: List[Tuple[Path, Path]], also_sync: Set[Path], fsync_dirs: Callable[[Iterable[Path]], None]) -> None:
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
            fsync_dirs({place.parent for _, place in moves})
            for found_at, _ in moves:
                with contextlib.suppress(FileNotFoundError):  # replaced above
                    os.unlink(found_at)
            fsync_dirs({found_at.parent for found_at, _ in moves} | also_sync)
        except OSError as exc:
            raise IoError(f"cannot move a record file into place: {exc.strerror}", path=str(exc.filename or self.root), errno=exc.errno) from exc
        if moves:
            log.info("gdskv: moved %d record files of an older layout into place in %s", len(moves), self.root)

    def remove_old_tree(self) -> None:
        """Remove the older layout's directories that are empty (once their files have
        moved), and fsync what held them."""
        emptied: Set[Path] = set()
        for dirpath, _dirs, _names in os.walk(self.root, topdown=False):
            path = Path(dirpath)
            if self.layout_of(path)[0] == 1:
                with contextlib.suppress(OSError):
                    path.rmdir()  # only an empty one goes
                    emptied.add(path.parent)
        for parent in emptied:
            if parent.exists():
                sync.fsync_dir_quietly(parent)


def load_record(engine: IoEngine, path: Path, reader: Optional[RecordReader]) -> Optional[IndexEntry]:
    """The entry of the record file ``path``, or None if it is not an intact record of its
    name. Read through ``engine``; with a ``reader`` (a full verification at open), also
    verified as ``check()`` verifies a record. A file that cannot be read for now (EIO,
    EMFILE, ...) is not judged: IoError, and the open fails with nothing deleted. A file
    gone meanwhile raises FileNotFoundError; one of a newer format, FormatVersionError."""
    try:
        fd = engine.open_file(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            head = bytearray(min(size, head_size(0)))
            engine.run([IoRequest.read(fd, 0, memoryview(head), path=str(path))])
            header = decode_head(head, path=str(path))
            value_at = head_size(header.key_len)
            if size < value_at + header.value_len:
                raise CorruptionError("record file shorter than its header says", path=str(path), got=size)
            if value_at > len(head):  # a key longer than the first block holds
                head = bytearray(value_at)
                engine.run([IoRequest.read(fd, 0, memoryview(head), path=str(path))])
            key = bytes(head[RECORD_HEADER.size : RECORD_HEADER.size + header.key_len])
            if file_name(key) != path.name:
                raise CorruptionError("file name does not match the key inside", path=str(path))
            entry = IndexEntry(key, value_at, header.value_len, header.seq, header.crc)
            why = reader.verify(fd, str(path), 0, entry) if reader is not None else None
            if why is not None:
                raise CorruptionError(why, path=str(path))
        finally:
            os.close(fd)
    except CorruptionError as exc:  # (a newer format's FormatVersionError goes through)
        log.warning("gdskv: dropping %s: %s", path, exc)
        return None
    except FileNotFoundError:
        raise
    except OSError as exc:
        code = exc.context.get("errno") if isinstance(exc, IoError) else exc.errno
        raise IoError(f"cannot read a record file at open: {exc.strerror or exc}", path=str(path), errno=code) from exc
    return entry
