"""Aligned memory and the O_DIRECT rules every engine follows.

A file opened with ``O_DIRECT`` moves bytes between the device and user memory without the
page cache, and the kernel then insists that the file offset, the transfer length and every
buffer's address and length are multiples of the device's block size. gdskv uses
:data:`DIRECT_ALIGN` (4 KiB, a multiple of every common logical block size).

Callers never manage alignment. An engine looks at each request:

- the file is not ``O_DIRECT`` (:func:`is_direct_fd`), or the request already obeys the
  rules (:func:`is_aligned`): the user's buffers are used as they are, zero-copy;
- otherwise the engine moves the *aligned span* around the request (:func:`span`) through
  staging memory it allocated once (:func:`alloc_aligned`); :mod:`gdskv.gds.bounce` plans
  that transfer.

Large buffers (the DRAM tier's arena, the engines' staging) are mapped by
:func:`map_anonymous`: private anonymous memory (Python's ``mmap.mmap(-1, n)`` maps
*shared* memory, which the kernel keeps in shmem and which O_DIRECT pins more slowly), on
transparent huge pages where the kernel allows. The kernel pins every page of a user
buffer for an O_DIRECT transfer and hands the device one scatter-gather segment per
physically contiguous run, so a 2 MiB write from 4 KiB pages is up to 512 segments and
from huge pages one or two (a value is page-aligned, not huge-page-aligned). On a virtual
disk, whose requests cost per segment, O_DIRECT writes ran slowest from shared memory and
fastest from private memory on huge pages (docs/notes/odirect-memory.md).

Helpers to open files: :func:`open_file` adds ``O_DIRECT`` when asked and falls back to
buffered I/O on a filesystem that refuses it (ramfs, some FUSE and network filesystems).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

#: Alignment of offsets, lengths and addresses for O_DIRECT transfers.
DIRECT_ALIGN = 4096
#: Size of a transparent huge page (x86-64, and arm64 with 4 KiB pages).
HUGE_PAGE = 2 << 20
#: Most iovecs one vectored call accepts (Linux IOV_MAX).
IOV_MAX = 1024
#: Largest aligned span (bytes) of a read that the engines move through a small staging
#: buffer and copy out, aligned or not: at a few pages the copy costs less than checking the
#: caller's alignment and having the kernel map its pages.
SMALL_READ = 16 << 10
O_DIRECT = getattr(os, "O_DIRECT", 0)
O_NOATIME = getattr(os, "O_NOATIME", 0)


def align_down(n: int, alignment: int = DIRECT_ALIGN) -> int:
    return n - n % alignment


def align_up(n: int, alignment: int = DIRECT_ALIGN) -> int:
    return -(-n // alignment) * alignment


#: Where Linux says how it hands out transparent huge pages.
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> Optional[str]:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or
    None on a kernel without them."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return None


def map_anonymous(nbytes: int, *, huge: bool = True) -> Tuple[mmap.mmap, bool]:
    """Private, page-aligned anonymous memory of ``nbytes`` (> 0), zero-filled lazily by the
    kernel.

    The mapping is not inherited by a forked child (``MADV_DONTFORK``): the memory is I/O
    memory of this process (pinned by io_uring and CUDA where registered, which a fork would
    otherwise copy at once), and a child has no business touching it; one that does gets a
    segmentation fault rather than a silent copy of the parent's cache.

    With ``huge`` and at least :data:`HUGE_PAGE` bytes, the mapping is advised
    ``MADV_HUGEPAGE`` (see the module docstring): the kernel then backs its 2 MiB-aligned
    stretches with huge pages where it can. That is advice, not a reservation: with
    transparent huge pages set to ``never``, or no huge page free, the memory is ordinary.
    Returns ``(mapping, advised)``: whether the kernel accepted the advice (not whether
    it has huge pages to give: with THP ``never`` the advice is accepted and ignored).
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mapping, _advise(mapping, nbytes, huge)


def map_shared(nbytes: int, *, huge: bool = True, name: str = "gdskv") -> Tuple[mmap.mmap, int, bool]:
    """Shared memory of ``nbytes`` (> 0) that other processes can map: an anonymous memory
    file (``memfd_create``, close-on-exec) mapped ``MAP_SHARED``, zero-filled lazily. The
    descriptor is what another process maps (it is passed over a Unix socket); the memory
    lives while any process maps it or holds the descriptor. As in :func:`map_anonymous`,
    a forked child does not inherit the mapping, and ``huge`` advises huge pages (shared
    memory gets them only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
    allows). Returns ``(mapping, descriptor, advised)``; the caller closes both."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return mapping, fd, _advise(mapping, nbytes, huge)


def _advise(mapping: mmap.mmap, nbytes: int, huge: bool) -> bool:
    """Not inherited by a forked child; with ``huge``, advised onto huge pages. Returns
    whether the huge-page advice was accepted."""
    if hasattr(mmap, "MADV_DONTFORK"):
        try:
            mapping.madvise(mmap.MADV_DONTFORK)
        except OSError:  # not refused on Linux; other systems: inherited as usual
            pass
    if huge and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
            return True
        except OSError:  # a kernel built without transparent huge pages
            return False
    return False


class AlignedBuffer:
    """Page-aligned anonymous memory, allocated once, zero-filled lazily by the kernel
    (:func:`map_anonymous`; with ``huge``, advised onto huge pages where it is large enough:
    right for long-lived staging, not for short-lived buffers that a huge-page fault would
    zero-fill 2 MiB at a time).

    ``view`` is a writable byte memoryview of the whole buffer. ``close()`` unmaps it once
    no view is alive (a live view keeps the mapping until it is released).
    """

    def __init__(self, nbytes: int, *, huge: bool = True) -> None:
        if nbytes <= 0:
            raise ValueError("aligned buffer size must be positive")
        self.nbytes = align_up(nbytes, mmap.PAGESIZE)
        self._map: Optional[mmap.mmap]
        self._map, self.huge_pages_advised = map_anonymous(self.nbytes, huge=huge)
        self.view = memoryview(self._map)

    def close(self) -> None:
        if self._map is None:
            return
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            return  # a caller still holds a view; the mapping goes when it does
        self._map = None


def alloc_aligned(nbytes: int, *, huge: bool = True) -> AlignedBuffer:
    """Allocate ``nbytes`` (rounded up to whole pages) of page-aligned memory
    (:class:`AlignedBuffer`)."""
    return AlignedBuffer(nbytes, huge=huge)


def address_of(buf: memoryview) -> int:
    """The address of the first byte of ``buf`` (0 for an empty buffer, which has none to
    point at: an I/O entry of length 0 moves nothing wherever it points)."""
    if not buf.nbytes:
        return 0
    if not buf.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def is_direct_fd(fd: int) -> bool:
    """Whether ``fd`` was opened with ``O_DIRECT`` (and so needs aligned transfers)."""
    return bool(O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


def is_aligned(offset: int, buffers: Sequence[memoryview], alignment: int = DIRECT_ALIGN) -> bool:
    """Whether a transfer at ``offset`` over ``buffers`` obeys the O_DIRECT rules as is."""
    if offset % alignment or len(buffers) > IOV_MAX:
        return False
    for b in buffers:
        if b.nbytes % alignment or address_of(b) % alignment:
            return False
    return True


def span(offset: int, nbytes: int, alignment: int = DIRECT_ALIGN) -> Tuple[int, int]:
    """The aligned ``[lo, hi)`` file range that covers ``[offset, offset + nbytes)``."""
    return align_down(offset, alignment), align_up(offset + nbytes, alignment)


def chunks(lo: int, hi: int, chunk: int) -> Iterator[Tuple[int, int]]:
    """Split the aligned range ``[lo, hi)`` into aligned pieces of at most ``chunk`` bytes."""
    pos = lo
    while pos < hi:
        end = min(pos + chunk, hi)
        yield pos, end
        pos = end


def gather(buffers: Sequence[memoryview], start: int, dst: memoryview) -> None:
    """Copy bytes ``[start, start + len(dst))`` of the concatenated ``buffers`` into ``dst``."""
    _copy(buffers, start, dst, into_buffers=False)


def scatter(src: memoryview, buffers: Sequence[memoryview], start: int) -> None:
    """Copy ``src`` into bytes ``[start, start + len(src))`` of the concatenated ``buffers``."""
    _copy(buffers, start, src, into_buffers=True)


def slices(buffers: Sequence[memoryview], start: int, nbytes: int) -> List[memoryview]:
    """Views of bytes ``[start, start + nbytes)`` of the concatenated ``buffers`` (no copy)."""
    out: List[memoryview] = []
    pos = 0
    end = start + nbytes
    for b in buffers:
        n = b.nbytes
        lo, hi = max(start - pos, 0), min(end - pos, n)
        if lo < hi:
            out.append(b[lo:hi])
        pos += n
        if pos >= end:
            break
    return out


def split_views(buffers: Sequence[memoryview], piece: int) -> List[List[memoryview]]:
    """The concatenated ``buffers`` cut into consecutive pieces of ``piece`` bytes (the last
    one shorter), each as views (no copy): what :func:`slices` gives for every piece, in
    one pass over the buffers instead of one per piece."""
    out: List[List[memoryview]] = []
    current: List[memoryview] = []
    room = piece
    for b in buffers:
        pos, n = 0, b.nbytes
        while n - pos > room:
            current.append(b[pos : pos + room])
            out.append(current)
            pos += room
            current, room = [], piece
        if n - pos:
            current.append(b if pos == 0 else b[pos:])
            room -= n - pos
        if room == 0:
            out.append(current)
            current, room = [], piece
    if current:
        out.append(current)
    return out


def _copy(buffers: Sequence[memoryview], start: int, flat: memoryview, *, into_buffers: bool) -> None:
    want = flat.nbytes
    if len(buffers) == 1:  # the common case, without the walk
        if into_buffers:
            buffers[0][start : start + want] = flat
        else:
            flat[:] = buffers[0][start : start + want]
        return
    pos = 0  # position of the current buffer in the concatenation
    done = 0
    for b in buffers:
        n = b.nbytes
        if pos + n <= start:
            pos += n
            continue
        lo = max(start + done - pos, 0)
        take = min(n - lo, want - done)
        if into_buffers:
            b[lo : lo + take] = flat[done : done + take]
        else:
            flat[done : done + take] = b[lo : lo + take]
        done += take
        pos += n
        if done == want:
            return
    if done != want:
        raise ValueError("copy range outside the buffers")


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` for a new file about to be written with O_DIRECT.

    Filesystems serialise O_DIRECT writes that extend a file (ext4 makes them synchronous
    under the inode lock), so a batch of them runs at queue depth one; writes inside a
    preallocated file run concurrently. Buffered files need nothing. Raises OSError
    (ENOSPC when the filesystem is full)."""
    if nbytes > 0 and is_direct_fd(fd):
        os.posix_fallocate(fd, 0, nbytes)


def open_file(path: "str | os.PathLike[str]", flags: int, mode: int = 0o644, *, direct: bool) -> Tuple[int, bool]:
    """Open ``path``; with ``direct``, try ``O_DIRECT`` first and fall back to buffered I/O
    when the filesystem refuses it (EINVAL). Returns ``(fd, opened_direct)``.

    Reads through the descriptor never touch the file's access time (``O_NOATIME``) when the
    process may ask for that (it owns the file, as a store owns its data files): ext4 would
    otherwise check the atime on every read and write it after every change of the file.

    An O_DIRECT file asked for write-only is opened read-write where the process may read
    it: an unaligned write reads the blocks around it first (:mod:`gdskv.gds.bounce`)."""
    if direct and O_DIRECT:
        readable = flags & ~os.O_ACCMODE | os.O_RDWR if flags & os.O_ACCMODE == os.O_WRONLY else flags
        for attempt in dict.fromkeys([readable, flags]):  # read-write first, then as asked
            try:
                return _open_noatime(path, attempt | O_DIRECT, mode), True
            except PermissionError:
                if attempt == flags:
                    raise
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                break
    return _open_noatime(path, flags, mode), False


def _open_noatime(path: "str | os.PathLike[str]", flags: int, mode: int) -> int:
    """``os.open`` with ``O_NOATIME``, or without it where the kernel refuses it (EPERM:
    the process neither owns the file nor has CAP_FOWNER)."""
    if O_NOATIME:
        try:
            return os.open(path, flags | O_NOATIME, mode)
        except OSError as exc:
            if exc.errno != errno.EPERM:
                raise
    return os.open(path, flags, mode)


def advance(buffers: List[memoryview], n: int) -> List[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers."""
    while n and buffers:
        first = buffers[0]
        if n >= first.nbytes:
            n -= first.nbytes
            buffers = buffers[1:]
        else:
            buffers = [first[n:]] + buffers[1:]
            n = 0
    return buffers


def cuda_host_register(torch: Any, host: memoryview) -> Optional[int]:
    """Page-lock ``host`` for CUDA (``cudaHostRegister`` through ``torch``'s runtime) so
    copies between it and a device are real asynchronous DMA. Returns its address, to pass
    to ``cudaHostUnregister`` later, or None when the runtime refused."""
    ptr = address_of(host)
    if int(torch.cuda.cudart().cudaHostRegister(ptr, host.nbytes, 0)) != 0:
        return None
    return ptr
