# Two commands a newcomer needs:  `make demo`  and  `make test`.
# Everything installs into .venv; torch==2.13.0 resolves to the local CPU build here.
PY    ?= python3
VENV  ?= .venv
BIN   := $(VENV)/bin
TORCH ?= torch==2.13.0
EXTRAS ?= daemon,operator,dev

.PHONY: setup demo test lint unit e2e clean

$(BIN)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

setup: $(BIN)/.installed

## The main job on an embedded default: build a tiny random Llama, generate offline.
demo: setup
	$(BIN)/pagoda generate --tiny llama --prompt "The capital of France is" --prompt "Paged attention means" --max-tokens 24

## Lint plus every test CI runs.
test: setup lint unit

lint: setup
	$(BIN)/ruff check .

unit: setup
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
