"""Byte movement between files and buffers: the I/O engines.

:func:`make_engine` builds an engine by its registered name; an unknown name raises
:class:`ConfigError` listing the valid ones.
"""

from __future__ import annotations

from typing import Callable, Dict

from gdskv.errors import ConfigError
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest
from gdskv.gds.psync import PsyncEngine

ENGINES: Dict[str, Callable[..., IoEngine]] = {
    "psync": lambda threads=4: PsyncEngine(threads=threads),
}


def make_engine(name: str, *, threads: int = 4) -> IoEngine:
    """Build the I/O engine registered as ``name``."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ConfigError("unknown io engine", got=name, valid=", ".join(sorted(ENGINES))) from None
    return factory(threads=threads)


__all__ = ["ENGINES", "IoEngine", "IoFuture", "IoOp", "IoRequest", "PsyncEngine", "make_engine"]
