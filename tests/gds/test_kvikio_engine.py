"""The kvikio engine: refused without a device; its request handling against a stand-in
kvikio module on the CPU; real cuFile reads into device memory on a GPU."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from gdskv.errors import ConfigError, IoError
from gdskv.gds.device import DeviceInfo, detect
from gdskv.gds.engine import IoRequest
from gdskv.gds.kvikio_engine import KvikioEngine
from gdskv.io_config import KvikioConfig
from tests.conftest import block

GPU = DeviceInfo(available=True, count=1, reason="stand-in")


class _Done:
    def __init__(self, n):
        self.n = n

    def get(self):
        if isinstance(self.n, Exception):
            raise self.n
        return self.n


class FakeCuFile:
    """Host-only CuFile: pread/pwrite through os.pread/os.pwrite, returning futures."""

    opened: list = []

    def __init__(self, path, flags="r"):
        self.path, self.flags = path, flags
        self.fd = os.open(path, os.O_RDONLY if flags == "r" else os.O_RDWR)
        self.closed = False
        FakeCuFile.opened.append(self)

    def pread(self, buf, size, file_offset, task_size):
        data = os.pread(self.fd, size, file_offset)
        np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return _Done(len(data))

    def pwrite(self, buf, size, file_offset, task_size):
        if self.flags == "r":
            return _Done(RuntimeError("file not open for writing"))
        return _Done(os.pwrite(self.fd, memoryview(buf).cast("B")[:size], file_offset))

    def close(self):
        self.closed = True
        os.close(self.fd)


def fake_kvikio(compat: bool):
    defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat, get=lambda name: "AUTO")
    return types.SimpleNamespace(CuFile=FakeCuFile, defaults=defaults, memory_register=lambda b: None,
                                 memory_deregister=lambda b: None)


@pytest.fixture
def engine():
    FakeCuFile.opened = []
    eng = KvikioEngine(device=GPU, kvikio_module=fake_kvikio(compat=True))
    yield eng
    eng.close()


def test_threads_size_kvikios_pool_and_bad_counts_are_refused():
    kv = fake_kvikio(compat=True)
    settings = {}
    kv.defaults.set = lambda name, value: settings.__setitem__(name, value)
    KvikioEngine(device=GPU, kvikio_module=kv, threads=16).close()
    assert settings == {"num_threads": 16}
    with pytest.raises(ConfigError):
        KvikioEngine(device=GPU, kvikio_module=kv, threads=0)


def test_needs_a_device_and_says_why(monkeypatch):
    monkeypatch.setenv("GDSKV_DEVICE", "cpu")
    with pytest.raises(ConfigError) as info:
        KvikioConfig(direct=False).build()
    assert "kvikio engine needs a CUDA device" in str(info.value)
    assert "GDSKV_DEVICE=cpu" in info.value.context["reason"]


@pytest.mark.skipif(detect().available, reason="checks the CPU-only refusal")
def test_refused_on_this_cpu_machine():
    with pytest.raises(ConfigError) as info:
        KvikioConfig(direct=False).build()
    assert info.value.context["reason"]


def test_batch_of_reads_and_writes(engine, tmp_path):
    path = tmp_path / "f"
    fd = engine.open_file(path, os.O_RDWR | os.O_CREAT)
    a, b = block(1, 8192), block(2, 4096)
    engine.run([IoRequest.write(fd, 0, memoryview(a), path=str(path)),
                IoRequest.write(fd, 8192, memoryview(b[:1000]), memoryview(b[1000:]), path=str(path))])
    out1, out2 = bytearray(8192), bytearray(4096)
    view2 = memoryview(out2)
    counts = engine.run([IoRequest.read(fd, 0, memoryview(out1), path=str(path)),
                         IoRequest.read(fd, 8192, view2[:100], view2[100:], path=str(path))])
    assert counts == [8192, 4096] and bytes(out1) == a and bytes(out2) == b
    assert len(FakeCuFile.opened) == 1 and FakeCuFile.opened[0].flags == "r+"
    d = engine.describe()
    assert (d["name"], d["mode"], d["open_cufiles"]) == ("kvikio", "compat", 1)
    os.close(fd)


def test_short_read_is_an_io_error(engine, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = engine.open_file(path, os.O_RDONLY)
    with pytest.raises(IoError) as info:
        engine.run([IoRequest.read(fd, 0, memoryview(bytearray(4096)), path=str(path))])
    assert (info.value.context["expected"], info.value.context["got"]) == (4096, 100)
    os.close(fd)


def test_failed_write_is_an_io_error_with_the_path(engine, tmp_path):
    path = tmp_path / "ro"
    path.write_bytes(b"\0" * 4096)
    fd = engine.open_file(path, os.O_RDONLY)
    with pytest.raises(IoError) as info:
        engine.run([IoRequest.write(fd, 0, memoryview(b"y" * 4096), path=str(path))])
    assert info.value.context["path"] == str(path)
    os.close(fd)


def read_and_close(engine, path) -> int:
    """Read 4 KiB of ``path`` through the engine on a descriptor opened for it, close that
    descriptor, and return its number (the kernel hands the lowest free one out next)."""
    fd = engine.open_file(path, os.O_RDONLY)
    engine.run([IoRequest.read(fd, 0, memoryview(bytearray(4096)), path=str(path))])
    os.close(fd)
    return fd


def test_a_reused_descriptor_number_reaches_the_new_file(engine, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_bytes(block(1, 4096))
    second.write_bytes(block(2, 4096))
    fd = read_and_close(engine, first)
    out = bytearray(4096)
    fd2 = engine.open_file(second, os.O_RDONLY)
    assert fd2 == fd  # the kernel reuses the lowest free number
    engine.run([IoRequest.read(fd2, 0, memoryview(out), path=str(second))])
    assert bytes(out) == block(2, 4096)
    assert FakeCuFile.opened[0].closed and engine.describe()["open_cufiles"] == 1
    os.close(fd2)


def test_the_same_file_opened_for_writing_gets_a_writable_handle(engine, tmp_path):
    """A backend may read a file, close it, and open the same file (same inode, often the
    same descriptor number) for writing: the engine's cached read-only handle must not
    serve that write."""
    path = tmp_path / "f"
    path.write_bytes(block(1, 4096))
    fd = read_and_close(engine, path)
    fd2 = engine.open_file(path, os.O_RDWR)
    assert fd2 == fd
    engine.run([IoRequest.write(fd2, 0, memoryview(block(2, 4096)), path=str(path))])
    os.close(fd2)
    assert path.read_bytes() == block(2, 4096)


def test_a_handle_opens_the_descriptors_file_not_the_path(engine, tmp_path):
    """The path may name another file by the time the engine opens its handle (an
    overwrite renamed over it): the bytes come from the file the descriptor holds."""
    path = tmp_path / "f"
    path.write_bytes(block(1, 4096))
    fd = engine.open_file(path, os.O_RDONLY)
    replacement = tmp_path / "f.tmp"
    replacement.write_bytes(block(2, 4096))
    os.replace(replacement, path)
    out = bytearray(4096)
    engine.run([IoRequest.read(fd, 0, memoryview(out), path=str(path))])
    os.close(fd)
    assert bytes(out) == block(1, 4096)


def test_gds_mode_is_reported():
    eng = KvikioEngine(device=GPU, kvikio_module=fake_kvikio(compat=False))
    assert eng.describe()["mode"] == "gds"
    eng.close()


@pytest.mark.gpu
def test_real_kvikio_reads_into_device_memory(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("kvikio")
    path = tmp_path / "data"
    data = block(7, 1 << 20)
    path.write_bytes(data)
    with KvikioConfig(direct=False).build() as eng:
        fd = eng.open_file(path, os.O_RDONLY)
        out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        eng.register(out)
        assert eng.run([IoRequest.read(fd, 0, out, path=str(path))]) == [1 << 20]
        assert bytes(out.cpu().numpy()) == data
        print("kvikio mode:", eng.describe()["mode"], eng.describe()["mode_reason"])
        os.close(fd)
