"""Eviction policies: LRU and FIFO order, registry errors."""

import pytest

from gdskv.config import EVICTION_POLICIES
from gdskv.errors import ConfigError
from gdskv.tiers.policies import POLICIES, make_policy


def test_lru_moves_touched_to_the_back():
    p = make_policy("lru")
    for name in "abc":
        p.insert(name)
    p.touch("a")
    assert list(p.victims()) == ["b", "c", "a"]
    assert p.first_victim() == "b"


def test_fifo_ignores_touches():
    p = make_policy("fifo")
    for name in "abc":
        p.insert(name)
    p.touch("a")
    assert list(p.victims()) == ["a", "b", "c"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remove_and_victims_snapshot(name):
    p = make_policy(name)
    for i in range(5):
        p.insert(i)
    seen = []
    for v in p.victims():  # removing while iterating the snapshot is allowed
        p.remove(v)
        seen.append(v)
    assert seen == [0, 1, 2, 3, 4] and len(p) == 0
    p.remove("unknown")  # ignored
    assert p.first_victim() is None


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ConfigError, match="fifo, lru"):
        make_policy("arc")


def test_config_names_match_registry():
    assert set(EVICTION_POLICIES) == set(POLICIES)
