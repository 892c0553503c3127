"""Device memory pools behind the HBM tier: one allocation made once, addressed by offset.

A :class:`DevicePool` owns ``nbytes`` of device memory and copies bytes in and out of it by
offset; the HBM tier (:mod:`gdskv.tiers.hbm`) decides which offsets hold what. Contract:

- ``write(offset, src)``: copy all of ``src`` (a device array of this pool's kind, or a host
  buffer) to ``[offset, offset + nbytes(src))``; synchronous with respect to later calls.
- ``read_into(offset, size, dst)``: copy ``size`` bytes at ``offset`` into ``dst``; for a
  device ``dst`` this is a device-to-device copy (no host hop).
- ``to_host_async(offset, size, host)``: start copying the bytes to the host buffer ``host``
  and return a :class:`Completion`; the source range must not be reused until it is done.
- ``close()``: idempotent; releases the memory.

Beyond the pool's own memory, a pool knows its kind of device buffer, which is how the store
tells a device value from a host one: ``is_device(buf)``; ``upload(host, dst)`` copies host
bytes into such a buffer, ``download(src)`` copies one to new host memory, and
``read_many([(offset, size, dst), ...])`` serves several objects at once (one batched copy
on a GPU).

Implementations: :class:`HostStandInPool` (numpy memory standing in for a device, with an
optional gate that holds back asynchronous copies, so tests decide when they finish; its
"device buffers" are :class:`StandInArray` arrays) and
:class:`TorchCudaPool` (one ``torch.empty(..., device="cuda")`` allocation and a side
stream; torch is imported only when it is built).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Optional

import numpy as np

from gdskv.errors import GdskvError, InvalidValueError, StoreClosedError


class Completion:
    """An asynchronous copy in flight: ``done()`` without blocking, ``wait()`` to finish."""

    def done(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, timeout: Optional[float] = None) -> bool:  # pragma: no cover - interface
        """Block until done (or ``timeout`` seconds); return whether it is done. A failed
        copy raises its error here."""
        raise NotImplementedError


class FutureCompletion(Completion):
    def __init__(self, future: "concurrent.futures.Future[None]") -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> bool:
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True


class _Done(Completion):
    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True


#: A completion that is already done.
DONE: Completion = _Done()


class DevicePool:
    """Interface of a device memory pool (see the module docstring)."""

    kind = "base"
    nbytes = 0
    #: How a single hit reaches a device buffer.
    hit_copy = "copy"

    def size_of(self, buf: Any) -> int:  # pragma: no cover - interface
        """Bytes in ``buf`` (InvalidValueError when this pool cannot take it)."""
        raise NotImplementedError

    def write(self, offset: int, src: Any) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def read_into(self, offset: int, size: int, dst: Any) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def to_host_async(self, offset: int, size: int, host: memoryview) -> Completion:  # pragma: no cover
        raise NotImplementedError

    def copy_out(self, offset: int, size: int, dst: Any) -> bool:
        """``read_into`` when ``dst`` holds at least ``size`` bytes (True); else copy nothing
        and return False. One call, for the hot path of a single hit."""
        if self.size_of(dst) < size:
            return False
        self.read_into(offset, size, dst)
        return True

    def read_many(self, items: "list[tuple[int, int, Any]]") -> None:
        """``read_into`` for each ``(offset, size, dst)``; pools may batch the copies."""
        for offset, size, dst in items:
            self.read_into(offset, size, dst)

    def is_device(self, buf: Any) -> bool:  # pragma: no cover - interface
        """Whether ``buf`` is a device buffer of this pool's kind (not host memory)."""
        raise NotImplementedError

    def upload(self, host: memoryview, dst: Any) -> None:  # pragma: no cover - interface
        """Copy the bytes of ``host`` into the start of the device buffer ``dst``."""
        raise NotImplementedError

    def upload_async(self, host: memoryview, dst: Any) -> Completion:
        """Start copying ``host`` into ``dst``; ``host`` must stay untouched until the
        returned completion is done. Pools without asynchronous copies copy at once."""
        self.upload(host, dst)
        return DONE

    def download(self, src: Any) -> memoryview:  # pragma: no cover - interface
        """A new host copy of the device buffer ``src``, as flat bytes."""
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def _host_bytes(buf: Any, what: str) -> np.ndarray:
    """A flat uint8 view of a contiguous host buffer (numpy array, bytes-like, CPU tensor)."""
    if hasattr(buf, "numpy") and hasattr(buf, "is_cuda"):  # a torch tensor
        if buf.is_cuda:
            raise InvalidValueError(f"{what}: a CUDA tensor given to a host-memory pool")
        if not buf.is_contiguous():
            raise InvalidValueError(f"{what}: tensor is not contiguous")
        buf = buf.detach().view(-1).view(__import__("torch").uint8).numpy()
    try:
        arr = np.asarray(memoryview(buf).cast("B")) if not isinstance(buf, np.ndarray) else buf
    except (TypeError, ValueError) as exc:
        raise InvalidValueError(f"{what}: not a contiguous buffer", type=type(buf).__name__) from exc
    if not arr.flags.c_contiguous:
        raise InvalidValueError(f"{what}: array is not contiguous")
    return arr.reshape(-1).view(np.uint8)


class StandInArray(np.ndarray):
    """A numpy array that a :class:`HostStandInPool` treats as a device buffer, so the
    store's device paths (put of a device value, get_into a device buffer) run anywhere.
    Make one with ``standin_array(data)`` or ``np.empty(n, np.uint8).view(StandInArray)``."""


def standin_array(data: Any) -> StandInArray:
    """A :class:`StandInArray` holding a copy of the bytes of ``data`` (or ``data`` zero
    bytes when it is an int)."""
    if isinstance(data, int):
        return np.zeros(data, dtype=np.uint8).view(StandInArray)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8).copy().view(StandInArray)


class HostStandInPool(DevicePool):
    """Host memory standing in for a device, so the HBM tier's logic runs anywhere.

    Asynchronous copies run on one worker thread, in order, like a CUDA stream. With
    ``gate`` (a :class:`threading.Event`) each copy waits for the gate to be set first:
    tests use it to look at the tier while copies are still in flight.
    """

    kind = "host-standin"

    def __init__(self, nbytes: int, *, gate: Optional[threading.Event] = None) -> None:
        self.nbytes = nbytes
        self.memory: Optional[np.ndarray] = np.zeros(nbytes, dtype=np.uint8)
        self.gate = gate
        self._stream = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gdskv-hbm-standin")
        self.copies_to_host = 0

    def _mem(self) -> np.ndarray:
        if self.memory is None:
            raise StoreClosedError("device pool is closed", kind=self.kind)
        return self.memory

    def size_of(self, buf: Any) -> int:
        return int(_host_bytes(buf, "value").size)

    def write(self, offset: int, src: Any) -> None:
        data = _host_bytes(src, "value")
        self._mem()[offset : offset + data.size] = data

    def read_into(self, offset: int, size: int, dst: Any) -> None:
        out = _host_bytes(dst, "output buffer")
        out[:size] = self._mem()[offset : offset + size]

    def is_device(self, buf: Any) -> bool:
        return isinstance(buf, StandInArray)

    def pin(self, host: memoryview) -> bool:
        """Host memory needs no page-locking here: report it as pinned, so the store takes
        the same paths (DRAM slots as staging) as on a GPU."""
        return True

    def upload(self, host: memoryview, dst: Any) -> None:
        out = _host_bytes(dst, "output buffer")
        out[: host.nbytes] = np.frombuffer(host, dtype=np.uint8)

    def download(self, src: Any) -> memoryview:
        return memoryview(_host_bytes(src, "value").copy())

    def to_host_async(self, offset: int, size: int, host: memoryview) -> Completion:
        mem = self._mem()
        out = _host_bytes(host, "host buffer")

        def copy() -> None:
            if self.gate is not None:
                self.gate.wait()
            out[:size] = mem[offset : offset + size]

        self.copies_to_host += 1
        return FutureCompletion(self._stream.submit(copy))

    def close(self) -> None:
        if self.memory is None:
            return
        if self.gate is not None:
            self.gate.set()
        self._stream.shutdown(wait=True)
        self.memory = None


class _EventCompletion(Completion):
    def __init__(self, event: Any, keep: Any) -> None:
        self._event = event
        self._keep = keep  # tensors the copy uses stay alive until it is done

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout: Optional[float] = None) -> bool:
        if timeout is None:
            self._event.synchronize()
            return True
        import time

        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True


def _raw_device_copy(torch: Any, device: Any) -> Optional[Any]:
    """``copy(dst_ptr, src_ptr, n)``: ``cudaMemcpyAsync`` device-to-device on torch's current
    stream of ``device``, through the CUDA runtime torch loaded (ctypes), after checking
    it on a small copy; None where that is not possible (then ``Tensor.copy_`` serves)."""
    import ctypes

    try:
        major = str(torch.version.cuda or "").split(".")[0]
        lib = ctypes.CDLL(f"libcudart.so.{major}")
        memcpy = lib.cudaMemcpyAsync
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        current_stream = torch._C._cuda_getCurrentRawStream
        index = device.index if device.index is not None else torch.cuda.current_device()
        device_to_device = 3  # cudaMemcpyDeviceToDevice

        def copy(dst: int, src: int, n: int) -> None:
            rc = memcpy(dst, src, n, device_to_device, current_stream(index))
            if rc != 0:
                raise GdskvError("cudaMemcpyAsync failed", error=rc, nbytes=n)

        src = torch.arange(4096, device=device, dtype=torch.int32).view(torch.uint8)
        dst = torch.zeros_like(src)
        copy(dst.data_ptr() + 64, src.data_ptr() + 128, 8192)
        torch.cuda.synchronize(device)
        if not torch.equal(dst[64 : 64 + 8192], src[128 : 128 + 8192]) or bool(dst[:64].any()):
            return None
        return copy
    except Exception:  # noqa: BLE001 - no runtime to call: copy_ serves
        return None


class TorchCudaPool(DevicePool):
    """One plain device allocation (``torch.empty``, never managed memory) and a side stream
    for copies to the host. Raises ConfigError when no CUDA device is usable."""

    kind = "cuda"

    def __init__(self, nbytes: int, *, device: int = 0) -> None:
        from gdskv.gds.device import require_device

        require_device("the HBM tier's torch pool")
        import torch  # imported only here: a device exists

        self._torch = torch
        self.device = torch.device("cuda", device)
        self.nbytes = nbytes
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._registered: list = []
        self._batched_copy = True
        self._views: dict = {}
        self._base = self.memory.data_ptr()
        self._memcpy = _raw_device_copy(torch, self.device)
        #: How a single hit reaches a device buffer (``stats()["hbm"]["hit_copy"]``).
        self.hit_copy = "cudaMemcpyAsync" if self._memcpy is not None else "Tensor.copy_"

    def _as_bytes(self, buf: Any, what: str) -> Any:
        torch = self._torch
        if type(buf) is torch.Tensor and buf.dtype is torch.uint8 and buf.dim() == 1 and buf.is_contiguous():
            return buf  # the common case, without building new views
        if isinstance(buf, torch.Tensor):
            t = buf
        elif hasattr(buf, "__cuda_array_interface__") or hasattr(buf, "__dlpack__"):
            t = torch.from_dlpack(buf) if hasattr(buf, "__dlpack__") else torch.as_tensor(buf, device=self.device)
        else:
            t = torch.frombuffer(memoryview(buf).cast("B"), dtype=torch.uint8)
        if not t.is_contiguous():
            raise InvalidValueError(f"{what}: tensor is not contiguous")
        return t.reshape(-1).view(torch.uint8)

    def pin(self, host: memoryview) -> bool:
        """Page-lock ``host`` (e.g. the DRAM arena) once, so copies to and from it run
        asynchronously; return whether it is page-locked now."""
        from gdskv.gds.aligned import cuda_host_register

        ptr = cuda_host_register(self._torch, host)
        if ptr is None:
            return False
        self._registered.append(ptr)
        return True

    def size_of(self, buf: Any) -> int:
        torch = self._torch
        if type(buf) is torch.Tensor and buf.is_contiguous():
            return buf.numel() * buf.element_size()
        return int(self._as_bytes(buf, "value").numel())

    def _region(self, offset: int, size: int) -> Any:
        """The device bytes ``[offset, offset + size)`` as a tensor view, cached: building a
        view costs more than launching the copy of a 2 MiB block."""
        key = (offset, size)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 65536:
                self._views.clear()
            view = self._views[key] = self.memory[offset : offset + size]
        return view

    def write(self, offset: int, src: Any) -> None:
        data = self._as_bytes(src, "value")
        self._region(offset, data.numel()).copy_(data, non_blocking=False)

    def read_into(self, offset: int, size: int, dst: Any) -> None:
        out = self._as_bytes(dst, "output buffer")
        if out.numel() != size:
            out = out[:size]
        out.copy_(self._region(offset, size), non_blocking=out.is_cuda)

    def copy_out(self, offset: int, size: int, dst: Any) -> bool:
        """A device ``dst`` gets one ``cudaMemcpyAsync`` on the current stream where the
        runtime is reachable (a fraction of ``Tensor.copy_``'s launch cost); else ``copy_``."""
        out = self._as_bytes(dst, "output buffer")
        room = out.numel()
        if room < size:
            return False
        if self._memcpy is not None and out.is_cuda:
            self._memcpy(out.data_ptr(), self._base + offset, size)
        else:
            self.read_into(offset, size, out)
        return True

    def read_many(self, items: "list[tuple[int, int, Any]]") -> None:
        """Device destinations are served by one batched copy (``torch._foreach_copy_``:
        a few kernel launches for the whole batch instead of one per object)."""
        outs = [self._as_bytes(dst, "output buffer") for _, _, dst in items]
        if self._batched_copy and len(items) > 1 and all(o.is_cuda for o in outs):
            dsts = [o if o.numel() == size else o[:size] for o, (_, size, _) in zip(outs, items)]
            srcs = [self._region(offset, size) for offset, size, _ in items]
            try:
                self._torch._foreach_copy_(dsts, srcs, non_blocking=True)
                return
            except (AttributeError, RuntimeError, TypeError):  # an older torch: copy one by one
                self._batched_copy = False
        for out, (offset, size, _) in zip(outs, items):
            self.read_into(offset, size, out)

    def is_device(self, buf: Any) -> bool:
        torch = self._torch
        if isinstance(buf, torch.Tensor):
            return bool(buf.is_cuda)
        return hasattr(buf, "__cuda_array_interface__")

    def upload(self, host: memoryview, dst: Any) -> None:
        self.upload_async(host, dst).wait()

    def upload_async(self, host: memoryview, dst: Any) -> Completion:
        """An asynchronous host-to-device copy on the current stream: real DMA when
        ``host`` is page-locked (the DRAM arena is, once the store has pinned it)."""
        torch = self._torch
        out = self._as_bytes(dst, "output buffer")
        src = torch.frombuffer(host, dtype=torch.uint8) if not host.readonly else torch.from_numpy(
            np.frombuffer(host, dtype=np.uint8).copy())  # torch refuses to view read-only memory
        if not out.is_cuda:
            out[: host.nbytes].copy_(src)
            return DONE
        out[: host.nbytes].copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _EventCompletion(event, (src, out))

    def download(self, src: Any) -> memoryview:
        return memoryview(self._as_bytes(src, "value").cpu().numpy())

    def to_host_async(self, offset: int, size: int, host: memoryview) -> Completion:
        torch = self._torch
        out = self._as_bytes(host, "host buffer")
        src = self._region(offset, size)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out[:size].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _EventCompletion(event, (out, src))

    def close(self) -> None:
        if self.memory is None:
            return
        torch = self._torch
        torch.cuda.synchronize(self.device)
        self._views.clear()
        cudart = torch.cuda.cudart()
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered.clear()
        self.memory = None
