# warren: the common paths. The README's two commands are `make demo` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install demo test cluster stop bench mutants dst

install:
	$(PIP) install -q -e ".[test,analysis]"

# start a local 3-node cluster, publish and consume through the client, kill -9 the leader of a
# mirrored queue under load and show what happened to every message, stop the cluster
demo: install
	$(PYTHON) -m broker.localcluster demo

# The docker cluster test (tests/test_docker_cluster.py) may install docker.io, docker-compose and
# debootstrap with apt and start dockerd as root; it stops the dockerd it started when it ends.
# The files run on TEST_WORKERS parallel workers (pytest-xdist), each file whole on one worker, in
# its order (the README's blocks build on each other; a module's cluster is started once). Most
# process tests wait on nodes more than they compute, so one worker more than two cores pays.
TEST_WORKERS ?= 3
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# the fault explorer on the deterministic simulation: SEEDS seeded chaos schedules (a failure
# prints the one command that replays it)
SEEDS ?= 1000
dst: install
	warren-bench dst --seeds $(SEEDS) --procs 2

# inject one broken promise at a time into a copy of the tree: every one must be caught by its tests
mutants: install
	$(PYTHON) tests/mutants.py

# a 3-node cluster as background processes on 127.0.0.1 (state in var/warren)
cluster: install
	$(PYTHON) -m broker.localcluster start

# stops every node of var/warren (or $WARREN_HOME): those `make cluster` started and any started
# there by hand (a node registers itself under $WARREN_HOME/run)
stop:
	$(PYTHON) -m broker.localcluster stop

bench: install
	warren-bench throughput --seconds 10
	$(PIP) install -q -e ".[bench]"
	warren-bench run $(BENCH_SUITE) --target $(BENCH_TARGET) --out results
	$(PYTHON) -m bench.analysis

# the chaos campaign (bench/chaos): CHAOS_SCHEDULES seeded fault schedules from CHAOS_SEED,
# each judged by the total-queue checker; `make chaos-smoke` runs one short schedule per kind
CHAOS_SCHEDULES ?= 200
CHAOS_SEED ?= 20000
.PHONY: chaos chaos-smoke
chaos: install
	warren-bench chaos --schedules $(CHAOS_SCHEDULES) --seed $(CHAOS_SEED) --out results

chaos-smoke: install
	warren-bench chaos --smoke --out results

# `make bench` runs the smoke suite on warren and (when rabbitmq-server is installed) RabbitMQ,
# then the Spark analysis over ./results; e.g. `make bench BENCH_SUITE="throughput latency failover"`
BENCH_SUITE ?= smoke
BENCH_TARGET ?= both


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
rolling-restart:
	WARREN_HOME=$${WARREN_HOME:-$(CURDIR)/var/warren} WARREN_SECRET=$${WARREN_SECRET:-warren-local-demo-secret} warrenctl -n n1 rolling_restart $(ROLLING_ARGS)
docker-rolling-restart:
	$(DOCKER_COMPOSE) exec -T n1 warrenctl -n 127.0.0.1:25672 rolling_restart $(ROLLING_ARGS)
