# Every target sets itself up on a fresh clone: it creates .venv and installs what it needs.
SHELL := bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-engines bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so that nothing below can pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c <(echo torch==2.13.0) -e '.[dev,bench,engine,uring]'
	touch $(STAMP)

## The main job: a few GB of KV blocks through the embedded store, verified byte by byte;
## then TTFT per conversation round on the reference engine (table + plot paths last).
demo: $(STAMP)
	$(BIN)/gdskv demo
	$(BIN)/gdskv bench-ttft

## The whole test suite (CPU only; GPU tests skip with a reason).
test: $(STAMP)
	$(BIN)/python -m pytest -q

## The real-engine tests (vLLM, SGLang), each engine in a venv of its own under .venv-engines.
test-engines:
	scripts/test_engines.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_store.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
