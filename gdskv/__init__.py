"""gdskv: a tiered KV-cache store for LLM serving (GPU HBM, host DRAM, local NVMe).

Quick start::

    import gdskv
    with gdskv.open("/tmp/kv", dram="2GiB", ssd="20GiB") as store:
        store.put("block-0", b"...")
        value = store.get("block-0")        # bytearray, or None on a miss
        store.flush()                       # wait until queued offloads are on SSD

A cluster (a ``gdskv-master`` and ``gdskv-node`` daemons)::

    client = gdskv.connect("127.0.0.1:50051")               # thin client
    client = gdskv.connect("127.0.0.1:50051", local=store)  # this process becomes a node

``import gdskv`` imports no GPU, RDMA or engine package, and no gRPC: :func:`connect` and
:class:`Client` import the cluster modules on first use.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Optional

from gdskv.config import StoreConfig, env_overrides, format_size, parse_size
from gdskv.errors import (
    ConfigError,
    CorruptionError,
    FormatVersionError,
    GdskvError,
    InvalidKeyError,
    InvalidValueError,
    IoError,
    KeyExistsError,
    NodeUnavailableError,
    NoSpaceError,
    StoreClosedError,
    StoreLockedError,
    TimedOutError,
    ValueTooLargeError,
)
from gdskv.kvstore import KVStore
from gdskv.store import CheckReport, Store
from gdskv.types import Tier

if TYPE_CHECKING:
    from gdskv.client import Client
    from gdskv.local.client import AttachedStore

__version__ = "0.1.0"


def open(  # noqa: A001 - mirrors the builtin on purpose: gdskv.open(path)
    path: "str | os.PathLike[str]",
    *,
    dram: "int | str | None" = None,
    ssd: "int | str | None" = None,
    hbm: "int | str | None" = None,
    config: Optional[StoreConfig] = None,
    hbm_pool: Any = None,
    **options: Any,
) -> Store:
    """Open (or create) a store in directory ``path``.

    ``dram``, ``ssd`` and ``hbm`` are capacities (``"2GiB"`` or bytes; ``ssd=0`` disables
    the NVMe tier; ``hbm`` > 0 adds a GPU tier, which needs a CUDA device); other keyword
    options are :class:`StoreConfig` fields. Precedence, lowest first: ``config`` (or the
    defaults), ``GDSKV_*`` environment variables, explicit arguments. ``hbm_pool`` (a
    :class:`gdskv.tiers.devpool.DevicePool`) replaces the device pool of the HBM tier: tests
    pass a host stand-in. Reopening a directory recovers every intact object on NVMe.
    """
    fields = dict(env_overrides())
    if dram is not None:
        fields["dram_bytes"] = parse_size(dram, field="dram")
    if ssd is not None:
        fields["ssd_bytes"] = parse_size(ssd, field="ssd")
    if hbm is not None:
        fields["hbm_bytes"] = parse_size(hbm, field="hbm")
    valid = sorted(f.name for f in dataclasses.fields(StoreConfig))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown store option; valid options: dram, ssd, hbm, config, hbm_pool, {', '.join(valid)}",
            got=", ".join(unknown),
        )
    fields.update(options)
    if config is not None and not isinstance(config, StoreConfig):
        raise ConfigError("config must be a StoreConfig (or pass its fields as options)", got=type(config).__name__)
    base = config if config is not None else StoreConfig()
    return Store(path, base.replace(**fields), hbm_pool=hbm_pool)


def connect(master: str, *, local: Optional[Store] = None, **options: Any) -> "Client":
    """Connect to the cluster whose master listens on ``master`` ("host:port").

    With ``local`` (an open :class:`Store`), this process joins the cluster as a node: its
    store is registered with the master and served to peers, and reads try it first. With
    ``local=None`` the client is thin: puts go to the node the master picks. ``options``
    are :class:`gdskv.node.ClusterConfig` fields. See :mod:`gdskv.client` for the API.
    """
    from gdskv.client import Client
    from gdskv.node.config import ClusterConfig

    try:
        config = ClusterConfig(**options)
    except TypeError as exc:  # an unknown keyword
        raise ConfigError("unknown cluster option", cause=str(exc)) from None
    return Client(master, local=local, config=config)


def attach(path: "str | os.PathLike[str]", **options: Any) -> "AttachedStore":
    """Attach to the node serving ``path`` on this host (``gdskv-node --socket``): its socket,
    or its store directory (``node.sock`` in it). The store API is :class:`KVStore`, as for
    :func:`open`; values are copied through shared memory, never through the socket (see
    :mod:`gdskv.local`). ``options``: ``connections`` (most at once, default 8) and
    ``timeout_s`` (of one call, default 30). :class:`NodeUnavailableError` when no node
    serves there."""
    from gdskv.local.client import AttachedStore

    return AttachedStore(path, **options)


def __getattr__(name: str) -> Any:
    if name == "Client":  # imported on first use: it brings in gRPC
        from gdskv.client import Client

        return Client
    raise AttributeError(f"module 'gdskv' has no attribute {name!r}")


__all__ = [
    "CheckReport",
    "Client",
    "ConfigError",
    "CorruptionError",
    "FormatVersionError",
    "GdskvError",
    "InvalidKeyError",
    "InvalidValueError",
    "IoError",
    "KVStore",
    "KeyExistsError",
    "NoSpaceError",
    "NodeUnavailableError",
    "Store",
    "StoreClosedError",
    "StoreConfig",
    "StoreLockedError",
    "Tier",
    "TimedOutError",
    "ValueTooLargeError",
    "attach",
    "connect",
    "format_size",
    "open",
    "parse_size",
]
