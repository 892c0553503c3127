"""Bounce plans: move an O_DIRECT request that breaks the alignment rules through staging.

A :class:`Bounce` covers one request. Its *aligned span* ``[lo, hi)`` (the request rounded
out to 4 KiB blocks) is cut into chunks of at most the engine's staging chunk size; each
chunk is one aligned transfer between the file and a staging buffer the engine allocated
once. Per chunk:

- a read transfers the chunk into staging, then :meth:`Bounce.drain` copies the part the
  caller asked for into the caller's buffers; the chunk is complete once the bytes up to
  the request's end are in (a read may stop at end of file past that point);
- a write first calls :meth:`Bounce.fill`: blocks the request covers only partly are read
  from the file (read-modify-write; past end of file they are zeros), the caller's bytes are
  copied over them, and the whole chunk is written. A last block that is only partly
  covered and lies past the end of the file is not padded (that would make the file
  longer than asked): :meth:`Bounce.finish` writes the caller's bytes of it through a
  second, buffered descriptor of the same file (the kernel keeps buffered and direct I/O of
  one file coherent, and an fsync of either descriptor makes both durable).

Engines differ only in how they run the chunk transfers (one after another on a pool thread,
or all at once on an io_uring).

A write is first cut by :func:`split_write`: the parts of it whose memory is 4 KiB-aligned
where the file offset is (a page-aligned value behind an unaligned record header, say) go
straight from the caller's buffers, and only the rest is staged. The cuts fall on block
boundaries, so no two parts share a block.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import List, Optional, Tuple

from gdskv.gds.aligned import DIRECT_ALIGN, address_of, align_down, align_up, chunks, gather, scatter, slices, span
from gdskv.gds.engine import IoOp, IoRequest


class Bounce:
    """The chunked, aligned form of one unaligned request on an O_DIRECT file."""

    __slots__ = ("request", "offset", "end", "lo", "hi", "pieces", "tail")

    def __init__(self, request: IoRequest, chunk_bytes: int, nbytes: Optional[int] = None) -> None:
        self.request = request
        self.offset = request.offset
        if nbytes is None:
            nbytes = request.nbytes
        self.end = request.offset + nbytes
        self.lo, self.hi = span(self.offset, nbytes)
        #: Bytes ``[start, end)`` written buffered by :meth:`finish` (a partial last block
        #: past the end of the file), or None.
        self.tail: Optional[Tuple[int, int]] = None
        direct_hi = self.hi
        if request.op is IoOp.WRITE and self.end % DIRECT_ALIGN and self.hi > os.fstat(request.fd).st_size:
            direct_hi = self.hi - DIRECT_ALIGN
            self.tail = (max(self.offset, direct_hi), self.end)
        if direct_hi - self.lo <= chunk_bytes:  # the common case: one chunk
            self.pieces: List[Tuple[int, int]] = [(self.lo, direct_hi)] if direct_hi > self.lo else []
        else:
            self.pieces = list(chunks(self.lo, direct_hi, chunk_bytes))

    def need(self, c_lo: int, c_hi: int) -> int:
        """Bytes of chunk ``[c_lo, c_hi)`` a read must obtain: up to the request's end."""
        return min(c_hi, self.end) - c_lo

    def fill(self, c_lo: int, c_hi: int, staging: memoryview) -> None:
        """Prepare staging for writing chunk ``[c_lo, c_hi)`` (``staging`` is that long)."""
        fd = self.request.fd
        for block in _edge_blocks(self.offset, self.end, c_lo, c_hi):
            view = staging[block - c_lo : block - c_lo + DIRECT_ALIGN]
            got = os.preadv(fd, [view], block)
            if got < DIRECT_ALIGN:
                view[got:] = bytes(DIRECT_ALIGN - got)
        a, b = max(c_lo, self.offset), min(c_hi, self.end)
        gather(self.request.buffers, a - self.offset, staging[a - c_lo : b - c_lo])

    def drain(self, c_lo: int, c_hi: int, staging: memoryview) -> None:
        """Copy the requested part of read chunk ``[c_lo, c_hi)`` out of staging."""
        a, b = max(c_lo, self.offset), min(c_hi, self.end)
        scatter(staging[a - c_lo : b - c_lo], self.request.buffers, a - self.offset)

    def finish(self) -> None:
        """After the chunks of a write: write the unpadded tail, if any (buffered)."""
        if self.tail is None:
            return
        start, end = self.tail
        data = memoryview(bytearray(end - start))  # less than a block, from any number of buffers
        gather(self.request.buffers, start - self.offset, data)
        if fcntl.fcntl(self.request.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            # The buffered descriptor below is opened anew: it must not write where the
            # caller's could not (pwrite(2) on it fails so).
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        fd = os.open(f"/proc/self/fd/{self.request.fd}", os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                n = os.pwrite(fd, data[done:], start + done)
                if n == 0:
                    raise OSError(5, "write made no progress")
                done += n
        finally:
            os.close(fd)


def _edge_blocks(offset: int, end: int, c_lo: int, c_hi: int) -> List[int]:
    """Blocks of chunk ``[c_lo, c_hi)`` that a write of ``[offset, end)`` covers partly."""
    out = []
    if c_lo < offset:
        out.append(c_lo)
    if c_hi > end and (c_hi - DIRECT_ALIGN) not in out:
        out.append(c_hi - DIRECT_ALIGN)
    return out


#: Smallest run of blocks :func:`split_write` sends straight from the caller's memory: below
#: it, one more submission costs more than the copy it saves.
MIN_DIRECT_BYTES = 64 << 10


def split_write(request: IoRequest, min_direct: int = MIN_DIRECT_BYTES) -> List[Tuple[IoRequest, bool]]:
    """Cut a write on an O_DIRECT file into ``(part, direct)`` pairs, in file order.

    A ``direct`` part obeys the O_DIRECT rules as it is (4 KiB-aligned offset, lengths and
    addresses): the longest block-aligned stretch of each buffer whose address is aligned
    where its file offset is, merged with its neighbours, at least ``min_direct`` bytes. The
    other parts must be bounced. Every cut is on a block boundary, so a bounced part never
    shares a block with a direct one. A request with nothing to send directly comes back
    whole, as one bounced part.
    """
    runs: List[Tuple[int, int]] = []  # direct file ranges [lo, hi)
    pos = request.offset
    for b in request.buffers:
        n = b.nbytes
        lo, hi = align_up(pos), align_down(pos + n)
        if hi > lo and (address_of(b) - pos) % DIRECT_ALIGN == 0:
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi)
            else:
                runs.append((lo, hi))
        pos += n
    runs = [r for r in runs if r[1] - r[0] >= min_direct]
    if not runs:
        return [(request, False)]
    end = pos
    parts: List[Tuple[IoRequest, bool]] = []
    at = request.offset

    def part(lo: int, hi: int, direct: bool) -> None:
        buffers = tuple(slices(request.buffers, lo - request.offset, hi - lo))
        parts.append((IoRequest(request.op, request.fd, lo, buffers, request.path), direct))

    for lo, hi in runs:
        if lo > at:
            part(at, lo, False)
        part(lo, hi, True)
        at = hi
    if end > at:
        part(at, end, False)
    return parts
