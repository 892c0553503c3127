"""Is there a CUDA device here? Answered without importing torch, cupy or kvikio.

:func:`probe` loads the driver library (``libcuda.so.1``) with :mod:`ctypes`, calls
``cuInit(0)`` and ``cuDeviceGetCount``, and returns a :class:`DeviceInfo` with a one-line
reason either way. Nothing heavy is imported, so the answer is cheap and ``import gdskv``
stays light; the GPU paths (:mod:`gdskv.tiers.hbm`, :mod:`gdskv.gds.kvikio_engine`) ask
here first and import their packages only when a device exists.

``GDSKV_DEVICE`` steers it:

- unset or ``auto``: probe;
- ``cpu``: report no device without touching the driver (the CPU path, everywhere);
- ``cuda``: probe, and :func:`require_device` fails loudly when none is found (a
  deployment that must not silently run on the CPU).

Any other value is a :class:`ConfigError` naming the valid ones.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

from gdskv.errors import ConfigError

#: Values ``GDSKV_DEVICE`` accepts.
DEVICE_MODES = ("auto", "cpu", "cuda")
#: The CUDA driver library probed.
LIBCUDA = "libcuda.so.1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """The probe's answer: whether a device is usable, how many, and why (or why not)."""

    available: bool
    count: int
    reason: str
    mode: str = "auto"
    driver_version: Optional[int] = None


def device_mode(env: Optional[Mapping[str, str]] = None) -> str:
    """The ``GDSKV_DEVICE`` setting ("auto" when unset); ConfigError for anything else."""
    env = os.environ if env is None else env
    mode = env.get("GDSKV_DEVICE", "").strip().lower() or "auto"
    if mode not in DEVICE_MODES:
        raise ConfigError("unknown device mode", field="GDSKV_DEVICE", got=mode, valid=", ".join(DEVICE_MODES))
    return mode


def probe(
    env: Optional[Mapping[str, str]] = None, *, loader: Optional[Callable[[str], Any]] = None
) -> DeviceInfo:
    """Probe for CUDA devices (see the module docstring). ``loader`` replaces
    ``ctypes.CDLL`` (tests pass a stand-in driver). Never raises for a missing or broken
    driver: that is an unavailable device with its reason."""
    mode = device_mode(env)
    if mode == "cpu":
        return DeviceInfo(available=False, count=0, reason="GDSKV_DEVICE=cpu forces the CPU path", mode=mode)
    load = loader or ctypes.CDLL
    try:
        lib = load(LIBCUDA)
    except OSError as exc:
        return DeviceInfo(available=False, count=0, reason=f"no CUDA driver: cannot load {LIBCUDA} ({exc})", mode=mode)
    try:
        status = lib.cuInit(0)
        if status != 0:
            return DeviceInfo(available=False, count=0, reason=f"cuInit failed with CUresult {status}", mode=mode)
        count = ctypes.c_int(0)
        status = lib.cuDeviceGetCount(ctypes.byref(count))
        if status != 0:
            return DeviceInfo(available=False, count=0, reason=f"cuDeviceGetCount failed with CUresult {status}", mode=mode)
        version = ctypes.c_int(0)
        driver = version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except AttributeError as exc:
        return DeviceInfo(available=False, count=0, reason=f"{LIBCUDA} lacks a driver entry point ({exc})", mode=mode)
    if count.value <= 0:
        return DeviceInfo(available=False, count=0, reason="the CUDA driver reports no devices", mode=mode, driver_version=driver)
    return DeviceInfo(
        available=True, count=count.value, mode=mode, driver_version=driver,
        reason=f"{count.value} CUDA device(s), driver {driver}",
    )


_CACHED: Optional[DeviceInfo] = None


def detect() -> DeviceInfo:
    """:func:`probe` of this process's environment, cached after the first call
    (``GDSKV_DEVICE=cpu`` is honoured on every call, so it can be set late)."""
    global _CACHED
    if device_mode() == "cpu":
        return probe()
    if _CACHED is None:
        _CACHED = probe()
    return _CACHED


def require_device(what: str, info: Optional[DeviceInfo] = None) -> DeviceInfo:
    """Return the device info when a CUDA device is usable; else raise ConfigError saying
    that ``what`` needs one, and why none is available."""
    info = detect() if info is None else info
    if not info.available:
        raise ConfigError(f"{what} needs a CUDA device", reason=info.reason)
    return info
