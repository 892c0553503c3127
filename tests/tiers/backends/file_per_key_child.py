"""The process that tests/tiers/backends/test_file_per_key.py kills with SIGKILL.

Run by path: ``python file_per_key_child.py '<json options>'``. It opens a file-per-key
backend on ``path`` with a small ``capacity`` (and ``sync``, the backend's sync mode), says ``recovered {report as JSON}``, then
writes batches of ``per_batch`` objects forever, so that every write evicts (and reuses the
files of) older objects, and removes one older key after each batch. Each step is reported
on stdout once it returned (one line, flushed at once):

    wrote <first> <last>       keys k<first> .. k<last> were written (write() returned)
    removing <n>               remove(k<n>) is called
    removed <n> <True|False>   remove(k<n>) returned

Key ``k<n>`` holds :func:`value_of` ``(n)``; keys start at ``first`` (from the options), so
that each run writes keys no earlier run wrote.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np

SIZES = (4096, 5000, 64 << 10, 200 << 10)


def value_of(n: int) -> bytes:
    """The bytes of key ``k<n>``."""
    size = random.Random(n).choice(SIZES)
    return np.random.default_rng(n).integers(0, 256, size, dtype=np.uint8).tobytes()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(options: dict) -> None:
    from gdskv.gds import make_engine
    from gdskv.tiers.backends.file_per_key import FilePerKeyBackend
    from gdskv.tiers.backends.record import checksum

    backend = FilePerKeyBackend(options["path"], make_engine("uring" if options["uring"] else "psync", direct=True), capacity=options["capacity"], sync=options.get("sync", "filesystem"))
    say("recovered " + json.dumps(backend.recover().as_dict()))
    rng = random.Random(options["first"])
    n = options["first"]
    while True:
        batch = []
        for k in range(n, n + options["per_batch"]):
            key, value = f"k{k}".encode(), value_of(k)
            batch.append((key, memoryview(value), checksum(key, value)))
        backend.write(batch)
        say(f"wrote {n} {n + options['per_batch'] - 1}")
        n += options["per_batch"]
        victim = rng.randrange(max(options["first"], n - 3 * options["per_batch"]), n)
        say(f"removing {victim}")
        say(f"removed {victim} {backend.remove(f'k{victim}'.encode())}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
