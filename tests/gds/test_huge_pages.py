"""Large buffers ask for transparent huge pages (gdskv.gds.aligned.map_anonymous).

The kernel reports, per mapping, whether it may back it with huge pages ("THPeligible" in
/proc/self/smaps); with the system mode ``madvise`` that is exactly the advice given.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

import gdskv
from gdskv.gds.aligned import HUGE_PAGE, AlignedBuffer, map_anonymous
from gdskv.gds.aligned import transparent_huge_pages as thp_mode
from gdskv.tiers.dram import DramTier
from gdskv.tiers.policies import make_policy

def smaps(mapping: mmap.mmap) -> dict:
    """/proc/self/smaps of ``mapping``: its permissions ("rw-p": private) and fields."""
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.ctypes.data
    del array
    found: dict = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        head = fields[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
            if inside:
                found["perms"] = fields[1]
        elif inside:
            found[head.rstrip(":")] = fields[1]
    return found


def thp_eligible(mapping: mmap.mmap) -> Optional[bool]:
    """Whether the kernel may back ``mapping`` with huge pages (None: not reported)."""
    value = smaps(mapping).get("THPeligible")
    return None if value is None else value == "1"


def test_mappings_are_private() -> None:
    """Shared anonymous memory (Python's default) lives in shmem: slower to pin for O_DIRECT."""
    for huge in (True, False):
        mapping, _ = map_anonymous(2 * HUGE_PAGE, huge=huge)
        try:
            assert smaps(mapping)["perms"].endswith("p")
        finally:
            mapping.close()


needs_thp = pytest.mark.skipif(
    thp_mode() is None or not hasattr(mmap, "MADV_HUGEPAGE"), reason="kernel without transparent huge pages"
)


@needs_thp
def test_large_mapping_is_advised_and_eligible() -> None:
    mapping, advised = map_anonymous(4 * HUGE_PAGE)
    try:
        assert advised
        if thp_mode() != "never":
            assert thp_eligible(mapping) is True
    finally:
        mapping.close()


@needs_thp
def test_small_or_refused_mapping_is_not_advised() -> None:
    small, advised_small = map_anonymous(HUGE_PAGE // 2)
    plain, advised_plain = map_anonymous(4 * HUGE_PAGE, huge=False)
    try:
        assert not advised_small and not advised_plain
        if thp_mode() == "madvise":  # without the advice, the kernel keeps small pages
            assert thp_eligible(plain) is False
    finally:
        small.close()
        plain.close()


@needs_thp
def test_dram_arena_and_engine_staging_ask_for_huge_pages(tmp_path: Path) -> None:
    tier = DramTier(8 * HUGE_PAGE, make_policy("lru"))
    try:
        assert tier.huge_pages_advised
    finally:
        tier.close()
    staging = AlignedBuffer(4 * HUGE_PAGE)
    try:
        assert staging.huge_pages_advised
    finally:
        staging.close()
    with gdskv.open(tmp_path / "s", dram=8 * HUGE_PAGE, ssd=0) as store:
        assert store.stats()["dram"]["huge_pages_advised"] is True


def test_memory_is_usable_either_way() -> None:
    for huge in (True, False):
        mapping, _ = map_anonymous(2 * HUGE_PAGE + 4096, huge=huge)
        mapping[:4] = b"gdsk"
        mapping[-4:] = b"v!!!"
        assert mapping[:4] == b"gdsk" and mapping[-4:] == b"v!!!"
        mapping.close()


def test_the_store_can_be_told_not_to_ask_for_huge_pages(tmp_path: Path) -> None:
    with gdskv.open(tmp_path / "s", dram=8 * HUGE_PAGE, ssd=0, dram_huge_pages=False) as store:
        assert store.stats()["dram"]["huge_pages_advised"] is False
        store.put(b"k", b"v" * 100)
        assert store.get(b"k") == b"v" * 100


def test_huge_pages_setting_from_the_environment_and_bad_values() -> None:
    from gdskv.config import StoreConfig, env_overrides
    from gdskv.errors import ConfigError

    assert env_overrides({"GDSKV_DRAM_HUGE_PAGES": "off"}) == {"dram_huge_pages": False}
    assert env_overrides({"GDSKV_DRAM_HUGE_PAGES": "1"}) == {"dram_huge_pages": True}
    with pytest.raises(ConfigError, match="boolean"):
        env_overrides({"GDSKV_DRAM_HUGE_PAGES": "maybe"})
    with pytest.raises(ConfigError, match="True or False"):
        StoreConfig(dram_huge_pages="yes")  # type: ignore[arg-type]


def test_without_the_advice_constant_memory_is_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python or platform without MADV_HUGEPAGE still gets its memory, unadvised."""
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    mapping, advised = map_anonymous(4 * HUGE_PAGE)
    try:
        assert not advised and len(mapping) == 4 * HUGE_PAGE
    finally:
        mapping.close()


def test_a_forked_child_does_not_inherit_the_memory() -> None:
    """MADV_DONTFORK: the child's address space has no such mapping (pinned I/O memory is
    not copied at fork, and a child cannot scribble on or read the parent's cache)."""
    mapping, _ = map_anonymous(2 * HUGE_PAGE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.ctypes.data
    del array
    mapping[:4] = b"gdsk"
    pid = os.fork()
    if pid == 0:  # the child: is the parent's mapping in its address space?
        present = any(
            int(lo, 16) <= address < int(hi, 16)
            for lo, hi in (line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines())
        )
        os._exit(1 if present else 0)
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
        assert mapping[:4] == b"gdsk"  # the parent keeps it
    finally:
        mapping.close()
