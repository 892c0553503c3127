"""Reusable ``liburing.Iovec`` objects that point at any memory, without leaking it.

``liburing.Iovec(list)`` (version pinned by the ``uring`` extra) copies the address and
length of each buffer into a C ``struct iovec`` array it owns, but for a ``memoryview``
(or numpy memory) it never releases the buffer it obtained: every call leaks the view and
pins the memory behind it for good. Called once per I/O, that is a leak the size of the
traffic. ``bytearray`` items are not affected.

So the engine builds each ``Iovec`` once from placeholder ``bytearray`` s (no leak) and
rewrites its C array in place for every submission: :meth:`IovecFactory.fill` stores the
caller's addresses and lengths and the entry count. The object layout this relies on
(``_len``, then the ``struct iovec *``, right after the Python object header) is checked on
construction against an ``Iovec`` of known buffers; a wrapper that lays it out differently
raises :class:`EngineUnavailableError`, so ``auto`` falls back to ``psync``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Sequence

from gdskv.errors import ConfigError
from gdskv.gds.aligned import address_of

_HEAD = object.__basicsize__  # ob_refcnt + ob_type


class EngineUnavailableError(ConfigError):
    """An I/O engine that was asked for by name cannot run on this machine."""


class _CIovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Template:
    """One ``liburing.Iovec`` with room for ``capacity`` entries, rewritten per use."""

    __slots__ = ("obj", "capacity", "_count", "_entries")

    def __init__(self, lib: Any, capacity: int) -> None:
        self.obj = lib.Iovec([bytearray(1)] * capacity)
        self.capacity = capacity
        self._count = ctypes.c_size_t.from_address(id(self.obj) + _HEAD)
        array = ctypes.c_size_t.from_address(id(self.obj) + _HEAD + ctypes.sizeof(ctypes.c_size_t)).value
        self._entries = (_CIovec * capacity).from_address(array)

    def fill(self, buffers: Sequence[memoryview]) -> None:
        """Point the entries at ``buffers`` (at most ``capacity``); they must stay alive
        until the kernel is done with them."""
        entries = self._entries
        for i, buf in enumerate(buffers):
            entries[i].base = address_of(buf)
            entries[i].len = buf.nbytes
        self._count.value = len(buffers)

    def entry(self, index: int) -> _CIovec:
        """The C ``struct iovec`` at ``index``, to rewrite in place (``base``, ``len``)."""
        return self._entries[index]

    def point(self, address: int, length: int) -> None:
        """Make this a single entry ``(address, length)``."""
        self._entries[0].base = address
        self._entries[0].len = length
        self._count.value = 1

    def __del__(self) -> None:
        try:
            self._count.value = self.capacity  # the wrapper frees the array it allocated
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def check_layout(lib: Any) -> None:
    """Raise :class:`EngineUnavailableError` unless ``Iovec`` has the expected layout."""
    a, b = bytearray(3), bytearray(5)
    try:
        probe = lib.Iovec([a, b])
        count = ctypes.c_size_t.from_address(id(probe) + _HEAD).value
        array = ctypes.c_size_t.from_address(id(probe) + _HEAD + ctypes.sizeof(ctypes.c_size_t)).value
        entries = (_CIovec * 2).from_address(array) if count == 2 and array else None
        ok = (
            entries is not None
            and (entries[0].base, entries[0].len) == (address_of(memoryview(a)), 3)
            and (entries[1].base, entries[1].len) == (address_of(memoryview(b)), 5)
        )
    except Exception as exc:  # noqa: BLE001 - any surprise means: do not trust the layout
        raise EngineUnavailableError(
            "liburing.Iovec layout not recognised", version=getattr(lib, "__version__", "?"), cause=str(exc)
        ) from None
    if not ok:
        raise EngineUnavailableError(
            "liburing.Iovec layout not recognised", version=getattr(lib, "__version__", "?"), python=sys.version
        )
