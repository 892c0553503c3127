"""The staging fallback: NVMe -> aligned host staging -> device, pipelined.

Where kvikio is missing or unusable, reads reach device memory in two hops: an I/O engine
(``uring`` or ``psync``) reads into page-aligned host *slots* allocated once (pinned on a
GPU, so the copy is a real DMA), and a :class:`DeviceCopier` copies each slot to its
destination on a stream. With ``slots`` >= 2 the read of block i+1 is already in flight
while block i is copied to the device; a slot is read into again only once its copy is done.

:meth:`StagingReader.read_into` takes ``(fd, offset, size, dst, dst_offset)`` items; items
larger than a slot are split into slot-sized blocks. ``dst`` is whatever the copier takes:
:class:`TorchCopier` takes torch tensors (CUDA ones on a GPU; CPU ones anywhere, which is how
the pipeline is tested on machines without a device) and numpy arrays.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from gdskv.errors import ConfigError, IoError
from gdskv.gds.aligned import DIRECT_ALIGN, AlignedBuffer, alloc_aligned, cuda_host_register
from gdskv.gds.engine import IoEngine, IoFuture, IoRequest

#: Default size of one staging slot.
SLOT_BYTES = 4 << 20


class StagedRead(NamedTuple):
    """Read ``size`` bytes at ``offset`` of ``fd`` into ``dst`` at byte ``dst_offset``."""

    fd: int
    offset: int
    size: int
    dst: Any
    dst_offset: int = 0
    path: str = ""


class CopyDone:
    """A device copy in flight (``wait()`` blocks until it is over)."""

    def __init__(self, wait: Optional[Callable[[], None]] = None) -> None:
        self._wait = wait

    def wait(self) -> None:
        if self._wait is not None:
            self._wait()
            self._wait = None


class DeviceCopier:
    """Copies a host slot into a destination; ``start`` returns at once with a CopyDone."""

    def start(self, src: memoryview, dst: Any, dst_offset: int) -> CopyDone:  # pragma: no cover
        raise NotImplementedError

    def pin(self, host: memoryview) -> None:
        """Page-lock a staging slot (no-op where there is no device)."""


class TorchCopier(DeviceCopier):
    """``Tensor.copy_(non_blocking=True)`` on a side stream for CUDA destinations; a plain
    copy for CPU tensors and numpy arrays. torch is imported when the copier is built."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._stream = None
        self._pinned: List[int] = []

    def pin(self, host: memoryview) -> None:
        if not self._torch.cuda.is_available():
            return
        ptr = cuda_host_register(self._torch, host)
        if ptr is not None:
            self._pinned.append(ptr)

    def start(self, src: memoryview, dst: Any, dst_offset: int) -> CopyDone:
        torch = self._torch
        n = src.nbytes
        if isinstance(dst, np.ndarray):
            dst.reshape(-1).view(np.uint8)[dst_offset : dst_offset + n] = np.frombuffer(src, dtype=np.uint8)
            return CopyDone()
        flat = dst.view(-1).view(torch.uint8)[dst_offset : dst_offset + n]
        host = torch.frombuffer(src, dtype=torch.uint8)
        if not flat.is_cuda:
            flat.copy_(host)
            return CopyDone()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=flat.device)
        with torch.cuda.stream(self._stream):
            flat.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return CopyDone(event.synchronize)

    def close(self) -> None:
        if self._pinned:
            cudart = self._torch.cuda.cudart()
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
            self._pinned.clear()


class StagingReader:
    """NVMe -> staging slots -> device; see the module docstring."""

    def __init__(self, engine: IoEngine, copier: DeviceCopier, *, slot_bytes: int = SLOT_BYTES, slots: int = 3) -> None:
        if slots < 2:
            raise ConfigError("the staging pipeline needs at least two slots", got=slots)
        if slot_bytes < DIRECT_ALIGN or slot_bytes % DIRECT_ALIGN:
            raise ConfigError("staging slot size must be a positive multiple of 4 KiB", got=slot_bytes)
        self.engine = engine
        self.copier = copier
        self.slot_bytes = slot_bytes
        self._buffers: List[AlignedBuffer] = [alloc_aligned(slot_bytes) for _ in range(slots)]
        self._slots = [b.view for b in self._buffers]
        for view in self._slots:
            copier.pin(view)
        self.blocks = 0

    def _blocks(self, items: Sequence[StagedRead]) -> List[StagedRead]:
        out = []
        for item in items:
            done = 0
            while done < item.size:
                n = min(self.slot_bytes, item.size - done)
                out.append(item._replace(offset=item.offset + done, size=n, dst_offset=item.dst_offset + done))
                done += n
        return out

    def read_into(self, items: Sequence[StagedRead]) -> List[int]:
        """Read every item into its destination; return each item's size. Raises IoError
        (path, offset) for a failed or short read; destinations of items after a failure
        may be partly written."""
        blocks = self._blocks(items)
        count = len(self._slots)
        reads: Dict[int, IoFuture] = {}
        copies: Dict[int, CopyDone] = {}

        def start_read(i: int) -> None:
            slot = self._slots[i % count]
            previous = copies.pop(i - count, None)
            if previous is not None:
                previous.wait()  # the slot is free once its last copy is over
            b = blocks[i]
            reads[i] = self.engine.submit([IoRequest.read(b.fd, b.offset, slot[: b.size], path=b.path)])

        try:
            for i in range(min(count - 1, len(blocks))):
                start_read(i)
            for i, b in enumerate(blocks):
                if i + count - 1 < len(blocks):
                    start_read(i + count - 1)  # keep the next reads in flight during this copy
                got = reads.pop(i).result()[0]
                if got != b.size:
                    raise IoError("short staged read", path=b.path, offset=b.offset, expected=b.size, got=got)
                copies[i] = self.copier.start(self._slots[i % count][: b.size], b.dst, b.dst_offset)
                self.blocks += 1
        finally:
            for fut in reads.values():
                fut.outcomes()
            for done in copies.values():
                done.wait()
        return [item.size for item in items]

    def close(self) -> None:
        close = getattr(self.copier, "close", None)
        if close is not None:
            close()
        for view in self._slots:
            view.release()
        for buf in self._buffers:
            buf.close()
        self._slots = []
