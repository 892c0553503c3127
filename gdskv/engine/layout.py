"""Page geometry: how an engine lays out the KV of one page, and how big it is.

A *page* holds the keys and values of ``page_size`` consecutive tokens for every layer.
Its bytes are moved as *segments*:

- ``kind="per_layer"``: one segment per layer (one tensor per layer, as vLLM and SGLang
  keep their caches), each ``2 * num_kv_heads * page_size * head_dim`` elements
  (K then V); one store object per page and layer.
- ``kind="fused"``: one segment holding every layer (one fused buffer); one store object
  per page.

The geometry is part of every key's namespace (:mod:`gdskv.engine.prefix`), so KV saved
under one geometry is never found under another.
"""

from __future__ import annotations

import dataclasses

from gdskv.config import check_choice
from gdskv.errors import ConfigError

#: Layout kinds, by name.
LAYOUT_KINDS = ("per_layer", "fused")

#: Element sizes of the dtypes an engine may keep KV in (names as torch spells them).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

#: Largest page accepted, in tokens.
MAX_PAGE_SIZE = 1 << 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageLayout:
    """The shape of one page of KV. Validated on construction (ConfigError)."""

    #: Tokens per page (engines use 16..256). No default.
    page_size: int
    #: Transformer layers holding KV. No default.
    num_layers: int
    #: KV heads held by this process (after tensor-parallel sharding). No default.
    num_kv_heads: int
    #: Elements per head. No default.
    head_dim: int
    #: Element dtype, one of :data:`DTYPE_BYTES`. Default "float32".
    dtype: str = "float32"
    #: "per_layer" (one segment per layer) or "fused" (one segment). Default "per_layer".
    kind: str = "per_layer"

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError("must be a positive integer", field=name, got=value)
        if self.page_size > MAX_PAGE_SIZE:
            raise ConfigError("page size too large", field="page_size", got=self.page_size, limit=MAX_PAGE_SIZE)
        check_choice("KV dtype", self.dtype, tuple(DTYPE_BYTES))
        check_choice("page layout kind", self.kind, LAYOUT_KINDS)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer of one page: K and V."""
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.itemsize

    @property
    def num_segments(self) -> int:
        """Store objects per page: one per layer, or one."""
        return self.num_layers if self.kind == "per_layer" else 1

    @property
    def segment_nbytes(self) -> int:
        """Bytes of one segment (one store object)."""
        return self.layer_nbytes if self.kind == "per_layer" else self.layer_nbytes * self.num_layers

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page, every layer."""
        return self.layer_nbytes * self.num_layers

    def describe(self) -> str:
        """The geometry as a canonical string, e.g. ``per_layer/L4/H2/D64`` (page size and
        dtype are namespace fields of their own)."""
        return f"{self.kind}/L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}"
