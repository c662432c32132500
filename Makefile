# warren: the common paths. The README's two commands are `make demo` and `make test`.
#
# Every target runs in a virtual environment: the active one when there is one ($VIRTUAL_ENV),
# else .venv in this clone, made on first use. Nothing is installed into the system's python3.
# A target installs what it needs, once: the runtime dependencies (`pip install -e .`) for the
# demo and the local cluster, the `test` extras for the tests, the `analysis` extras (PySpark,
# matplotlib) for the Spark job and the whole suite (which has a few Spark tests). A stamp file
# per set in the environment marks it done; it is redone when pyproject.toml changes, or when
# the environment's editable install was last pointed at another clone.

ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := .venv
endif
BOOTSTRAP_PYTHON ?= python3
PYTHON := $(VENV)/bin/python
PIP ?= $(PYTHON) -m pip
# the environment's commands (warren-server, warrenctl, warren-bench) first on PATH
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Python's compiled modules in one folder of the clone, not beside the sources, and written even
# where PYTHONDONTWRITEBYTECODE is set (some CI machines set it): every node, warrenctl and
# test worker process would otherwise compile warren (and pytest rewrite every test module)
# from source at each start, some 0.35 s of CPU per node start; the suite starts hundreds.
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/.cache/pycache
export PYTHONDONTWRITEBYTECODE :=

RUNTIME := $(VENV)/.warren-installed
TEST_EXTRAS := $(VENV)/.warren-installed-test
ANALYSIS_EXTRAS := $(VENV)/.warren-installed-analysis
CLONE_MARK := $(VENV)/.warren-clone

$(PYTHON):
	$(BOOTSTRAP_PYTHON) -m venv $(VENV)

$(RUNTIME): pyproject.toml | $(PYTHON)
	$(PIP) install -q -e .
	echo "$(CURDIR)" > $(CLONE_MARK)
	touch $@

$(VENV)/.warren-installed-%: pyproject.toml | $(PYTHON)
	$(PIP) install -q -e ".[$*]"
	echo "$(CURDIR)" > $(CLONE_MARK)
	touch $@ $(RUNTIME)

# an environment shared by several clones: install again when another clone was the last to
ifneq ($(file <$(CLONE_MARK)),$(CURDIR))
$(RUNTIME) $(TEST_EXTRAS) $(ANALYSIS_EXTRAS): FORCE
endif
.PHONY: FORCE
# one pip at a time in one environment
.NOTPARALLEL:
FORCE:

.PHONY: install demo test check cluster start stop clean bench mutants dst

# the runtime dependencies and every extra, at once (the targets below install what they need)
install: $(RUNTIME) $(TEST_EXTRAS) $(ANALYSIS_EXTRAS)

# start a local 3-node cluster, publish and consume through the client, kill -9 the leader of a
# mirrored queue under load and show what happened to every message, stop the cluster
demo: $(RUNTIME)
	$(PYTHON) -m broker.localcluster demo

# The whole suite. The docker cluster test (tests/test_docker_cluster.py) may install docker.io,
# docker-compose and debootstrap with apt and start dockerd as root; it stops the dockerd it
# started when it ends. The files run on TEST_WORKERS parallel workers (pytest-xdist), each file
# whole on one worker, in its order (the README's blocks build on each other; a module's cluster
# is started once). The workers take the longest files first (tests/conftest.py), not the files
# with the most tests. Most process tests wait on nodes more than they compute: on 2 cores,
# 4 workers keep both busy.
TEST_WORKERS ?= 4
test: $(TEST_EXTRAS) $(ANALYSIS_EXTRAS)
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The loop to run while working: the unit, property and simulation tests, without the ones that
# start processes, need a Docker engine or run Spark (markers process, docker, spark), on
# CHECK_WORKERS workers that share the tests out one by one.
CHECK_WORKERS ?= 2
check: $(TEST_EXTRAS)
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(CHECK_WORKERS) --dist worksteal \
		-m "not process and not docker and not spark"

# the conformance suite (tests/conformance) against warren, then against RabbitMQ 3.10 when
# Debian's rabbitmq-server is installed (it starts its own node on free ports in a temporary dir)
.PHONY: conformance
conformance: $(TEST_EXTRAS)
	WARREN_CONFORMANCE_BROKER=warren $(PYTHON) -m pytest -q -p no:cacheprovider tests/conformance
	if sh bench/rabbitmq/cluster.sh check; then WARREN_CONFORMANCE_BROKER=rabbitmq $(PYTHON) -m pytest -q -p no:cacheprovider tests/conformance; \
	else echo "rabbitmq-server is not installed: tests/conformance ran against warren only"; fi

# the fault explorer on the deterministic simulation: SEEDS seeded chaos schedules (a failure
# prints the one command that replays it)
SEEDS ?= 1000
dst: $(RUNTIME)
	warren-bench dst --seeds $(SEEDS) --procs 2

# inject one broken promise at a time into a copy of the tree: every one must be caught by its tests
mutants: $(TEST_EXTRAS)
	$(PYTHON) tests/mutants.py

# a local CA and node and client certificates in var/certs (python -m broker.tls certs), for
# `python -m broker.localcluster start --tls` and docker-compose.tls.yml; CERTS_ARGS passes options
# (e.g. CERTS_ARGS="--nodes 5 --hosts broker.example.com")
.PHONY: certs
certs: $(RUNTIME)
	$(PYTHON) -m broker.tls certs var/certs $(CERTS_ARGS)

# a 3-node cluster as background processes on 127.0.0.1 (state in var/warren, or $WARREN_HOME):
# starts the nodes that are not running
cluster: $(RUNTIME)
	$(PYTHON) -m broker.localcluster start

# one node of that cluster again (e.g. after a kill -9), with its ports and settings: make start NODE=n1
start: $(RUNTIME)
	@test -n "$(NODE)" || { echo "make start: say which node, e.g. make start NODE=n1" >&2; exit 2; }
	$(PYTHON) -m broker.localcluster start $(NODE)

# stops every node of var/warren (or $WARREN_HOME): those `make cluster` started and any started
# there by hand (a node registers itself under $WARREN_HOME/run)
stop: $(RUNTIME)
	$(PYTHON) -m broker.localcluster stop

# wipes the local cluster's state (its queues, policies and membership); stops nothing, and
# refuses while any of its nodes runs
clean: $(RUNTIME)
	$(PYTHON) -m broker.localcluster reset

# `make bench` runs the smoke suite on warren and (when rabbitmq-server is installed) RabbitMQ,
# then the Spark analysis over ./results; e.g. `make bench BENCH_SUITE="throughput latency failover"`
BENCH_SUITE ?= smoke
BENCH_TARGET ?= both
bench: $(ANALYSIS_EXTRAS)
	warren-bench throughput --seconds 10
	warren-bench run $(BENCH_SUITE) --target $(BENCH_TARGET) --out results
	$(PYTHON) -m bench.analysis

# random inputs over every port of one node (bench/fuzz.py), logged in and not, beside a
# well-behaved client: FUZZ_INPUTS of them; the verdict (crashes, hangs, fds, RSS) in results/fuzz.json
FUZZ_INPUTS ?= 100000
.PHONY: fuzz
fuzz: $(TEST_EXTRAS)
	warren-bench fuzz --inputs $(FUZZ_INPUTS) --out results/fuzz.json

# the chaos campaign (bench/chaos): CHAOS_SCHEDULES seeded fault schedules from CHAOS_SEED,
# each judged by the total-queue checker; `make chaos-smoke` runs one short schedule per kind
CHAOS_SCHEDULES ?= 200
CHAOS_SEED ?= 20000
.PHONY: chaos chaos-smoke
chaos: $(RUNTIME)
	warren-bench chaos --schedules $(CHAOS_SCHEDULES) --seed $(CHAOS_SEED) --out results

chaos-smoke: $(RUNTIME)
	warren-bench chaos --smoke --out results


# --- Docker cluster: docker/, docker-compose.yml ------------------------------
# docker-engine       installs docker.io, docker-compose and debootstrap if missing
#                     and starts dockerd as root in the background (pid in
#                     /run/warren-dockerd.pid, log in /tmp/warren-dockerd.log)
# docker-engine-stop  stops the dockerd that docker-engine started
# docker-image        builds warren-base:bookworm (once) and warren:latest
# docker-up           docker-image, then a three-node cluster n1..n3, and waits
#                     (60 s at most) until n1 sees all three running
# docker-down         stops and removes that cluster
DOCKER_COMPOSE ?= docker-compose

.PHONY: docker-engine docker-engine-stop docker-image docker-up docker-down

docker-engine:
	sh docker/engine.sh

docker-engine-stop:
	sh docker/engine.sh stop

docker-image:
	bash docker/build-image.sh

docker-up: docker-image
	$(DOCKER_COMPOSE) up -d
	$(DOCKER_COMPOSE) exec -T n1 warrenctl -n 127.0.0.1:25672 -t 60 await_online_nodes 3

docker-down:
	$(DOCKER_COMPOSE) down --remove-orphans

# maintenance one node at a time (warrenctl rolling_restart) on `make cluster`'s nodes, or on the
# compose cluster's; ROLLING_ARGS passes options (e.g. ROLLING_ARGS="--pause 5 --force")
.PHONY: rolling-restart docker-rolling-restart
rolling-restart: $(RUNTIME)
	WARREN_HOME=$${WARREN_HOME:-$(CURDIR)/var/warren} WARREN_SECRET=$${WARREN_SECRET:-warren-local-demo-secret} warrenctl -n n1 rolling_restart $(ROLLING_ARGS)
docker-rolling-restart:
	$(DOCKER_COMPOSE) exec -T n1 warrenctl -n 127.0.0.1:25672 rolling_restart $(ROLLING_ARGS)
