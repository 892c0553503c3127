"""The process that tests/test_crash.py kills with SIGKILL.

Run by path: ``python tests/crash_child.py '<json options>'``. It opens a store, writes
blocks in rounds, removes a few, flushes, and reports on stdout (one line each, flushed at
once, so that whatever it printed before it died reaches the parent):

    ready                      the store is open
    round R first F last L     keys F .. L-1 may be put in this round
    removing N / removed N     remove(key N) was called / returned True
    flushed N                  flush() returned: every put of a key below N that returned
                               is on SSD (eager offload), except the removed ones
    tearing WHAT               a write is stopped half-way and the process waits to be killed

Key number ``n`` is the string ``f"{prefix}{n}"`` and its value is :func:`value_of`
``(seed, n)``, so the parent can verify every byte after a reopen without being told the
values.

Options (JSON object): ``path``, ``prefix``, ``seed``, ``rounds``, ``per_round``, ``store`` (keyword
options for gdskv.open), ``paced`` (read one line from stdin before each round, so the
parent decides when a round starts and can kill the child at a chosen time inside it), and ``tear``: null, or ``{"what": "data"|"index"|"rewrite",
"round": R}`` to stop, from round R on, the next bucket data write half-way ("data"), the
next new bucket index write half-way ("index") or the next index rewrite of a remove
half-way ("rewrite"). The tear hooks patch the backend's I/O calls inside this process;
the files written and the kill are real.
"""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path

import numpy as np

SIZES = (512, 4096, 5000, 64 << 10, 100 << 10, 256 << 10)


def size_of(seed: int, n: int) -> int:
    return random.Random(seed * 1_000_003 + n).choice(SIZES)


def value_of(seed: int, n: int) -> bytes:
    """The bytes the child puts under key number ``n``."""
    return np.random.default_rng([seed, n]).integers(0, 256, size_of(seed, n), dtype=np.uint8).tobytes()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def block_forever(what: str) -> None:
    say(f"tearing {what}")
    threading.Event().wait()


class TearingEngine:
    """Passes reads through; once armed, writes half of the next bucket's records and stops."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.armed = False

    def run(self, requests):
        if self.armed:
            self._engine.run(requests[: max(1, len(requests) // 2)])
            self.backend._sealer.submit(lambda: None).result()  # its index.tmp is written beside
            block_forever("data")
        return self._engine.run(requests)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def install_index_tear(what: str):
    """Arm a tear of a new bucket's index ("index": ``write_file_synced`` of its temporary
    file, written while the bucket's data is in flight) or of an index rewrite ("rewrite":
    ``write_file_atomic``)."""
    from gdskv.tiers.backends import bucket as bucket_module

    state = {"armed": False}
    if what == "index":
        real_synced = bucket_module.write_file_synced

        def tearing_synced(path: Path, data: bytes):
            if state["armed"] and path.name.endswith(".index.tmp"):
                path.write_bytes(data[: len(data) // 2])
                block_forever(what)
            return real_synced(path, data)

        bucket_module.write_file_synced = tearing_synced
        return state
    real = bucket_module.write_file_atomic

    def tearing_write(path: Path, data: bytes, **kwargs):
        if state["armed"] and path.name.endswith(".index") and path.exists():
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data[: len(data) // 2])
            block_forever(what)
        return real(path, data, **kwargs)

    bucket_module.write_file_atomic = tearing_write
    return state


def main(options: dict) -> None:
    import gdskv

    seed = options["seed"]
    prefix = options["prefix"]
    rng = random.Random(seed)
    tear = options.get("tear")
    store = gdskv.open(options["path"], **options["store"])
    engine = None
    index_tear = None
    if tear is not None:
        if tear["what"] == "data":
            engine = store.parts.nvme.engine = TearingEngine(store.parts.nvme.engine)
            engine.backend = store.parts.nvme
        else:
            index_tear = install_index_tear(tear["what"])
    say("ready")
    n = 0
    live: list[int] = []
    per_round = options["per_round"]
    for r in range(options["rounds"]):
        if tear is not None and r >= tear["round"]:
            if engine is not None:
                engine.armed = True
            if index_tear is not None:
                index_tear["armed"] = True
        if options.get("paced"):
            sys.stdin.readline()  # the parent says when each round starts
        say(f"round {r} first {n} last {n + per_round}")
        fresh = []
        for _ in range(per_round):
            store.put(f"{prefix}{n}", value_of(seed, n))
            fresh.append(n)
            n += 1
        # Remove a key that is likely still queued or being written, and an older one.
        victims = [rng.choice(fresh)]
        if live:
            victims.append(live.pop(rng.randrange(len(live))))
        for v in victims:
            say(f"removing {v}")
            if store.remove(f"{prefix}{v}"):
                say(f"removed {v}")
        live.extend(k for k in fresh if k not in victims)
        store.flush()
        say(f"flushed {n}")
    say("done")
    store.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
