"""``gdskv bench-ttft`` and ``benchmarks/bench_ttft.py``: the options, and the dispatch to
the runner of the chosen engine (:mod:`gdskv.ttft.run_reference` or
:mod:`gdskv.ttft.run_vllm`; with ``--instances`` N > 1, :mod:`gdskv.ttft.run_instances`),
then the report (:func:`gdskv.ttft.report.render`).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

from gdskv.config import parse_size
from gdskv.ttft import report as ttft_report
from gdskv.errors import ConfigError
from gdskv.ttft import run_instances, run_reference, run_vllm
from gdskv.ttft.workload import CONFIGS, ENGINES, QUICK, TtftConfig

#: The first line of ``gdskv bench-ttft --help``.
DESCRIPTION = "TTFT per conversation round: the multi-turn benchmark on the reference engine."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TtftConfig()
    parser.add_argument("--engine", choices=ENGINES, default="reference", help="reference (default) or vllm: the real vLLM engine with the gdskv connector")
    parser.add_argument("--quick", action="store_true", help="tiny model, short workload (well under a minute)")
    parser.add_argument("--conversations", type=int, help=f"concurrent conversations (default {d.conversations})")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {d.rounds})")
    parser.add_argument("--first-tokens", type=int, help=f"tokens of the first message (default {d.first_tokens})")
    parser.add_argument("--turn-tokens", type=int, help=f"new user tokens a round (default {d.turn_tokens})")
    parser.add_argument("--page-size", type=int, help=f"tokens per KV page (default {d.page_size})")
    parser.add_argument("--shape", help=f"model shape preset (default {d.shape})")
    parser.add_argument("--pool-pages", type=int, help="engine pool in pages (default: derived)")
    parser.add_argument("--dram", help="DRAM tier, e.g. 256MiB (default: derived)")
    parser.add_argument("--ssd", help="SSD tier cap, e.g. 4GiB (default: derived)")
    parser.add_argument("--configs", help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--out", help=f"output directory (default {d.out_dir})")
    parser.add_argument("--store-dir", help="parent directory of the stores (default: system temp)")
    parser.add_argument("--keep-page-cache", action="store_true", help="do not drop the store files' page cache between rounds")
    parser.add_argument("--threads", type=int, help=f"torch intra-op threads (default {d.threads})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--instances", type=int, default=1,
        help="with --engine vllm: N vLLM instances, round r of every conversation served by instance r %% N (default 1)",
    )
    parser.add_argument(
        "--setups", help="with --instances: comma-separated subset of " + ",".join(run_instances.SETUPS) + " (default all)"
    )


def config_from_args(args: argparse.Namespace) -> TtftConfig:
    fields: Dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.quick and getattr(args, "engine", "reference") == "vllm":
        fields["page_size"] = 32  # vLLM's CPU attention: pages of a multiple of 32 tokens
    for arg, field in (
        ("conversations", "conversations"),
        ("rounds", "rounds"),
        ("first_tokens", "first_tokens"),
        ("turn_tokens", "turn_tokens"),
        ("page_size", "page_size"),
        ("shape", "shape"),
        ("pool_pages", "pool_pages"),
        ("seed", "seed"),
        ("threads", "threads"),
        ("out", "out_dir"),
        ("store_dir", "store_dir"),
    ):
        value = getattr(args, arg)
        if value is not None:
            fields[field] = value
    if args.dram is not None:
        fields["dram_bytes"] = parse_size(args.dram, field="--dram")
    if args.ssd is not None:
        fields["ssd_bytes"] = parse_size(args.ssd, field="--ssd")
    if args.configs:
        fields["configs"] = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    fields["drop_page_cache"] = not args.keep_page_cache
    return TtftConfig(**fields)


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark, print the banner, the table and the output paths."""
    cfg = config_from_args(args)
    engine = getattr(args, "engine", "reference")
    instances = getattr(args, "instances", 1) or 1
    if instances != 1:
        if engine != "vllm":
            raise ConfigError("--instances needs --engine vllm", got=engine)
        setups = tuple(s.strip() for s in args.setups.split(",") if s.strip()) if args.setups else run_instances.SETUPS
        report = run_instances.run(cfg, instances=instances, setups=setups, progress=not args.no_progress)
    else:
        if getattr(args, "setups", None):
            raise ConfigError("--setups needs --instances 2 or more")
        runner = run_vllm if engine == "vllm" else run_reference
        report = runner.run(cfg, progress=not args.no_progress)
    print(ttft_report.render(report))
    return 0


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``gdskv bench-ttft``."""
    p = sub.add_parser(
        "bench-ttft",
        help="TTFT and KV hit rate per conversation round: pool only, +DRAM, +DRAM+SSD, +promotion",
        description=DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(func=run_command)


__all__ = ["DESCRIPTION", "add_arguments", "add_parser", "config_from_args", "run_command"]
