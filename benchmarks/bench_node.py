#!/usr/bin/env python3
"""Is a process attached to a node as fast as an embedded store?

Starts a ``gdskv-node --socket`` process (DRAM only: ``--ssd DIR:0``) and, in this process,
an embedded store of the same size; this process also attaches to the node
(:func:`gdskv.attach`). Each round puts ``--size`` bytes of ``--block`` blocks into each
(half of them one per ``put``, half with ``batch_put`` of ``--batch`` blocks), then reads
every block back with ``get_into`` and again with ``batch_get_into`` into the same
preallocated buffers (checked byte for byte), then removes them: the embedded store's steps
and the attached ones run back to back, so they share whatever load the machine has. ``memcpy`` is a plain numpy copy of the same blocks
into the same buffers, the limit of either. With ``--cluster`` it also starts a
``gdskv-master`` and measures puts through ``gdskv.connect(master, local=store)`` (this
process as a node) against the embedded puts.

    python benchmarks/bench_node.py --block 2MiB --size 256MiB --repeat 5

Columns: GB/s per path (median of the rounds); ``ratio``: median over the rounds of the
embedded store's time for the same step in the same round over the path's. Targets: attached
reads of DRAM hits >= 0.8x the embedded ones, attached puts >= 0.7x, cluster puts >= 0.7x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

import gdskv
from gdskv.config import format_size, parse_size

TARGETS = {
    "attached get_into": 0.8, "attached batch_get_into": 0.8, "attached put": 0.7, "attached batch_put": 0.7,
    "cluster put": 0.7, "cluster batch_put": 0.7,
}


def start_daemon(argv: List[str], want: str) -> "tuple[subprocess.Popen, dict]":
    """Start a daemon that prints JSON events; wait for the event ``want``."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{argv[0]} exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == want:
            return proc, event
    raise SystemExit(f"{argv[0]} did not say {want!r} in 60 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", default="2MiB")
    ap.add_argument("--size", default="256MiB", help="bytes put and read per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds")
    ap.add_argument("--batch", type=int, default=16, help="blocks per batch_put / batch_get_into call")
    ap.add_argument("--cluster", action="store_true", help="also measure puts through gdskv.connect(local=store)")
    ap.add_argument("--dir", default=None, help="where the stores live (default: a temporary directory)")
    args = ap.parse_args()
    block = parse_size(args.block, field="block")
    count = max(1, parse_size(args.size, field="size") // block)
    dram = format_size(count * block * 2 + (64 << 20))
    root = Path(args.dir or tempfile.mkdtemp(prefix="gdskv-bench-node-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    values = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(count)]
    outs = [np.empty(block, dtype=np.uint8) for _ in range(count)]
    for out in outs:
        out.fill(0)  # fault the destination pages in before any timing

    node, event = start_daemon(
        [sys.executable, "-m", "gdskv.node", "--socket", "--dram", dram, "--ssd", f"{root / 'node'}:0"], "attachable"
    )
    procs = [node]
    embedded = gdskv.open(root / "embedded", dram=dram, ssd=0)
    attached = gdskv.attach(event["socket"])
    cluster = None
    if args.cluster:
        master, started = start_daemon([sys.executable, "-m", "gdskv.master", "--listen", "127.0.0.1:0"], "listening")
        procs.append(master)
        address = started["address"]
        cluster_store = gdskv.open(root / "cluster", dram=dram, ssd=0)
        cluster = gdskv.connect(address, local=cluster_store)
    times: Dict[str, List[float]] = {}
    ratios: Dict[str, List[float]] = {}
    try:
        for r in range(args.repeat + 1):  # round 0 warms every path up (page faults, connections)
            keys = [f"r{r}-b{i}" for i in range(count)]
            round_t: Dict[str, float] = {}
            round_t["memcpy"] = timed(lambda: [np.copyto(o, v) for o, v in zip(outs, values)])
            for kind, kv in (("embedded", embedded), ("attached", attached), ("cluster", cluster)):
                if kv is None:
                    continue
                half = count // 2  # one half put one per call, the other in batches
                round_t[f"{kind} put"] = timed(lambda: [kv.put(k, v) for k, v in zip(keys[:half], values[:half])])
                round_t[f"{kind} batch_put"] = timed(lambda: [
                    kv.batch_put(keys[i : i + args.batch], values[i : i + args.batch]) for i in range(half, count, args.batch)
                ])
            for kind, kv in (("embedded", embedded), ("attached", attached)):
                round_t[f"{kind} get_into"] = timed(lambda: [kv.get_into(k, o) for k, o in zip(keys, outs)])
                round_t[f"{kind} batch_get_into"] = timed(lambda: [
                    kv.batch_get_into(keys[i : i + args.batch], outs[i : i + args.batch]) for i in range(0, count, args.batch)
                ])
                if not all(np.array_equal(o, v) for o, v in zip(outs, values)):
                    raise SystemExit(f"a read of the {kind} store returned wrong bytes")
            embedded.batch_remove(keys)
            attached.batch_remove(keys)
            if cluster is not None:
                cluster.batch_remove(keys)
            if r == 0:
                continue
            for name, t in round_t.items():
                times.setdefault(name, []).append(t)
                kind, _, op = name.partition(" ")
                if kind in ("attached", "cluster"):  # against the embedded store's same step, same round
                    ratios.setdefault(name, []).append(round_t[f"embedded {op}"] / t)
    finally:
        attached.close()
        embedded.close()
        if cluster is not None:
            cluster.close()
            cluster_store.close()
        for proc in procs:
            stop(proc)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"# bench_node: {count} x {format_size(block)} per round (puts: half one per call, half in batches of "
          f"{args.batch}), {args.repeat} rounds, {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"{'path':<26} {'GB/s':>8} {'ratio':>7}  target")
    print("-" * 56)
    for name, ts in times.items():
        share = 0.5 if name.endswith("put") else 1.0
        gbps = count * block * share / statistics.median(ts) / 1e9
        ratio = statistics.median(ratios[name]) if name in ratios else None
        target = TARGETS.get(name)
        verdict = "" if target is None or ratio is None else f">= {target}x {'met' if ratio >= target else 'missed'}"
        print(f"{name:<26} {gbps:>8.2f} {(f'{ratio:.2f}x' if ratio is not None else ''):>7}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
