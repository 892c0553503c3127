#!/usr/bin/env python3
"""KV-cache blocks as numpy arrays, keyed by a chained prefix hash.

An engine keeps K and V per layer in pages of ``BLOCK_TOKENS`` tokens. Each page is stored
under a key derived from the hash of every token up to and including it, so two prompts with
the same prefix share keys. A second request with a longer prompt looks up how many leading
blocks are cached (``batch_exists``) and loads them with ``batch_get_into`` straight into
preallocated arrays, recomputing only the rest.

Usage: ``python examples/kv_blocks_numpy.py [DIR]`` (default: a temporary directory).
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import numpy as np

import gdskv

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 4, 8, 64, 16


def block_keys(tokens: List[int]) -> List[str]:
    """One key per full block of tokens: a hash chained over the whole prefix."""
    keys, digest = [], b""
    for start in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
        chunk = np.asarray(tokens[start : start + BLOCK_TOKENS], dtype=np.int64).tobytes()
        digest = hashlib.sha256(digest + chunk).digest()
        keys.append("kv/" + digest.hex()[:32])
    return keys


def compute_kv(tokens: List[int], block: int) -> np.ndarray:
    """Stand-in for prefill: K and V of all layers for one block, shape (layers, 2, heads, tokens, dim)."""
    seed = int.from_bytes(hashlib.sha256(repr(tokens[: (block + 1) * BLOCK_TOKENS]).encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYERS, 2, HEADS, BLOCK_TOKENS, HEAD_DIM), dtype=np.float32).astype(np.float16)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 32000, 8 * BLOCK_TOKENS).tolist()
    follow_up = prompt + rng.integers(0, 32000, 4 * BLOCK_TOKENS).tolist()  # same prefix, longer

    with tempfile.TemporaryDirectory(prefix="gdskv-kv-") as tmp:
        path = Path(argv[0]) if argv else Path(tmp) / "store"
        # DRAM holds five blocks: the older ones are served from NVMe.
        with gdskv.open(path, dram="640KiB", ssd="64MiB") as store:
            # Request 1: prefill and save every full block.
            keys = block_keys(prompt)
            blocks = [compute_kv(prompt, b) for b in range(len(keys))]
            store.batch_put(keys, blocks)
            print(f"request 1: saved {len(keys)} blocks of {blocks[0].nbytes // 1024} KiB "
                  f"({blocks[0].shape} {blocks[0].dtype})")

            # Request 2: find the cached prefix, load it in place, compute only the rest.
            keys2 = block_keys(follow_up)
            present = store.batch_exists(keys2)
            cached = present.index(False) if False in present else len(present)
            pages = np.empty((cached, LAYERS, 2, HEADS, BLOCK_TOKENS, HEAD_DIM), dtype=np.float16)
            sizes = store.batch_get_into(keys2[:cached], list(pages))  # each page filled in place
            loaded = sum(1 for n in sizes if n == pages[0].nbytes)
            same = all(np.array_equal(pages[b], blocks[b]) for b in range(cached))
            print(f"request 2: {cached} of {len(keys2)} blocks cached, {loaded} loaded "
                  f"{'bit-exact' if same else 'WRONG'}; {len(keys2) - cached} to compute")
            store.batch_put(keys2[cached:], [compute_kv(follow_up, b) for b in range(cached, len(keys2))])
            s = store.stats()
            print(f"DRAM hits {s['dram']['hits']}, NVMe hits {s['nvme']['hits']}, "
                  f"objects {len(store)}, DRAM used {gdskv.format_size(s['dram']['used_bytes'])}")
        return 0 if same and loaded == cached == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main())
