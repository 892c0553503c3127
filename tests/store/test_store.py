"""The tiered store's API and data flows, scenario by scenario."""

import threading

import numpy as np
import pytest

import gdskv
from conftest import block
from gdskv.config import MiB
from gdskv.errors import (
    InvalidKeyError,
    InvalidValueError,
    KeyExistsError,
    NoSpaceError,
    StoreClosedError,
)

KiB = 1024


def verify_reads(store, expected):
    """Every key in ``expected`` reads back byte-exact through get and get_into."""
    for key, value in expected.items():
        assert store.get(key) == value, key
        out = bytearray(len(value))
        assert store.get_into(key, out) == len(value)
        assert out == value


def stats_hits(store):
    s = store.stats()
    return s["dram"]["hits"], s.get("nvme", {}).get("hits", 0), s["gets"]["misses"]


def test_put_get_roundtrip_for_every_buffer_kind(make_store):
    store = make_store()
    arr = np.arange(1000, dtype=np.int32)
    store.put("np", arr)
    store.put(b"bytes", b"hello")
    store.put("ba", bytearray(b"world"))
    store.put("mv", memoryview(b"xyz"))
    out = np.zeros_like(arr)
    assert store.get_into("np", out) == arr.nbytes
    assert np.array_equal(out, arr)
    assert store.get("bytes") == b"hello" and store.get("ba") == b"world" and store.get("mv") == b"xyz"
    assert store.get("absent") is None
    assert store.get_into("absent", bytearray(4)) is None
    assert store.exists("np") and not store.exists("absent")
    assert store.batch_exists(["np", "absent", b"bytes"]) == [True, False, True]
    assert "np" in store and len(store) == 4


def test_get_into_accepts_larger_out_and_rejects_smaller(make_store):
    store = make_store()
    store.put("k", b"12345")
    out = bytearray(10)
    assert store.get_into("k", out) == 5 and out[:5] == b"12345"
    small = bytearray(b"....")
    with pytest.raises(InvalidValueError, match="smaller"):
        store.get_into("k", small)
    assert small == b"...."  # nothing written
    with pytest.raises(InvalidValueError, match="writable"):
        store.get_into("k", b"readonly")


def test_same_value_is_idempotent_and_different_value_needs_overwrite(make_store):
    store = make_store()
    store.put("k", b"one")
    store.put("k", b"one")
    assert store.stats()["puts"]["idempotent"] == 1
    with pytest.raises(KeyExistsError):
        store.put("k", b"two")
    assert store.get("k") == b"one"
    store.put("k", b"two!", overwrite=True)
    assert store.get("k") == b"two!"
    store.flush()
    store.put("k", b"three", overwrite=True)
    store.flush()
    assert store.get("k") == b"three"


def test_remove_forgets_in_every_tier(make_store, tmp_path):
    store = make_store()
    store.put("a", block(1, 100 * KiB))
    store.put("b", block(2, 100 * KiB))
    store.flush()
    assert store.remove("a") and not store.remove("a")
    assert store.get("a") is None and store.get("b") == block(2, 100 * KiB)
    store.close()
    reopened = gdskv.open(tmp_path / "store", dram="4MiB", ssd="64MiB")
    try:
        assert reopened.get("a") is None
        assert reopened.get("b") == block(2, 100 * KiB)
    finally:
        reopened.close()


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
@pytest.mark.parametrize("offload", ["eager", "watermark"])
def test_data_larger_than_dram_spills_to_ssd_and_reads_back(make_store, eviction, offload):
    store = make_store(dram="2MiB", eviction=eviction, offload=offload, promote_after_reads=0)
    expected = {f"blk{i}": block(i, 256 * KiB) for i in range(40)}  # 10 MiB through 2 MiB
    for key, value in expected.items():
        store.put(key, value)
    store.flush()
    verify_reads(store, expected)
    s = store.stats()
    assert s["dram"]["used_bytes"] <= s["dram"]["capacity"]
    assert s["nvme"]["hits"] > 0 and s["dram"]["evicted"] > 0
    assert s["offload"]["objects"] >= 40 - 8  # everything that left DRAM went through SSD
    assert s["dram"]["dropped"] == 0


def test_eager_offload_queues_every_put(make_store):
    store = make_store(offload="eager")
    for i in range(5):
        store.put(f"k{i}", block(i, 10 * KiB))
    store.flush()
    s = store.stats()
    assert s["offload"]["objects"] == 5 and s["nvme"]["objects"] == 5
    assert s["dram"]["objects"] == 5  # still cached in DRAM too


def test_watermark_offload_waits_for_the_high_watermark(make_store):
    store = make_store(dram="1MiB", offload="watermark", high_watermark=0.75, low_watermark=0.5)
    for i in range(5):  # 5 x 128 KiB = 62.5% < 75%: nothing goes to SSD
        store.put(f"k{i}", block(i, 128 * KiB))
    store.flush()
    assert store.stats()["offload"]["objects"] == 0
    for i in range(5, 8):  # crosses 75%: offload and evict down to 50%
        store.put(f"k{i}", block(i, 128 * KiB))
    deadline_store_settles(store, lambda s: s["dram"]["used_bytes"] <= 0.5 * MiB)
    s = store.stats()
    assert s["offload"]["objects"] >= 3 and s["dram"]["evicted"] >= 3
    verify_reads(store, {f"k{i}": block(i, 128 * KiB) for i in range(8)})


def deadline_store_settles(store, predicate, timeout=10.0):
    """Wait until the offloader has acted (flush + poll on stats, bounded)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        store.flush()
        if predicate(store.stats()):
            return
        time.sleep(0.01)
    raise AssertionError(f"store did not settle: {store.stats()}")


def test_promotion_after_repeated_nvme_reads(make_store):
    store = make_store(dram="1MiB", promote_after_reads=2, offload="eager")
    for i in range(12):
        store.put(f"k{i}", block(i, 128 * KiB))
    store.flush()
    # DRAM holds the 8 newest; k0 lives on NVMe only. Free room so promotion is allowed.
    for i in range(4, 12):
        store.remove(f"k{i}")
    assert store.get("k0") == block(0, 128 * KiB)
    assert store.stats()["promoted"] == 0
    assert store.get("k0") == block(0, 128 * KiB)
    assert store.stats()["promoted"] == 1
    before = stats_hits(store)
    assert store.get("k0") == block(0, 128 * KiB)
    after = stats_hits(store)
    assert after[0] == before[0] + 1 and after[1] == before[1]  # served from DRAM now


def test_no_promotion_above_the_watermark(make_store):
    store = make_store(dram="1MiB", promote_after_reads=1, high_watermark=0.5, low_watermark=0.5)
    for i in range(12):
        store.put(f"k{i}", block(i, 128 * KiB))
    store.flush()
    for _ in range(3):
        assert store.get("k0") == block(0, 128 * KiB)
    assert store.stats()["promoted"] == 0


def test_dram_only_store_evicts_by_dropping(make_store):
    store = make_store(dram="1MiB", ssd=0, eviction="lru")
    for i in range(8):
        store.put(f"k{i}", block(i, 128 * KiB))
    store.get("k0")  # k0 becomes most recent
    store.put("k8", block(8, 128 * KiB))  # evicts k1, the least recently used
    assert store.get("k1") is None and store.get("k0") == block(0, 128 * KiB)
    s = store.stats()
    assert s["dram"]["dropped"] == 1 and "nvme" not in s
    store.flush()  # no-op without SSD


def test_fifo_dram_eviction_ignores_reads(make_store):
    store = make_store(dram="1MiB", ssd=0, eviction="fifo")
    for i in range(8):
        store.put(f"k{i}", block(i, 128 * KiB))
    store.get("k0")
    store.put("k8", block(8, 128 * KiB))
    assert store.get("k0") is None and store.get("k1") == block(1, 128 * KiB)


def test_backpressure_times_out_then_offload_resumes(make_store, tmp_path):
    # DRAM-only objects fill DRAM (watermark mode) and the SSD cannot be written (its
    # bucket directory is replaced by a file): a put waits, then fails clearly, keeps what
    # is stored, and the failure shows in stats(). Once the directory is back, offload
    # resumes and the same put succeeds.
    store = make_store(dram="256KiB", ssd="4MiB", offload="watermark", put_timeout_s=0.3, offload_retry_s=0.05)
    buckets = tmp_path / "store" / "buckets"
    buckets.rmdir()
    buckets.write_bytes(b"not a directory")
    store.put("a", block(1, 200 * KiB))
    with pytest.raises(NoSpaceError, match="DRAM full") as info:
        store.put("big", block(2, 100 * KiB))
    assert info.value.context["offload_error"]
    assert store.get("a") == block(1, 200 * KiB)
    s = store.stats()
    assert s["puts"]["no_space"] == 1 and s["offload"]["failures"] >= 1
    buckets.unlink()
    buckets.mkdir()
    store.put("big", block(2, 100 * KiB))  # retried after the pause, within put_timeout_s
    verify_reads(store, {"a": block(1, 200 * KiB), "big": block(2, 100 * KiB)})


def test_backpressure_waits_for_offload_then_succeeds(make_store):
    store = make_store(dram="512KiB", offload="eager", bucket_max_age_s=5.0, bucket_bytes=64 * MiB)
    # The bucket would only seal after 5 s, but a waiting put makes the offloader write now.
    for i in range(8):
        store.put(f"k{i}", block(i, 128 * KiB))
    assert store.stats()["puts"]["waited"] >= 1
    verify_reads(store, {f"k{i}": block(i, 128 * KiB) for i in range(8)})


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda s: s.put("", b"x"), InvalidKeyError),
        (lambda s: s.put(3, b"x"), InvalidKeyError),
        (lambda s: s.put("k" * 5000, b"x"), InvalidKeyError),
        (lambda s: s.put("k", 42), InvalidValueError),
        (lambda s: s.put("k", b""), InvalidValueError),
        (lambda s: s.put("k", bytes(5 * MiB)), gdskv.ValueTooLargeError),
        (lambda s: s.get(None), InvalidKeyError),
        (lambda s: s.batch_put(["a", "b"], [b"x"]), InvalidValueError),
        (lambda s: s.batch_get_into(["a"], []), InvalidValueError),
    ],
)
def test_bad_input_is_refused_and_nothing_is_lost(make_store, call, error):
    store = make_store()
    store.put("keep", b"safe")
    with pytest.raises(error):
        call(store)
    assert store.get("keep") == b"safe"


def test_closed_store_refuses_calls_and_close_is_idempotent(make_store):
    store = make_store()
    store.put("k", b"v")
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.get("k")
    with pytest.raises(StoreClosedError):
        store.put("k2", b"v")


def test_batch_get_into_mixes_tiers_and_misses(make_store):
    store = make_store(dram="1MiB", promote_after_reads=0)
    values = {f"k{i}": block(i, 128 * KiB) for i in range(16)}
    store.batch_put(list(values), list(values.values()))
    store.flush()
    keys = ["k0", "missing", "k15", "k3"]
    outs = [bytearray(128 * KiB) for _ in keys]
    sizes = store.batch_get_into(keys, outs)
    assert sizes == [128 * KiB, None, 128 * KiB, 128 * KiB]
    assert outs[0] == values["k0"] and outs[2] == values["k15"] and outs[3] == values["k3"]


def test_concurrent_writers_and_readers(make_store):
    store = make_store(dram="2MiB", promote_after_reads=1)
    errors = []

    def worker(t):
        try:
            for i in range(30):
                key = f"t{t}-{i}"
                store.put(key, block(t * 1000 + i, 64 * KiB))
                for j in range(0, i + 1, 7):
                    got = store.get(f"t{t}-{j}")
                    assert got == block(t * 1000 + j, 64 * KiB), (key, j)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    store.flush()
    assert len(store) == 120


def test_check_reports_a_healthy_store(make_store):
    store = make_store()
    for i in range(10):
        store.put(f"k{i}", block(i, 64 * KiB))
    store.flush()
    report = store.check()
    assert report.ok and report.nvme_objects == 10 and report.dram_objects == 10


def test_import_gdskv_pulls_no_heavy_packages():
    import subprocess
    import sys

    code = "import gdskv, sys; print(sorted(m for m in ('torch','cupy','kvikio','pyverbs','transformers','liburing','matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
