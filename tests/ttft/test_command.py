"""The TTFT benchmark's command: a smoke run of the script in --quick mode (which writes the
JSON and both plots), the ``gdskv bench-ttft`` registration, and imports that stay light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gdskv.ttft.workload import CONFIGS, QUICK

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_table_and_writes_json_and_plots(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_ttft.py"), "--quick", "--no-progress",
         "--out", str(out), "--store-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "TTFT mean" in text and "dram+ssd+promote" in text
    assert f"plot: {out / 'ttft_per_round.png'}" in text
    assert f"plot: {out / 'hit_rate_per_round.png'}" in text
    for name in ("ttft_per_round.png", "hit_rate_per_round.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "ttft.json").read_text())
    results = data["results"]
    assert list(results) == list(CONFIGS)
    rounds = QUICK["rounds"]
    for per_round in results.values():
        assert [r["round"] for r in per_round] == list(range(1, rounds + 1))
        assert per_round[0]["hit_rate"] == 0
        assert len(per_round[0]["requests"]) == QUICK["conversations"]
        for r in per_round:
            assert r["device_tokens"] + r["dram_tokens"] + r["ssd_tokens"] + r["queued_tokens"] == pytest.approx(
                r["hit_rate"] * r["prompt_tokens"]
            )
    # With SSD behind DRAM nothing is lost: every round hits the whole cacheable history.
    for r in results["dram+ssd"]:
        assert r["hit_rate"] == pytest.approx(r["ideal_hit_rate"])
    assert results["dram+ssd"][-1]["ssd_tokens"] > 0
    # Without it, memory ran out and the last round misses part of the history.
    assert results["dram"][-1]["hit_rate"] < results["dram"][-1]["ideal_hit_rate"]
    assert results["device"][-1]["hit_rate"] < results["dram+ssd"][-1]["hit_rate"]
    acc = data["acceptance"]
    assert acc["evaluated"] and acc["hit_rate_ok"]


def test_the_cli_registers_bench_ttft(capsys):
    from gdskv.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench-ttft", "--help"])
    assert info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_importing_gdskv_the_engine_packages_and_the_benchmark_stays_light():
    code = (
        "import sys, gdskv, gdskv.engine, gdskv.connectors, gdskv.ttft.command, gdskv.cli; gdskv.cli.build_parser(); "
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'rich') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"
