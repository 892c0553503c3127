"""The process that tests/tiers/backends/test_offset.py kills with SIGKILL.

Run by path: ``python offset_child.py '<json options>'``. It opens an offset backend on
``path`` (``capacity``, ``window_bytes``, ``eviction``), says ``recovered {report as JSON}``,
runs ``steps`` in order, reporting each on stdout (one line, flushed at once), then says
``ready`` and waits to be killed.

Steps (JSON lists):

    ["expect", {key: [seed, size], ...}]  ``expect ok`` when the backend holds exactly these
                                          keys with these bytes, else ``expect bad: ...``
    ["write", {key: [seed, size], ...}]   one batch; ``wrote`` once write() returned, then
                                          ``evicted K...`` (the keys it returned)
    ["write_fails", {key: [seed, size]}]  one batch that must raise: ``failed ErrorClass``
    ["remove", key]                        ``removed True|False`` once remove() returned,
                                           ``remove failed ErrorClass`` if it raised
    ["fail_writes", n]                     the next ``n`` batches of writes fail with EIO
    ["fail_checkpoints", n]                the next ``n`` checkpoint writes fail with ENOSPC
                                           (``write_file_atomic`` of the offset module is
                                           patched in this process; the files are real)
    ["hang_checkpoints"]                   the next checkpoint write waits for the writes
                                           submitted before it, fdatasyncs the data file,
                                           says ``tearing`` and waits to be killed
    ["pin", key, size]                     a read of ``key`` held in flight (its record is
                                           pinned) until ``unpin``: ``pinned``
    ["unpin"]                              the held read completes: ``unpinned``
    ["tear", {key: [seed, size], ...}]     write the batch's record headers only (their
                                           values never reach the disk), fdatasync, say
                                           ``tearing`` and wait to be killed

Every ``evict_listener`` call prints ``heard K...``. Keys are ASCII strings; the value of
``[seed, size]`` is :func:`value_of` ``(seed, size)``, so the parent can check every byte.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading

import numpy as np


def value_of(seed: int, size: int) -> bytes:
    """The bytes the child writes for ``[seed, size]``."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class TestEngine:
    """Wraps an engine: a read submitted from the ``held-read`` thread waits for ``release``;
    a batch of writes fails while ``failing_writes`` counts down; once ``tearing``, a batch
    of writes puts each request's first buffer only, then blocks: a record's head block,
    as the values here are not page-aligned and so never share a request (see
    ``gdskv.tiers.backends.coalesce``)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.entered, self.release = threading.Event(), threading.Event()
        self.tearing = False
        self.failing_writes = 0
        self.last_writes = None  # the future of the last batch of writes submitted

    def submit(self, requests):
        if threading.current_thread().name == "held-read":
            self.entered.set()
            self.release.wait()
        if self.failing_writes and requests and requests[0].op.value == "write":
            from gdskv.errors import IoError
            from gdskv.gds.engine import IoFuture

            self.failing_writes -= 1
            return IoFuture.failed(IoError("write failed: Input/output error", errno=errno.EIO))
        if self.tearing and requests and requests[0].op.value == "write":
            heads = [r._replace(buffers=r.buffers[:1]) for r in requests]
            self._engine.run(heads)
            os.fdatasync(heads[0].fd)
            say("tearing")
            threading.Event().wait()
        future = self._engine.submit(requests)
        if requests and requests[0].op.value == "write":
            self.last_writes = future
        return future

    def run(self, requests):  # (a write may submit part of its batch and run the rest)
        return self.submit(requests).result()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def main(options: dict) -> None:
    from gdskv.errors import GdskvError, IoError
    from gdskv.gds import make_engine
    from gdskv.tiers.backends.offset import OffsetBackend, checkpoint_log
    from gdskv.tiers.backends.record import checksum

    def items(spec: dict):
        out = []
        for key, (seed, size) in spec.items():
            k, v = key.encode(), value_of(seed, size)
            out.append((k, memoryview(v), checksum(k, v)))
        return out

    engine = TestEngine(make_engine("psync", direct=True))
    backend = OffsetBackend(
        options["path"], engine, capacity=options["capacity"], window_bytes=options["window_bytes"],
        eviction=options.get("eviction", "fifo"),
    )
    say("recovered " + json.dumps(backend.recover().as_dict()))
    backend.evict_listener = lambda keys: say("heard " + " ".join(k.decode() for k in keys))
    real_write_file_atomic = checkpoint_log.write_file_atomic
    failing = {"left": 0}

    def write_file_atomic(path, data, **kwargs):
        if failing.get("hang"):  # the writes submitted so far land, the checkpoint never does
            if engine.last_writes is not None:
                engine.last_writes.outcomes()
            os.fdatasync(backend._fd)
            say("tearing")
            threading.Event().wait()
        if failing["left"]:
            failing["left"] -= 1
            raise IoError(f"could not write {path.name}: No space left on device", path=str(path), errno=errno.ENOSPC)
        return real_write_file_atomic(path, data, **kwargs)

    checkpoint_log.write_file_atomic = write_file_atomic
    reader = None
    for step in options["steps"]:
        op, *args = step
        if op == "expect":
            expected = {key.encode(): value_of(seed, size) for key, (seed, size) in args[0].items()}
            bad = sorted(set(backend.keys()) ^ set(expected))
            for key, value in expected.items():
                out = bytearray(len(value))
                if key in backend and (backend.read_batch([(key, memoryview(out))]) != [len(value)] or out != value):
                    bad.append(key)
            say("expect ok" if not bad else f"expect bad: {bad}")
        elif op == "tear":
            engine.tearing = True
            backend.write(items(args[0]))
        elif op == "write":
            evicted = backend.write(items(args[0]))
            say("wrote")
            say("evicted " + " ".join(k.decode() for k in evicted))
        elif op == "write_fails":
            try:
                backend.write(items(args[0]))
            except GdskvError as exc:
                say(f"failed {type(exc).__name__}")
            else:
                say("failed nothing")
        elif op == "remove":
            try:
                say(f"removed {backend.remove(args[0].encode())}")
            except GdskvError as exc:
                say(f"remove failed {type(exc).__name__}")
        elif op == "fail_writes":
            engine.failing_writes = args[0]
        elif op == "fail_checkpoints":
            failing["left"] = args[0]
        elif op == "hang_checkpoints":
            failing["hang"] = True
        elif op == "pin":
            key, size = args[0].encode(), args[1]
            out = bytearray(size)
            reader = threading.Thread(target=backend.read_batch, args=([(key, memoryview(out))],), name="held-read")
            reader.start()
            if not engine.entered.wait(30):
                raise RuntimeError(f"the read of {args[0]!r} was never submitted")
            say("pinned")
        elif op == "unpin":
            engine.release.set()
            reader.join()
            say("unpinned")
        else:
            raise ValueError(f"unknown step {op!r}")
    say("ready")
    threading.Event().wait()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
