"""What this machine allows: the probe behind the ``auto`` I/O engine.

:func:`choose` answers two questions for a store directory and returns a :class:`Choice`
with a one-line reason:

1. Can io_uring run here? The ``liburing`` package may be missing, the kernel may be too
   old, or a sandbox may refuse the syscalls (seccomp, ``kernel.io_uring_disabled``). The
   probe builds a ring and moves 4 KiB through it to a scratch file in the directory.
2. Does the directory's filesystem accept ``O_DIRECT``? Some refuse it at ``open()``
   (ramfs, several FUSE and network filesystems); then I/O there is buffered.

``auto`` takes ``uring`` when (1) holds and ``psync`` otherwise.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
from pathlib import Path
from typing import Optional

from gdskv.errors import GdskvError
from gdskv.gds.aligned import O_DIRECT
from gdskv.gds.engine import IoRequest


@dataclasses.dataclass(frozen=True)
class Choice:
    """The engine ``auto`` picked, whether to use O_DIRECT, and why."""

    engine: str
    direct: bool
    reason: str


def fs_type(path: "str | os.PathLike[str]") -> str:
    """The filesystem type of the mount holding ``path`` ("ext4", "tmpfs", ...), or "?"."""
    target = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def probe_direct(directory: "str | os.PathLike[str]") -> Optional[str]:
    """None if files in ``directory`` can be opened O_DIRECT, else why not."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    fd, name = tempfile.mkstemp(prefix=".gdskv-probe-", dir=directory)
    os.close(fd)
    try:
        os.close(os.open(name, os.O_RDWR | O_DIRECT))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"{fs_type(directory)} at {directory} refuses O_DIRECT"
        return f"O_DIRECT open failed at {directory}: {exc.strerror}"
    finally:
        os.unlink(name)
    return None


def probe_uring(directory: "str | os.PathLike[str]", *, direct: bool) -> Optional[str]:
    """None if io_uring works here (a 4 KiB write and read through a ring), else why not."""
    from gdskv.gds.uring import UringEngine

    try:
        engine = UringEngine(depth=4, slots=1, chunk_bytes=4096, direct=direct)
    except GdskvError as exc:
        return exc.message if not exc.context.get("cause") else f"{exc.message} ({exc.context['cause']})"
    except OSError as exc:
        return f"io_uring refused by the kernel: {exc.strerror}"
    fd, name = tempfile.mkstemp(prefix=".gdskv-probe-", dir=directory)
    os.close(fd)
    try:
        fd = engine.open_file(name, os.O_RDWR)
        try:
            block = bytes(range(256)) * 16
            back = bytearray(len(block))
            engine.run([IoRequest.write(fd, 0, memoryview(block), path=name)])
            engine.run([IoRequest.read(fd, 0, memoryview(back), path=name)])
            if back != block:
                return "io_uring returned wrong bytes in the probe"
        finally:
            os.close(fd)
    except (GdskvError, OSError) as exc:
        return f"io_uring I/O failed in the probe: {exc}"
    finally:
        os.unlink(name)
        engine.close()
    return None


def choose(directory: "str | os.PathLike[str]", *, direct: bool) -> Choice:
    """Pick the engine and O_DIRECT mode for a store in ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    notes = []
    use_direct = direct
    if direct:
        refused = probe_direct(directory)
        if refused is not None:
            use_direct = False
            notes.append(f"{refused}: buffered I/O")
        else:
            notes.append(f"O_DIRECT on {fs_type(directory)}")
    else:
        notes.append("buffered I/O (direct_io off)")
    missing = probe_uring(directory, direct=use_direct)
    if missing is None:
        return Choice("uring", use_direct, "; ".join(["io_uring available"] + notes))
    return Choice("psync", use_direct, "; ".join([f"io_uring unusable: {missing}"] + notes))
