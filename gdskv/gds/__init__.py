"""Byte movement between files and buffers: the I/O engines.

Each engine's options, their checks and its construction live in its config
(:mod:`gdskv.io_config`): ``PsyncConfig(threads=2).build()``. :data:`ENGINES` registers those
configs by name; :func:`make_engine` builds one by name (an unknown name, or an option that
engine does not take, raises :class:`ConfigError` listing the valid ones). The names are
those of :data:`gdskv.config.IO_ENGINES`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Type

from gdskv.gds.engine import IoEngine, IoFuture, IoOp, IoRequest
from gdskv.gds.psync import PsyncEngine
from gdskv.io_config import ENGINE_CONFIGS, EngineConfig, engine_config

#: The engine configs by registered name.
ENGINES: Dict[str, Type[EngineConfig]] = ENGINE_CONFIGS


def make_engine(name: str, *, directory: "Optional[str | os.PathLike[str]]" = None, **options: Any) -> IoEngine:
    """Build the I/O engine registered as ``name`` with ``options``, the fields of its
    config (``direct``, and ``threads``, ``depth`` or ``read_inflight_bytes`` for the
    engines that take them); ``directory`` is the store directory, where ``auto`` probes."""
    return engine_config(name, **options).build(directory)


__all__ = ["ENGINES", "IoEngine", "IoFuture", "IoOp", "IoRequest", "PsyncEngine", "make_engine"]
