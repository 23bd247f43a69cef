# Two commands do everything on a fresh machine with python3, make and git:
#   make demo   run the demo (gateway + simulated fleet, in-memory index; no Redis needed)
#   make test   install what the tests need (incl. redis-server) and run the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint install install-dev redis-server bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/cachelane demo

redis-server:
	@command -v redis-server >/dev/null || { \
		echo "installing redis-server (the tests start their own throwaway servers)"; \
		(apt-get install -y redis-server || (apt-get update && apt-get install -y redis-server)) \
			>/dev/null; }

test: install-dev redis-server
	$(PY) -m pytest -q

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy routing gateway loadtest

clean:
	rm -rf $(VENV) results .pytest_cache .mypy_cache .ruff_cache *.egg-info
