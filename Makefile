# Every target sets itself up on a fresh clone: it creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench,uring]'
	touch $(STAMP)

## The main job: the embedded store on a few GB of KV-sized blocks.
demo: $(STAMP)
	$(BIN)/gdskv demo

## The whole test suite (CPU only; GPU tests skip with a reason).
test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_store.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
