"""Every I/O engine, with and without O_DIRECT: the same contract, the same bytes."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import numpy as np
import pytest

from awaiting import awaited, cancel_an_await
from conftest import block, uring_unavailable
from gdskv.errors import InvalidValueError, IoError, StoreClosedError
from gdskv.gds import IoRequest
from gdskv.gds.aligned import alloc_aligned, is_direct_fd
from gdskv.io_config import PsyncConfig


def _engine(name: str, direct: bool, **kw):
    if name == "uring":
        if uring_unavailable():
            pytest.skip(uring_unavailable())
        from gdskv.gds.uring import UringEngine

        return UringEngine(direct=direct, **kw)
    from gdskv.gds.psync import PsyncEngine

    return PsyncEngine(direct=direct, **kw)


@pytest.fixture(params=[("psync", False), ("psync", True), ("uring", False), ("uring", True)], ids=lambda p: f"{p[0]}-{'direct' if p[1] else 'buffered'}")
def engine(request):
    name, direct = request.param
    # Small staging chunks so that modest requests already span several of them.
    eng = _engine(name, direct, chunk_bytes=64 << 10)
    yield eng
    eng.close()


@pytest.fixture
def datafile(tmp_path, engine):
    path = tmp_path / "data"
    fd = engine.open_file(path, os.O_RDWR | os.O_CREAT)
    yield fd, str(path)
    os.close(fd)


def _read(engine, fd, path, offset, size) -> bytes:
    out = bytearray(size)
    assert engine.run([IoRequest.read(fd, offset, memoryview(out), path=path)]) == [size]
    return bytes(out)


def test_open_file_uses_o_direct_only_when_asked(engine, datafile):
    fd, _ = datafile
    assert is_direct_fd(fd) == engine.direct
    assert engine.describe()["direct"] == engine.direct


def test_open_file_asks_for_no_access_time_updates(engine, datafile, tmp_path, monkeypatch):
    """Data files are opened O_NOATIME (reads never touch the inode); where the kernel
    refuses it (EPERM: not the file's owner) the file is opened without it."""
    import fcntl

    from gdskv.gds import aligned

    fd, _ = datafile
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & aligned.O_NOATIME
    real_open = os.open

    def refuse_noatime(path, flags, mode=0o777):
        if flags & aligned.O_NOATIME:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(aligned.os, "open", refuse_noatime)
    other = engine.open_file(tmp_path / "not-ours", os.O_RDWR | os.O_CREAT)
    try:
        assert not fcntl.fcntl(other, fcntl.F_GETFL) & aligned.O_NOATIME
        assert is_direct_fd(other) == engine.direct
    finally:
        os.close(other)


def test_a_request_that_says_whether_its_file_is_direct_is_believed(engine, datafile, monkeypatch):
    """``IoRequest.direct`` spares the engine its fcntl per file and batch; unset, the
    engine asks the kernel."""
    import gdskv.gds.psync as psync_module
    import gdskv.gds.ring as ring_module

    fd, path = datafile
    data = block(3, 3 * 4096)
    engine.run([IoRequest.write(fd, 0, memoryview(data), path=path)])
    asked = []

    def counting(fd_):
        asked.append(fd_)
        return is_direct_fd(fd_)

    monkeypatch.setattr(ring_module, "is_direct_fd", counting)
    monkeypatch.setattr(psync_module, "is_direct_fd", counting)
    out = bytearray(5000)
    told = IoRequest(IoRequest.read(fd, 100, memoryview(out)).op, fd, 100, (memoryview(out),), path, engine.direct)
    assert engine.run([told]) == [5000] and bytes(out) == data[100:5100] and asked == []
    out2 = bytearray(5000)
    assert engine.run([IoRequest.read(fd, 100, memoryview(out2), path=path)]) == [5000]
    assert bytes(out2) == data[100:5100] and asked == [fd]


def test_unaligned_writes_and_reads_round_trip(engine, datafile):
    fd, path = datafile
    data = block(1, 300_001)
    view = memoryview(data)
    # Three buffers of odd lengths, at an odd offset, in one request.
    assert engine.run([IoRequest.write(fd, 777, view[:5], view[5:70_000], view[70_000:], path=path)]) == [len(data)]
    assert os.fstat(fd).st_size == 777 + len(data)  # block padding never shows as file length
    assert _read(engine, fd, path, 777, len(data)) == data
    out = bytearray(len(data))
    parts = [memoryview(out)[:3], memoryview(out)[3:200_000], memoryview(out)[200_000:]]
    assert engine.run([IoRequest.read(fd, 777, *parts, path=path)]) == [len(data)]
    assert out == data


def test_partial_block_overwrite_keeps_its_neighbours(engine, datafile):
    fd, path = datafile
    base = block(2, 3 * 4096)
    engine.run([IoRequest.write(fd, 0, memoryview(base), path=path)])
    engine.run([IoRequest.write(fd, 4090, memoryview(b"0123456789ab"), path=path)])
    expect = base[:4090] + b"0123456789ab" + base[4102:]
    assert _read(engine, fd, path, 0, len(base)) == expect


def test_aligned_buffers_are_moved_in_place(engine, datafile):
    fd, path = datafile
    src = alloc_aligned(1 << 20)
    dst = alloc_aligned(1 << 20)
    src.view[:] = block(3, 1 << 20)
    assert engine.run([IoRequest.write(fd, 8192, src.view, path=path)]) == [1 << 20]
    assert engine.run([IoRequest.read(fd, 8192, dst.view, path=path)]) == [1 << 20]
    assert dst.view == src.view
    src.close()
    dst.close()


def test_transfers_larger_than_one_kernel_entry_round_trip(engine, datafile):
    """Aligned transfers above the uring split size (4 MiB) go as several entries, over
    several buffers, with both ends of the split inside one buffer."""
    fd, path = datafile
    size = (9 << 20) + 8192
    src = alloc_aligned(size)
    dst = alloc_aligned(size)
    src.view[:] = block(4, size)
    cut = (3 << 20) + 4096  # a buffer boundary that is not a split boundary
    parts = [src.view[:cut], src.view[cut:]]
    assert engine.run([IoRequest.write(fd, 4096, *parts, path=path)]) == [size]
    outs = [dst.view[: 5 << 20], dst.view[5 << 20 :]]
    assert engine.run([IoRequest.read(fd, 4096, *outs, path=path)]) == [size]
    assert dst.view == src.view
    src.close()
    dst.close()


def test_a_write_stages_only_what_is_not_aligned(engine, datafile):
    """A record-shaped write (unaligned header block, page-aligned value, a partial last
    block) sends the value's whole blocks straight from memory and stages only the rest."""
    fd, path = datafile
    mem = alloc_aligned(1 << 20)
    data = block(5, 4096 + (256 << 10) + 100)
    head = mem.view[64 : 64 + 4096]  # 64 bytes past a page: cannot go direct
    value = mem.view[8192 : 8192 + (256 << 10) + 100]  # page-aligned, like the file offset
    head[:] = data[:4096]
    value[:] = data[4096:]
    before = engine.describe().get("staged_write_bytes", 0)
    assert engine.run([IoRequest.write(fd, 8192, head, value, path=path)]) == [len(data)]
    staged = engine.describe()["staged_write_bytes"] - before
    # Direct: the header block and the block holding the value's last 100 bytes.
    assert staged == (2 * 4096 if engine.direct else 0)
    assert _read(engine, fd, path, 8192, len(data)) == data
    assert os.fstat(fd).st_size == 8192 + len(data)
    del head, value
    mem.close()


def test_a_batch_larger_than_the_queue_and_the_staging(tmp_path):
    for name in ("psync", "uring"):
        eng = _engine(name, True, chunk_bytes=4096, **({"depth": 4, "slots": 2} if name == "uring" else {"threads": 2}))
        path = tmp_path / f"batch-{name}"
        fd = eng.open_file(path, os.O_RDWR | os.O_CREAT)
        values = [block(10 + i, 1000 + 37 * i) for i in range(50)]
        offsets = [i * 8192 + 13 for i in range(50)]
        eng.run([IoRequest.write(fd, o, memoryview(v), path=str(path)) for o, v in zip(offsets, values)])
        outs = [bytearray(len(v)) for v in values]
        sizes = eng.run([IoRequest.read(fd, o, memoryview(b), path=str(path)) for o, b in zip(offsets, outs)])
        assert sizes == [len(v) for v in values]
        assert outs == [bytearray(v) for v in values]
        os.close(fd)
        eng.close()


def test_more_buffers_than_iov_max(engine, datafile):
    fd, path = datafile
    data = block(4, 1500 * 8)
    pieces = [memoryview(data)[i * 8 : (i + 1) * 8] for i in range(1500)]
    assert engine.run([IoRequest.write(fd, 0, *pieces, path=path)]) == [len(data)]
    assert _read(engine, fd, path, 0, len(data)) == data


def test_short_read_past_end_of_file_is_an_error_with_context(engine, datafile):
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(5, 10_000)), path=path)])
    with pytest.raises(IoError) as info:
        engine.run([IoRequest.read(fd, 8192, memoryview(bytearray(8192)), path=path)])
    assert "short read" in str(info.value)
    assert info.value.context["path"] == path and info.value.context["offset"] == 8192
    assert info.value.context["expected"] == 8192 and info.value.context["got"] == 10_000 - 8192


def test_a_failing_request_fails_alone(engine, datafile):
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(6, 4096)), path=path)])
    good = bytearray(4096)
    bad_fd = os.open(os.devnull, os.O_WRONLY)  # reading a write-only fd: EBADF
    try:
        outcomes = engine.submit(
            [IoRequest.read(bad_fd, 0, memoryview(bytearray(4096)), path="/dev/null"), IoRequest.read(fd, 0, memoryview(good), path=path)]
        ).outcomes()
    finally:
        os.close(bad_fd)
    assert isinstance(outcomes[0], IoError) and outcomes[0].context["errno"] == errno.EBADF
    assert outcomes[0].context["path"] == "/dev/null"
    assert outcomes[1] == 4096 and bytes(good) == block(6, 4096)


def test_empty_buffers_move_nothing(engine, datafile, tmp_path):
    """Empty buffers anywhere in a request are allowed. On io_uring, a request that could not
    be prepared must never leave its submission entry holding the previous request: that
    entry would be sent again and write an old buffer into an unrelated file."""
    fd, path = datafile
    other_path = tmp_path / "other"
    other = engine.open_file(other_path, os.O_RDWR | os.O_CREAT)
    try:
        engine.run([IoRequest.write(other, 0, memoryview(bytearray(b"OLD-DATA")), path=str(other_path))])
        plain = os.open(other_path, os.O_RDWR)  # not O_DIRECT: any length goes
        os.pwrite(plain, b"NEW-DATA", 0)
        empty = memoryview(bytearray())
        assert engine.run([IoRequest.write(fd, 0, memoryview(bytearray(b"Z")), empty, memoryview(bytearray(b"Y")), path=path)]) == [2]
        assert engine.run([IoRequest.write(fd, 2, memoryview(bytearray(b"0123456789")), empty, path=path)]) == [10]
        out = bytearray(12)
        assert engine.run([IoRequest.read(fd, 0, memoryview(out), empty, path=path)]) == [12]
        assert bytes(out) == b"ZY0123456789"
        assert engine.run([IoRequest.read(fd, 0, empty, path=path)]) == [0]
        assert os.pread(plain, 8, 0) == b"NEW-DATA"
        os.close(plain)
    finally:
        os.close(other)


def test_a_read_into_read_only_memory_fails_alone(engine, datafile):
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(21, 8192)), path=path)])
    frozen = bytes(4096)
    good = bytearray(4096)
    outcomes = engine.submit([IoRequest.read(fd, 0, memoryview(frozen), path=path), IoRequest.read(fd, 4096, memoryview(good), path=path)]).outcomes()
    assert isinstance(outcomes[0], InvalidValueError) and outcomes[0].context["path"] == path
    assert frozen == bytes(4096)  # the kernel never wrote into it
    assert outcomes[1] == 4096 and bytes(good) == block(21, 8192)[4096:]


@pytest.mark.parametrize("size", [4096, 256 * 1024])  # a small read and a large one
def test_buffers_that_are_not_flat_byte_views_fail_alone(engine, datafile, size):
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(24, 2 * size)), path=path)])
    floats = memoryview(np.zeros(size // 4, dtype=np.float32))
    square = memoryview(np.zeros((size // 64, 64), dtype=np.uint8))
    good = bytearray(size)
    outcomes = engine.submit(
        [IoRequest.read(fd, 0, floats, path=path), IoRequest.read(fd, 0, square, path=path), IoRequest.read(fd, size, memoryview(good), path=path)]
    ).outcomes()
    assert all(isinstance(o, InvalidValueError) for o in outcomes[:2])
    assert outcomes[2] == size and bytes(good) == block(24, 2 * size)[size:]
    assert engine.run([IoRequest.read(fd, 0, floats.cast("B"), path=path)]) == [size]  # as bytes, fine


def test_a_closed_descriptor_is_an_io_error(engine, datafile, tmp_path):
    engine.run([IoRequest.write(datafile[0], 0, memoryview(block(23, 4096)), path=datafile[1])])  # rings made first
    fd = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT)
    os.close(fd)  # (a descriptor opened after this could take its number)
    for batch in (1, 2):  # psync runs a single request inline, a batch on its pool
        outcomes = engine.submit([IoRequest.read(fd, 0, memoryview(bytearray(4096)), path="gone")] * batch).outcomes()
        assert all(isinstance(o, IoError) and o.context["errno"] == errno.EBADF for o in outcomes)


def test_more_buffers_than_iov_max_keep_the_neighbours_of_a_buffered_file(engine, datafile):
    """Past IOV_MAX buffers a buffered file is written as it is (several entries or calls),
    not block by block through staging: a read-modify-write of a block would undo another
    write of the same batch in that block (allowed on a buffered file)."""
    if engine.direct:
        pytest.skip("two writes of a batch may not share a block of an O_DIRECT file")
    fd, path = datafile
    ones = [memoryview(bytearray(b"a")) for _ in range(1100)]
    for _ in range(10):
        os.ftruncate(fd, 0)
        engine.run([IoRequest.write(fd, 2000, memoryview(bytearray(b"B" * 100)), path=path), IoRequest.write(fd, 0, *ones, path=path)])
        assert os.pread(fd, 2100, 0) == b"a" * 1100 + bytes(900) + b"B" * 100


def test_more_buffers_than_iov_max_with_a_partial_block_past_the_end(engine, datafile):
    fd, path = datafile
    data = block(22, 2000)
    assert engine.run([IoRequest.write(fd, 0, *[memoryview(data)[i : i + 1] for i in range(2000)], path=path)]) == [2000]
    assert os.fstat(fd).st_size == 2000 and _read(engine, fd, path, 0, 2000) == data


def test_future_done_and_await(engine, datafile):
    fd, path = datafile
    data = block(7, 200_000)
    fut = engine.submit([IoRequest.write(fd, 100, memoryview(data), path=path)])
    assert fut.result() == [len(data)]
    assert fut.done()
    out = bytearray(len(data))

    async def read():
        return await engine.submit([IoRequest.read(fd, 100, memoryview(out), path=path)])

    assert asyncio.run(read()) == [len(data)]
    assert out == data


def test_threads_get_their_own_rings_and_the_same_bytes(engine, datafile):
    fd, path = datafile
    values = {t: block(100 + t, 50_000 + t) for t in range(4)}
    errors = []
    all_done = threading.Barrier(5)
    checked = threading.Event()

    def work(t):
        try:
            off = t * 65536 + 11
            for _ in range(5):
                engine.run([IoRequest.write(fd, off, memoryview(values[t]), path=path)])
                assert _read(engine, fd, path, off, len(values[t])) == values[t]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        all_done.wait()
        checked.wait()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    all_done.wait()
    rings = engine.describe().get("rings")
    checked.set()
    for th in threads:
        th.join()
    assert errors == []
    if engine.name == "uring":
        assert rings >= 4  # one per thread while the threads live; released when they end


def test_closed_engine_refuses_work(tmp_path):
    eng = PsyncConfig(direct=False).build()
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(StoreClosedError):
        eng.submit([IoRequest.read(0, 0, memoryview(bytearray(1)))])


def test_no_buffer_is_held_after_io(engine, datafile):
    """The caller's buffers are released when the batch completes (a bytearray that is
    still exported cannot be resized)."""
    fd, path = datafile
    buf = bytearray(block(8, 10_000))
    for _ in range(3):
        engine.run([IoRequest.write(fd, 0, memoryview(buf), path=path)])
        engine.run([IoRequest.read(fd, 0, memoryview(buf), path=path)])
    buf.extend(b"x")  # raises BufferError if an export leaked
    arr = np.frombuffer(block(9, 8192), dtype=np.uint8).copy()
    engine.run([IoRequest.write(fd, 4096, memoryview(arr), path=path)])
    arr.resize(16384, refcheck=True)  # raises ValueError if a reference leaked


def test_small_write_past_the_end_makes_the_file_exactly_that_long(engine, datafile):
    fd, path = datafile
    assert engine.run([IoRequest.write(fd, 5, memoryview(b"0123456789"), path=path)]) == [10]
    assert os.fstat(fd).st_size == 15
    assert _read(engine, fd, path, 0, 15) == bytes(5) + b"0123456789"
    # Several unaligned writes extending the file at once (no two share a 4 KiB block, the
    # engines' one rule): none trims or zeroes another.
    values = [block(200 + i, 5000 + i) for i in range(8)]
    offsets = [15 + i * 16384 for i in range(8)]
    engine.run([IoRequest.write(fd, o, memoryview(v), path=path) for o, v in zip(offsets, values)])
    assert os.fstat(fd).st_size == offsets[-1] + len(values[-1])
    for o, v in zip(offsets, values):
        assert _read(engine, fd, path, o, len(v)) == v


def test_a_write_through_a_read_only_descriptor_fails_wherever_it_lands(engine, tmp_path):
    """A write on a descriptor opened read-only fails as pwrite(2) would (EBADF), also where
    the engine writes a partial last block past the end of the file on its own: the file
    is left as it was."""
    path = tmp_path / "ro"
    path.write_bytes(b"x" * 5000)
    fd = engine.open_file(path, os.O_RDONLY)
    try:
        outcomes = engine.submit([
            IoRequest.write(fd, 100, memoryview(b"hello"), path=str(path)),   # inside the file
            IoRequest.write(fd, 6000, memoryview(b"hello"), path=str(path)),  # past its end
        ]).outcomes()
    finally:
        os.close(fd)
    assert [isinstance(o, IoError) and o.context.get("errno") == errno.EBADF for o in outcomes] == [True, True], outcomes
    assert path.read_bytes() == b"x" * 5000


def test_as_completed_yields_each_request_once_with_its_outcome(engine, datafile):
    fd, path = datafile
    values = [block(300 + i, 20_000 + 4096 * i) for i in range(10)]
    offsets = [i * (1 << 20) for i in range(10)]
    engine.run([IoRequest.write(fd, o, memoryview(v), path=path) for o, v in zip(offsets, values)])
    outs = [bytearray(len(v)) for v in values]
    requests = [IoRequest.read(fd, o, memoryview(b), path=path) for o, b in zip(offsets, outs)]
    requests.append(IoRequest.read(fd, 20 << 20, memoryview(bytearray(4096)), path=path))  # past the end
    seen = {}
    for index, outcome in engine.submit(requests).as_completed():
        assert index not in seen
        seen[index] = outcome
        if index < len(values):  # its bytes are in as soon as it is reported
            assert outs[index] == values[index]
    assert sorted(seen) == list(range(len(requests)))
    assert [seen[i] for i in range(len(values))] == [len(v) for v in values]
    assert isinstance(seen[len(values)], IoError)


def test_a_small_read_that_fails_fails_alone_with_path_and_offset(engine, datafile, tmp_path):
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(7, 8192)), path=path)])
    other = str(tmp_path / "write-only")
    wfd = os.open(other, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if engine.direct else 0))  # like fd
    good = bytearray(100)
    try:
        outcomes = engine.submit(
            [IoRequest.read(wfd, 4106, memoryview(bytearray(100)), path=other), IoRequest.read(fd, 4000, memoryview(good), path=path)]
        ).outcomes()
    finally:
        os.close(wfd)
    assert isinstance(outcomes[0], IoError) and outcomes[0].context["errno"] == errno.EBADF
    assert outcomes[0].context["path"] == other and outcomes[0].context["offset"] == 4106
    assert outcomes[1] == 100 and bytes(good) == block(7, 8192)[4000:4100]


def test_a_read_past_an_end_of_file_on_a_block_boundary_is_a_short_read(engine, datafile):
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(8, 8192)), path=path)])
    with pytest.raises(IoError) as info:  # the first transfer stops at 8192, the resumed one gets nothing
        engine.run([IoRequest.read(fd, 0, memoryview(bytearray(12_000)), path=path)])
    assert "short read" in str(info.value)
    assert info.value.context["path"] == path and info.value.context["offset"] == 0
    assert info.value.context["expected"] == 12_000 and info.value.context["got"] == 8192


def test_a_refused_submission_fails_every_queued_request_with_its_offset(tmp_path):
    """io_uring_enter failing outright (as a kernel out of resources for good would) fails
    what the kernel did not take, small reads and others alike, and frees their staging."""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    import liburing

    from gdskv.gds.ring import Ring

    class Refusing:
        def __getattr__(self, name):
            return getattr(liburing, name)

        @staticmethod
        def io_uring_submit(ring):
            raise OSError(errno.EFAULT, "refused")

    eng = _engine("uring", True, chunk_bytes=64 << 10)
    path = tmp_path / "data"
    fd = eng.open_file(path, os.O_RDWR | os.O_CREAT)
    eng.run([IoRequest.write(fd, 0, memoryview(block(9, 256 << 10)), path=str(path))])
    ring = Ring(Refusing(), depth=8, slots=4, chunk_bytes=64 << 10, fixed=eng.fixed)
    requests = [
        IoRequest.read(fd, 4096 + 10, memoryview(bytearray(100)), path=str(path)),  # small
        IoRequest.read(fd, 8192, memoryview(bytearray(100 << 10)), path=str(path)),  # bounced in chunks
    ]
    outcomes = ring.submit(requests).outcomes()
    assert all(isinstance(o, IoError) and o.context["errno"] == errno.EFAULT for o in outcomes)
    assert [o.context["offset"] for o in outcomes] == [4096 + 10, 8192]
    assert ring.broken and sorted(ring._free_slots) == [0, 1, 2, 3] and sorted(ring._free_small) == list(range(4, 12))
    ring.close()
    os.close(fd)
    eng.close()


def test_uring_caps_the_bytes_of_large_reads_in_flight(tmp_path, monkeypatch):
    """Large reads, direct or staged, wait while ``read_inflight_bytes`` of them are in
    flight; one larger than the cap still goes (alone); small reads and writes are not held."""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    from gdskv.gds.ring import Ring

    seen = []  # (large read bytes, entries) in flight at each submission
    submit = Ring._submit

    def watching(ring):
        seen.append((ring._reading, len(ring._inflight)))
        submit(ring)

    monkeypatch.setattr(Ring, "_submit", watching)
    cap = 64 << 10
    eng = _engine("uring", True, depth=32, slots=32, chunk_bytes=16 << 10, read_inflight_bytes=cap)
    path = tmp_path / "data"
    fd = eng.open_file(path, os.O_RDWR | os.O_CREAT)
    data = block(3, 2 << 20)
    eng.run([IoRequest.write(fd, 0, memoryview(data), path=str(path))])
    assert max(n for _, n in seen) > 4  # the write went out in many entries at once: not held

    def read_all(size, align, count, offset_step):
        page = alloc_aligned(count * (size + 4096) + 4096)
        outs = [page.view[i * (size + 4096) + align : i * (size + 4096) + align + size] for i in range(count)]
        seen.clear()
        got = eng.run([IoRequest.read(fd, i * offset_step, outs[i], path=str(path)) for i in range(count)])
        assert got == [size] * count
        assert [bytes(o) for o in outs] == [data[i * offset_step : i * offset_step + size] for i in range(count)]
        return max(r for r, _ in seen), max(n for _, n in seen)

    assert read_all(32 << 10, 0, 16, 32 << 10) == (cap, 2)  # direct: two 32 KiB reads at a time
    reading, entries = read_all(40 << 10, 64, 16, 64 << 10)  # staged: 16 KiB chunks
    assert reading <= cap and entries >= 2
    assert read_all(256 << 10, 0, 2, 256 << 10) == (256 << 10, 1)  # over the cap: one at a time
    assert read_all(4096, 64, 24, 8192)[1] == 24  # small reads: all at once
    os.close(fd)
    eng.close()


def test_uring_small_reads_have_staging_slots_of_their_own(tmp_path, monkeypatch):
    """Small reads and the chunks of large unaligned requests do not share staging: with a
    single chunk, a batch's small reads and the first chunk of its staged read all go at
    once, and the bytes of every read are right. (Before, each small read took a chunk,
    and they went one at a time.)"""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    from gdskv.gds.ring import Ring

    seen = []  # entries in flight at each submission
    submit = Ring._submit

    def watching(ring):
        seen.append(len(ring._inflight))
        submit(ring)

    eng = _engine("uring", True, depth=16, slots=1, chunk_bytes=16 << 10)
    path = tmp_path / "data"
    fd = eng.open_file(path, os.O_RDWR | os.O_CREAT)
    data = block(5, 1 << 20)
    eng.run([IoRequest.write(fd, 0, memoryview(data), path=str(path))])
    monkeypatch.setattr(Ring, "_submit", watching)
    page = alloc_aligned(2 << 20)
    large = page.view[64 : 64 + (256 << 10)]  # unaligned: staged, 16 chunks one after another
    smalls = [page.view[(512 << 10) + i * 8192 + 64 : (512 << 10) + i * 8192 + 64 + 3000] for i in range(12)]
    requests = [IoRequest.read(fd, 300_000 + i * 20_000, out, path=str(path)) for i, out in enumerate(smalls)]
    requests.append(IoRequest.read(fd, 4096, large, path=str(path)))
    assert eng.run(requests) == [3000] * 12 + [large.nbytes]
    assert seen and seen[0] == 13  # every small read and the first chunk, in one submission
    assert bytes(large) == data[4096 : 4096 + large.nbytes]
    assert all(bytes(out) == data[300_000 + i * 20_000 : 300_000 + i * 20_000 + 3000] for i, out in enumerate(smalls))
    ring = eng._ring()
    assert sorted(ring._free_slots) == [0] and sorted(ring._free_small) == list(range(1, 17))
    os.close(fd)
    eng.close()


def test_uring_refuses_staging_without_a_chunk_or_a_small_slot():
    """A ring without a chunk (or without a small slot) would leave any request that needs
    one waiting for good, and close() with it: refused at once (before, ``slots=0`` was
    refused only because the staging came out empty)."""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    import liburing

    from gdskv.errors import ConfigError
    from gdskv.gds.ring import Ring
    from gdskv.gds.uring import UringEngine

    for slots in (0, -1):
        with pytest.raises(ConfigError):
            UringEngine(direct=True, slots=slots)
    for slots, small_slots in ((0, 4), (2, 0)):
        with pytest.raises(ConfigError):
            Ring(liburing, depth=4, slots=slots, chunk_bytes=64 << 10, fixed=False, small_slots=small_slots)


def test_uring_staging_is_a_whole_number_of_huge_pages():
    """A ring's staging (chunks and small slots) is rounded up to whole huge pages: the
    kernel maps such a size 2 MiB-aligned, so each chunk lies on huge pages (one
    scatter-gather segment per transfer). 17 MiB of staging was mapped 1 MiB off a huge
    page every other time, and staged 2 MiB reads through 1 MiB chunks ran at half speed."""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    from gdskv.gds.aligned import HUGE_PAGE
    from gdskv.gds.uring import UringEngine

    eng = UringEngine(direct=True)  # 16 chunks of 1 MiB and 64 small slots of 16 KiB: 17 MiB
    ring = eng._ring()
    assert (ring.chunk_bytes, len(ring._free_slots), len(ring._free_small)) == (1 << 20, 16, 64)
    assert ring._staging.nbytes % HUGE_PAGE == 0 and ring._staging.nbytes >= 17 << 20
    eng.close()


def test_uring_refills_the_ring_while_a_caller_works_through_completed_requests(tmp_path):
    """A caller going through many completed requests (a large batch being verified) does
    not leave the device idle: every 16 it takes, the ring's backlog is issued."""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    import time

    eng = _engine("uring", True, depth=8, slots=8)
    path = tmp_path / "data"
    fd = eng.open_file(path, os.O_RDWR | os.O_CREAT)
    eng.run([IoRequest.write(fd, 0, memoryview(block(4, 64 * 4096)), path=str(path))])
    try:
        done = eng.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(16)])
        assert done.outcomes() == [4096] * 16
        waiting = eng.submit([IoRequest.read(fd, i * 4096, memoryview(bytearray(4096)), path=str(path)) for i in range(40)])
        time.sleep(0.05)  # the 8 in flight complete; 32 wait in the backlog
        assert len(list(done.as_completed())) == 16
        assert waiting._pending < 40  # reaped and refilled meanwhile, though nobody waited on it
        assert waiting.result() == [4096] * 40
    finally:
        os.close(fd)
        eng.close()


# --------------------------------------------------------------- odd requests and waiting


def test_a_zero_length_request_moves_nothing_and_rewrites_no_block(engine, datafile):
    """An unaligned write of no bytes must not read and rewrite the block around it (which
    could undo another write of the batch); a read of no bytes past the end is 0, not short."""
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(3, 5000)), path=path)])
    staged = engine.describe().get("staged_write_bytes")
    assert engine.run([IoRequest.write(fd, 100, memoryview(b""), path=path)]) == [0]
    assert engine.run([IoRequest.read(fd, 6000, memoryview(bytearray(0)), path=path), IoRequest.read(fd, 8192, path=path)]) == [0, 0]
    assert engine.describe().get("staged_write_bytes") == staged
    assert _read(engine, fd, path, 0, 5000) == block(3, 5000)


@pytest.mark.parametrize("make", [bytearray, lambda n: np.zeros(n, np.uint8), lambda n: memoryview(bytearray(2 * n))[::2]],
                         ids=["bytearray", "numpy", "strided"])
def test_a_buffer_that_is_not_a_flat_contiguous_memoryview_fails_its_request_alone(engine, datafile, make):
    """Whatever the offset, size or engine: the request fails with InvalidValueError, the
    rest of the batch runs, and submit() itself does not raise (nothing of the batch would
    be left queued behind an exception)."""
    fd, path = datafile
    engine.run([IoRequest.write(fd, 0, memoryview(block(4, 8192)), path=path)])
    for offset, size in [(0, 4096), (100, 1000), (5, 5000)]:
        good = bytearray(4096)
        outcomes = engine.submit([IoRequest.read(fd, 0, memoryview(good), path=path), IoRequest.read(fd, offset, make(size), path=path)]).outcomes()
        assert outcomes[0] == 4096 and bytes(good) == block(4, 8192)[:4096]
        assert isinstance(outcomes[1], InvalidValueError) and outcomes[1].context["path"] == path
        outcomes = engine.submit([IoRequest.write(fd, offset, make(size), path=path)]).outcomes()
        assert isinstance(outcomes[0], InvalidValueError)
    assert _read(engine, fd, path, 0, 8192) == block(4, 8192)


def test_an_o_direct_file_opened_write_only_takes_unaligned_writes(engine, tmp_path):
    path = str(tmp_path / "wronly")
    fd = engine.open_file(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert engine.run([IoRequest.write(fd, 0, memoryview(block(5, 10_000)), path=path)]) == [10_000]
        assert engine.run([IoRequest.write(fd, 100, memoryview(block(6, 50)), path=path)]) == [50]
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        data = f.read()
    assert data == block(5, 10_000)[:100] + block(6, 50) + block(5, 10_000)[150:]


@pytest.fixture
def held_reads(monkeypatch):
    """psync reads that wait until the returned event is set (a slow device)."""
    release = threading.Event()
    real = os.preadv

    def held(fd, buffers, offset, *args):
        release.wait(10)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", held)
    yield release
    release.set()


def test_a_failed_request_does_not_end_the_wait_for_the_others(tmp_path, held_reads):
    """result(timeout) and outcomes(timeout) raise TimeoutError while a request is in
    flight, even when another one has failed already; awaiting returns only once all have
    ended. Until then the caller's buffers are in use."""
    from gdskv.gds.psync import PsyncEngine

    engine = PsyncEngine(direct=False, threads=2)
    path = tmp_path / "data"
    path.write_bytes(block(1, 4096))
    fd = os.open(path, os.O_RDONLY)
    out = bytearray(4096)
    try:
        future = engine.submit([IoRequest.read(fd, 0, memoryview(out), path=str(path)), IoRequest.read(-1, 0, memoryview(bytearray(10)), path="bad")])
        with pytest.raises(TimeoutError):
            future.result(timeout=0.05)
        with pytest.raises(TimeoutError):
            future.outcomes(timeout=0.05)

        async def wait():
            task = asyncio.ensure_future(awaited(future))
            await asyncio.sleep(0.05)
            assert not task.done()  # the failed request alone does not end it
            held_reads.set()
            with pytest.raises(InvalidValueError):
                await task
            assert future.done() and bytes(out) == block(1, 4096)

        asyncio.run(wait())
    finally:
        held_reads.set()
        os.close(fd)
        engine.close()


def test_cancelling_an_await_leaves_the_requests_running(tmp_path, held_reads):
    from gdskv.gds.psync import PsyncEngine

    engine = PsyncEngine(direct=False, threads=1)
    path = tmp_path / "data"
    path.write_bytes(block(2, 3 * 4096))
    fd = os.open(path, os.O_RDONLY)
    outs = [bytearray(4096) for _ in range(3)]
    try:
        future = engine.submit([IoRequest.read(fd, i * 4096, memoryview(out), path=str(path)) for i, out in enumerate(outs)])

        cancel_an_await(future, after=0.05)
        held_reads.set()
        assert future.outcomes(timeout=10) == [4096] * 3
        assert b"".join(outs) == block(2, 3 * 4096)
    finally:
        held_reads.set()
        os.close(fd)
        engine.close()


def test_a_short_fault_whose_half_read_fails_fails_its_request_alone(tmp_path):
    """FaultyEngine: the half a "short" fault really reads can fail itself (past the end of
    the file); that error is the request's outcome, and submit() does not raise."""
    from gdskv.gds.faulty import FaultyEngine
    from gdskv.gds.psync import PsyncEngine

    engine = FaultyEngine(PsyncEngine(direct=False))
    path = tmp_path / "data"
    path.write_bytes(block(3, 10_000))
    fd = os.open(path, os.O_RDONLY)
    try:
        engine.inject("short", path_contains="data", times=1)
        outcomes = engine.submit([IoRequest.read(fd, 9500, memoryview(bytearray(2000)), path=str(path)),
                                  IoRequest.read(fd, 0, memoryview(bytearray(10)), path="other")]).outcomes()
        assert isinstance(outcomes[0], IoError) and outcomes[0].context["offset"] == 9500
        assert outcomes[1] == 10
    finally:
        os.close(fd)
        engine.close()


def test_a_slow_fault_delays_its_batch_and_changes_nothing_else(tmp_path):
    """FaultyEngine: "slow" requests succeed with their bytes, ``delay`` seconds late (the
    longest delay of a batch), and only the matching ones count as injected."""
    import time

    from gdskv.gds.engine import IoOp
    from gdskv.gds.faulty import FaultyEngine
    from gdskv.gds.psync import PsyncEngine

    engine = FaultyEngine(PsyncEngine(direct=False))
    path = tmp_path / "data"
    path.write_bytes(block(4, 8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError):
            engine.inject("slow", op=IoOp.READ)  # a slow fault needs its delay
        with pytest.raises(ValueError):
            engine.inject("eio", delay=1.0)
        engine.inject("slow", op=IoOp.READ, path_contains="data", delay=0.3, times=1)
        outs = [bytearray(4096), bytearray(4096)]
        t0 = time.monotonic()
        outcomes = engine.submit([IoRequest.read(fd, 0, memoryview(outs[0]), path=str(path)),
                                  IoRequest.read(fd, 4096, memoryview(outs[1]), path="other")]).outcomes()
        assert time.monotonic() - t0 >= 0.3
        assert outcomes == [4096, 4096] and b"".join(outs) == block(4, 8192)
        assert engine.injected == 1
        t0 = time.monotonic()
        assert engine.submit([IoRequest.read(fd, 0, memoryview(outs[0]), path=str(path))]).outcomes() == [4096]
        assert time.monotonic() - t0 < 0.3  # times=1: spent
    finally:
        os.close(fd)
        engine.close()
