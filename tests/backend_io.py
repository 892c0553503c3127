"""Helpers for driving a StorageBackend directly in tests."""

from __future__ import annotations

from gdskv.tiers.backends.record import checksum


def items(values: dict):
    """``write()`` items for a ``{key: bytes}`` mapping."""
    return [(k, memoryview(v), checksum(k, v)) for k, v in values.items()]


def read(backend, key: bytes, size: int):
    """Read ``key`` through ``read_batch`` into a buffer of ``size``; bytes or None."""
    out = bytearray(size)
    n = backend.read_batch([(key, memoryview(out))])[0]
    return None if n is None else bytes(out[:n])

