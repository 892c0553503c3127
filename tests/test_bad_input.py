"""Bad input: each gets a clear GdskvError subclass, and nothing stored is lost.

Every case runs against a store that holds objects on SSD only, in DRAM and on SSD, and in
DRAM only; after the error all of them read back byte-exact, and again after a reopen.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gdskv
from conftest import block
from gdskv.errors import (
    ConfigError,
    GdskvError,
    InvalidKeyError,
    InvalidValueError,
    StoreClosedError,
    StoreLockedError,
)
from gdskv.types import MAX_KEY_BYTES

KiB = 1024
OPTIONS = dict(dram="1MiB", ssd="8MiB", offload="watermark", bucket_bytes=256 * KiB, bucket_max_age_s=0.01)
STORED = {"on-ssd": block(1, 100 * KiB), "both": block(2, 5000), "dram-only": block(3, 7)}


@pytest.fixture
def store(tmp_path):
    """A store holding STORED: "on-ssd" only on SSD, "both" in DRAM and on SSD (promoted),
    "dram-only" only in DRAM (watermark offload, far below the watermark)."""
    path = tmp_path / "store"
    with gdskv.open(path, **OPTIONS) as s:
        s.put("on-ssd", STORED["on-ssd"])
        s.put("both", STORED["both"])
    s = gdskv.open(path, promote_after_reads=1, **OPTIONS)
    assert s.get("both") == STORED["both"] and s.stats()["promoted"] == 1
    s.put("dram-only", STORED["dram-only"])
    yield s
    s.close()


def verify_intact(s) -> None:
    for key, value in STORED.items():
        assert s.get(key) == value, key
    assert len(s) == len(STORED)


def verify_intact_after_reopen(s) -> None:
    s.close()
    with gdskv.open(s.path, **OPTIONS) as again:
        verify_intact(again)


def readonly_array(n: int) -> np.ndarray:
    a = np.zeros(n, dtype=np.uint8)
    a.flags.writeable = False
    return a


BAD_CALLS = {
    # values
    "value int": (lambda s: s.put("new", 42), InvalidValueError),
    "value str": (lambda s: s.put("new", "text is not a buffer"), InvalidValueError),
    "value list": (lambda s: s.put("new", [1, 2, 3]), InvalidValueError),
    "value None": (lambda s: s.put("new", None), InvalidValueError),
    "value strided": (lambda s: s.put("new", np.arange(100, dtype=np.uint8)[::2]), InvalidValueError),
    "value empty bytes": (lambda s: s.put("new", b""), InvalidValueError),
    "value empty array": (lambda s: s.put("new", np.empty(0, dtype=np.float32)), InvalidValueError),
    "value larger than DRAM": (lambda s: s.put("new", bytes((1 << 20) + 1)), gdskv.ValueTooLargeError),
    "overwrite larger than DRAM": (lambda s: s.put("both", bytes((1 << 20) + 1), overwrite=True), gdskv.ValueTooLargeError),
    "batch value bad": (lambda s: s.batch_put(["new1", "new2"], [3.5, b"ok"]), InvalidValueError),
    "batch lengths": (lambda s: s.batch_put(["a", "b"], [b"x"]), InvalidValueError),
    # keys
    "key empty str": (lambda s: s.put("", b"x"), InvalidKeyError),
    "key empty bytes": (lambda s: s.get(b""), InvalidKeyError),
    "key too long": (lambda s: s.put("k" * (MAX_KEY_BYTES + 1), b"x"), InvalidKeyError),
    "key too long once encoded": (lambda s: s.put("é" * (MAX_KEY_BYTES // 2 + 1), b"x"), InvalidKeyError),
    "key int": (lambda s: s.put(3, b"x"), InvalidKeyError),
    "key None get": (lambda s: s.get(None), InvalidKeyError),
    "key float get_into": (lambda s: s.get_into(1.5, bytearray(8)), InvalidKeyError),
    "key tuple remove": (lambda s: s.remove(("on-ssd",)), InvalidKeyError),
    "key list exists": (lambda s: s.exists(["on-ssd"]), InvalidKeyError),
    "key in batch": (lambda s: s.batch_exists(["on-ssd", 7]), InvalidKeyError),
    "key not UTF-8 put": (lambda s: s.put("\udc80", b"x"), InvalidKeyError),
    "key not UTF-8 get": (lambda s: s.get("on-\udc80"), InvalidKeyError),
    "key not UTF-8 remove": (lambda s: s.remove("\udc80"), InvalidKeyError),
    # sequences of keys
    "batch keys int": (lambda s: s.batch_exists(5), InvalidValueError),
    "batch keys str": (lambda s: s.batch_exists("on-ssd"), InvalidValueError),
    "batch put ints": (lambda s: s.batch_put(5, 5), InvalidValueError),
    "batch get_into outs int": (lambda s: s.batch_get_into(["both"], 5), InvalidValueError),
    "borrow keys str": (lambda s: s.borrow("ab").__enter__(), InvalidValueError),
    "offload keys str": (lambda s: s.offload("dram-only"), InvalidValueError),
    # other arguments
    "flush timeout str": (lambda s: s.flush(timeout="1"), InvalidValueError),
    "flush timeout nan": (lambda s: s.flush(timeout=float("nan")), InvalidValueError),
    "flush timeout past a year": (lambda s: s.flush(timeout=1e10), InvalidValueError),
    # output buffers
    "out too small (ssd)": (lambda s: s.get_into("on-ssd", bytearray(100 * KiB - 1)), InvalidValueError),
    "out too small (dram)": (lambda s: s.get_into("dram-only", bytearray(6)), InvalidValueError),
    "out bytes": (lambda s: s.get_into("both", bytes(5000)), InvalidValueError),
    "out read-only array": (lambda s: s.get_into("on-ssd", readonly_array(100 * KiB)), InvalidValueError),
    "out read-only view": (lambda s: s.get_into("both", memoryview(bytearray(5000)).toreadonly()), InvalidValueError),
    "out not a buffer": (lambda s: s.get_into("both", "out"), InvalidValueError),
    "out empty": (lambda s: s.get_into("both", bytearray(0)), InvalidValueError),
    "batch out too small": (
        lambda s: s.batch_get_into(["both", "on-ssd"], [bytearray(5000), bytearray(10)]),
        InvalidValueError,
    ),
    "batch outs lengths": (lambda s: s.batch_get_into(["both", "on-ssd"], [bytearray(5000)]), InvalidValueError),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_call_raises_a_clear_error_and_keeps_everything(store, case):
    call, error = BAD_CALLS[case]
    with pytest.raises(error) as info:
        call(store)
    assert isinstance(info.value, GdskvError) and str(info.value)
    verify_intact(store)
    assert not store.exists("new") and not store.exists("new1")
    verify_intact_after_reopen(store)


def test_too_small_outs_are_left_untouched(store):
    outs = [bytearray(b"\xaa" * 5000), bytearray(b"\xbb" * 10)]
    with pytest.raises(InvalidValueError) as info:
        store.batch_get_into(["both", "on-ssd"], outs)
    assert info.value.context["size"] == 100 * KiB and info.value.context["got"] == 10
    assert outs[0] == b"\xaa" * 5000 and outs[1] == b"\xbb" * 10  # nothing written to any


def test_boundary_inputs_are_accepted(store):
    longest = "k" * MAX_KEY_BYTES
    store.put(longest, b"\x01")
    store.put("one byte", b"\x02")
    wide = np.zeros(100 * KiB // 8 + 1, dtype=np.float64)  # a larger out of another dtype
    assert store.get_into("on-ssd", wide) == 100 * KiB
    assert wide.view(np.uint8)[: 100 * KiB].tobytes() == STORED["on-ssd"]
    assert store.get(longest) == b"\x01" and store.get("one byte") == b"\x02"
    for key, value in STORED.items():
        assert store.get(key) == value


CLOSED_CALLS = {
    "put": lambda s: s.put("new", b"x"),
    "batch_put": lambda s: s.batch_put(["new"], [b"x"]),
    "get": lambda s: s.get("on-ssd"),
    "get_into": lambda s: s.get_into("on-ssd", bytearray(100 * KiB)),
    "batch_get_into": lambda s: s.batch_get_into(["both"], [bytearray(5000)]),
    "exists": lambda s: s.exists("both"),
    "remove": lambda s: s.remove("both"),
    "flush": lambda s: s.flush(),
    "check": lambda s: s.check(),
    "len": lambda s: len(s),
}


def test_stats_after_close_are_the_final_figures(store):
    store.get("both")
    before = store.stats()
    store.close()
    after = store.stats()
    assert after["gets"] == before["gets"]
    assert (before["nvme"]["objects"], after["nvme"]["objects"]) == (2, 3)  # close() wrote "dram-only" to SSD


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_use_after_close_is_a_store_closed_error(store, call):
    store.close()
    with pytest.raises(StoreClosedError) as info:
        CLOSED_CALLS[call](store)
    assert info.value.context["path"] == str(store.path)
    store.close()  # idempotent
    with gdskv.open(store.path, **OPTIONS) as again:
        verify_intact(again)


def test_store_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "a-file"
    path.write_bytes(b"keep me")
    with pytest.raises(ConfigError, match="not a directory") as info:
        gdskv.open(path, **OPTIONS)
    assert info.value.context["path"] == str(path)
    assert path.read_bytes() == b"keep me"


@pytest.mark.parametrize("path", [None, b"/tmp/bytes-path", 42], ids=["None", "bytes", "int"])
def test_store_path_of_the_wrong_type_is_a_config_error(path):
    with pytest.raises(ConfigError, match="store path"):
        gdskv.open(path, **OPTIONS)


LOCK_PROBE = """
import sys, gdskv
try:
    gdskv.open(sys.argv[1], dram="1MiB", ssd="8MiB")
except gdskv.StoreLockedError as exc:
    print("StoreLockedError", exc.context["path"], exc.context.get("holder_pid"))
else:
    print("opened")
"""


def test_second_process_is_refused_while_the_store_is_open(store):
    probe = [sys.executable, "-c", LOCK_PROBE, str(store.path)]
    out = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["StoreLockedError", str(store.path), str(os.getpid())]  # names the process that has it
    with pytest.raises(StoreLockedError):  # a second open in this process is refused too
        gdskv.open(store.path, **OPTIONS)
    verify_intact(store)
    store.close()
    out = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["opened"]  # the lock went with the close
    with gdskv.open(store.path, **OPTIONS) as again:
        verify_intact(again)


CONFIG_CASES = {
    # case: (options, the bad name, names the error must list)
    "eviction": ({"eviction": "lfu"}, "lfu", ["lru", "fifo"]),
    "ssd_eviction": ({"ssd_eviction": "random"}, "random", ["lru", "fifo"]),
    "offload": ({"offload": "lazy"}, "lazy", ["eager", "watermark"]),
    "backend": ({"backend": "rocksdb"}, "rocksdb", ["bucket"]),
    "io_engine": ({"io_engine": "aio"}, "aio", ["psync"]),
    "verify_on_open": ({"verify_on_open": "paranoid"}, "paranoid", ["index", "full"]),
    "unknown option": ({"colour": "blue"}, "colour", ["dram", "ssd", "eviction", "offload", "bucket_bytes", "put_timeout_s"]),
    "misspelt option": ({"evicton": "lru"}, "evicton", ["eviction"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_unknown_config_names_list_the_valid_ones(store, case):
    options, bad, valid = CONFIG_CASES[case]
    path = store.path.parent / "other"
    with pytest.raises(ConfigError) as info:
        gdskv.open(path, **{**OPTIONS, **options})
    text = str(info.value)
    assert bad in text
    for name in valid:
        assert name in text, f"{name} missing from: {text}"
    assert not path.exists()  # refused before anything was created
    verify_intact(store)


def test_unknown_name_from_the_environment_lists_the_valid_ones(store, monkeypatch):
    monkeypatch.setenv("GDSKV_OFFLOAD", "sometimes")
    with pytest.raises(ConfigError, match="eager, watermark"):
        gdskv.open(store.path.parent / "other", dram="1MiB", ssd="8MiB")
    verify_intact(store)


@pytest.mark.parametrize("option, value", [
    ("bucket_max_age_s", 1e10),  # the offloader's wait would overflow: it died, flush() and close() hung
    ("offload_retry_s", 1e10),
    ("put_timeout_s", 1e10),
    ("io_depth", 40000),  # more than io_uring takes: every offload failed, close() lost the data
    ("io_threads", 100000),  # an OS thread each: the open died with RuntimeError
    ("dram", "9" * 400),  # a size too large for a float
])
def test_settings_past_what_the_machine_can_do_are_config_errors(tmp_path, option, value):
    with pytest.raises(ConfigError, match=option):
        gdskv.open(tmp_path / "store", **{option: value})
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_a_config_that_is_not_a_store_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config must be a StoreConfig"):
        gdskv.open(tmp_path / "store", config={"dram_bytes": 1 << 20})


def test_an_infinite_flush_timeout_waits_for_ever(store):
    store.put("new", b"n" * 5000)
    store.flush(timeout=float("inf"))
    assert store.stats()["offload"]["queued"] == 0


def test_a_value_larger_than_a_tier_is_a_value_error_not_a_type_error(tmp_path):
    with gdskv.open(tmp_path / "kv", dram="1MiB", ssd="8MiB") as store:
        with pytest.raises(gdskv.ValueTooLargeError) as too_large:
            store.put("big", bytes((1 << 20) + 1))
        assert isinstance(too_large.value, ValueError) and not isinstance(too_large.value, TypeError)
        assert too_large.value.context["capacity"] == 1 << 20
        assert "big" not in store


def test_a_flush_that_runs_out_of_time_is_a_timeout_not_no_space(tmp_path):
    import threading

    with gdskv.open(tmp_path / "kv", dram="4MiB", ssd="16MiB") as store:
        gate = threading.Event()
        nvme = store.parts.nvme
        write = nvme.write
        nvme.write = lambda items: (gate.wait(10), write(items))[1]  # the disk is slow
        store.put("k", b"x" * 4096)
        with pytest.raises(gdskv.TimedOutError) as timed_out:
            store.flush(timeout=0.05)
        assert isinstance(timed_out.value, TimeoutError) and not isinstance(timed_out.value, gdskv.NoSpaceError)
        gate.set()
        store.flush()
        assert store.get("k") == b"x" * 4096
