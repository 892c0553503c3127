"""What becomes of the files of objects the file-per-key backend evicts.

Eviction is object-level (FIFO or LRU) under the byte cap; every file counts its record
size. Writes into a full tier overwrite evicted files in place
(:func:`~gdskv.tiers.backends.files.fit_reused_file`) instead of creating files, as the
bucket backend does, but never one a read is using:

- in "file" mode a write takes its own victims' files as its temporary files, once their
  directories are fsynced (:meth:`EvictedFiles.dispose`);
- in "filesystem" mode its victims' files are renamed to spare names
  (``<shard>/spare-<n>.tmp``) once its own writes are submitted, and the *next* write takes
  them, since the first syncfs of this one has made those renames durable by then: no
  eviction waits for a sync of its own. The spares take at most about one write's bytes of
  disk beyond the cap (``spare_bytes`` in the stats); close() deletes them, and so does an
  open, as temporary files.

An evicted file that cannot be deleted (EIO, EROFS, an immutable file) is kept in
:attr:`EvictedFiles.undeleted`: no longer indexed, but a reopen would find it and bring the
key back, so each eviction tries it again, a ``remove()`` of the key must delete it (or
raise), and a new write of the key replaces it.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Set, Tuple

from gdskv.tiers.backends.file_per_key.sync import PendingDirs, Syncer
from gdskv.tiers.backends.file_per_key.tree import SPARE_PREFIX, ShardTree
from gdskv.tiers.backends.files import TMP_SUFFIX, unlink_quietly

log = logging.getLogger(__name__)


class EvictedFiles:
    """The evicted objects' files a backend keeps track of (callers hold its lock; the
    spares are the writes', one at a time). Directories whose entries change here go to
    ``pending_dirs``, to be made durable by the write's syncfs or a ``remove()``."""

    def __init__(self, pending_dirs: PendingDirs) -> None:
        self._pending_dirs = pending_dirs
        #: Files renamed to spare names, (path, bytes), that a write may overwrite: ready
        #: ones; unready ones wait for a syncfs to make their renames durable (a file must
        #: not take new bytes while its victim's name may still name it after a crash).
        self.ready: List[Tuple[str, int]] = []
        self.unready: List[Tuple[str, int]] = []
        self._made = 0
        #: The objects the write in progress evicted whose files are to become spares, by
        #: key: (path, record bytes). The write renames them once its writes are submitted,
        #: so the device works meanwhile (:meth:`settle`).
        self.to_settle: Dict[bytes, Tuple[str, int]] = {}
        #: Evicted files that could not be deleted, by key.
        self.undeleted: Dict[bytes, Path] = {}

    def dispose(
        self,
        victims: Sequence[Tuple[bytes, int, bool]],
        nbytes: int,
        spares_taken: int,
        reuse_as: Sequence[str],
        changed_dirs: Set[Path],
        tree: ShardTree,
        syncer: Syncer,
    ) -> int:
        """What becomes of the files of an eviction's ``victims`` (key, record bytes, and
        whether a read is using its file; their entries are gone already) for a write of
        ``nbytes``. Returns how many of ``reuse_as`` (the write's temporary names) are
        victims' files now: the first ones.

        The victims' files are not deleted but reused where they can be: in "file" mode the
        file of each victim that no read is using is renamed to the next of ``reuse_as``
        (a shard directory removed behind the store's back is made again here), to be
        overwritten in place (see :func:`~gdskv.tiers.backends.files.fit_reused_file`); in
        "filesystem" mode it is to become a spare file while the spares hold less than
        ``nbytes`` (besides the first ``spares_taken`` ready ones, which the write takes):
        it is kept as one (:meth:`keep_as_spare`), and the write renames it to a spare name
        once its own writes are submitted (:meth:`settle`). The others are unlinked here. A
        crash leaves a reused or spare file under a temporary name, which recovery deletes
        (a victim whose file the write had not renamed yet may come back, as after any crash
        before its eviction was synced). In "file" mode the victims' directories are fsynced
        (side by side; one whose fsync fails by the next ``remove()``, and then no victim's
        file is reused: they are deleted) before the lock is released; in "filesystem" mode
        they wait for the write's first syncfs, and a ``remove()`` before it fsyncs them
        itself (and deletes a victim's file not yet renamed). Either way a ``remove()`` that
        finds a victim absent returns only once the victim cannot come back after a crash,
        and no reused file takes new bytes while its victim's name may still name it.
        Directories that gained a shard directory made here are added to ``changed_dirs``,
        which the write fsyncs before it returns."""
        reused = 0
        spare_room = self.spare_room(nbytes, spares_taken)
        victim_dirs: Set[Path] = set()
        for key, size, busy in victims:
            if syncer.mode == "filesystem" and not busy and spare_room > 0:
                self.keep_as_spare(key, tree.path_str(key), size)  # a spare, once the writes are out
                spare_room -= size
                continue
            path = tree.path_of(key)
            victim_dirs.add(path.parent)
            if not busy and reused < len(reuse_as) and only_name(path) and tree.move(path, reuse_as[reused], changed_dirs):
                reused += 1
            else:
                self.delete(key, path)
        victim_dirs |= self.retry_undeleted()  # the ones that could not be deleted before
        if syncer.mode == "filesystem":
            # Made durable by the write's first syncfs (the backend's _sync_batch), or by a
            # remove() that comes before it.
            self._pending_dirs.update(victim_dirs)
            return reused
        # Plain fsyncs: the lock is held here, so they cannot shed cached descriptors on
        # EMFILE (that takes the lock); one that fails is left to the next remove().
        failed = syncer.fsync_dirs_locked(victim_dirs)
        for directory, exc in failed.items():
            log.warning("gdskv: could not fsync %s after an eviction: %s", directory, exc)
            self._pending_dirs.add(directory)
        if failed and reused:  # a victim's old name may still name its file: none takes new bytes
            for tmp in reuse_as[:reused]:
                unlink_quietly(tmp)
            reused = 0
        return reused

    def take(self, tmps: List[str], count: int) -> None:
        """Make the first ``count`` ready spares the temporary files of a write's first
        items (``tmps[i]`` replaced by a spare's path)."""
        for i in range(count):
            tmps[i] = self.ready[i][0]
        del self.ready[:count]

    def spare_room(self, nbytes: int, taken: int) -> int:
        """How many bytes of spares a write of ``nbytes`` that took the first ``taken``
        ready ones may still keep."""
        return nbytes - sum(size for _, size in self.ready[taken:] + self.unready)

    def keep_as_spare(self, key: bytes, path: str, size: int) -> None:
        """The file of the evicted ``key`` is to become a spare (:meth:`settle`)."""
        self.to_settle[key] = (path, size)

    def settle(self) -> None:
        """Rename each file :meth:`keep_as_spare` chose to a spare name in its directory (or
        delete it, when another name links to it too or the rename fails); the directories
        go to the pending ones, for the write's first syncfs."""
        for key, (path, size) in self.to_settle.items():
            if not (only_name(path) and self._make_spare(path, size)):
                self.delete(key, Path(path))
            self._pending_dirs.add(Path(os.path.dirname(path)))
        self.to_settle.clear()

    def _make_spare(self, path: str, nbytes: int) -> bool:
        spare = f"{os.path.dirname(path)}/{SPARE_PREFIX}{self._made}{TMP_SUFFIX}"
        try:
            os.replace(path, spare)
        except OSError:
            return False
        self._made += 1
        self.unready.append((spare, nbytes))
        return True

    def make_ready(self, count: int) -> None:
        """The first ``count`` unready spares' renames are durable (a syncfs covered them)."""
        self.ready += self.unready[:count]
        del self.unready[:count]

    def delete(self, key: bytes, path: Path) -> None:
        """Delete the file of the evicted ``key``; one that cannot be deleted is listed in
        :attr:`undeleted`, for later evictions and a remove() of the key."""
        if not delete(path):
            log.warning("gdskv: could not delete the file of evicted %r (%s); tried again later", key[:64], path)
            self.undeleted[key] = path

    def retry_undeleted(self) -> Set[Path]:
        """Try the files that could not be deleted again; returns the directories of those
        deleted now."""
        changed: Set[Path] = set()
        for key, path in list(self.undeleted.items()):
            if delete(path):
                del self.undeleted[key]
                changed.add(path.parent)
        return changed

    def remove_leftover(self, key: bytes, unlink: Callable[[Path], None]) -> None:
        """A remove() of ``key``, which is not indexed: ``unlink`` the file an eviction of
        it left (undeleted, or not yet settled by the write in progress), if any. Raises
        what ``unlink`` raises, the file still listed."""
        if key in self.undeleted:
            unlink(self.undeleted[key])
            del self.undeleted[key]
        elif key in self.to_settle:
            unlink(Path(self.to_settle[key][0]))
            del self.to_settle[key]

    def close(self) -> None:
        """Delete the spares (else the next open deletes them)."""
        for spare, _ in self.ready + self.unready:
            unlink_quietly(spare)
        self.ready.clear()
        self.unready.clear()

    def stats(self) -> Dict[str, int]:
        return {
            "undeleted_files": len(self.undeleted),
            "spare_files": len(self.ready) + len(self.unready),
            "spare_bytes": sum(size for _, size in self.ready + self.unready),
        }


def delete(path: "str | Path") -> bool:
    """Unlink ``path``; whether it is gone (a file already gone is)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def only_name(path: "str | Path") -> bool:
    """Whether ``path`` is a regular file that no other name links to: only such a victim's
    file may be overwritten in place for a new object (a hard-linked copy of the store, or
    a record that is a symlink to a file elsewhere, must not take another key's bytes)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1
