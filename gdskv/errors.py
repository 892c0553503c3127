"""The gdskv error hierarchy.

Every fault raises a :class:`GdskvError` subclass that carries the context needed to act on
it (the key, the path, the offset, what was expected and what was found). Misses are *not*
errors: ``Store.get`` returns ``None`` and ``Store.get_into`` returns ``None`` for a key that
is not stored.

This module is a leaf: it imports nothing of gdskv.
"""

from __future__ import annotations

from typing import Any


class GdskvError(Exception):
    """Base of every gdskv error. ``context`` holds the details as keyword fields."""

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context = context
        if context:
            details = ", ".join(f"{k}={_short(v)}" for k, v in context.items())
            message = f"{message} ({details})"
        super().__init__(message)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class ConfigError(GdskvError):
    """A configuration value is invalid (unknown name, bad size, inconsistent settings)."""


class InvalidKeyError(GdskvError, TypeError):
    """A key is not bytes/str, is empty, or is longer than the limit once encoded."""


class InvalidValueError(GdskvError, TypeError):
    """A value or output buffer is not a usable contiguous host buffer, or has a bad size."""


class ValueTooLargeError(GdskvError, ValueError):
    """A value is larger than a tier it must fit in (``capacity`` says how large that is)."""


class TimedOutError(GdskvError, TimeoutError):
    """A wait ran past its time limit (``flush(timeout=...)``) before what it waited for happened."""


class KeyExistsError(GdskvError):
    """A put tried to store a different value under an existing key without ``overwrite``."""


class NoSpaceError(GdskvError):
    """No room could be made in time: the tier is full and nothing is evictable yet."""


class StoreClosedError(GdskvError):
    """The store (or an engine, or a tier) was used after ``close()``."""


class StoreLockedError(GdskvError):
    """Another process has the store directory open."""


class CorruptionError(GdskvError):
    """Stored bytes failed verification (checksum, magic, length). Never served."""


class FormatVersionError(GdskvError):
    """A directory or record was written by a format version this build cannot read."""


class NodeUnavailableError(GdskvError):
    """No node serves the socket a process attaches to, or the node went away (the next call
    connects again)."""


class IoError(GdskvError, OSError):
    """An I/O call failed or returned short; carries path/fd, offset and length."""


class ClusterError(GdskvError):
    """Base of the errors of the cluster: the master, the nodes and the data plane."""


class MasterUnavailableError(ClusterError):
    """The master could not be reached (or did not answer in time)."""


class UnknownNodeError(ClusterError):
    """The master does not know this node (it restarted, or the node's lease expired)."""


class RemoteError(ClusterError):
    """A master or a peer refused a request; ``code`` says why (e.g. INVALID_ARGUMENT)."""


class TransportError(ClusterError):
    """A data-plane transfer failed: the peer is unreachable, or the connection broke."""


class PeerDisconnectedError(TransportError):
    """The peer closed the connection in the middle of a frame (``expected``/``got`` bytes)."""


class ProtocolError(TransportError):
    """A frame of the data plane or of a node's attach socket is malformed: bad magic,
    version, checksum, a length over a limit, an id the connection does not hold."""
