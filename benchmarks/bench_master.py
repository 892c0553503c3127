#!/usr/bin/env python3
"""How many keys per second does the master register and look up, in batches?

Starts ``gdskv-master`` in another process, registers one node, then times batched
UpdateReplicas (registrations), Lookup (reads: they also count hotness), Lookup without
counting (exists) and PreparePut, ``--batch`` keys per RPC. The limit it is compared
with is measured in the same run: the round trip of an empty RPC (Lookup of 0 keys), i.e. what a
batch would cost if the per-key work were free.

    python benchmarks/bench_master.py --keys 200000 --batch 1000 --repeat 5

Prints a banner (machine, versions, load) and a table of medians over ``--repeat`` rounds:
wall-clock keys/s, and keys per CPU-second of the master process (what one core given to the
master sustains, whatever else loads the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List

TARGET_KEYS_PER_S = 200_000


def banner(title: str) -> None:
    import google.protobuf
    import grpc

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    print(f"# {title}")
    print(f"# machine: {platform.node()} {os.cpu_count()} cpus {cpu}; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"# python {platform.python_version()}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")


def start_master() -> "tuple[subprocess.Popen, str]":
    proc = subprocess.Popen(
        [sys.executable, "-m", "gdskv.master", "--listen", "127.0.0.1:0", "--lease-s", "600"],
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise SystemExit("bench_master: the master did not start")
    return proc, json.loads(line)["address"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[int, int], None], clients: int, pid: int) -> "tuple[float, float]":
    """Run ``fn(worker, workers)`` on ``clients`` threads at once; (wall time, master CPU time)."""
    threads = [threading.Thread(target=fn, args=(i, clients)) for i in range(clients)]
    c0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, cpu_seconds(pid) - c0


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=200_000, help="keys per measured pass")
    p.add_argument("--batch", type=int, default=1000, help="keys per RPC")
    p.add_argument("--key-bytes", type=int, default=64, help="length of each key")
    p.add_argument("--repeat", type=int, default=5, help="rounds; medians are printed")
    p.add_argument("--clients", type=int, default=1, help="client threads sharing the batches (pipelining)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from gdskv.master.client import MasterClient
    from gdskv.master.model import DRAM, REGISTER, NodeView, ReplicaBatch

    banner(
        f"bench_master: {args.keys} keys per pass, {args.batch} keys per RPC, {args.clients} client thread(s), "
        "master in another process"
    )
    proc, address = start_master()
    rng = random.Random(args.seed)
    try:
        client = MasterClient(address, timeout_s=60, max_keys_per_rpc=args.batch)
        client.register_node(NodeView("bench-node", "127.0.0.1:1", dram_capacity=1 << 40))
        results: Dict[str, List[float]] = {}
        cpu: Dict[str, List[float]] = {}
        for rnd in range(args.repeat):
            keys = [rng.randbytes(args.key_bytes) for _ in range(args.keys)]
            sizes = [rng.randrange(1, 64 << 20) for _ in keys]
            crcs = [rng.randrange(1 << 32) for _ in keys]
            batches = [(lo, min(len(keys), lo + args.batch)) for lo in range(0, len(keys), args.batch)]
            n_rpcs = len(batches)

            def register(me: int, workers: int) -> None:
                for lo, hi in batches[me::workers]:
                    batch = ReplicaBatch(REGISTER, DRAM, keys[lo:hi], sizes[lo:hi], crcs[lo:hi])
                    client.update_replicas("bench-node", [batch])

            def lookup(count: bool) -> Callable[[int, int], None]:
                def run(me: int, workers: int) -> None:
                    for lo, hi in batches[me::workers]:
                        res = client.lookup(keys[lo:hi], count_access=count)
                        if sum(res.counts) != hi - lo:
                            raise SystemExit("bench_master: lookup lost keys")
                return run

            fresh = [rng.randbytes(args.key_bytes) for _ in keys]

            def prepare(me: int, workers: int) -> None:
                for lo, hi in batches[me::workers]:
                    client.prepare_put("", fresh[lo:hi], sizes[lo:hi], crcs[lo:hi])

            def empty(me: int, workers: int) -> None:
                for _ in range(me, n_rpcs, workers):
                    client.lookup([])

            for name, fn in (
                ("empty RPC (Lookup of 0 keys)", empty),
                ("register (UpdateReplicas)", register),
                ("lookup, counting hotness", lookup(True)),
                ("lookup, exists only", lookup(False)),
                ("prepare put (placement)", prepare),
            ):
                wall, master_cpu = timed(fn, args.clients, proc.pid)
                results.setdefault(name, []).append(wall)
                cpu.setdefault(name, []).append(master_cpu)
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)

    rpcs = -(-args.keys // args.batch)
    empty_s = statistics.median(results["empty RPC (Lookup of 0 keys)"])
    print()
    print("keys/s: wall clock, as this client saw it. keys per master CPU-second: what one core fully")
    print("given to the master would do (the master's user+system time, so other load on the machine")
    print("does not count). RPC share: the time an empty RPC takes, as a share of a batch's time.")
    print()
    print(f"| call | ms per RPC | keys/s | keys per master CPU-s | vs target {TARGET_KEYS_PER_S:,} (CPU-s) | RPC share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, times in results.items():
        t = statistics.median(times)
        c = statistics.median(cpu[name])
        per_rpc_ms = 1000 * t / rpcs
        if name.startswith("empty"):
            print(f"| {name} | {per_rpc_ms:.3f} | | | | 1.00 |")
            continue
        rate = args.keys / t
        per_cpu = args.keys / c if c > 0 else float("nan")
        print(f"| {name} | {per_rpc_ms:.3f} | {rate:,.0f} | {per_cpu:,.0f} | {per_cpu / TARGET_KEYS_PER_S:.2f}x "
              f"| {empty_s / t:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
