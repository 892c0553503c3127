"""Byte movement between files and buffers: the I/O engines.

:func:`make_engine` builds an engine by its registered name; an unknown name raises
:class:`ConfigError` listing the valid ones. The names must match
:data:`gdskv.config.IO_ENGINES` (a test checks that they agree).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Optional

from gdskv.errors import ConfigError
from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest
from gdskv.gds.psync import PsyncEngine

log = logging.getLogger(__name__)


# Every factory takes the same keywords; each uses those its engine has.


def _psync(*, threads: int, depth: int, direct: bool, directory: Optional[str], read_inflight_bytes: Optional[int]) -> IoEngine:
    return PsyncEngine(threads=threads, direct=direct)


def _uring(*, threads: int, depth: int, direct: bool, directory: Optional[str], read_inflight_bytes: Optional[int]) -> IoEngine:
    from gdskv.gds.uring import READ_INFLIGHT_BYTES, UringEngine  # liburing is imported only when asked for

    return UringEngine(depth=depth, direct=direct, read_inflight_bytes=READ_INFLIGHT_BYTES if read_inflight_bytes is None else read_inflight_bytes)


def _kvikio(*, threads: int, depth: int, direct: bool, directory: Optional[str], read_inflight_bytes: Optional[int]) -> IoEngine:
    from gdskv.gds.kvikio_engine import KvikioEngine  # needs a CUDA device and kvikio

    return KvikioEngine(direct=direct, threads=threads)


def _auto(*, threads: int, depth: int, direct: bool, directory: Optional[str], read_inflight_bytes: Optional[int]) -> IoEngine:
    from gdskv.gds.probe import choose

    choice = choose(directory or os.getcwd(), direct=direct)
    engine = ENGINES[choice.engine](
        threads=threads, depth=depth, direct=choice.direct, directory=directory, read_inflight_bytes=read_inflight_bytes
    )
    engine.reason = choice.reason
    log.info("gdskv: io engine %s (auto: %s)", engine.name, choice.reason)
    return engine


ENGINES: Dict[str, Callable[..., IoEngine]] = {
    "auto": _auto,
    "kvikio": _kvikio,
    "psync": _psync,
    "uring": _uring,
}


def make_engine(
    name: str,
    *,
    threads: int = 4,
    depth: int = 64,
    direct: bool = False,
    directory: "Optional[str | os.PathLike[str]]" = None,
    read_inflight_bytes: Optional[int] = None,
) -> IoEngine:
    """Build the I/O engine registered as ``name``.

    ``direct`` asks for O_DIRECT where the filesystem allows it; ``directory`` is where
    ``auto`` probes (the store directory); ``read_inflight_bytes`` caps the large reads in
    flight per io_uring (None: the engine's default).
    """
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ConfigError("unknown io engine", got=name, valid=", ".join(sorted(ENGINES))) from None
    return factory(
        threads=threads, depth=depth, direct=direct, directory=None if directory is None else str(directory),
        read_inflight_bytes=read_inflight_bytes,
    )


__all__ = ["ENGINES", "IoEngine", "IoFuture", "IoOp", "IoRequest", "PsyncEngine", "make_engine"]
