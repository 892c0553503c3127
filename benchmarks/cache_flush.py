"""Pushing memory out of the CPU's caches (x86-64 ``clflushopt``), for benchmarks that ask
what a read costs depending on where the lines of the memory it lands in are cached.

Python cannot issue the instruction, so :func:`load_flusher` compiles a C function of a few
lines with the machine's C compiler (``cc``) into a temporary directory and loads it with
ctypes. Where that cannot be done (no compiler, a CPU without ``clflushopt``, a failed
build) it says why instead, and the benchmark leaves out what needs it.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Tuple, Union

import numpy as np

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
/* Writes back and drops from every cache level the lines of [p, p + n). */
void flush_lines(const void *p, size_t n) {
    const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63);
    const char *end = (const char *)p + n;
    for (; line < end; line += 64)
        __asm__ volatile("clflushopt (%0)" :: "r"(line) : "memory");
    __asm__ volatile("sfence" ::: "memory");
}
"""

#: A flusher: drops the lines of the array's memory from the CPU's caches.
Flusher = Callable[[np.ndarray], None]


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load_flusher() -> Union[Tuple[Flusher, str], Tuple[None, str]]:
    """``(flush, how)`` where the flush can be built here, else ``(None, why not)``."""
    if platform.machine() != "x86_64":
        return None, f"clflushopt is an x86-64 instruction; this machine is {platform.machine()}"
    if "clflushopt" not in _cpu_flags():
        return None, "this CPU does not list clflushopt in /proc/cpuinfo"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc) to build the clflushopt helper"
    build = Path(tempfile.mkdtemp(prefix="gdskv-cache-flush-"))
    try:
        (build / "flush.c").write_text(SOURCE)
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(build / "flush.so"), str(build / "flush.c")],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            return None, f"building the clflushopt helper failed: {done.stderr.strip()[:200]}"
        lib = ctypes.CDLL(str(build / "flush.so"))  # stays mapped after its file is gone
    finally:
        shutil.rmtree(build, ignore_errors=True)
    lib.flush_lines.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.flush_lines.restype = None

    def flush(array: np.ndarray) -> None:
        lib.flush_lines(array.ctypes.data, array.nbytes)

    return flush, f"clflushopt, built with {cc}"
