"""The key-value API that every gdskv store speaks: :class:`KVStore`.

An embedded :class:`gdskv.Store` (``gdskv.open``) and a cluster :class:`gdskv.Client`
(``gdskv.connect``) both implement all of it, so code that only moves KV blocks (the engine
integration, benchmarks, tools) depends on this protocol and works with either.

Contracts (every method is thread-safe):

- ``put(key, value, *, overwrite=False)``: ``value`` (a contiguous buffer) is readable once
  the call returns. The same bytes again are a no-op; different bytes under a stored key raise
  :class:`~gdskv.errors.KeyExistsError` unless ``overwrite``. ``batch_put(keys, values)``: each
  pair in turn, stopping at the first error (earlier pairs stay stored).
- ``get(key) -> bytearray | None``; ``batch_get(keys)``: a list of those. ``None`` is a miss.
- ``get_into(key, out) -> int | None``: the value's size, written into the writable buffer
  ``out``; ``None`` is a miss; an ``out`` smaller than the value raises
  :class:`~gdskv.errors.InvalidValueError` and nothing is written. ``batch_get_into(keys,
  outs)``: the batch form (reads of one tier go out as one submission).
- ``exists(key) -> bool``; ``batch_exists(keys) -> list[bool]``.
- ``remove(key) -> bool``: whether it was stored; durable when it returns.
  ``batch_remove(keys) -> list[bool]``.
- ``stats() -> dict``: a snapshot of the store's figures (its keys depend on the kind).
- ``close()``: idempotent; the store is also a context manager.

Keys are ``str`` or ``bytes`` (1 B to 4 KiB once encoded); faults raise a
:class:`~gdskv.errors.GdskvError` subclass. This module imports only the leaf :mod:`gdskv.types`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, runtime_checkable

from gdskv.types import Key


@runtime_checkable
class KVStore(Protocol):
    """What :class:`gdskv.Store` and :class:`gdskv.Client` share (see the module docstring)."""

    def put(self, key: Key, value: Any, *, overwrite: bool = False) -> None: ...

    def batch_put(self, keys: Sequence[Key], values: Sequence[Any], *, overwrite: bool = False) -> None: ...

    def get(self, key: Key) -> Optional[bytearray]: ...

    def batch_get(self, keys: Sequence[Key]) -> List[Optional[bytearray]]: ...

    def get_into(self, key: Key, out: Any) -> Optional[int]: ...

    def batch_get_into(self, keys: Sequence[Key], outs: Sequence[Any]) -> List[Optional[int]]: ...

    def exists(self, key: Key) -> bool: ...

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]: ...

    def remove(self, key: Key) -> bool: ...

    def batch_remove(self, keys: Sequence[Key]) -> List[bool]: ...

    def stats(self) -> Dict[str, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> "KVStore": ...

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None: ...
