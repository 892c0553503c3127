"""When the offloader wakes up: a queue that makes a bucket due must start its write."""

import time

from conftest import block

KiB = 1024


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_bucket_max_keys_seals_a_bucket_without_waiting_for_its_age(make_store):
    # A bucket is due once bucket_max_keys objects are queued. The offloader must be woken
    # then, not only when the oldest object's age (an hour here) runs out.
    store = make_store(bucket_max_keys=2, bucket_max_age_s=3600.0)
    for i in range(2):
        store.put(f"k{i}", block(i, 4 * KiB))
    wait_for(lambda: store.stats()["offload"]["objects"] == 2, "a full bucket waited for its age timeout")
    assert store.stats()["nvme"]["buckets"] == 1


def test_bucket_bytes_seals_a_bucket_without_waiting_for_its_age(make_store):
    store = make_store(bucket_bytes=8 * KiB, bucket_max_age_s=3600.0)
    for i in range(2):
        store.put(f"k{i}", block(i, 4 * KiB))
    wait_for(lambda: store.stats()["offload"]["objects"] >= 1, "a full bucket waited for its age timeout")
