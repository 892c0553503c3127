"""GPU detection without heavy imports: the probe's answers and reasons."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from gdskv.errors import ConfigError
from gdskv.gds import device


class FakeDriver:
    """Stands in for libcuda.so.1: chosen CUresult codes and device count."""

    def __init__(self, init=0, count=2, count_status=0):
        self.init, self.count, self.count_status = init, count, count_status

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, ref):
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.count_status

    def cuDriverGetVersion(self, ref):
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = 13000
        return 0


def test_cpu_mode_never_loads_the_driver():
    def loader(name):
        raise AssertionError("driver loaded under GDSKV_DEVICE=cpu")

    info = device.probe({"GDSKV_DEVICE": "cpu"}, loader=loader)
    assert not info.available and "GDSKV_DEVICE=cpu" in info.reason


def test_missing_driver_is_no_device_with_the_reason():
    def loader(name):
        raise OSError(f"{name}: cannot open shared object file")

    info = device.probe({}, loader=loader)
    assert (info.available, info.count) == (False, 0)
    assert "libcuda.so.1" in info.reason


@pytest.mark.parametrize(
    "driver, expect",
    [
        (FakeDriver(init=100), "cuInit failed with CUresult 100"),
        (FakeDriver(count_status=3), "cuDeviceGetCount failed"),
        (FakeDriver(count=0), "no devices"),
    ],
)
def test_driver_failures_are_reasons(driver, expect):
    info = device.probe({}, loader=lambda name: driver)
    assert not info.available and expect in info.reason


def test_working_driver_reports_devices():
    info = device.probe({"GDSKV_DEVICE": "cuda"}, loader=lambda name: FakeDriver(count=8))
    assert info.available and info.count == 8 and info.driver_version == 13000
    assert device.require_device("x", info) is info


def test_require_device_names_what_needs_it():
    info = device.probe({"GDSKV_DEVICE": "cpu"})
    with pytest.raises(ConfigError) as exc:
        device.require_device("the kvikio engine", info)
    assert "kvikio engine" in str(exc.value) and "GDSKV_DEVICE=cpu" in exc.value.context["reason"]


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ConfigError) as exc:
        device.probe({"GDSKV_DEVICE": "tpu"})
    assert exc.value.context["valid"] == "auto, cpu, cuda"


def test_probe_and_gpu_modules_import_nothing_heavy():
    code = (
        "import sys, gdskv, gdskv.gds.device as d, gdskv.tiers.hbm, gdskv.gds.staging, gdskv.gds.kvikio_engine;"
        "d.probe();"
        "heavy = [m for m in ('torch', 'cupy', 'kvikio') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
