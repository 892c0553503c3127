"""The TTFT benchmark's workload: capacity planning and the validation of a configuration."""

from __future__ import annotations

import pytest

from gdskv.errors import ConfigError
from gdskv.ttft.workload import TtftConfig, Workload, plan


def test_capacities_make_memory_run_out_part_way():
    cfg = TtftConfig()
    page = 64 * 1024
    p = plan(cfg, page)
    assert p.target_round == cfg.rounds // 2 + 1
    w = [n * page for n in p.round_pages]
    assert w[p.target_round - 2] <= p.dram_bytes < w[p.target_round - 1]
    last_request = -(-Workload.prompt_tokens(cfg, cfg.rounds) // cfg.page_size)
    assert last_request < p.pool_pages < p.round_pages[0]
    assert p.ssd_bytes >= 2 * w[-1]


def test_a_pool_smaller_than_the_longest_prompt_is_refused():
    with pytest.raises(ConfigError):
        plan(TtftConfig(pool_pages=4), 1024)


def test_unknown_configuration_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        TtftConfig(configs=("dram", "hbm"))
    assert "dram+ssd+promote" in str(info.value)
