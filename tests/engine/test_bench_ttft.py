"""The TTFT benchmark: capacity planning, the acceptance check, and a smoke run of the
script in --quick mode (which writes the JSON and both plots)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gdskv.engine import ttft
from gdskv.engine.ttft_report import acceptance

ROOT = Path(__file__).resolve().parents[2]


def test_capacities_make_memory_run_out_part_way():
    cfg = ttft.TtftConfig()
    page = 64 * 1024
    p = ttft.plan(cfg, page)
    assert p.target_round == cfg.rounds // 2 + 1
    w = [n * page for n in p.round_pages]
    assert w[p.target_round - 2] <= p.dram_bytes < w[p.target_round - 1]
    last_request = -(-ttft.Workload.prompt_tokens(cfg, cfg.rounds) // cfg.page_size)
    assert last_request < p.pool_pages < p.round_pages[0]
    assert p.ssd_bytes >= 2 * w[-1]


def test_a_pool_smaller_than_the_longest_prompt_is_refused():
    from gdskv.errors import ConfigError

    with pytest.raises(ConfigError):
        ttft.plan(ttft.TtftConfig(pool_pages=4), 1024)


def test_unknown_configuration_lists_the_valid_ones():
    from gdskv.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        ttft.TtftConfig(configs=("dram", "hbm"))
    assert "dram+ssd+promote" in str(info.value)


def fake_round(n, hit, ttft_s, dropped=0):
    return {"round": n, "hit_rate": hit, "ttft_mean_s": ttft_s, "store": {"dram_dropped": dropped}}


def test_acceptance_passes_when_ssd_holds_the_hit_rate_and_is_faster():
    dram = [fake_round(1, 0, 1), fake_round(2, 0.8, 1), fake_round(3, 0.3, 2, dropped=5), fake_round(4, 0.2, 3, dropped=9)]
    ssd = [fake_round(1, 0, 1), fake_round(2, 0.8, 1), fake_round(3, 0.78, 1.1), fake_round(4, 0.84, 1.2)]
    acc = acceptance({"dram": dram, "dram+ssd": ssd}, 3)
    assert acc["exhausted_round"] == 3
    assert acc["hit_rate_ok"] and acc["ttft_ok"] and acc["passed"]
    assert acc["ttft_ratio_dram_over_ssd"] == pytest.approx(2.5)


def test_acceptance_fails_when_the_ssd_hit_rate_drops_more_than_5_points():
    dram = [fake_round(1, 0, 1), fake_round(2, 0.8, 1), fake_round(3, 0.3, 2, dropped=5)]
    ssd = [fake_round(1, 0, 1), fake_round(2, 0.8, 1), fake_round(3, 0.74, 1.5)]
    acc = acceptance({"dram": dram, "dram+ssd": ssd}, 3)
    assert not acc["hit_rate_ok"] and not acc["passed"]


def test_acceptance_is_not_evaluated_when_memory_never_ran_out():
    rounds = [fake_round(1, 0, 1), fake_round(2, 0.8, 1)]
    acc = acceptance({"dram": rounds, "dram+ssd": rounds}, 2)
    assert acc["evaluated"] is False and "never ran out" in acc["reason"]


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
    assert list(results) == list(ttft.CONFIGS)
    rounds = ttft.QUICK["rounds"]
    for per_round in results.values():
        assert [r["round"] for r in per_round] == list(range(1, rounds + 1))
        assert per_round[0]["hit_rate"] == 0
        assert len(per_round[0]["requests"]) == ttft.QUICK["conversations"]
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


def test_importing_gdskv_and_its_engine_package_stays_light():
    code = (
        "import sys, gdskv, gdskv.engine, gdskv.engine.ttft, gdskv.cli; gdskv.cli.build_parser(); "
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'rich') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"
