"""Attaching gdskv to an outside engine (vLLM, SGLang): the settings both connectors read,
and the process-wide registry of the stores they use.

Contract:

- :class:`AttachConfig` is built from the engine's free-form "extra config" mapping
  (:meth:`AttachConfig.from_mapping`): ``path`` (the store directory; required),
  ``mode`` (below; default ``"auto"``), ``socket`` (the node's Unix socket; default
  ``node.sock`` in ``path``; at most 107 bytes), ``master`` (``host:port`` of the
  cluster's master; mode ``cluster`` only), ``dram``, ``ssd`` (sizes, ``"8GiB"`` style),
  ``model_id`` (part of every key; default: the engine's model name), ``staging`` (host
  staging of asynchronous saves), ``store_options`` (any other :class:`gdskv.StoreConfig`
  field). An unknown key is a ConfigError listing the valid ones; keys the engine itself
  uses are passed in ``ignore``.
- Modes. ``embedded``: the process opens the store itself (:func:`gdskv.open` on
  ``path``); a store directory admits one process, so an engine whose scheduler and
  workers run in several processes gets the store in one of them only. ``node``: the
  process attaches to the node that serves ``socket`` (:func:`gdskv.attach`; the node is
  started by the operator: ``gdskv-node --socket``, whose ``--dram``/``--ssd``/``--set``
  then apply, not this config's). ``auto``: as ``node`` when a node serves ``socket``;
  else the process starts one for the host (:mod:`gdskv.engine.hostnode`: store in
  ``path`` with ``dram``, ``ssd`` and ``store_options``; it exits 30 s after its last
  process left), under a lock so that of several processes starting at once one starts
  it and the others attach. ``cluster``: as ``auto``, and a node it starts joins the
  master ``master`` (the node does the cross-host part).
- :func:`acquire_store` gives each process one store per directory (embedded) or socket
  (the other modes) and counts its users, so an engine's scheduler-side and worker-side
  connectors in one process share one store. ``role`` names the user in warnings.
  Embedded: a store that cannot be opened is logged as a warning (a locked one names the
  process that holds it) and returned as None: the engine serves without gdskv (misses),
  never crashes. The other modes return a :class:`~gdskv.engine.resilient.ResilientStore`
  even when no node could be reached: while the node is gone, reads are misses and puts
  are dropped, with one warning per outage, and it attaches again (at most one try a
  second; auto and cluster start the node again) and says so once.
  :func:`release_store` closes a store when its last user in the process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from gdskv.config import GiB, MiB, StoreConfig, parse_size
from gdskv.engine.hostnode import NodeLink, node_options
from gdskv.engine.resilient import ResilientStore
from gdskv.errors import ConfigError, GdskvError, StoreLockedError
from gdskv.kvstore import KVStore
from gdskv.local.protocol import MAX_SOCKET_PATH, SOCKET_NAME

log = logging.getLogger(__name__)

#: Keys an attach mapping may carry.
ATTACH_KEYS = ("path", "mode", "socket", "master", "dram", "ssd", "model_id", "staging", "store_options")
#: The modes (see the module docstring); the first is the default.
MODES = ("auto", "embedded", "node", "cluster")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttachConfig:
    """Where an engine's connector keeps KV, and how much. Validated on construction."""

    #: Store directory (created if missing). No default.
    path: str
    #: How the process reaches the store: "auto", "embedded", "node" or "cluster" (see the
    #: module docstring). Default "auto".
    mode: str = "auto"
    #: The node's Unix socket (not for "embedded"). Default None: ``node.sock`` in ``path``.
    socket: Optional[str] = None
    #: ``host:port`` of the cluster's master ("cluster" only, required there). Default None.
    master: Optional[str] = None
    #: DRAM tier in bytes (of the store this process opens or the node it starts). Default 1 GiB.
    dram_bytes: int = 1 * GiB
    #: SSD tier cap in bytes (0: DRAM only). Default 16 GiB.
    ssd_bytes: int = 16 * GiB
    #: Model identity written into every key (None: the engine's model name). Default None.
    model_id: Optional[str] = None
    #: Host staging of asynchronous saves, in bytes. Default 256 MiB.
    staging_bytes: int = 256 * MiB
    #: Other :class:`gdskv.StoreConfig` fields, passed to :func:`gdskv.open` (embedded) or
    #: to the node this process starts (``--set``). Default {}.
    store_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError("the gdskv store path is required", field="path", got=self.path)
        object.__setattr__(self, "path", str(self.path))
        if self.mode not in MODES:
            raise ConfigError("unknown gdskv mode", field="mode", got=self.mode, valid=", ".join(MODES))
        for name in ("dram_bytes", "ssd_bytes", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = parse_size(value, field=name)
                object.__setattr__(self, name, value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError("must be a byte count", field=name, got=value)
        if self.staging_bytes <= 0:
            raise ConfigError("staging must be positive", field="staging_bytes", got=self.staging_bytes)
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError("model_id must be a non-empty string", field="model_id", got=self.model_id)
        if not isinstance(self.store_options, Mapping):
            raise ConfigError("store_options must be a mapping", field="store_options", got=type(self.store_options).__name__)
        object.__setattr__(self, "store_options", dict(self.store_options))
        valid = {f.name for f in dataclasses.fields(StoreConfig)}
        unknown = sorted(k for k in self.store_options if k not in valid)
        if unknown:
            raise ConfigError("unknown store option in store_options", got=", ".join(map(str, unknown)), valid=", ".join(sorted(valid)))
        self._check_master()
        self._check_socket()
        if self.mode in ("auto", "cluster"):
            node_options(self.store_options)  # each must be expressible on a node's command line

    def _check_master(self) -> None:
        if self.mode != "cluster":
            if self.master is not None:
                raise ConfigError("master is an option of mode 'cluster'", field="master", mode=self.mode)
            return
        host, sep, port = str(self.master or "").rpartition(":")
        if not isinstance(self.master, str) or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("mode 'cluster' needs master as 'host:port' (where gdskv-master listens)", field="master", got=self.master)

    def _check_socket(self) -> None:
        if self.mode == "embedded":
            if self.socket is not None:
                raise ConfigError("socket is an option of modes auto, node and cluster", field="socket", mode=self.mode)
            return
        if self.socket is not None and (not isinstance(self.socket, (str, os.PathLike)) or not str(self.socket)):
            raise ConfigError("socket must be a path", field="socket", got=self.socket)
        sock = os.path.abspath(str(self.socket) if self.socket is not None else os.path.join(self.path, SOCKET_NAME))
        if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"the node's socket path is {len(os.fsencode(sock))} bytes; a Unix socket path has at most "
                f"{MAX_SOCKET_PATH}: set 'socket' to a shorter path (e.g. /tmp/gdskv-<name>.sock) or use a shorter 'path'",
                field="socket", got=sock,
            )
        object.__setattr__(self, "socket", sock)

    @property
    def attached(self) -> bool:
        """Whether the store is a node's (every mode but "embedded")."""
        return self.mode != "embedded"

    @classmethod
    def from_mapping(cls, mapping: Optional[Mapping[str, Any]], *, ignore: Sequence[str] = ()) -> "AttachConfig":
        """Build from an engine's extra-config mapping (see the module docstring)."""
        if mapping is None:
            raise ConfigError("the gdskv connector needs an extra config with at least 'path'", valid=", ".join(ATTACH_KEYS))
        if not isinstance(mapping, Mapping):
            raise ConfigError("the gdskv extra config must be a mapping", got=type(mapping).__name__)
        unknown = sorted(k for k in mapping if k not in ATTACH_KEYS and k not in ignore)
        if unknown:
            raise ConfigError("unknown gdskv connector option", got=", ".join(unknown), valid=", ".join(ATTACH_KEYS))
        fields: Dict[str, Any] = {"path": mapping.get("path")}
        for key, field in (("dram", "dram_bytes"), ("ssd", "ssd_bytes"), ("staging", "staging_bytes")):
            if key in mapping:
                fields[field] = mapping[key]
        for key in ("mode", "socket", "master", "model_id", "store_options"):
            if key in mapping:
                fields[key] = mapping[key]
        return cls(**fields)


class _Entry:
    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.users = 0
        self.pid = os.getpid()


_lock = threading.Lock()
_stores: Dict[Tuple[str, str], _Entry] = {}


def _where(cfg: AttachConfig) -> Tuple[str, str]:
    if cfg.attached:
        assert cfg.socket is not None
        return ("socket", os.path.realpath(cfg.socket))
    return ("path", os.path.realpath(cfg.path))


def acquire_store(cfg: AttachConfig, *, role: Optional[str] = None) -> Optional[KVStore]:
    """The store of ``cfg`` for one more user in this process (``role``, e.g. "worker tp
    rank 1", names it in warnings); for "embedded", None (and a warning) when it cannot be
    opened. See the module docstring."""
    key = _where(cfg)
    with _lock:
        entry = _stores.get(key)
        if entry is not None and (entry.pid != os.getpid() or getattr(entry.store, "_closed", False)):
            entry = None  # a forked child's, or closed under its users
        if entry is None:
            store = _attach(cfg, role) if cfg.attached else _open_embedded(cfg, role)
            if store is None:
                return None
            entry = _stores[key] = _Entry(store)
        elif role is not None and hasattr(entry.store, "add_role"):
            entry.store.add_role(role)
        entry.users += 1
        return entry.store


def _open_embedded(cfg: AttachConfig, role: Optional[str]) -> Optional[KVStore]:
    import gdskv

    where = os.path.realpath(cfg.path)
    try:
        return gdskv.open(where, dram=cfg.dram_bytes, ssd=cfg.ssd_bytes, **cfg.store_options)
    except StoreLockedError as exc:
        holder = exc.context.get("holder_pid")
        by = f"process {holder}" if holder is not None else "another process"
        log.warning(
            "gdskv: %s cannot open the store %s: %s has it open; this process serves without gdskv (misses). "
            "Several processes share one store through a node: use mode 'auto' (the default) or 'node'",
            _who(role), where, by,
        )
    except (GdskvError, OSError) as exc:
        log.warning("gdskv: %s: store %s unavailable, the engine serves without it (misses): %s", _who(role), where, exc)
    return None


def _attach(cfg: AttachConfig, role: Optional[str]) -> KVStore:
    link = NodeLink(cfg)
    store = ResilientStore(link.connect, socket=str(cfg.socket), mode=cfg.mode, role=role)
    store.start()
    return store


def _who(role: Optional[str]) -> str:
    return f"process {os.getpid()}" + (f" ({role})" if role else "")


def release_store(store: Optional[KVStore]) -> None:
    """One user fewer of ``store``; the last one closes it (an embedded store writes its
    DRAM-only objects to SSD; an attached one lets go of the node). Unknown or None stores
    are ignored."""
    if store is None:
        return
    with _lock:
        for where, entry in list(_stores.items()):
            if entry.store is store:
                entry.users -= 1
                if entry.users > 0:
                    return
                del _stores[where]
                break
        else:
            return
    try:
        store.close()
    except GdskvError as exc:
        log.warning("gdskv: closing the store failed: %s", exc)
