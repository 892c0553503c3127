"""Prefix keys: the store key of every full page of a token sequence.

Token ids are cut into pages of ``page_size`` tokens; only full pages get a key. The key of
page ``i`` is a chained hash::

    h[-1] = xxh3_128(namespace)
    h[i]  = xxh3_128(h[i-1] || tokens[i*P:(i+1)*P] as little-endian uint32)

with the fixed seed :data:`SEED`, so the key of a page names the page's tokens *and every
token before them*: equal prefixes give equal keys in every process and on every node
(nothing depends on ``PYTHONHASHSEED``), and a page is only found after the same history.

The namespace (model id, page layout, dtype, page size, tensor-parallel rank and size)
starts the chain and also prefixes the key in clear, so two models, two layouts or two
ranks never share a key: a store written by another model or layout gives misses, never
foreign KV.

A key reads ``kv1/<namespace tag, 16 hex>/<page hash, 32 hex>``; a per-layer layout adds
``/L<layer>`` for each segment (:meth:`PrefixKeys.segment_keys`).

Engines that chain page hashes themselves (SGLang's HiCache hands a storage backend one
hash string per page, already covering the page's whole prefix) are keyed with
:meth:`PrefixKeys.external_keys`: ``h = xxh3_128(namespace digest || "ext" || engine
hash)``, so the engine's hash names the prefix and the namespace still starts every key:
a store written under another model or layout gives misses there too.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, List, Optional, Sequence

import numpy as np
import xxhash

from gdskv.errors import ConfigError, InvalidValueError
from gdskv.engine.layout import MAX_PAGE_SIZE, PageLayout

#: Seed of every hash in this module. Changing it changes every key: bump KEY_VERSION too.
SEED = 0x6764736B76  # "gdskv"
#: Version of the key scheme, written into every key.
KEY_VERSION = 1

_MAX_TOKEN = (1 << 32) - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyNamespace:
    """Everything that must match for stored KV to be usable. Validated on construction."""

    #: Model identity, e.g. a hub id plus revision, or a hash of the weights. No default.
    model_id: str
    #: Page geometry as :meth:`PageLayout.describe` spells it. No default.
    layout: str
    #: KV element dtype. No default.
    dtype: str
    #: Tokens per page. No default.
    page_size: int
    #: Tensor-parallel rank of this process. Default 0.
    tp_rank: int = 0
    #: Tensor-parallel world size. Default 1.
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("model_id", "layout", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError("must be a non-empty string", field=name, got=value)
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or not 0 < self.page_size <= MAX_PAGE_SIZE:
            raise ConfigError("page size must be an integer in 1..65536", field="page_size", got=self.page_size)
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size <= 0:
            raise ConfigError("must be a positive integer", field="tp_size", got=self.tp_size)
        if not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("tp_rank must be in 0..tp_size-1", tp_rank=self.tp_rank, tp_size=self.tp_size)

    @classmethod
    def for_layout(cls, model_id: str, layout: PageLayout, *, tp_rank: int = 0, tp_size: int = 1) -> "KeyNamespace":
        """The namespace of an engine whose pages have ``layout``."""
        return cls(
            model_id=model_id,
            layout=layout.describe(),
            dtype=layout.dtype,
            page_size=layout.page_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def encode(self) -> bytes:
        """Canonical bytes of the namespace (sorted JSON, versioned)."""
        fields = dataclasses.asdict(self)
        fields["key_version"] = KEY_VERSION
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> bytes:
        """16-byte hash of :meth:`encode`: the start of every chain in this namespace."""
        return xxhash.xxh3_128_digest(self.encode(), seed=SEED)

    @property
    def tag(self) -> str:
        """16 hex characters naming the namespace inside keys."""
        return self.digest[:8].hex()


def as_tokens(token_ids: Any) -> np.ndarray:
    """Return ``token_ids`` (a sequence of ints, a 1-D integer numpy array or CPU tensor)
    as a uint32 array, or raise :class:`InvalidValueError`."""
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidValueError("token ids must be a 1-D sequence of integers", cause=str(exc)) from None
    if array.ndim != 1:
        raise InvalidValueError("token ids must be one-dimensional", shape=tuple(array.shape))
    if array.size == 0:
        return np.empty(0, dtype=np.uint32)
    if array.dtype.kind not in "iu":
        raise InvalidValueError("token ids must be integers", dtype=str(array.dtype))
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > _MAX_TOKEN:
        raise InvalidValueError("token ids must lie in 0..2**32-1", min=low, max=high)
    return array.astype("<u4", copy=False)


class PrefixKeys:
    """Page keys of token sequences in one namespace. Stateless and thread-safe."""

    def __init__(self, namespace: KeyNamespace) -> None:
        if not isinstance(namespace, KeyNamespace):
            raise ConfigError("namespace must be a KeyNamespace", got=type(namespace).__name__)
        self.namespace = namespace
        self.page_size = namespace.page_size
        self._root = namespace.digest
        self._prefix = f"kv{KEY_VERSION}/{namespace.tag}/".encode()

    def full_pages(self, n_tokens: int) -> int:
        """How many full pages ``n_tokens`` tokens fill."""
        return n_tokens // self.page_size

    def page_hashes(self, token_ids: Any, n_pages: Optional[int] = None) -> List[bytes]:
        """16-byte chained hashes of the first ``n_pages`` full pages (default: all)."""
        tokens = as_tokens(token_ids)
        full = self.full_pages(tokens.size)
        if n_pages is None:
            n_pages = full
        elif not 0 <= n_pages <= full:
            raise InvalidValueError("more pages asked for than the tokens fill", n_pages=n_pages, full_pages=full)
        p = self.page_size
        raw = tokens[: n_pages * p].tobytes()
        out: List[bytes] = []
        h = self._root
        step = 4 * p
        for i in range(n_pages):
            h = xxhash.xxh3_128_digest(h + raw[i * step : (i + 1) * step], seed=SEED)
            out.append(h)
        return out

    def page_keys(self, token_ids: Any, n_pages: Optional[int] = None) -> List[bytes]:
        """Store keys of the first ``n_pages`` full pages (default: all)."""
        return [self._prefix + h.hex().encode() for h in self.page_hashes(token_ids, n_pages)]

    def external_keys(self, page_hashes: Sequence[Any]) -> List[bytes]:
        """Store keys of pages named by an engine's own chained page hashes (``str`` or
        ``bytes``, each naming a page and its whole prefix), in this namespace."""
        out: List[bytes] = []
        for h in page_hashes:
            raw = h.encode() if isinstance(h, str) else h
            if not isinstance(raw, (bytes, bytearray)) or not raw:
                raise InvalidValueError("engine page hashes must be non-empty str or bytes", got=type(h).__name__)
            digest = xxhash.xxh3_128_digest(self._root + b"ext" + bytes(raw), seed=SEED)
            out.append(self._prefix + digest.hex().encode())
        return out

    @staticmethod
    def segment_keys(page_key: bytes, num_segments: int) -> List[bytes]:
        """Store keys of a page's segments: the page key itself for one segment, else one
        ``/L<i>`` key per layer."""
        if num_segments == 1:
            return [page_key]
        return [page_key + b"/L%d" % i for i in range(num_segments)]
