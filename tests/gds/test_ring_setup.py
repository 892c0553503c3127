"""How a ring is set up: with IORING_SETUP_COOP_TASKRUN where the kernel takes it, without
where it refuses the flag (kernels before 5.19 answer EINVAL)."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import block, uring_unavailable
from gdskv.gds.engine import IoRequest

pytestmark = pytest.mark.skipif(uring_unavailable() is not None, reason=str(uring_unavailable()))


class _KernelWithoutFlags:
    """The liburing module, but io_uring_queue_init refuses any setup flag, as an old kernel does."""

    def __init__(self) -> None:
        import liburing

        self._lib = liburing
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def io_uring_queue_init(self, depth, ring, flags=0):
        if flags:
            self.refused += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return self._lib.io_uring_queue_init(depth, ring, flags)


def _read_through(engine, tmp_path) -> bytes:
    path = tmp_path / "data"
    path.write_bytes(block(3, 64 * 4096))
    fd = engine.open_file(path, os.O_RDONLY)
    try:
        outs = [bytearray(4096 - 10) for _ in range(16)]
        got = engine.run([IoRequest.read(fd, i * 4096 * 4 + 5, memoryview(out), path=str(path)) for i, out in enumerate(outs)])
        assert got == [4096 - 10] * 16
        return b"".join(outs)
    finally:
        os.close(fd)


def _expected() -> bytes:
    data = block(3, 64 * 4096)
    return b"".join(data[i * 4096 * 4 + 5 : i * 4096 * 4 + 4091] for i in range(16))


def test_rings_are_set_up_for_cooperative_task_running(tmp_path):
    import liburing

    from gdskv.gds.uring import UringEngine

    engine = UringEngine(direct=True)
    try:
        assert engine.coop_taskrun and engine.describe()["coop_taskrun"] is True
        assert engine._ring().setup_flags == liburing.IORING_SETUP_COOP_TASKRUN
        assert _read_through(engine, tmp_path) == _expected()
    finally:
        engine.close()


def test_a_kernel_refusing_the_flag_gets_rings_without_it(tmp_path):
    from gdskv.gds.uring import UringEngine

    engine = UringEngine(direct=True)
    old = _KernelWithoutFlags()
    engine._lib = old  # the rings made from now on
    try:
        ring = engine._ring()
        assert ring.setup_flags == 0 and old.refused == 1
        assert _read_through(engine, tmp_path) == _expected()
    finally:
        engine.close()
