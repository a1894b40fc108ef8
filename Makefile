PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test lint typecheck bench clean soak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'

serve: install
	$(BIN)/pleach-server

test: install
	$(BIN)/ruff check shared pleach_client pleach_server tests bench
	$(BIN)/mypy
	PYTHONASYNCIODEBUG=1 $(BIN)/python -m pytest -q -p no:cacheprovider

bench: install
	$(BIN)/python -m bench

soak: install
	$(BIN)/python -m tests.sim --soak $(or $(SOAK_SCHEDULES),10000) --backend $(or $(SOAK_BACKEND),sqlite)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
