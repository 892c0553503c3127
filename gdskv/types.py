"""Small shared types: tiers, keys and the conversion of user buffers to byte views.

Values may be any C-contiguous host buffer: ``bytes``, ``bytearray``, ``memoryview``, numpy
arrays, or anything exporting DLPack on the CPU (torch tensors) — converted without importing
torch and without copying.

This module is a leaf: it imports only :mod:`gdskv.errors`.
"""

from __future__ import annotations

import enum
from typing import Any, Union

from gdskv.errors import InvalidKeyError, InvalidValueError

#: Longest key accepted, in bytes once encoded (DESIGN.md: "at most 4 KiB").
MAX_KEY_BYTES = 4096

Key = Union[bytes, str]

_DLPACK_CPU = 1  # kDLCPU in the DLPack device enum


class Tier(enum.Enum):
    """Where a replica lives, fastest first."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"


def encode_key(key: Any) -> bytes:
    """Return ``key`` as bytes, or raise :class:`InvalidKeyError`.

    ``str`` keys are UTF-8 encoded; bytes-like keys are copied to ``bytes``. A key must be
    non-empty and at most :data:`MAX_KEY_BYTES` long once encoded.
    """
    if isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from a mis-decoded file name
            raise InvalidKeyError("str key is not encodable as UTF-8", at=exc.start) from None
    elif isinstance(key, bytes):
        raw = key
    elif isinstance(key, (bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise InvalidKeyError("key must be bytes or str", got=type(key).__name__)
    if not raw:
        raise InvalidKeyError("key must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidKeyError("key too long", limit=MAX_KEY_BYTES, got=len(raw))
    return raw


def sequence_arg(items: Any, what: str) -> Any:
    """``items`` if it is a sized, iterable collection of items (a list, a tuple); a str or
    bytes-like object (a key, not a sequence of keys), or anything else, is
    :class:`InvalidValueError`."""
    if isinstance(items, (str, bytes, bytearray, memoryview)) or not (hasattr(items, "__len__") and hasattr(items, "__iter__")):
        raise InvalidValueError(f"{what} must be a sequence (a list or a tuple)", got=type(items).__name__)
    return items


def byte_view(value: Any, *, writable: bool = False, what: str = "value") -> memoryview:
    """Return a flat, C-contiguous ``uint8`` memoryview of ``value`` without copying.

    Accepts objects with the buffer protocol and CPU DLPack exporters (torch tensors).
    Raises :class:`InvalidValueError` for anything else: non-contiguous arrays, device
    tensors, read-only buffers when ``writable`` is requested, and empty buffers.
    """
    try:
        view = memoryview(value)
    except TypeError:
        view = _dlpack_view(value, what)
    if not view.c_contiguous:
        raise InvalidValueError(f"{what} must be C-contiguous", type=type(value).__name__)
    if writable and view.readonly:
        raise InvalidValueError(f"{what} must be writable", type=type(value).__name__)
    if view.nbytes == 0:
        raise InvalidValueError(f"{what} must not be empty", type=type(value).__name__)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _dlpack_view(value: Any, what: str) -> memoryview:
    if not hasattr(value, "__dlpack__"):
        raise InvalidValueError(
            f"{what} must support the buffer protocol or DLPack", type=type(value).__name__
        )
    device = value.__dlpack_device__()
    if device[0] != _DLPACK_CPU:
        raise InvalidValueError(
            f"{what} lives on a device; device buffers need an HBM tier",
            type=type(value).__name__,
            dlpack_device=tuple(device),
        )
    import numpy as np  # numpy is a core dependency; imported here to keep this leaf light

    try:
        array = np.from_dlpack(value)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise InvalidValueError(
            f"{what} could not be exported through DLPack", type=type(value).__name__, cause=str(exc)
        ) from exc
    if not array.flags.c_contiguous:
        raise InvalidValueError(f"{what} must be C-contiguous", type=type(value).__name__)
    return memoryview(array.reshape(-1).view(np.uint8))
