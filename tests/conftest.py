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
