"""The ``uring`` I/O engine: io_uring through the ``liburing`` package (extra ``uring``).

- One :class:`gdskv.gds.ring.Ring` per thread, created on the thread's first submission:
  threads never share a ring or a lock on the submission path.
- A batch goes to the kernel in as few ``io_uring_enter`` calls as the queue ``depth``
  allows (default 64); larger batches and larger requests wait in the ring's backlog.
- With ``direct=True`` files are opened ``O_DIRECT`` where the filesystem allows it;
  unaligned requests on them go through staging memory allocated page-aligned once per ring
  (``slots`` chunks of ``chunk_bytes``, default 16 of 1 MiB, and a 16 KiB slot per entry
  for small reads) and registered as a fixed buffer. Of an unaligned
  write only the unaligned parts are staged; a page-aligned stretch of it goes straight
  from the caller's memory. ``describe()["staged_write_bytes"]`` counts the bytes staged
  for writes by the rings alive.
- Large reads (direct or staged; not the small reads of a few KiB) wait in the backlog
  while ``read_inflight_bytes`` of them are in flight on the ring (default 4 MiB, config
  ``io_read_inflight_bytes``): a deeper queue of large reads made a virtual disk slower,
  and 4 MiB is still about a millisecond of work for an NVMe drive at a few GB/s.
- The future of a batch is driven by whoever waits on it (``result()``, ``outcomes()``,
  ``done()``); ``await`` holds no thread: the event loop watches the ring's descriptor and
  drives the ring when completions are in.

``liburing`` is imported here only, lazily: :func:`load_liburing` raises
:class:`EngineUnavailableError` naming the extra to install when it is missing.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import weakref
from typing import Any, Optional, Sequence

from gdskv.errors import ConfigError, StoreClosedError
from gdskv.gds.engine import IoEngine, IoFuture, IoRequest
from gdskv.gds.iovec import EngineUnavailableError, check_layout
from gdskv.gds.ring import READ_INFLIGHT_BYTES, Ring

log = logging.getLogger(__name__)

#: Default number of requests in flight per ring.
DEPTH = 64
#: Default staging chunk: the largest piece of an unaligned O_DIRECT request per submission.
CHUNK_BYTES = 1 << 20
#: Default staging memory for chunks per ring: ``slots`` defaults to this over the chunk
#: size, at most ``depth``. (Small reads have staging slots of their own, one per entry.)
STAGING_BYTES = 16 << 20

#: Version of the ``liburing`` wrapper this engine is written against (pinned by the extra).
LIBURING_VERSION = "2026.3.30"


def load_liburing() -> Any:
    """Import the ``liburing`` wrapper, or raise :class:`EngineUnavailableError`: when it is
    missing, and when it cannot run on this machine (:func:`liburing_crash`)."""
    try:
        import liburing
    except ImportError as exc:
        raise EngineUnavailableError(
            "the uring engine needs the liburing package: pip install 'gdskv[uring]'", cause=str(exc)
        ) from None
    crash = liburing_crash()
    if crash is not None:
        raise EngineUnavailableError("the liburing package cannot run on this machine", cause=crash)
    return liburing


#: Run by :func:`liburing_crash` in a process of its own: set up a ring, submit one no-op
#: and wait for it, tear the ring down.
_CANARY = """
import liburing as L
ring = L.Ring()
L.io_uring_queue_init(2, ring)
L.io_uring_prep_nop(L.io_uring_get_sqe(ring))
L.io_uring_submit_and_wait(ring, 1)
L.io_uring_queue_exit(ring)
"""

_CRASH: "list[Optional[str]]" = []  # the answer of liburing_crash, once known


def liburing_crash() -> Optional[str]:
    """None when the ``liburing`` wrapper runs here, else how it died. Its compiled core can
    carry instructions that a CPU lacks (builds with AVX-512 have been seen): calling it then
    kills the process with SIGILL, which no ``except`` can catch. So a child process sets a
    ring up and submits a no-op first; the answer is kept for the life of this process (what
    a CPU can run does not change). A kernel that refuses io_uring is not a crash: the child
    exits with an error, and the engine's own setup reports it as usual."""
    if not _CRASH:
        try:
            done = subprocess.run([sys.executable, "-c", _CANARY], capture_output=True, timeout=60)
            died = -done.returncode if done.returncode < 0 else None
            _CRASH.append(None if died is None else f"a test process calling it was killed by {signal.Signals(died).name}")
        except (OSError, subprocess.SubprocessError) as exc:  # cannot tell: let the engine try
            _CRASH.append(None)
            log.debug("gdskv: could not check liburing in a child process: %s", exc)
    return _CRASH[0]


def fixed_ops_supported(lib: Any) -> bool:
    """Whether the kernel has READV_FIXED/WRITEV_FIXED (vectored I/O on registered buffers)."""
    try:
        ops = lib.probe() or {}
    except OSError:
        return False
    return bool(ops.get("IORING_OP_READV_FIXED")) and bool(ops.get("IORING_OP_WRITEV_FIXED"))


class UringEngine(IoEngine):
    """io_uring engine with one ring per thread. See the module docstring."""

    name = "uring"

    def __init__(
        self,
        *,
        depth: int = DEPTH,
        direct: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
        slots: Optional[int] = None,
        read_inflight_bytes: int = READ_INFLIGHT_BYTES,
    ) -> None:
        super().__init__(direct=direct)
        if depth <= 0 or chunk_bytes <= 0 or chunk_bytes % 4096:
            raise ConfigError("uring needs depth > 0 and a chunk that is a multiple of 4 KiB", depth=depth, chunk_bytes=chunk_bytes)
        if read_inflight_bytes <= 0:
            raise ConfigError("uring needs a positive cap on reads in flight", read_inflight_bytes=read_inflight_bytes)
        self._lib = load_liburing()
        check_layout(self._lib)
        self.depth = depth
        self.chunk_bytes = chunk_bytes
        self.slots = slots if slots is not None else max(1, min(depth, STAGING_BYTES // chunk_bytes))
        if self.slots < 1:  # a request that needs a chunk would wait for good
            raise ConfigError("uring needs at least one staging chunk", slots=slots)
        self.read_inflight_bytes = read_inflight_bytes
        self.fixed = fixed_ops_supported(self._lib)
        self._local = threading.local()
        self._rings: "weakref.WeakSet[Ring]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        # Set up (and drop) a small ring now, so a kernel or sandbox that refuses io_uring
        # fails here, at open, with a clear error rather than at the first I/O; the rings
        # that do the work (and pin their staging) come with each thread's first submission.
        Ring(self._lib, depth=2, slots=1, chunk_bytes=4096, fixed=False).close()

    def _ring(self) -> Ring:
        ring: Optional[Ring] = getattr(self._local, "ring", None)
        if ring is None or ring.broken:
            with self._lock:
                if self._closed:
                    raise StoreClosedError("I/O engine is closed", engine=self.name)
                ring = Ring(
                    self._lib, depth=self.depth, slots=self.slots, chunk_bytes=self.chunk_bytes, fixed=self.fixed,
                    read_inflight_bytes=self.read_inflight_bytes,
                )
                self._rings.add(ring)
            self._local.ring = ring
        return ring

    def submit(self, requests: Sequence[IoRequest]) -> IoFuture:
        if self._closed:
            raise StoreClosedError("I/O engine is closed", engine=self.name)
        if not requests:
            return IoFuture.completed([])
        return self._ring().submit(requests)

    def describe(self) -> dict:
        with self._lock:
            rings = len(self._rings)
            fixed = all(r.fixed for r in self._rings) if rings else self.fixed
            staged = sum(r.staged_write_bytes for r in self._rings)
        return {
            **super().describe(),
            "depth": self.depth,
            "chunk_bytes": self.chunk_bytes,
            "read_inflight_bytes": self.read_inflight_bytes,
            "rings": rings,
            "fixed_buffers": fixed,
            "staged_write_bytes": staged,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rings = list(self._rings)
        for ring in rings:
            ring.close()
