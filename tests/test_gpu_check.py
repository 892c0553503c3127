"""benchmarks/gpu_check.sh on a machine without a GPU: every stage ends, failures are rows of
the table, the table comes last and is written under $OUT. (Speeds are not checked.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_reports_failures_as_rows(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKV_")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path / "out"), GDSKV_GPU_STAGES="probe copy nvme",
               GDSKV_GPU_GIB="0.0625", GDSKV_GPU_DIR=str(tmp_path / "data"), GDSKV_DEVICE="cpu")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "out" / "table.md").read_text()
    assert done.stdout.rstrip().endswith(table.rstrip())  # the table is printed last
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "GDSKV_DEVICE=cpu" in rows["CUDA device"]
    assert "| ok |" in rows["stage probe"]
    assert "FAILED" in rows["stage copy"]  # no CUDA: torch cannot pin or allocate
    assert "ConfigError" in rows["NVMe->GPU kvikio"] and "FAILED" in rows["NVMe->GPU kvikio"]
    assert "FAILED" in rows["NVMe->GPU staging"]
    assert "stage setup" not in rows and "stage tests" not in rows
    for name in ("probe", "copy", "nvme"):
        assert (tmp_path / "out" / f"{name}.log").exists()
