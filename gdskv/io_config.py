"""The config of each I/O engine: the options that engine takes, validated, and ``build()``.

- :class:`PsyncConfig`: the psync engine (a thread pool of ``preadv``/``pwritev``);
- :class:`UringConfig`: the io_uring engine (one ring per thread);
- :class:`KvikioConfig`: the kvikio (cuFile / GPUDirect Storage) engine;
- :class:`AutoConfig`: io_uring where the store directory allows it, else psync.

Each is a frozen, keyword-only dataclass validated on construction (a :class:`ConfigError`
names the field); ``build(directory)`` constructs the engine, importing it only then, so
this module imports no engine (and no GPU or io_uring package). :data:`ENGINE_CONFIGS`
registers them by name; :func:`engine_config` picks one by name. A store builds the one
``StoreConfig.io_engine`` names from the flat ``io_*`` fields (see :mod:`gdskv.config`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Type

from gdskv.config_fields import MiB, check_bytes, check_flag, check_positive, construct, registered

if TYPE_CHECKING:  # no engine is imported at run time before build()
    from gdskv.gds.engine import IoEngine

log = logging.getLogger(__name__)

#: io_uring refuses a queue of more entries than this (IORING_MAX_ENTRIES).
MAX_IO_DEPTH = 32768
#: More psync threads than this is a mistake, not a setting (each is an OS thread).
MAX_IO_THREADS = 1024

def _threads(value: Any) -> int:
    return check_positive("threads", value, maximum=MAX_IO_THREADS)


def _depth(value: Any) -> int:
    return check_positive("depth", value, maximum=MAX_IO_DEPTH, why=" (io_uring's largest queue)")


def _read_inflight(value: Any) -> int:
    return check_positive("read_inflight_bytes", check_bytes("read_inflight_bytes", value))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What every engine takes. Subclasses add their own options and :meth:`build`."""

    #: The name the engine is registered under.
    name: ClassVar[str] = ""

    #: Open files with O_DIRECT where the filesystem allows it (buffered otherwise).
    #: Default True.
    direct: bool = True

    def __post_init__(self) -> None:
        check_flag("direct", self.direct)

    def build(self, directory: "str | os.PathLike[str] | None" = None) -> "IoEngine":
        """Construct the engine; ``directory`` is the store directory (``auto`` probes it)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class PsyncConfig(EngineConfig):
    """The psync engine: ``threads`` workers running ``preadv``/``pwritev``."""

    name: ClassVar[str] = "psync"

    #: Worker threads. Default 4.
    threads: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        _threads(self.threads)

    def build(self, directory: "str | os.PathLike[str] | None" = None) -> "IoEngine":
        from gdskv.gds.psync import PsyncEngine

        return PsyncEngine(threads=self.threads, direct=self.direct)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UringConfig(EngineConfig):
    """The io_uring engine: one ring of ``depth`` entries per thread (needs gdskv[uring])."""

    name: ClassVar[str] = "uring"

    #: Requests in flight per ring. Default 64.
    depth: int = 64
    #: Bytes of large reads (not the small reads of a few KiB) in flight per ring: more
    #: waits, so a deep queue of large reads does not slow the disk down. Default 4 MiB.
    read_inflight_bytes: int = 4 * MiB

    def __post_init__(self) -> None:
        super().__post_init__()
        _depth(self.depth)
        object.__setattr__(self, "read_inflight_bytes", _read_inflight(self.read_inflight_bytes))

    def build(self, directory: "str | os.PathLike[str] | None" = None) -> "IoEngine":
        from gdskv.gds.uring import UringEngine  # liburing is imported only when asked for

        return UringEngine(depth=self.depth, direct=self.direct, read_inflight_bytes=self.read_inflight_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvikioConfig(EngineConfig):
    """The kvikio engine: cuFile (GPUDirect Storage) reads and writes (needs gdskv[gpu])."""

    name: ClassVar[str] = "kvikio"

    #: Size of kvikio's thread pool, a process-wide kvikio setting. Default 4.
    threads: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        _threads(self.threads)

    def build(self, directory: "str | os.PathLike[str] | None" = None) -> "IoEngine":
        from gdskv.gds.kvikio_engine import KvikioEngine  # needs a CUDA device and kvikio

        return KvikioEngine(direct=self.direct, threads=self.threads)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoConfig(EngineConfig):
    """io_uring when the store directory allows it, else psync (``stats()`` says which and
    why): the options of both, each passed to the engine chosen."""

    name: ClassVar[str] = "auto"

    #: Worker threads, if psync is chosen. Default 4.
    threads: int = 4
    #: Requests in flight per ring, if io_uring is chosen. Default 64.
    depth: int = 64
    #: Bytes of large reads in flight per ring, if io_uring is chosen. Default 4 MiB.
    read_inflight_bytes: int = 4 * MiB

    def __post_init__(self) -> None:
        super().__post_init__()
        _threads(self.threads)
        _depth(self.depth)
        object.__setattr__(self, "read_inflight_bytes", _read_inflight(self.read_inflight_bytes))

    def choose(self, directory: "str | os.PathLike[str] | None" = None) -> "tuple[EngineConfig, str]":
        """The config of the engine this machine allows in ``directory`` (the current
        directory by default), with the reason."""
        from gdskv.gds.probe import choose

        choice = choose(os.getcwd() if directory is None else directory, direct=self.direct)
        if choice.engine == "uring":
            return UringConfig(depth=self.depth, direct=choice.direct, read_inflight_bytes=self.read_inflight_bytes), choice.reason
        return PsyncConfig(threads=self.threads, direct=choice.direct), choice.reason

    def build(self, directory: "str | os.PathLike[str] | None" = None) -> "IoEngine":
        chosen, reason = self.choose(directory)
        engine = chosen.build(directory)
        engine.reason = reason
        log.info("gdskv: io engine %s (auto: %s)", engine.name, reason)
        return engine


#: The engine configs by registered name (gdskv.gds.ENGINES is this registry).
ENGINE_CONFIGS: Dict[str, Type[EngineConfig]] = {
    cls.name: cls for cls in (AutoConfig, KvikioConfig, PsyncConfig, UringConfig)
}


def engine_config(name: str, **options: Any) -> EngineConfig:
    """The config of the engine registered as ``name``, with ``options`` (its own fields;
    an unknown name or option is a ConfigError listing the valid ones)."""
    cls = registered("io engine", name, ENGINE_CONFIGS)
    return construct(cls, options, what=f"the {name} io engine")
