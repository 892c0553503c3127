#!/usr/bin/env python3
"""Watermark offload: DRAM fills, crosses its high watermark, and the coldest blocks go to SSD.

With ``offload="watermark"`` nothing is written to SSD until DRAM usage passes
``high_watermark``; then the least recently used blocks are offloaded and evicted until usage
is back at ``low_watermark``. Puts never wait for SSD unless DRAM is full of blocks not yet
offloaded (back-pressure). An NVMe block read twice is promoted back into DRAM.

Usage: ``python examples/watermark_offload.py [DIR]`` (default: a temporary directory).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import numpy as np

import gdskv

BLOCK = 256 << 10


def usage(store: gdskv.Store) -> str:
    d = store.stats()["dram"]
    return f"{100 * d['used_bytes'] / d['capacity']:.0f}% of DRAM"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="gdskv-watermark-") as tmp:
        path = Path(argv[0]) if argv else Path(tmp) / "store"
        opts = dict(offload="watermark", high_watermark=0.75, low_watermark=0.5, bucket_max_age_s=0.05)
        with gdskv.open(path, dram="4MiB", ssd="64MiB", **opts) as store:
            blocks = [np.full(BLOCK, i, dtype=np.uint8) for i in range(24)]  # 6 MiB through 4 MiB
            for i, value in enumerate(blocks):
                store.put(f"block-{i:02d}", value)
                if i in (5, 11, 23):
                    store.flush()  # wait for any offload the watermark started
                    s = store.stats()
                    print(f"after {i + 1:2d} puts: {usage(store)}, {s['offload']['objects']} offloaded, "
                          f"{s['dram']['evicted']} evicted from DRAM")
            out = np.empty(BLOCK, dtype=np.uint8)
            for _ in range(2):  # block-00 is the coldest: it went to SSD; two reads promote it
                store.get_into("block-00", out)
            s = store.stats()
            print(f"block-00 read twice from NVMe -> promoted {s['promoted']}, now in {usage(store)}")
            ok = all(store.get_into(f"block-{i:02d}", out) == BLOCK and (out == i).all() for i in range(24))
            print(f"all 24 blocks read back {'intact' if ok else 'WRONG'}: "
                  f"{store.stats()['dram']['hits']} DRAM hits, {store.stats()['nvme']['hits']} NVMe hits")
        return 0 if ok and s["offload"]["objects"] > 0 and s["promoted"] >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
