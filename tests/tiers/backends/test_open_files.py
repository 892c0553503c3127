"""The descriptor cache of the file-per-key backend: limits, tags, pins and closing."""

from __future__ import annotations

import errno
import os

import pytest

from gdskv.tiers.backends.open_files import OpenFiles, default_limit


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        assert exc.errno == errno.EBADF
        return False
    return True


def new_fd() -> int:
    return os.open(os.devnull, os.O_RDONLY)


def test_least_recently_used_descriptors_leave_first():
    cache = OpenFiles(2)
    a, b, c = new_fd(), new_fd(), new_fd()
    cache.add(b"a", a, 1, "/dev/null", pinned=False)
    cache.add(b"b", b, 1, "/dev/null", pinned=False)
    handle = cache.pin(b"a", 1)  # a is now the most recent
    cache.unpin(handle)
    cache.add(b"c", c, 1, "/dev/null", pinned=False)
    assert len(cache) == 2 and not is_open(b) and is_open(a) and is_open(c)
    assert cache.pin(b"b", 1) is None
    cache.clear()
    assert not is_open(a) and not is_open(c) and len(cache) == 0


def test_a_handle_of_another_tag_is_never_served():
    """The tag is the record's sequence number: a descriptor of an older file of the key
    must not serve a newer record."""
    cache = OpenFiles(4)
    old = new_fd()
    cache.add(b"k", old, 1, "/dev/null", pinned=False)
    assert cache.pin(b"k", 2) is None
    assert not is_open(old) and len(cache) == 0


def test_a_pinned_descriptor_is_closed_by_its_last_reader():
    cache = OpenFiles(1)
    fd = new_fd()
    first = cache.add(b"k", fd, 1, "/dev/null", pinned=True)
    second = cache.pin(b"k", 1)
    assert second is first and first.pins == 2
    cache.discard(b"k")  # removed or overwritten while two reads are in flight
    assert is_open(fd)
    cache.unpin(first)
    assert is_open(fd)
    cache.unpin(second)
    assert not is_open(fd)


def test_a_pinned_descriptor_is_never_pushed_out():
    """A key with a read in flight on its file stays in the cache, and busy, beyond the
    limit if need be: its owner must see that the file is in use."""
    cache = OpenFiles(2)
    a = cache.add(b"a", new_fd(), 1, "/dev/null", pinned=True)
    b = cache.add(b"b", new_fd(), 1, "/dev/null", pinned=False)
    c = cache.add(b"c", new_fd(), 1, "/dev/null", pinned=False)  # b, the oldest idle one, goes
    assert not is_open(b.fd) and cache.busy(b"a") and not cache.busy(b"c") and len(cache) == 2
    cache.unpin(a)
    assert is_open(a.fd) and not cache.busy(b"a")
    d = cache.add(b"d", new_fd(), 1, "/dev/null", pinned=False)  # now a is the oldest idle one
    assert not is_open(a.fd) and is_open(c.fd) and is_open(d.fd)
    cache.clear()


def test_shedding_closes_the_idle_descriptors_at_once():
    """What the backend does when the process is out of descriptors."""
    cache = OpenFiles(4)
    idle = [cache.add(key, new_fd(), 1, "/dev/null", pinned=False) for key in (b"a", b"b")]
    busy = cache.add(b"c", new_fd(), 1, "/dev/null", pinned=True)
    assert cache.shed() == 2 and len(cache) == 1 and cache.busy(b"c")
    assert not any(is_open(h.fd) for h in idle) and is_open(busy.fd)
    cache.unpin(busy)
    assert is_open(busy.fd)  # idle again, and within the limit: kept
    cache.clear()
    assert not is_open(busy.fd)


def test_a_limit_of_zero_keeps_only_what_reads_are_using():
    cache = OpenFiles(0)
    kept = cache.add(b"k", new_fd(), 1, "/dev/null", pinned=True)
    assert len(cache) == 1 and cache.busy(b"k") and is_open(kept.fd)
    cache.unpin(kept)
    assert len(cache) == 0 and not is_open(kept.fd)
    unpinned = cache.add(b"k", new_fd(), 1, "/dev/null", pinned=False)
    assert not is_open(unpinned.fd) and len(cache) == 0
    with pytest.raises(ValueError):
        OpenFiles(-1)


def test_the_default_limit_is_half_the_descriptor_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1000, soft), hard))
        assert default_limit() == min(1000, soft) // 2
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
