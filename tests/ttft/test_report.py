"""The TTFT benchmark's acceptance check on per-round figures."""

from __future__ import annotations

import pytest

from gdskv.ttft.report import acceptance


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
