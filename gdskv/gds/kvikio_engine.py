"""The ``kvikio`` I/O engine: NVMe <-> device (or host) buffers through ``kvikio.CuFile``.

Each request becomes ``CuFile.pread``/``pwrite`` calls (one per buffer, at consecutive file
offsets), which kvikio splits into tasks on its own thread pool and returns as futures; a
batch is all of them in flight together. With GPUDirect Storage available (the ``nvidia-fs``
driver and a supported filesystem) cuFile DMAs straight between the SSD and device memory;
otherwise kvikio runs in *compat mode* (POSIX reads into its own pinned bounce buffers, then
a copy to the device). :meth:`KvikioEngine.describe` says which (``mode``: ``gds`` or
``compat``), and why.

Buffers may be anything kvikio takes: CUDA torch tensors, cupy arrays (the CUDA array
interface), or host buffers. :meth:`KvikioEngine.register` registers a device buffer with
cuFile once (for buffers reused across reads, e.g. the HBM pool); GDS reads are in place
when file offsets are 4 KiB-aligned, which every gdskv record layout guarantees for values.

Files: a backend opens a descriptor through :meth:`open_file` as with any engine; the engine
opens a ``CuFile`` on the same file on first use (kvikio opens by path, keeping its own
O_DIRECT descriptor) and caches it by (fd, device, inode), so a reused descriptor number
never reaches the wrong file.

Only selectable where a CUDA device exists (:mod:`gdskv.gds.device`) and kvikio imports;
otherwise building it raises :class:`ConfigError` with the reason. kvikio is imported here
only, when the engine is built.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gdskv.errors import ConfigError, IoError, StoreClosedError
from gdskv.gds.device import DeviceInfo, require_device
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest


def load_kvikio() -> Any:
    """Import kvikio, or raise ConfigError saying how to get it."""
    try:
        import kvikio
    except ImportError as exc:
        raise ConfigError("the kvikio engine needs the kvikio package (pip install 'gdskv[gpu]')", cause=str(exc)) from exc
    return kvikio


def kvikio_defaults(kvikio: Any) -> Any:
    """kvikio's settings module (``kvikio.defaults``)."""
    defaults = getattr(kvikio, "defaults", None)
    if defaults is None:  # a submodule that ``import kvikio`` does not load
        import importlib

        defaults = importlib.import_module("kvikio.defaults")
    return defaults


def gds_mode(kvikio: Any) -> Tuple[str, str]:
    """``("gds" | "compat", why)`` for this process's kvikio settings and platform."""
    defaults = kvikio_defaults(kvikio)
    try:
        preferred = bool(defaults.is_compat_mode_preferred())
        setting = str(defaults.get("compat_mode"))
    except AttributeError:  # kvikio before 24.12: compat_mode() is a bool
        preferred = bool(defaults.compat_mode())
        setting = str(preferred)
    available: Optional[bool] = None
    try:
        from kvikio import cufile_driver

        available = bool(cufile_driver.get("is_gds_available"))
    except Exception:  # noqa: BLE001 - a driver that cannot answer is "unknown", not fatal
        available = None
    if preferred:
        return "compat", f"kvikio compat mode (compat_mode={setting}, GDS available={available})"
    return "gds", f"cuFile GPUDirect Storage (compat_mode={setting}, GDS available={available})"


class KvikioEngine(IoEngine):
    """``CuFile`` futures for every request of a batch; see the module docstring."""

    name = "kvikio"

    def __init__(
        self,
        *,
        direct: bool = True,
        task_size: Optional[int] = None,
        threads: Optional[int] = None,
        device: Optional[DeviceInfo] = None,
        kvikio_module: Any = None,
    ) -> None:
        """``threads``: size of kvikio's thread pool, which runs the ``task_size`` pieces of
        every request (kvikio's default is one thread: one piece in flight at a time). It is
        a process-wide kvikio setting; None leaves it as it is."""
        require_device("the kvikio engine", device)
        super().__init__(direct=direct)
        self._kvikio = kvikio_module if kvikio_module is not None else load_kvikio()
        self.mode, self.mode_reason = gds_mode(self._kvikio)
        self.task_size = task_size
        if threads is not None:
            if threads <= 0:
                raise ConfigError("kvikio needs at least one thread", threads=threads)
            kvikio_defaults(self._kvikio).set("num_threads", threads)
        self.threads = threads
        self._files: Dict[Tuple[int, int, int, int], Any] = {}
        self._registered: List[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        # kvikio's futures block in get(); one waiter per request, off the caller's thread.
        self._waiters = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="gdskv-kvikio")

    def open_file(self, path: "str | os.PathLike[str]", flags: int, mode: int = 0o644) -> int:
        """A plain descriptor (kvikio keeps its own O_DIRECT one for the same file)."""
        return os.open(path, flags, mode)

    def register(self, buf: Any) -> None:
        """Register a device buffer with cuFile once, for reuse across many reads."""
        self._kvikio.memory_register(buf)
        self._registered.append(buf)

    def _cufile(self, request: IoRequest) -> Any:
        """kvikio's handle for the file open as ``request.fd``: one per descriptor number,
        file (device, inode) and access mode. A number closed and reused for another file,
        or for the same file opened another way (a backend reuses an evicted file for
        writing after reading it), gets a new handle, and the old one is closed. The handle
        opens the descriptor's own file (``/proc/self/fd/N``), never the path, which may
        name another file by then (an overwrite renamed over it)."""
        st = os.fstat(request.fd)
        access = fcntl.fcntl(request.fd, fcntl.F_GETFL) & os.O_ACCMODE
        key = (request.fd, st.st_dev, st.st_ino, access)
        with self._lock:
            handle = self._files.get(key)
            if handle is None:
                proc = f"/proc/self/fd/{request.fd}"
                handle = self._kvikio.CuFile(proc if os.path.exists(proc) else request.path, "r" if access == os.O_RDONLY else "r+")
                for stale in [k for k in self._files if k[0] == request.fd]:
                    self._files.pop(stale).close()  # the number now names another file, or another mode
                self._files[key] = handle
            return handle

    def submit(self, requests: Sequence[IoRequest]) -> IoFuture:
        if self._closed:
            raise StoreClosedError("I/O engine is closed", engine=self.name)
        parts = []
        for request in requests:
            try:
                parts.append(self._start(request))
            except (OSError, RuntimeError, ValueError) as exc:
                failed: "concurrent.futures.Future[int]" = concurrent.futures.Future()
                failed.set_exception(self._error(request, exc))
                parts.append(failed)
        return IoFuture(parts)

    def _start(self, request: IoRequest) -> "concurrent.futures.Future[int]":
        handle = self._cufile(request)
        call = handle.pread if request.op is IoOp.READ else handle.pwrite
        futures = []
        offset = request.offset
        sizes = []
        for buf in request.buffers:
            size = _nbytes(buf)
            futures.append(call(buf, size, offset, self.task_size))
            sizes.append(size)
            offset += size
        return self._waiters.submit(self._wait, request, futures, sum(sizes))

    def _wait(self, request: IoRequest, futures: List[Any], expected: int) -> int:
        try:
            got = sum(int(f.get()) for f in futures)
        except (OSError, RuntimeError, ValueError) as exc:
            raise self._error(request, exc) from exc
        if got != expected:
            raise IoError(f"short {request.op.value}", path=request.path, offset=request.offset, expected=expected, got=got)
        return got

    @staticmethod
    def _error(request: IoRequest, exc: BaseException) -> IoError:
        return IoError(f"{request.op.value} failed: {exc}", path=request.path, offset=request.offset)

    def describe(self) -> dict:
        return {**super().describe(), "mode": self.mode, "mode_reason": self.mode_reason,
                "open_cufiles": len(self._files), "registered_buffers": len(self._registered)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._waiters.shutdown(wait=True)
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        for buf in self._registered:
            try:
                self._kvikio.memory_deregister(buf)
            except Exception:  # noqa: BLE001 - deregistering at close is best effort
                pass
        self._registered.clear()


def _nbytes(buf: Any) -> int:
    """Bytes in a buffer: memoryview, numpy/cupy array, or torch tensor."""
    if hasattr(buf, "nbytes"):
        return int(buf.nbytes)
    if hasattr(buf, "element_size"):  # torch
        return int(buf.numel() * buf.element_size())
    return memoryview(buf).nbytes
