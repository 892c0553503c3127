#!/usr/bin/env bash
# The GPU check of gdskv: one script, under 6 minutes on one GPU, a table printed last.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# Stages (each under its own timeout, 345 s in all; a failure is a row in the table, never an abort):
#   setup  install the carried wheels (no network) into $GDSKV_GPU_SITE (default
#          /tmp/gdskv-site, never the system's packages): wheels/gpu (kvikio) and wheels/deps
#          (gdskv's small dependencies, only those missing); gdskv itself runs from the
#          working tree (PYTHONPATH), not installed
#   probe  gdskv's device probe, kvikio import, GDS/compat mode
#   tests  pytest -m gpu (the tests that need CUDA)
#   copy   device<->pinned host bandwidth of the HBM tier against a plain torch copy;
#          HBM hits of 2 MiB blocks (the tier, and the store's get_into/batch_get_into)
#          against device-to-device copies
#   nvme   NVMe -> GPU through kvikio and through the staging path, against fio (or a plain
#          O_DIRECT read) of the same file
# Environment: PYTHON (default python3), GDSKV_GPU_DIR (where the test file goes; default
# bench-out/gpu, put it on the NVMe), GDSKV_GPU_GIB (file size, default 4), OUT (full
# output and the table are written there when set).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGDIR=${OUT:-bench-out/gpu-check}
mkdir -p "$LOGDIR"
ROWS="$LOGDIR/rows.txt"
: > "$ROWS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# A carried fio (tools/fio/fio, a static build; not committed) where the machine has none.
[ -x tools/fio/fio ] && ! command -v fio > /dev/null && export PATH="$PWD/tools/fio:$PATH"

STAGES=" ${GDSKV_GPU_STAGES:-setup probe tests copy nvme} "

stage() {  # stage NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    case "$STAGES" in *" $name "*) ;; *) return 0 ;; esac
    local log="$LOGDIR/$name.log" t0=$SECONDS rc
    echo "== $name (limit ${limit}s)"
    timeout -k 5 "$limit" bash -c "$*" > "$log" 2>&1
    rc=$?
    cat "$log"
    grep '^ROW|' "$log" >> "$ROWS" || true
    local status=ok
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMEOUT after ${limit}s"
    [ "$rc" -ne 0 ] && [ "$status" = ok ] && status="FAILED rc=$rc"
    echo "ROW|stage $name|$status|-|-|$((SECONDS - t0))s, log $log" >> "$ROWS"
}

SITE=${GDSKV_GPU_SITE:-/tmp/gdskv-site}
export PYTHONPATH="$SITE:$PYTHONPATH"

pipt() {  # install wheels into $SITE (never into the system's site-packages)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

setup() {
    $PY -m pip --version || return 1
    mkdir -p "$SITE"
    if ls wheels/gpu/*.whl > /dev/null 2>&1; then
        pipt wheels/gpu/*.whl || echo "kvikio wheels did not install"
    else
        echo "no wheels/gpu directory: kvikio stages will report it missing"
    fi
    for mod in crc32c liburing; do  # the wheels scripts/prepare_gpu_check.sh fetches
        if ! $PY -c "import $mod" 2> /dev/null; then
            echo "installing $mod from wheels/deps"
            pipt wheels/deps/${mod}-*.whl || echo "could not install $mod"
        fi
    done
    for mod in numpy xxhash pytest; do  # expected on the machine already
        $PY -c "import $mod" 2> /dev/null || echo "missing: $mod (not carried in wheels/deps)"
    done
    $PY -c "import gdskv; print('gdskv from', gdskv.__file__)"
    $PY -m pip list 2> /dev/null | grep -i -E "^(torch|cupy|kvikio|libkvikio|nvidia-cufile|cuda-pathfinder|numpy) " || true
}

probe() {
    $PY - << 'PYEOF'
import sys
from gdskv.gds.device import probe
info = probe()
print("device:", info)
print(f"ROW|CUDA device|{'yes' if info.available else 'no'}|-|-|{info.reason}")
try:
    import kvikio
    from gdskv.gds.kvikio_engine import gds_mode
    mode, why = gds_mode(kvikio)
    print(f"ROW|kvikio {kvikio.__version__}|{mode}|-|-|{why}")
except Exception as exc:
    print(f"ROW|kvikio|unavailable|-|-|{type(exc).__name__}: {str(exc)[:100]}")
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PYEOF
}

tests() {  # only the modules that hold gpu tests: the others need packages this machine may lack
    $PY -m pytest -q -m gpu -p no:cacheprovider -rs $(grep -rl "mark.gpu" tests --include='test_*.py')
}

export -f pipt setup probe tests
export PY LOGDIR SITE
nvidia-smi > "$LOGDIR/nvidia-smi.txt" 2>&1 || true
stage setup 60 setup
# libcufile from an nvidia-cufile wheel, where the system has none of its own.
CUFILE_DIR=$($PY -c "
import glob, nvidia
for p in nvidia.__path__:
    for d in glob.glob(p + '/cu*/lib') + glob.glob(p + '/cufile/lib'):
        if glob.glob(d + '/libcufile.so*'):
            print(d); raise SystemExit
" 2> /dev/null)
[ -n "$CUFILE_DIR" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$CUFILE_DIR" && echo "libcufile from $CUFILE_DIR"
stage probe 30 probe
stage tests 90 tests
[ -f "$LOGDIR/tests.log" ] && tail -1 "$LOGDIR/tests.log" | tr '|' '/' | sed 's/^/ROW|gpu tests|/; s/$/|-|-|pytest -m gpu/' >> "$ROWS"
stage copy 45 $PY benchmarks/bench_gpu.py copy
stage nvme 120 $PY benchmarks/bench_gpu.py nvme

{
    echo
    echo "gdskv GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)"
    echo "| what | measured (GB/s) | baseline (GB/s) | ratio | note |"
    echo "| --- | --- | --- | --- | --- |"
    sed 's/^ROW|//; s/|/ | /g; s/^/| /; s/$/ |/' "$ROWS"
} | tee "$LOGDIR/table.md"
