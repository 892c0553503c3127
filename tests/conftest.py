"""Shared fixtures: small stores in tmp_path, and deterministic random blocks."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gdskv

# Keep the suite independent of a developer's environment.
for _var in list(os.environ):
    if _var.startswith("GDSKV_"):
        del os.environ[_var]


def pytest_collection_modifyitems(config, items):
    gpu = pytest.mark.skip(reason="needs a CUDA device (run benchmarks/gpu_check.sh on a GPU machine)")
    if not _cuda_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(gpu)


def _cuda_available() -> bool:
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def block(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes: the value of block ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def make_store(tmp_path):
    """Open stores under tmp_path with small defaults; close them all at teardown."""
    opened = []

    def _make(sub: str = "store", **options):
        options.setdefault("dram", "4MiB")
        options.setdefault("ssd", "64MiB")
        options.setdefault("bucket_bytes", 1 << 20)
        options.setdefault("bucket_max_age_s", 0.02)
        options.setdefault("put_timeout_s", 5.0)
        store = gdskv.open(tmp_path / sub, **options)
        opened.append(store)
        return store

    yield _make
    for store in opened:
        store.close()


# --------------------------------------------------------------------------- backends x engines

#: I/O engines the store matrix runs on ("auto" resolves to one of them; tested on its own).
MATRIX_ENGINES = ("psync", "uring")


def uring_unavailable() -> "str | None":
    """None when the uring engine works here, else why not (the skip reason)."""
    global _URING_REASON
    if _URING_REASON == "":
        from gdskv.errors import GdskvError
        from gdskv.gds.uring import UringEngine

        try:
            UringEngine(depth=2, slots=1, chunk_bytes=4096).close()
            _URING_REASON = None
        except (GdskvError, OSError) as exc:
            _URING_REASON = f"uring engine unavailable: {exc}"
    return _URING_REASON


_URING_REASON: "str | None" = ""


@pytest.fixture(
    params=[(b, e) for b in gdskv.config.BACKENDS for e in MATRIX_ENGINES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def backend_engine(request):
    """``(backend, io_engine)``: every registered backend on every engine. Opt in by taking
    this fixture and passing ``backend=..., io_engine=...`` to ``make_store``."""
    backend, engine = request.param
    if engine == "uring" and uring_unavailable():
        pytest.skip(uring_unavailable())
    return backend, engine


# --------------------------------------------------------------------------- small filesystems


def _mount(kind: str, target, size: "str | None" = None) -> "str | None":
    """Mount a fresh ``kind`` filesystem on ``target``; None on success, else why not."""
    import subprocess

    if os.geteuid() != 0:
        return "needs root to mount a filesystem"
    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", kind] + (["-o", f"size={size}"] if size else []) + [kind, str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return None if done.returncode == 0 else f"cannot mount {kind}: {done.stderr.strip()}"


def _umount(target) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def ramfs_dir(tmp_path):
    """A directory on ramfs, a filesystem that refuses O_DIRECT (skips where one cannot be
    mounted). tmpfs accepts O_DIRECT on recent kernels, so it cannot stand in."""
    target = tmp_path / "ramfs"
    reason = _mount("ramfs", target)
    if reason:
        pytest.skip(reason)
    yield target
    _umount(target)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 4 MiB tmpfs, to fill up for real ENOSPC (skips where one cannot be mounted)."""
    target = tmp_path / "tiny"
    reason = _mount("tmpfs", target, "4m")
    if reason:
        pytest.skip(reason)
    yield target
    _umount(target)


@pytest.fixture
def direct_psync():
    """A psync I/O engine using O_DIRECT where the filesystem allows it, closed afterwards."""
    from gdskv.io_config import PsyncConfig

    eng = PsyncConfig(direct=True).build()
    yield eng
    eng.close()
