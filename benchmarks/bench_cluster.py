#!/usr/bin/env python3
"""How fast does a reader pull blocks from a peer's DRAM and a peer's NVMe, next to a plain
socket copy of the same bytes?

Starts a ``gdskv-master`` and two ``gdskv-node`` processes on loopback: one holds the
"DRAM set" in memory, the other the "NVMe set" on SSD only (its DRAM is kept full of other
blocks; promotion is off). This process is a thin client: each pass reads one whole set
with ``batch_get_into`` (``--batch`` blocks per call: one master lookup, then the transfer
over ``--connections`` connections) into the same preallocated buffers. The limit is
measured in the same run, batch by batch: a plain TCP copy of the same number of bytes from
another process, ``send`` from one buffer to ``recv_into`` the same destination buffers. The
three copies of each batch run back to back, so they share whatever load the machine has.

    python benchmarks/bench_cluster.py --block 2MiB --size 256MiB --repeat 5

NVMe reads go through the page cache unless ``--drop-caches`` (root; drops the whole
machine's page cache before every round).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

PLAIN_SENDER = r"""
import socket, sys
block = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0))
print("127.0.0.1:%d" % srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(b"\x5a" * block))
while True:
    head = conn.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        break
    for _ in range(int.from_bytes(head, "little")):
        conn.sendall(buf)
"""


def parse_size(text: str) -> int:
    from gdskv.config import parse_size as parse

    return parse(text, field="size")


def banner(args: argparse.Namespace, count: int) -> None:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()
    print(f"# bench_cluster: {count} blocks of {args.block} per set, {args.batch} per call, "
          f"{args.connections} connection(s) per peer, checksums {'on' if not args.no_verify else 'off'}")
    print(f"# machine: {platform.node()} {os.cpu_count()} cpus {cpu}; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    pages = "page cache dropped before each round" if args.drop_caches else "page cache warm"
    print(f"# transport tcp over loopback; NVMe pages: {pages}")


class Daemon:
    def __init__(self, args: List[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True)

    def event(self, name: str) -> dict:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            event = json.loads(line)
            if event.get("event") == name:
                return event
        raise SystemExit(f"bench_cluster: a daemon exited before {name!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_block(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def fill(client, keys: List[str], block: int, seed: int, batch: int) -> Dict[str, int]:
    """Put deterministic blocks under ``keys``; return each one's CRC32C."""
    import crc32c

    crcs = {}
    for lo in range(0, len(keys), batch):
        part = keys[lo : lo + batch]
        values = [make_block(seed + lo + i, block) for i in range(len(part))]
        client.batch_put(part, values)
        crcs.update({k: crc32c.crc32c(v) for k, v in zip(part, values)})
    return crcs


def tiers(client, keys: List[str]) -> List[List[int]]:
    res = client._master.lookup([k.encode() for k in keys], count_access=False)
    out, pos = [], 0
    for n in res.counts:
        out.append(sorted(res.tiers[pos : pos + n]))
        pos += n
    return out


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main(argv: "List[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block", default="2MiB", help="block size")
    p.add_argument("--size", default="256MiB", help="bytes per set (and per pass)")
    p.add_argument("--batch", type=int, default=16, help="blocks per batch_get_into call")
    p.add_argument("--connections", type=int, default=4, help="connections per peer")
    p.add_argument("--repeat", type=int, default=5, help="rounds; medians are printed")
    p.add_argument("--no-verify", action="store_true", help="skip the end-to-end CRC32C check of each block")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each round (root)")
    p.add_argument("--dir", default=None, help="where the nodes keep their SSD tier (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import crc32c

    import gdskv
    from gdskv.config import format_size

    block = parse_size(args.block)
    count = max(1, parse_size(args.size) // block)
    total = count * block
    banner(args, count)
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="gdskv-bench-cluster-"))
    daemons: List[Daemon] = []
    try:
        master = Daemon(["gdskv.master", "--listen", "127.0.0.1:0", "--lease-s", "60", "--promote-threshold", "1e12",
                         "--offload-threshold", "1e12"])
        daemons.append(master)
        address = master.event("listening")["address"]
        ssd = f"{format_size(3 * total + (256 << 20)).replace(' ', '')}"
        small_dram = max(8 * block, min(32 << 20, total // 2))
        nvme_node = Daemon(["gdskv.node", "--master", address, "--dram", str(small_dram), "--ssd", f"{tmp / 'nvme'}:{ssd}",
                            "--set", "promote_after_reads=0", "--set", f"bucket_bytes={32 << 20}"])
        daemons.append(nvme_node)
        nvme_node.event("registered")
        client = gdskv.connect(address, connections=args.connections, verify_transfers=not args.no_verify)
        nvme_keys = [f"nvme-{i:06d}" for i in range(count)]
        nvme_crcs = fill(client, nvme_keys, block, args.seed, args.batch)
        filler = [f"filler-{i:06d}" for i in range(2 * small_dram // block + 2)]
        fill(client, filler, block, args.seed + 10**6, args.batch)  # pushes the NVMe set out of DRAM
        deadline = time.monotonic() + 120
        while any(t != [3] for t in tiers(client, nvme_keys)):
            if time.monotonic() > deadline:
                raise SystemExit("bench_cluster: the NVMe set never became SSD-only")
            time.sleep(0.1)
        dram_node = Daemon(["gdskv.node", "--master", address, "--dram", str(total + small_dram + (64 << 20)),
                            "--ssd", f"{tmp / 'dram'}:{ssd}"])
        daemons.append(dram_node)
        dram_node.event("registered")
        dram_keys = [f"dram-{i:06d}" for i in range(count)]
        dram_crcs = fill(client, dram_keys, block, args.seed + 2 * 10**6, args.batch)
        if any(2 not in t for t in tiers(client, dram_keys)):
            raise SystemExit("bench_cluster: the DRAM set is not in a peer's DRAM")

        plain = Daemon.__new__(Daemon)
        plain.proc = subprocess.Popen([sys.executable, "-c", PLAIN_SENDER, str(block)], stdout=subprocess.PIPE, text=True)
        daemons.append(plain)
        host, port = plain.proc.stdout.readline().strip().rsplit(":", 1)  # type: ignore[union-attr]
        plain_sock = socket.create_connection((host, int(port)))
        plain_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        dest = np.empty((count, block), dtype=np.uint8)
        views = [memoryview(dest[i]) for i in range(count)]

        def plain_copy(lo: int, hi: int) -> None:
            plain_sock.sendall((hi - lo).to_bytes(8, "little"))
            for view in views[lo:hi]:
                got = 0
                while got < block:
                    got += plain_sock.recv_into(view[got:], block - got)

        def gdskv_get(keys: List[str]) -> "Callable[[int, int], None]":
            def run(lo: int, hi: int) -> None:
                sizes = client.batch_get_into(keys[lo:hi], views[lo:hi])
                if any(n != block for n in sizes):
                    raise SystemExit(f"bench_cluster: a block was missed: {sizes}")
            return run

        def check(keys: List[str], crcs: Dict[str, int]) -> None:
            bad = [k for i, k in enumerate(keys) if crc32c.crc32c(dest[i]) != crcs[k]]
            if bad:
                raise SystemExit(f"bench_cluster: wrong bytes in {len(bad)} blocks, e.g. {bad[0]}")

        # Warm up the connections and check every byte once.
        for keys, crcs in ((dram_keys, dram_crcs), (nvme_keys, nvme_crcs)):
            for lo in range(0, count, args.batch):
                gdskv_get(keys)(lo, min(count, lo + args.batch))
            check(keys, crcs)
        # Each batch is copied the three ways back to back (in rotating order), so that all
        # three see the same load from whatever else runs on the machine.
        paths = [("plain", plain_copy), ("dram", gdskv_get(dram_keys)), ("nvme", gdskv_get(nvme_keys))]
        results: Dict[str, List[float]] = {name: [] for name, _ in paths}
        for rnd in range(args.repeat):
            if args.drop_caches:
                drop_caches()
            spent = {name: 0.0 for name, _ in paths}
            for b, lo in enumerate(range(0, count, args.batch)):
                hi = min(count, lo + args.batch)
                for k in range(len(paths)):
                    name, fn = paths[(b + rnd + k) % len(paths)]
                    t0 = time.perf_counter()
                    fn(lo, hi)
                    spent[name] += time.perf_counter() - t0
            for name in spent:
                results[name].append(total / spent[name])
        if any(2 not in t for t in tiers(client, dram_keys)) or any(t != [3] for t in tiers(client, nvme_keys)):
            raise SystemExit("bench_cluster: the sets moved between tiers during the run")
        stats = client.stats()
        client.close()
        plain_sock.close()
    finally:
        for d in reversed(daemons):
            d.stop()

    base = statistics.median(results["plain"])
    print()
    print("| path | GB/s (median) | min .. max | vs plain socket copy |")
    print("| --- | ---: | ---: | ---: |")
    for name, label in (("plain", "plain socket copy (same bytes, same buffers)"),
                        ("dram", "gdskv get from a peer's DRAM"), ("nvme", "gdskv get from a peer's NVMe")):
        xs = results[name]
        print(f"| {label} | {statistics.median(xs) / 1e9:.2f} | {min(xs) / 1e9:.2f} .. {max(xs) / 1e9:.2f} "
              f"| {statistics.median(xs) / base:.2f}x |")
    per_round = [d / b for d, b in zip(results["dram"], results["plain"])]
    print(f"\npeer NVMe / plain, per round: {', '.join(f'{n / b:.2f}' for n, b in zip(results['nvme'], results['plain']))}")
    print(f"peer DRAM / plain, per round: {', '.join(f'{r:.2f}' for r in per_round)} (target >= 0.70)")
    print(f"client: {stats['client']}; fetch: {stats['fetch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
