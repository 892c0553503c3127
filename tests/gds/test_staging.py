"""The staging pipeline (NVMe -> host slots -> "device"), with CPU tensors as the device."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gdskv.errors import ConfigError, IoError
from gdskv.gds.psync import PsyncEngine
from gdskv.gds.staging import (
    CopyDone,
    DeviceCopier,
    StagedRead,
    StagingReader,
    TorchCopier,
)
from tests.conftest import block

SLOT = 16 << 10


class TracingEngine:
    """Wraps an engine and logs each submitted read."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def submit(self, requests):
        self.log.append(("read", requests[0].offset))
        return self.inner.submit(requests)


class TracingCopier(DeviceCopier):
    """Copies into numpy and logs when each copy starts and when it is waited for."""

    def __init__(self, log):
        self.log = log

    def start(self, src, dst, dst_offset):
        self.log.append(("copy", dst_offset))
        dst[dst_offset : dst_offset + src.nbytes] = np.frombuffer(src, dtype=np.uint8)
        return CopyDone(lambda: self.log.append(("copied", dst_offset)))


@pytest.fixture
def datafile(tmp_path):
    data = block(3, 10 * SLOT + 1234)
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data, str(path)
    os.close(fd)


@pytest.mark.parametrize("direct", [False, True])
def test_reads_land_in_cpu_tensors(datafile, tmp_path, direct):
    torch = pytest.importorskip("torch")
    _, data, path = datafile
    with PsyncEngine(threads=2, direct=direct) as engine:
        fd = engine.open_file(path, os.O_RDONLY)
        reader = StagingReader(engine, TorchCopier(), slot_bytes=SLOT, slots=3)
        out = torch.zeros(len(data), dtype=torch.uint8)
        half = torch.zeros(5000, dtype=torch.int32)  # 20000 bytes, typed destination
        sizes = reader.read_into([StagedRead(fd, 0, len(data), out, path=path),
                                  StagedRead(fd, 4096, 20000, half, path=path)])
        assert sizes == [len(data), 20000]
        assert bytes(out.numpy()) == data
        assert bytes(half.numpy().view(np.uint8)) == data[4096:24096]
        assert reader.blocks == 11 + 2
        reader.close()
        os.close(fd)


def test_next_read_is_in_flight_while_a_block_is_copied(datafile):
    fd, data, path = datafile
    log = []
    with PsyncEngine(threads=2) as inner:
        reader = StagingReader(TracingEngine(inner, log), TracingCopier(log), slot_bytes=SLOT, slots=2)
        out = np.zeros(4 * SLOT, dtype=np.uint8)
        reader.read_into([StagedRead(fd, 0, 4 * SLOT, out, path=path)])
        reader.close()
    assert bytes(out) == data[: 4 * SLOT]
    for i in range(3):
        # block i+1's read was submitted before block i's copy started ...
        assert log.index(("read", (i + 1) * SLOT)) < log.index(("copy", i * SLOT))
    for i in range(2):
        # ... and a slot is read into again only after its previous copy finished.
        assert log.index(("copied", i * SLOT)) < log.index(("read", (i + 2) * SLOT))


def test_short_read_names_the_file(datafile):
    fd, data, path = datafile
    with PsyncEngine(threads=2) as engine:
        reader = StagingReader(engine, TracingCopier([]), slot_bytes=SLOT)
        with pytest.raises(IoError) as info:
            reader.read_into([StagedRead(fd, len(data) - 100, 4096, np.zeros(4096, dtype=np.uint8), path=path)])
        assert info.value.context["path"] == path
        reader.close()


def test_bad_configuration():
    with PsyncEngine(threads=1) as engine:
        with pytest.raises(ConfigError):
            StagingReader(engine, TracingCopier([]), slots=1)
        with pytest.raises(ConfigError):
            StagingReader(engine, TracingCopier([]), slot_bytes=1000)


@pytest.mark.gpu
def test_staging_into_cuda_tensor(datafile):
    torch = pytest.importorskip("torch")
    fd, data, path = datafile
    with PsyncEngine(threads=2) as engine:
        reader = StagingReader(engine, TorchCopier(), slot_bytes=SLOT)
        out = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
        reader.read_into([StagedRead(fd, 0, len(data), out, path=path)])
        assert bytes(out.cpu().numpy()) == data
        reader.close()
