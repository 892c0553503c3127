"""The peer data plane: how replicas move between nodes (never through the master).

:func:`make_transport` builds a client transport by its registered name and
:func:`make_server` the matching server; an unknown name raises :class:`ConfigError`
listing the valid ones. Only ``tcp`` exists: an RDMA transport (pyverbs) would register
here, implementing :class:`Transport` and :class:`DataServer`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from gdskv.errors import ConfigError
from gdskv.transport.base import DataServer, Provider, ServedItem, Staging, Transport
from gdskv.transport.frames import ItemStatus, Limits
from gdskv.transport.tcp import TcpTransport
from gdskv.transport.tcp_server import TcpServer

TRANSPORTS: Dict[str, Callable[..., Transport]] = {"tcp": TcpTransport}
SERVERS: Dict[str, Callable[..., DataServer]] = {"tcp": TcpServer}


def make_transport(name: str = "tcp", **options: Any) -> Transport:
    """Build the client transport registered as ``name``."""
    try:
        factory = TRANSPORTS[name]
    except KeyError:
        raise ConfigError("unknown transport", got=name, valid=", ".join(sorted(TRANSPORTS))) from None
    return factory(**options)


def make_server(name: str, provider: Provider, listen: str, **options: Any) -> DataServer:
    """Build the data server registered as ``name`` in front of ``provider``."""
    try:
        factory = SERVERS[name]
    except KeyError:
        raise ConfigError("unknown transport", got=name, valid=", ".join(sorted(SERVERS))) from None
    return factory(provider, listen, **options)


__all__ = [
    "DataServer",
    "ItemStatus",
    "Limits",
    "Provider",
    "ServedItem",
    "Staging",
    "TcpServer",
    "TcpTransport",
    "Transport",
    "make_server",
    "make_transport",
]
