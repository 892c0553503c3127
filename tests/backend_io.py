"""Helpers for driving a StorageBackend directly in tests."""

from __future__ import annotations

from typing import Tuple

import pytest

from conftest import MATRIX_ENGINES, uring_unavailable
from gdskv.config import BACKENDS
from gdskv.gds import make_engine
from gdskv.tiers.backends import make_backend
from gdskv.tiers.backends.record import checksum


def items(values: dict):
    """``write()`` items for a ``{key: bytes}`` mapping."""
    return [(k, memoryview(v), checksum(k, v)) for k, v in values.items()]


def read(backend, key: bytes, size: int):
    """Read ``key`` through ``read_batch`` into a buffer of ``size``; bytes or None."""
    out = bytearray(size)
    n = backend.read_batch([(key, memoryview(out))])[0]
    return None if n is None else bytes(out[:n])



@pytest.fixture(params=[(b, e) for b in BACKENDS for e in MATRIX_ENGINES], ids=lambda p: f"{p[0]}-{p[1]}")
def every_backend(request, tmp_path):
    """Each registered backend (64 MiB, recovered) on each engine with O_DIRECT; uring
    cases skip, with the reason, where io_uring is unavailable."""
    name, engine_name = request.param
    if engine_name == "uring" and uring_unavailable():
        pytest.skip(uring_unavailable())
    engine = make_engine(engine_name, direct=True)
    be = make_backend(name, tmp_path, engine, capacity=64 << 20)
    be.recover()
    yield be
    be.close()
    engine.close()


def value_location(be, key: bytes) -> Tuple[str, int]:
    """The file and offset of the stored value of ``key``."""
    if be.name == "bucket":
        bucket = be._objects[key]
        return str(bucket.data_path), bucket.entries[key].value_offset
    if be.name == "offset":
        return str(be.data_path), be._objects[key].value_offset
    return str(be.path_of(key)), be._objects[key].value_offset
