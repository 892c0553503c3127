"""The store on every backend x I/O engine: put, get, flush, reopen, remove, evict, crash.

Each test takes the ``backend_engine`` fixture (tests/conftest.py), so it runs once per
registered backend on each engine; uring cases skip, with the reason, where io_uring is
unavailable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import block

# Odd sizes on purpose: O_DIRECT needs 4 KiB multiples, the engines must not care.
SIZES = [1, 4095, 4096, 4097, 100_001, (1 << 20) + 3]


def verify_all(store, expected: dict) -> None:
    """Every key reads back its exact bytes, through get and get_into."""
    for key, value in expected.items():
        assert store.get(key) == value, key
        out = np.zeros(len(value) + 5, dtype=np.uint8)
        assert store.get_into(key, out) == len(value)
        assert out[: len(value)].tobytes() == value


def verify_absent(store, keys) -> None:
    for key in keys:
        assert store.get(key) is None, key
        assert not store.exists(key)


def put_all(store, values: dict) -> None:
    for key, value in values.items():
        store.put(key, value)


def values_for(prefix: str, sizes=SIZES, seed: int = 0) -> dict:
    return {f"{prefix}{i}": block(seed + i, size) for i, size in enumerate(sizes)}


def test_values_come_back_from_nvme_after_reopen(make_store, backend_engine):
    backend, engine = backend_engine
    values = values_for("obj-")
    store = make_store(backend=backend, io_engine=engine)
    put_all(store, values)
    store.flush()
    verify_all(store, values)  # from DRAM
    stats = store.stats()
    assert stats["nvme"]["backend"] == backend and stats["io_engine"]["name"] == engine
    assert stats["nvme"]["objects"] == len(values)
    store.close()

    store = make_store(backend=backend, io_engine=engine, promote_after_reads=0)
    assert store.recovery.objects == len(values)
    assert store.stats()["dram"]["objects"] == 0
    verify_all(store, values)
    assert store.stats()["nvme"]["hits"] == 2 * len(values)


def test_batch_reads_mix_dram_nvme_and_misses(make_store, backend_engine):
    backend, engine = backend_engine
    on_disk = values_for("disk-", seed=10)
    store = make_store(backend=backend, io_engine=engine)
    put_all(store, on_disk)
    store.close()
    store = make_store(backend=backend, io_engine=engine, promote_after_reads=0)
    in_dram = values_for("dram-", sizes=[10, 5000], seed=20)
    put_all(store, in_dram)
    keys = list(on_disk) + list(in_dram) + ["missing"]
    outs = [np.zeros(max(SIZES) + 1, dtype=np.uint8) for _ in keys]
    sizes = store.batch_get_into(keys, outs)
    wanted = {**on_disk, **in_dram}
    for key, out, size in zip(keys, outs, sizes):
        if key == "missing":
            assert size is None
        else:
            assert size == len(wanted[key]) and out[:size].tobytes() == wanted[key]


def test_remove_and_overwrite_survive_reopen(make_store, backend_engine):
    backend, engine = backend_engine
    values = values_for("k", sizes=[3000, 70_000, 5, 9000], seed=30)
    store = make_store(backend=backend, io_engine=engine)
    put_all(store, values)
    store.flush()
    assert store.remove("k1")
    assert not store.remove("k1")
    store.put("k2", b"new bytes", overwrite=True)
    store.flush()
    store.close()

    store = make_store(backend=backend, io_engine=engine)
    verify_absent(store, ["k1"])
    verify_all(store, {"k0": values["k0"], "k2": b"new bytes", "k3": values["k3"]})
    store.close()
    store = make_store(backend=backend, io_engine=engine)  # and again: nothing came back
    verify_absent(store, ["k1"])
    assert len(store) == 3


def test_nvme_evicts_under_its_cap_and_never_serves_wrong_bytes(make_store, backend_engine):
    backend, engine = backend_engine
    store = make_store(
        backend=backend, io_engine=engine, dram="2MiB", ssd="6MiB",
        offload="eager", bucket_bytes=256 << 10, promote_after_reads=0,
    )
    values = {f"e{i:03d}": block(100 + i, 60_000 + i) for i in range(250)}  # ~15 MiB through a 6 MiB tier
    put_all(store, values)
    store.flush()
    stats = store.stats()
    assert stats["nvme"]["used_bytes"] <= stats["nvme"]["capacity"]
    assert stats["nvme"]["objects_evicted"] > 0
    if backend == "bucket":  # a write that evicts a bucket writes into its data file
        assert stats["nvme"]["files_reused"] > 0
    survivors = [k for k in values if store.exists(k)]
    assert list(values)[-1] in survivors  # the newest survive; every survivor reads back exactly
    verify_all(store, {k: values[k] for k in survivors})
    store.close()
    store = make_store(backend=backend, io_engine=engine, dram="2MiB", ssd="6MiB")
    assert store.stats()["nvme"]["used_bytes"] <= store.stats()["nvme"]["capacity"]
    on_disk = [k.decode() for k in store.parts.nvme.keys()]  # noqa: SLF001 - what recovery found
    assert on_disk
    verify_all(store, {k: values[k] for k in on_disk})


_CRASH_CHILD = textwrap.dedent(
    """
    import sys, numpy as np, gdskv
    path, backend, engine = sys.argv[1:4]
    store = gdskv.open(path, dram="8MiB", ssd="64MiB", backend=backend, io_engine=engine, bucket_bytes=1 << 20)
    for i in range(40):
        store.put(f"c{i}", np.random.default_rng(i).integers(0, 256, 30_000 + 997 * i, dtype=np.uint8).tobytes())
        if i == 29:
            store.flush()
            store.remove("c3")
            print("durable", flush=True)
    sys.stdin.read()  # wait to be killed
    """
)


def test_acknowledged_objects_survive_sigkill(tmp_path, backend_engine):
    backend, engine = backend_engine
    path = tmp_path / "store"
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASH_CHILD, str(path), backend, engine],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert child.stdout.readline().strip() == b"durable"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    import gdskv

    with gdskv.open(path, dram="8MiB", ssd="64MiB", backend=backend, io_engine=engine) as store:
        durable = {f"c{i}": block_of(i) for i in range(30) if i != 3}
        verify_all(store, durable)
        verify_absent(store, ["c3"])
        for i in range(30, 40):  # maybe offloaded before the kill, maybe not: never wrong
            got = store.get(f"c{i}")
            assert got is None or got == block_of(i)


_FULL_TIER_CHILD = textwrap.dedent(
    """
    import sys, numpy as np, gdskv
    path, backend, engine = sys.argv[1:4]
    store = gdskv.open(path, dram="2MiB", ssd="3MiB", backend=backend, io_engine=engine, bucket_bytes=256 << 10,
                       promote_after_reads=0)
    for i in range(10_000):  # until killed: every bucket written evicts one
        store.put(f"f{i}", np.random.default_rng(i).integers(0, 256, 30_000 + 997 * (i % 40), dtype=np.uint8).tobytes())
        if i % 20 == 19:
            store.flush()
            print("flushed", i, store.stats()["nvme"].get("files_reused", 0), flush=True)
    """
)


def test_sigkill_in_a_full_tier_leaves_only_whole_objects(tmp_path, backend_engine):
    """Killed while every write evicts (and the bucket backend writes into evicted buckets'
    files): whatever the reopen finds reads back exactly, and nothing is counted corrupt."""
    backend, engine = backend_engine
    path = tmp_path / "store"
    child = subprocess.Popen(
        [sys.executable, "-c", _FULL_TIER_CHILD, str(path), backend, engine],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        for _ in range(12):  # 240 objects, about three tiers' worth
            fields = child.stdout.readline().split()
            assert fields[0] == b"flushed", fields
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    if backend == "bucket":
        assert int(fields[2]) > 0  # files were being reused when it died
    import gdskv

    with gdskv.open(path, dram="8MiB", ssd="3MiB", backend=backend, io_engine=engine) as store:
        assert store.recovery.dropped_corrupt == 0, store.recovery
        found = [k.decode() for k in store.parts.nvme.keys()]  # noqa: SLF001 - what recovery found
        assert found
        verify_all(store, {k: block_of_full(int(k[1:])) for k in found})


def block_of_full(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 30_000 + 997 * (i % 40), dtype=np.uint8).tobytes()


def block_of(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 30_000 + 997 * i, dtype=np.uint8).tobytes()


def test_unknown_backend_and_engine_names_list_the_valid_ones(make_store):
    import gdskv

    with pytest.raises(gdskv.ConfigError) as info:
        make_store(backend="tape")
    assert "bucket" in str(info.value) and "offset" in str(info.value) and "file_per_key" in str(info.value)
    with pytest.raises(gdskv.ConfigError) as info:
        make_store(io_engine="spdk")
    assert "auto" in str(info.value) and "uring" in str(info.value) and "psync" in str(info.value)


@pytest.mark.parametrize("name", ["bucket", "offset", "file_per_key"])
def test_a_write_failing_with_any_exception_gives_back_what_it_reserved(tmp_path, name):
    """A MemoryError (or a bug) in a backend write: its reservation and temporary files go,
    as for an I/O error. The offloader retries such a batch; before, every retry kept its
    bytes reserved, until the tier looked full of writes in flight."""
    from backend_io import items

    from gdskv.io_config import PsyncConfig
    from gdskv.tiers.backends import make_backend
    from gdskv.tiers.backends.record import record_size

    engine = PsyncConfig().build()
    backend = make_backend(name, tmp_path, engine, capacity=16 << 20)
    backend.recover()
    real_run, real_submit = engine.run, engine.submit
    raised = []

    def failing(requests):
        if not raised and any(r.op.value == "write" for r in requests):
            raised.append(True)
            raise MemoryError("injected")
        return real_submit(requests)

    engine.submit = failing
    engine.run = lambda requests: failing(requests).result()
    value = {b"key": block(1, 10_000)}
    with pytest.raises(MemoryError):
        backend.write(items(value))
    assert raised and backend.used_bytes == 0 and not list(tmp_path.rglob("*.tmp"))
    engine.run, engine.submit = real_run, real_submit
    backend.write(items(value))
    assert backend.used_bytes == record_size(3, 10_000)
    backend.close()
    engine.close()
