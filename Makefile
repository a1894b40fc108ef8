PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test lint typecheck bench clean soak bench-peers wheel

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'

# The server alone: the package without the test tools.
serve: $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	$(BIN)/pleach-server

test: install
	$(BIN)/ruff check shared pleach_client pleach_server tests bench
	$(BIN)/ruff format --check shared pleach_client pleach_server tests bench
	$(BIN)/mypy
	PYTHONASYNCIODEBUG=1 $(BIN)/python -m pytest -q -p no:cacheprovider

bench: install
	$(BIN)/python -m bench --json

# pleach beside its peers (LangGraph, OpenAI Agents SDK, pycrdt-websocket), which are installed
# into .venv-peers, never into .venv. QUICK=1 for fewer turns and rounds.
bench-peers: install
	$(BIN)/python -m bench.peers --install $(if $(QUICK),--quick) --json

soak: install
	$(BIN)/python -m tests.sim --soak $(or $(SOAK_SCHEDULES),10000) --backend $(or $(SOAK_BACKEND),sqlite)
	$(BIN)/python -m tests.sim --soak $(or $(SOAK_RACES),2000) --start 1000000 --mix races --backend $(or $(SOAK_BACKEND),sqlite)
	$(BIN)/python -m tests.fuzz --frames $(or $(FUZZ_FRAMES),100000) --seed $(or $(FUZZ_SEED),0)
	$(BIN)/python -m tests.campaign all --rounds $(or $(CAMPAIGN_ROUNDS),200) --seed $(or $(CAMPAIGN_SEED),0)

# The wheel (and nothing else) into dist/: pleach-VERSION-py3-none-any.whl. A fresh ./build
# each time, so a module removed from the tree cannot linger in the wheel.
wheel: $(BIN)/python
	$(BIN)/python -m pip install -q 'build>=1'
	rm -rf build
	$(BIN)/python -m build --wheel --outdir dist .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
