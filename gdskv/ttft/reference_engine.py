"""The reference engine: a Hugging Face causal LM with a paged KV pool and gdskv behind it.

It exists to measure TTFT with real prefill compute. The model is a ``LlamaForCausalLM``
built from a :class:`ModelShape` with random weights drawn from a fixed seed (no download;
the machines have no model hub). Its KV lives in a pool of ``pool_pages`` fixed-size pages
allocated once — device memory on a GPU, host memory otherwise — standing in for the GPU
KV memory of a serving engine. The engine implements the
:class:`~gdskv.engine.allocator.PagedKVEngine` protocol and takes its pages from an
:class:`~gdskv.engine.allocator.OffloadingAllocator`, so a request's cached prefix comes
from the pool, the store's DRAM or its SSD, and only the uncached suffix is computed.

:meth:`ReferenceEngine.prefill` serves one request with output length 1: it acquires the
cached prefix, allocates pages for the rest, runs the model on the suffix with the prefix
KV as its past, writes the new KV into the pages, commits and releases them, and returns
the first generated token and its logits.

torch and transformers are imported when an engine is built, never at ``import gdskv``;
install the ``engine`` extra for them.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, List, Optional, Sequence

import numpy as np
import xxhash

from gdskv.engine.allocator import OffloadConfig, OffloadingAllocator
from gdskv.engine.errors import LayoutMismatchError, PoolExhaustedError
from gdskv.engine.layout import LAYOUT_KINDS, PageLayout
from gdskv.engine.prefix import as_tokens
from gdskv.errors import ConfigError, InvalidValueError
from gdskv.kvstore import KVStore

#: Model shapes by name: ``tiny`` for tests, ``small`` for the benchmark (wide for its depth,
#: so that at 2k tokens of context the projections and MLP, not attention, dominate a
#: token's prefill, as in real models).
SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Shape and seed of the reference model (a Llama). Defaults: the ``small`` shape."""

    #: Vocabulary size. Default 8192.
    vocab_size: int = 8192
    #: Width of the residual stream. Default 512.
    hidden_size: int = 512
    #: Width of the MLP. Default 2048.
    intermediate_size: int = 2048
    #: Transformer layers. Default 4.
    num_layers: int = 4
    #: Query heads. Default 8.
    num_heads: int = 8
    #: Key/value heads (grouped-query attention). Default 2.
    num_kv_heads: int = 2
    #: Elements per head. Default 64.
    head_dim: int = 64
    #: Longest sequence, in tokens. Default 32768.
    max_positions: int = 32768
    #: Seed of the random weights. Default 0.
    seed: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            low = 0 if field.name == "seed" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError("must be an integer >= %d" % low, field=field.name, got=value)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)

    @classmethod
    def named(cls, name: str, **overrides: Any) -> "ModelShape":
        """A preset of :data:`SHAPES` (ConfigError listing them for an unknown name)."""
        if name not in SHAPES:
            raise ConfigError("unknown model shape", got=name, valid=", ".join(SHAPES))
        return cls(**{**SHAPES[name], **overrides})

    @property
    def model_id(self) -> str:
        """Identity of the weights: the shape and seed, hashed. Part of every key."""
        text = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return "reference-llama/" + xxhash.xxh64_hexdigest(text.encode())

    def describe(self) -> str:
        return (
            f"Llama L{self.num_layers} hidden {self.hidden_size} mlp {self.intermediate_size} "
            f"heads {self.num_heads}/{self.num_kv_heads}x{self.head_dim} vocab {self.vocab_size}"
        )


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """One served request (output length 1)."""

    token: int
    logits: Any  # torch tensor [vocab], float32, on the host
    prompt_tokens: int
    device_tokens: int
    store_tokens: int
    computed_tokens: int
    seconds: float

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.store_tokens


def _torch():
    try:
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ConfigError("the reference engine needs torch and transformers: pip install 'gdskv[engine]'", cause=str(exc)) from None
    return torch, transformers


class ReferenceEngine:
    """A paged-KV Llama with prefix caching through gdskv. See the module docstring."""

    def __init__(
        self,
        *,
        shape: Optional[ModelShape] = None,
        pool_pages: int,
        page_size: int = 64,
        kind: str = "per_layer",
        dtype: str = "float32",
        device: str = "cpu",
        store: Optional[KVStore] = None,
        offload: Optional[OffloadConfig] = None,
    ) -> None:
        torch, transformers = _torch()
        self.shape = shape or ModelShape()
        if not isinstance(pool_pages, int) or isinstance(pool_pages, bool) or pool_pages <= 0:
            raise ConfigError("pool_pages must be a positive integer", got=pool_pages)
        if kind not in LAYOUT_KINDS:
            raise ConfigError("unknown page layout kind", got=kind, valid=", ".join(LAYOUT_KINDS))
        self.torch_dtype = getattr(torch, dtype, None)
        if not isinstance(self.torch_dtype, torch.dtype):
            raise ConfigError("unknown torch dtype", got=dtype)
        s = self.shape
        self.layout = PageLayout(
            page_size=page_size, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=dtype, kind=kind
        )
        self.device = torch.device(device)
        config = transformers.LlamaConfig(
            vocab_size=s.vocab_size,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_hidden_layers=s.num_layers,
            num_attention_heads=s.num_heads,
            num_key_value_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            max_position_embeddings=s.max_positions,
        )
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(s.seed)
        try:
            model = transformers.LlamaForCausalLM(config)
        finally:
            torch.random.set_rng_state(generator_state)
        self.model = model.to(device=self.device, dtype=self.torch_dtype).eval()
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._pool = torch.zeros(
            (pool_pages, s.num_layers, 2, s.num_kv_heads, page_size, s.head_dim), dtype=self.torch_dtype, device=self.device
        )
        self.pool_pages = pool_pages
        self._free: List[int] = list(range(pool_pages - 1, -1, -1))
        self._in_use = np.zeros(pool_pages, dtype=bool)
        offload = offload or OffloadConfig(model_id=s.model_id)
        if offload.model_id != s.model_id:
            raise LayoutMismatchError("offload model_id differs from the engine's model", offload=offload.model_id, engine=s.model_id)
        self.kv = OffloadingAllocator(self, store, config=offload)

    # ================================================================== PagedKVEngine

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        if n > len(self._free):
            raise PoolExhaustedError("reference pool exhausted", wanted=n, free=len(self._free), pool_pages=self.pool_pages)
        pages = [self._free.pop() for _ in range(n)]
        self._in_use[pages] = True
        return pages

    def free(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._check_page(page)
        for page in pages:
            self._in_use[page] = False
            self._free.append(page)

    def read_page(self, page: int, outs: Sequence[Any]) -> None:
        for view, out in zip(self._segments(page, outs), outs):
            _host_tensor(out, view).copy_(view)

    def write_page(self, page: int, srcs: Sequence[Any]) -> None:
        for view, src in zip(self._segments(page, srcs), srcs):
            view.copy_(_host_tensor(src, view))

    def _segments(self, page: int, bufs: Sequence[Any]):
        self._check_page(page)
        lay = self.layout
        if len(bufs) != lay.num_segments:
            raise LayoutMismatchError("wrong number of page segments", expected=lay.num_segments, got=len(bufs))
        for buf in bufs:
            if memoryview(buf).nbytes != lay.segment_nbytes:
                raise LayoutMismatchError("page segment has the wrong size", expected=lay.segment_nbytes, got=memoryview(buf).nbytes)
        if lay.kind == "fused":
            return [self._pool[page]]
        return [self._pool[page, layer] for layer in range(lay.num_layers)]

    def _check_page(self, page: int) -> None:
        if not isinstance(page, (int, np.integer)) or not 0 <= page < self.pool_pages or not self._in_use[page]:
            raise InvalidValueError("not an allocated page of this pool", page=page, pool_pages=self.pool_pages)

    # ================================================================== serving

    def prefill(self, token_ids: Any) -> PrefillResult:
        """Serve one request with output length 1. See the module docstring."""
        torch, _ = _torch()
        tokens = as_tokens(token_ids)
        total = int(tokens.size)
        if total == 0:
            raise InvalidValueError("a prompt needs at least one token")
        if total > self.shape.max_positions:
            raise InvalidValueError("prompt longer than the model's positions", tokens=total, limit=self.shape.max_positions)
        if int(tokens.max()) >= self.shape.vocab_size:
            raise InvalidValueError("token id outside the vocabulary", max=int(tokens.max()), vocab_size=self.shape.vocab_size)
        p = self.layout.page_size
        t0 = time.perf_counter()
        hit = self.kv.acquire(tokens)
        pages = list(hit.pages)
        try:
            pages += self.kv.allocate(-(-total // p) - len(pages))
            logits = self._forward(tokens, pages, hit.tokens)
            self.kv.commit(tokens, pages)
        finally:
            self.kv.release(pages)
        token = int(torch.argmax(logits))
        return PrefillResult(
            token=token,
            logits=logits,
            prompt_tokens=total,
            device_tokens=hit.device_tokens,
            store_tokens=hit.store_tokens,
            computed_tokens=total - hit.tokens,
            seconds=time.perf_counter() - t0,
        )

    def _forward(self, tokens: np.ndarray, pages: List[int], past: int):
        """Run the model on ``tokens[past:]`` with pages ``[0, past/P)`` as the past; write
        the new KV into the following pages; return the last position's logits."""
        torch, transformers = _torch()
        s, p = self.shape, self.layout.page_size
        total = int(tokens.size)
        heads, dim = s.num_kv_heads, s.head_dim
        with torch.inference_mode():
            cache = transformers.DynamicCache(config=self.model.config)
            if past:
                idx = torch.tensor(pages[: past // p], device=self.device)
                for layer in range(s.num_layers):
                    kv = self._pool[idx, layer]  # [pages, 2, heads, P, dim]
                    k = kv[:, 0].permute(1, 0, 2, 3).reshape(1, heads, past, dim)
                    v = kv[:, 1].permute(1, 0, 2, 3).reshape(1, heads, past, dim)
                    cache.update(k, v, layer)
            ids = torch.from_numpy(tokens[past:].astype(np.int64)).to(self.device)[None]
            pos = torch.arange(past, total, device=self.device)[None]
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            first = past // p
            new_pages = len(pages) - first
            pad = new_pages * p - (total - past)
            idx = torch.tensor(pages[first:], device=self.device)
            for layer in range(s.num_layers):
                keys, values = _layer_kv(cache, layer)
                for j, t in enumerate((keys, values)):
                    t = t[0, :, past:total]  # [heads, new, dim]
                    if pad:
                        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
                    self._pool[idx, layer, j] = t.reshape(heads, new_pages, p, dim).permute(1, 0, 2, 3)
            return out.logits[0, -1].float().cpu()

    def reference_logits(self, token_ids: Any):
        """Logits of the last position from one plain forward pass over the whole prompt,
        no pages, no cache: the ground truth for correctness checks."""
        torch, _ = _torch()
        tokens = as_tokens(token_ids)
        with torch.inference_mode():
            ids = torch.from_numpy(tokens.astype(np.int64)).to(self.device)[None]
            return self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()

    def close(self) -> None:
        """Stop the allocator's saves (draining them). The store belongs to the caller."""
        self.kv.close()

    def __enter__(self) -> "ReferenceEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_tensor(buf: Any, like):
    """A uint8 host buffer viewed as a tensor of ``like``'s dtype and shape (no copy)."""
    torch, _ = _torch()
    return torch.frombuffer(buf, dtype=torch.uint8).view(like.dtype).view(like.shape)


def _layer_kv(cache, layer: int):
    """(keys, values) of one layer of a transformers cache, across cache API versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # pragma: no cover - transformers < 4.56
