"""The rule of when an offload batch is due (gdskv/store/offload_rule.py), which the store's
offloader and the trace simulator share."""

import pytest

from gdskv.config import MiB
from gdskv.offload_config import OffloaderConfig
from gdskv.store.offload_rule import batch_due, batch_full, batch_limit_bytes, keys_per_full_batch

CFG = OffloaderConfig(bucket_bytes=8 * MiB, bucket_max_keys=16, bucket_max_age_s=0.2)
SSD_BYTES = 64 * MiB


def test_a_batch_is_full_by_bytes_or_by_keys():
    assert not batch_full(8 * MiB - 1, 15, CFG)
    assert batch_full(8 * MiB, 1, CFG)
    assert batch_full(1, 16, CFG)


@pytest.mark.parametrize(
    "queued_bytes, keys, age, waited_for, due",
    [
        (0, 0, 99.0, True, False),  # an empty queue is never due
        (1, 1, 0.0, False, False),
        (1, 1, 0.2, False, True),  # its oldest waited long enough
        (1, 1, 0.0, True, True),  # a flush, a put under back-pressure or close waits for it
        (8 * MiB, 2, 0.0, False, True),  # full
    ],
)
def test_a_batch_is_due_when_full_old_or_waited_for(queued_bytes, keys, age, waited_for, due):
    assert batch_due(queued_bytes, keys, age, CFG, waited_for=waited_for) is due


def test_a_batch_takes_at_most_a_bucket_and_a_quarter_of_the_ssd():
    assert batch_limit_bytes(CFG, SSD_BYTES) == 8 * MiB
    assert batch_limit_bytes(CFG, 16 * MiB) == 4 * MiB


@pytest.mark.parametrize("size", [1, 4096, 1 * MiB, 3 * MiB, 8 * MiB, 9 * MiB])
def test_keys_per_full_batch_is_the_smallest_count_that_fills_it(size):
    n = keys_per_full_batch(size, CFG)
    assert batch_full(n * size, n, CFG)
    assert n == 1 or not batch_full((n - 1) * size, n - 1, CFG)
