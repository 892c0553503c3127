"""Prefix keys: chaining, namespaces, stability across processes, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gdskv.engine.layout import PageLayout
from gdskv.engine.prefix import KeyNamespace, PrefixKeys, as_tokens
from gdskv.errors import ConfigError, InvalidValueError

LAYOUT = PageLayout(page_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
NS = KeyNamespace.for_layout("model-a", LAYOUT)


def tokens(n: int, seed: int = 0) -> list:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def test_only_full_pages_get_keys():
    keys = PrefixKeys(NS)
    assert len(keys.page_keys(tokens(15))) == 0
    assert len(keys.page_keys(tokens(16))) == 1
    assert len(keys.page_keys(tokens(47))) == 2
    assert len(keys.page_keys(tokens(47), 1)) == 1


def test_equal_prefixes_give_equal_keys_and_a_change_breaks_every_later_key():
    keys = PrefixKeys(NS)
    base = tokens(64)
    longer = base + tokens(40, seed=1)
    assert keys.page_keys(longer)[:4] == keys.page_keys(base)
    changed = list(base)
    changed[20] += 1  # inside page 1
    a, b = keys.page_keys(base), keys.page_keys(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_same_page_after_another_history_has_another_key():
    keys = PrefixKeys(NS)
    page = tokens(16, seed=5)
    assert keys.page_keys(tokens(16, 1) + page)[1] != keys.page_keys(tokens(16, 2) + page)[1]


def test_key_format_carries_the_namespace_tag():
    key = PrefixKeys(NS).page_keys(tokens(16))[0]
    assert key.startswith(b"kv1/" + NS.tag.encode() + b"/")
    assert len(key) == 4 + 16 + 1 + 32
    assert PrefixKeys.segment_keys(key, 1) == [key]
    assert PrefixKeys.segment_keys(key, 3) == [key + b"/L0", key + b"/L1", key + b"/L2"]


@pytest.mark.parametrize(
    "change",
    [
        dict(model_id="model-b"),
        dict(layout="fused/L2/H2/D8"),
        dict(dtype="bfloat16"),
        dict(page_size=32),
        dict(tp_rank=1, tp_size=2),
        dict(tp_size=2),
    ],
)
def test_every_namespace_field_changes_every_key(change):
    base = dict(model_id="model-a", layout=LAYOUT.describe(), dtype="float32", page_size=16)
    other = KeyNamespace(**{**base, **change})
    toks = tokens(64)
    a = PrefixKeys(KeyNamespace(**base)).page_keys(toks, 2)
    b = PrefixKeys(other).page_keys(toks, 2)
    assert set(a).isdisjoint(b)


def test_token_containers_agree():
    keys = PrefixKeys(NS)
    toks = tokens(48)
    expected = keys.page_keys(toks)
    assert keys.page_keys(np.array(toks, dtype=np.int64)) == expected
    assert keys.page_keys(np.array(toks, dtype=np.uint32)) == expected
    assert keys.page_keys(tuple(toks)) == expected


def test_golden_key():
    # The key scheme is a storage format: keys written by one release are read by the
    # next. If this value changes, bump KEY_VERSION in gdskv/engine/prefix.py.
    ns = KeyNamespace(model_id="golden", layout="per_layer/L1/H1/D1", dtype="float32", page_size=4)
    assert PrefixKeys(ns).page_keys([1, 2, 3, 4, 5, 6, 7, 8]) == GOLDEN


GOLDEN = [
    b"kv1/0d9ad9004c6685be/481daeb7cd8f81051d0be56211b73adc",
    b"kv1/0d9ad9004c6685be/0e19f1deb62dd520dcb57876cb103846",
]


_CHILD = """
import json, sys
from gdskv.engine.prefix import KeyNamespace, PrefixKeys
ns = KeyNamespace(**json.loads(sys.argv[1]))
print(json.dumps([k.decode() for k in PrefixKeys(ns).page_keys(json.loads(sys.argv[2]))]))
"""


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_keys_are_equal_in_another_process_with_another_hash_seed(hashseed):
    ns = dict(model_id="model-a", layout=LAYOUT.describe(), dtype="float32", page_size=16, tp_rank=1, tp_size=4)
    toks = tokens(80)
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(ns), json.dumps(toks)],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    theirs = [k.encode() for k in json.loads(out)]
    assert theirs == PrefixKeys(KeyNamespace(**ns)).page_keys(toks)
    assert len(theirs) == 5


@pytest.mark.parametrize(
    "bad",
    [
        [1, -1, 2],
        [1.5, 2.0],
        [[1, 2], [3, 4]],
        [1 << 32],
        ["a", "b"],
        np.array([True, False]),
    ],
)
def test_bad_token_ids_are_rejected(bad):
    with pytest.raises(InvalidValueError):
        as_tokens(bad)


@pytest.mark.parametrize(
    "fields",
    [
        dict(page_size=0),
        dict(page_size=-16),
        dict(page_size=True),
        dict(page_size=1 << 17),
        dict(model_id=""),
        dict(tp_rank=2, tp_size=2),
        dict(tp_rank=-1),
        dict(tp_size=0),
    ],
)
def test_bad_namespace_is_a_config_error(fields):
    base = dict(model_id="m", layout="per_layer/L1/H1/D1", dtype="float32", page_size=16)
    with pytest.raises(ConfigError):
        KeyNamespace(**{**base, **fields})


def test_more_pages_than_the_tokens_fill_is_an_error():
    with pytest.raises(InvalidValueError):
        PrefixKeys(NS).page_keys(tokens(20), 2)


def test_namespace_must_be_a_namespace():
    with pytest.raises(ConfigError):
        PrefixKeys("model-a")  # type: ignore[arg-type]
