"""Running the fio-paired benchmarks of ``benchmarks/`` as a user would, for smoke tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_fio_benchmark(script: str, tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<script>`` in ``tmp_path``, without installing fio and with fio's
    default buffers (nothing reserved); the finished process, its output captured."""
    cmd = [sys.executable, str(BENCHMARKS / script), "--dir", str(tmp_path), "--no-fio-install", "--fio-mem", "malloc", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
