#!/usr/bin/env python3
"""Quick start: put, get, flush, close, reopen — values survive on the NVMe tier.

Usage: ``python examples/quickstart.py [DIR]`` (default: a temporary directory).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import numpy as np

import gdskv


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="gdskv-quickstart-") as tmp:
        path = Path(argv[0]) if argv else Path(tmp) / "store"
        block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)

        with gdskv.open(path, dram="16MiB", ssd="256MiB") as store:
            store.put("greeting", b"hello, tiers")  # any contiguous buffer
            store.put("block-0", block)  # readable at once; offloaded in the background
            value = store.get("greeting")  # a new bytearray
            out = np.empty_like(block)
            n = store.get_into("block-0", out)  # fills a buffer you own; returns the size
            ok = value == b"hello, tiers" and n == block.nbytes and np.array_equal(out, block)
            print(f"get -> {bytes(value)!r}; get_into -> {n} bytes, {'identical' if ok else 'DIFFERENT'}")
            print("missing key ->", store.get("no-such-key"))  # a miss is None, not an error
            store.flush()  # wait until everything queued is on SSD
            print(f"after flush: {store.stats()['offload']['objects']} objects offloaded to NVMe")

        # Reopening the directory rebuilds the index from the sealed buckets on disk.
        with gdskv.open(path, dram="16MiB", ssd="256MiB") as store:
            print(f"reopened: {store.recovery.objects} objects recovered")
            out = np.empty_like(block)
            n = store.get_into("block-0", out)  # served from NVMe, checksum verified
            ok = ok and n == block.nbytes and np.array_equal(out, block) and store.get("greeting") == b"hello, tiers"
            print(f"block-0 read back from {'NVMe' if store.stats()['nvme']['hits'] else 'DRAM'}: "
                  f"{'identical' if ok else 'DIFFERENT'}")
            store.remove("greeting")
            print("after remove, exists('greeting') ->", store.exists("greeting"))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
