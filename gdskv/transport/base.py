"""The data-plane protocol: how a reader pulls replicas from the node that owns them.

Data never goes through the master. A node runs a *server* in front of a :class:`Provider`
(its store); readers use a :class:`Transport` (a client with pooled connections per peer).
Every call takes a batch of keys; a transport may split a batch over several connections.

Client primitives (``address`` is the peer's "host:port"):

- ``read(address, keys, outs) -> list[int | None]``: fill ``outs[i]`` (writable buffers)
  with the value of ``keys[i]``; its size, or None where the peer has no replica (a clean
  miss). A value larger than its ``out`` is an :class:`InvalidValueError` (nothing of it is
  written). With ``verify``, each value is checked against its CRC32C on arrival: a mismatch
  is a :class:`CorruptionError`.
- ``write(address, keys, values, crcs) -> list[ItemStatus]``: store values on the peer.
- ``remove(address, keys) -> list[bool]``: delete the peer's replicas; whether each existed.
- ``pull(address, keys) -> list[ItemStatus]``: ask the peer to fetch keys from the cluster
  into its own store (replication, prefetch).
- ``ping(address)``, ``close()`` (idempotent).

A peer that cannot be reached, breaks a connection, or sends a malformed frame raises a
:class:`TransportError` subclass (:class:`PeerDisconnectedError`, :class:`ProtocolError`);
a peer that refuses a request raises :class:`RemoteError`. Callers treat these as "this
replica is unusable" and move on to the next replica.

Server side: :class:`Provider` is what a node plugs into a server. ``read`` is a generator
of groups of :class:`ServedItem` so a node can hand out pinned DRAM views first (zero copy)
and stream NVMe values through a staging buffer afterwards; views in a group stay valid
until the generator is resumed or closed.

Transports: ``tcp`` (always available). An RDMA transport implements the same protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, List, Optional, Sequence

from gdskv.transport.frames import ItemStatus


@dataclasses.dataclass
class ServedItem:
    """One value a node serves: ``index`` into the request, a status, and for OK the bytes
    (``view``) with their CRC32C (of key + value). ``size``: the value's size for TOO_SMALL."""

    index: int
    status: ItemStatus
    view: Optional[memoryview] = None
    crc: int = 0
    tier: int = 0
    size: int = 0


class Staging:
    """A reusable, growable byte buffer (one per server connection)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray(0)

    def get(self, nbytes: int) -> memoryview:
        if nbytes > len(self._buf):
            self._buf = bytearray(nbytes)
        return memoryview(self._buf)[:nbytes]

    def shrink(self, keep: int) -> None:
        if len(self._buf) > keep:
            self._buf = bytearray(0)


class Provider:
    """What a data server serves. Implemented by the node on top of its store."""

    def read(self, keys: List[bytes], rooms: List[int], staging: Staging) -> Iterator[List[ServedItem]]:  # pragma: no cover
        raise NotImplementedError

    def write(self, keys: List[bytes], values: List[memoryview], crcs: List[int]) -> List[ItemStatus]:  # pragma: no cover
        raise NotImplementedError

    def remove(self, keys: List[bytes]) -> List[ItemStatus]:  # pragma: no cover
        raise NotImplementedError

    def pull(self, keys: List[bytes]) -> List[ItemStatus]:  # pragma: no cover
        raise NotImplementedError


class Transport:
    """Client side of a data plane. See the module docstring."""

    name = "base"

    def read(  # pragma: no cover
        self, address: str, keys: Sequence[bytes], outs: Sequence[memoryview]
    ) -> List[Optional[int]]:
        raise NotImplementedError

    def write(
        self, address: str, keys: Sequence[bytes], values: Sequence[memoryview], crcs: Sequence[int]
    ) -> List[ItemStatus]:  # pragma: no cover
        raise NotImplementedError

    def remove(self, address: str, keys: Sequence[bytes]) -> List[bool]:  # pragma: no cover
        raise NotImplementedError

    def pull(self, address: str, keys: Sequence[bytes]) -> List[ItemStatus]:  # pragma: no cover
        raise NotImplementedError

    def ping(self, address: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DataServer:
    """Server side of a data plane: serves a :class:`Provider` on ``address``."""

    address: str

    def start(self) -> str:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover
        raise NotImplementedError
