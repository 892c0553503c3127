"""One write request for each run of a batch's records that lie end to end in a file.

A backend lays a batch's records out next to one another (a bucket file holds them back to
back; the offset backend's first fit mostly does). Written one request per record, a batch
of small records costs the engine a request's bookkeeping per record: with 64 KiB values
that Python work, not the device, set the pace. Records that follow one another in the
file, each already in the form ``O_DIRECT`` takes as it is (every buffer 4 KiB-aligned in
memory and in length), go instead as one vectored request of all their buffers.

A run stops at a gap in the file, at a record that needs the engine's staging (an
unaligned value, which goes alone, as before: the engine splits its request into the
aligned parts and the rest), and at ``IOV_MAX`` buffers (an engine stages a request of
more). A run is never longer than :data:`MAX_RUN_BYTES`, so a batch still goes out as
several requests that the device runs side by side. Records of :data:`ALONE_FROM` bytes or
more go one request each, as before: a request's bookkeeping is little beside their
transfer, and the engine splits them into entries of its own size either way.

Coalescing is kept because it made writes of small values (64-256 KiB) faster through both
``bucket`` and ``offset``; the runs are in docs/notes/write-path.md.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from gdskv.gds.aligned import IOV_MAX, is_aligned
from gdskv.gds.engine import IoRequest

#: Most bytes one coalesced request covers.
MAX_RUN_BYTES = 16 << 20
#: Records this large or larger are not coalesced.
ALONE_FROM = 1 << 20

Record = Tuple[int, Sequence[memoryview]]  # (offset in the file, buffers), in file order


def coalesced_writes(fd: int, records: Sequence[Record], *, path: str = "") -> List[IoRequest]:
    """Write requests for ``records`` (``(offset, buffers)``, by rising offset): one per
    run of aligned records under :data:`ALONE_FROM` bytes that follow one another in the
    file, one per other record."""
    requests: List[IoRequest] = []
    run: List[memoryview] = []
    run_start = run_end = 0
    for offset, buffers in records:
        size = sum(b.nbytes for b in buffers)
        if size >= ALONE_FROM or not is_aligned(offset, buffers):
            if run:
                requests.append(IoRequest.write(fd, run_start, *run, path=path))
                run = []
            requests.append(IoRequest.write(fd, offset, *buffers, path=path))
            continue
        if run and (offset != run_end or len(run) + len(buffers) > IOV_MAX or run_end - run_start + size > MAX_RUN_BYTES):
            requests.append(IoRequest.write(fd, run_start, *run, path=path))
            run = []
        if not run:
            run_start = run_end = offset
        run.extend(buffers)
        run_end += size
    if run:
        requests.append(IoRequest.write(fd, run_start, *run, path=path))
    return requests
