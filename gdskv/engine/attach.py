"""Attaching gdskv to an outside engine (vLLM, SGLang): the settings both connectors read,
and the process-wide registry of the stores they open.

Contract:

- :class:`AttachConfig` is built from the engine's free-form "extra config" mapping
  (:meth:`AttachConfig.from_mapping`): ``path`` (the store directory; required),
  ``dram``, ``ssd`` (sizes, ``"8GiB"`` style), ``model_id`` (part of every key; default:
  the engine's model name), ``staging`` (host staging of asynchronous saves),
  ``store_options`` (any other :class:`gdskv.StoreConfig` field). An unknown key is a
  ConfigError listing the valid ones; keys the engine itself uses are passed in
  ``ignore``.
- :func:`acquire_store` opens the store once per directory and process and counts its
  users, so an engine's scheduler-side and worker-side connectors in one process share one
  store (a store directory admits one process at a time). A store that cannot be opened
  is logged as a warning and returned as None: the engine serves without gdskv (misses),
  never crashes. :func:`release_store` closes it when its last user is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Dict, Mapping, Optional, Sequence

from gdskv.config import GiB, MiB, parse_size
from gdskv.errors import ConfigError, GdskvError
from gdskv.kvstore import KVStore

log = logging.getLogger(__name__)

#: Keys an attach mapping may carry.
ATTACH_KEYS = ("path", "dram", "ssd", "model_id", "staging", "store_options")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttachConfig:
    """Where an engine's connector keeps KV, and how much. Validated on construction."""

    #: Store directory (created if missing). No default.
    path: str
    #: DRAM tier in bytes. Default 1 GiB.
    dram_bytes: int = 1 * GiB
    #: SSD tier cap in bytes (0: DRAM only). Default 16 GiB.
    ssd_bytes: int = 16 * GiB
    #: Model identity written into every key (None: the engine's model name). Default None.
    model_id: Optional[str] = None
    #: Host staging of asynchronous saves, in bytes. Default 256 MiB.
    staging_bytes: int = 256 * MiB
    #: Other :class:`gdskv.StoreConfig` fields, passed to :func:`gdskv.open`. Default {}.
    store_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError("the gdskv store path is required", field="path", got=self.path)
        object.__setattr__(self, "path", str(self.path))
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
        for key in ("model_id", "store_options"):
            if key in mapping:
                fields[key] = mapping[key]
        return cls(**fields)


class _Entry:
    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.users = 0


_lock = threading.Lock()
_stores: Dict[str, _Entry] = {}


def acquire_store(cfg: AttachConfig) -> Optional[KVStore]:
    """The store of ``cfg.path`` for one more user in this process; None (and a warning)
    when it cannot be opened. See the module docstring."""
    import gdskv

    where = os.path.realpath(cfg.path)
    with _lock:
        entry = _stores.get(where)
        if entry is None or getattr(entry.store, "_closed", False):
            try:
                store = gdskv.open(where, dram=cfg.dram_bytes, ssd=cfg.ssd_bytes, **cfg.store_options)
            except (GdskvError, OSError) as exc:
                log.warning("gdskv: store %s unavailable, the engine serves without it (misses): %s", where, exc)
                return None
            entry = _stores[where] = _Entry(store)
        entry.users += 1
        return entry.store


def release_store(store: Optional[KVStore]) -> None:
    """One user fewer of ``store``; the last one closes it (writing DRAM-only objects to
    SSD). Unknown or None stores are ignored."""
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
