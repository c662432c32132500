"""The docker-compose cluster for real: three containers form one cluster, a
client on the host connects through a published port (as the "warren" user
the compose file defines; guest is refused there, loopback only), and a
killed node drops out of running_nodes but stays a member; then a rolling
restart behind the compose file's load balancer, under load, in both sync
modes (see its test).

These tests run by default.  Under a lock that makes concurrent runs on one
machine take turns, the module gets itself, once for both tests, what they
need:

- a Docker engine: when none answers and we are root, docker/engine.sh
  installs docker.io, docker-compose and debootstrap with apt if missing and
  starts dockerd in the background; the test stops that dockerd again when
  it ends (`sh docker/engine.sh stop`), so no root daemon outlives `make
  test`.  An engine that was already answering is left alone.  The packages
  stay installed;
- the image: docker/build-image.sh builds warren-base:bookworm once (about
  90 s, mostly debootstrap) and then an image of this work tree, tagged
  warren:test so that it does not replace a `make docker-up` image (7-12 s
  when the base exists; an unchanged tree hits docker's cache).

It skips, saying why, only where no engine can be had: not root, engine.sh
failed (apt could not install docker.io, or dockerd did not answer), or
docker-compose is still missing.  Each test runs its own compose project
("warrentest", "warrenroll") on free host ports, so it does not collide
with `make docker-up`, and always takes it down.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from broker.localcluster import free_port
from broker.rolling import delivery_times, longest_gap
from rolling_load import Consumer, Publisher, RobustConsumer, WarrenConsumer, wait_for_ids

# A cold run installs packages and debootstraps the base image.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENGINE_SCRIPT = REPO / "docker" / "engine.sh"
BUILD_SCRIPT = REPO / "docker" / "build-image.sh"
PROJECT = "warrentest"
IMAGE = "warren:test"
NODES = ("n1", "n2", "n3")
FORM_TIMEOUT = 60.0
DOWN_TIMEOUT = 60.0
ENGINE_TIMEOUT = 420.0  # apt-get install docker.io on a fresh machine, then dockerd
BUILD_TIMEOUT = 480.0   # debootstrap of the base image on a cold machine
# Two runs at once would share the compose project (the leftover-cleaning
# `down` of one stops the other's containers), the image tag and the dockerd
# start.  A lock file makes runs on this machine take turns.
LOCK_FILE = Path("/tmp/warren-docker-cluster-test.lock")
LOCK_TIMEOUT = 600.0


def _run(args, *, timeout=60.0, env=None, check=False):
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=check
    )


def _tail(proc: subprocess.CompletedProcess, lines: int = 8) -> str:
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return " | ".join(text[-lines:])


def _engine_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return _run([docker, "info"], timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _engine_or_skip(started: list) -> str:
    """The docker client's path once an engine answers; skips with the reason otherwise.
    Appends True to `started` when it started dockerd itself."""
    if not _engine_answers():
        if os.geteuid() != 0:
            pytest.skip(
                f"no Docker engine answers and uid {os.geteuid()} is not root, so the test "
                "cannot install docker.io or start dockerd (as root: `make docker-engine`)"
            )
        try:
            proc = _run(["sh", str(ENGINE_SCRIPT)], timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.skip(f"docker/engine.sh got no Docker engine within {ENGINE_TIMEOUT:.0f}s")
        if proc.returncode != 0:
            pytest.skip(f"docker/engine.sh could not get a Docker engine "
                        f"(exit {proc.returncode}): {_tail(proc)}")
        if "starting dockerd" in proc.stdout:
            started.append(True)
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed and docker/engine.sh did not install it")
    return shutil.which("docker")


def _build_image() -> None:
    """Build IMAGE from this work tree (the base image only when it is missing)."""
    env = dict(os.environ, WARREN_IMAGE=IMAGE)
    t0 = time.monotonic()
    proc = _run(["bash", str(BUILD_SCRIPT)], timeout=BUILD_TIMEOUT, env=env)
    assert proc.returncode == 0, f"docker/build-image.sh failed:\n{proc.stdout}\n{proc.stderr}"
    print(f"--- built {IMAGE} in {time.monotonic() - t0:.1f}s: {_tail(proc, 3)}")


@contextlib.contextmanager
def _exclusive_run():
    with LOCK_FILE.open("a") as f:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"another run of the docker cluster test held {LOCK_FILE} "
                        f"for {LOCK_TIMEOUT:.0f}s"
                    )
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cluster_status(docker: str, container: str) -> dict | str:
    """n1's view as parsed JSON, or the reason it could not be had."""
    try:
        proc = _run(
            [docker, "exec", container,
             "warrenctl", "-n", "127.0.0.1:25672", "cluster_status", "--formatter", "json"],
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return "warrenctl timed out"
    if proc.returncode != 0:
        return f"warrenctl exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        # Tolerate stray lines around the JSON document.
        for line in reversed(proc.stdout.splitlines()):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
        return f"not JSON: {proc.stdout.strip()[-500:]!r}"


def _wait_for(docker, container, predicate, timeout, what):
    deadline = time.monotonic() + timeout
    last: dict | str = "never asked"
    while time.monotonic() < deadline:
        last = _cluster_status(docker, container)
        if isinstance(last, dict) and predicate(last):
            return last
        if isinstance(last, str) and "is not running" in last:
            break  # n1's container exited: waiting longer cannot help
        time.sleep(1.0)
    pytest.fail(f"{what} within {timeout:.0f}s; n1's last cluster_status: {last}")


def _container_state(docker: str, container: str) -> str:
    proc = _run([docker, "inspect", "-f", "{{.State.Status}}", container])
    return proc.stdout.strip() or proc.stderr.strip()


def _stop_engine() -> None:
    proc = _run(["sh", str(ENGINE_SCRIPT), "stop"], timeout=60)
    print(f"--- {_tail(proc, 2)}")
    assert proc.returncode == 0, f"could not stop the dockerd this test started: {_tail(proc)}"


@pytest.fixture(scope="module")
def docker():
    """The docker client's path, with an engine and this tree's image, for every test of the
    module: one engine start and one image build, under the lock, and the engine stopped at the
    end when it was started here."""
    with _exclusive_run():
        started: list = []
        try:
            path = _engine_or_skip(started)
            _build_image()
            yield path
        finally:
            if started:
                _stop_engine()


def test_cluster_forms_a_host_client_connects_and_a_killed_node_is_noticed(docker):
    _cluster_scenario(docker)


async def _host_client(port: int, password: str) -> str:
    """From the host: guest is refused (loopback only), warren publishes and gets its message back."""
    import trio

    from broker.client.aio import open_connection
    from broker.client.errors import ConnectionClosedByBroker

    addr = f"127.0.0.1:{port}"
    with trio.fail_after(30):
        try:
            async with open_connection([addr]):
                pass
        except ConnectionClosedByBroker as exc:
            refused = exc.reply_text
        else:
            raise AssertionError("guest connected from the host: it should be loopback only")
        async with open_connection([addr], user="warren", password=password) as conn:
            ch = await conn.channel()
            await ch.queue_declare("host.check", durable=False)
            await ch.confirm_delivery()
            await ch.basic_publish("", "host.check", b"from the host")
            assert await ch.wait_for_confirms()
            consumer = await ch.basic_consume("host.check")
            async for msg in consumer:
                assert msg.body == b"from the host"
                ch.basic_ack(msg.delivery_tag)
                break
            await ch.queue_delete("host.check")
    return refused


def _host_amqp_client(port: int, password: str) -> None:
    """From the host, over AMQP 0-9-1 with pika: publish and get a message back."""
    import pika

    params = pika.ConnectionParameters("127.0.0.1", port,
                                       credentials=pika.PlainCredentials("warren", password))
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare("host.amqp")
    ch.confirm_delivery()
    ch.basic_publish("", "host.amqp", b"over AMQP")
    method, _, body = ch.basic_get("host.amqp", auto_ack=True)
    assert body == b"over AMQP", (method, body)
    ch.queue_delete("host.amqp")
    conn.close()


def _cluster_scenario(docker: str) -> None:
    env = dict(os.environ, WARREN_IMAGE=IMAGE)
    env.update({f"WARREN_PORT_{n.upper()}": str(free_port()) for n in NODES})
    env.update({f"WARREN_AMQP_PORT_{n.upper()}": str(free_port()) for n in NODES})
    env.update(WARREN_LB_AMQP_PORT=str(free_port()), WARREN_LB_PORT=str(free_port()))
    env["WARREN_PASSWORD"] = "docker-test-password"  # the compose file takes it from the host
    compose = ["docker-compose", "-f", str(COMPOSE_FILE), "-p", PROJECT]

    # Leftovers of an interrupted earlier run would confuse the test.
    _run(compose + ["down", "--remove-orphans", "-t", "5"], timeout=120, env=env)
    try:
        up = _run(compose + ["up", "-d"], timeout=180, env=env)
        assert up.returncode == 0, f"docker-compose up failed:\n{up.stderr}"
        ids = {}
        for node in NODES:
            ps = _run(compose + ["ps", "-q", node], env=env)
            ids[node] = ps.stdout.strip()
            assert ids[node], f"no container for {node}: {ps.stderr}"

        try:
            status = _wait_for(
                docker, ids["n1"],
                lambda s: sorted(s.get("running_nodes", [])) == list(NODES),
                FORM_TIMEOUT, "the three nodes did not all run",
            )
            assert sorted(status["members"]) == list(NODES), status

            import trio
            refused = trio.run(_host_client, int(env["WARREN_PORT_N1"]), env["WARREN_PASSWORD"])
            assert "loopback" in refused, refused
            _host_amqp_client(int(env["WARREN_AMQP_PORT_N2"]), env["WARREN_PASSWORD"])

            kill = _run([docker, "kill", ids["n3"]])
            assert kill.returncode == 0, f"docker kill n3 failed: {kill.stderr}"
            assert _container_state(docker, ids["n3"]) != "running"

            status = _wait_for(
                docker, ids["n1"],
                lambda s: "n3" not in s.get("running_nodes", []) and "n3" in s.get("members", []),
                DOWN_TIMEOUT, "n1 did not see n3 go down (while keeping it a member)",
            )
            assert sorted(status["running_nodes"]) == ["n1", "n2"], status
            assert sorted(status["members"]) == list(NODES), status
        except BaseException:
            states = {node: _container_state(docker, cid) for node, cid in ids.items()}
            logs = _run(compose + ["logs", "--no-color", "--tail", "40"], env=env)
            print(f"--- containers: {states}")
            print(f"--- docker-compose logs ---\n{logs.stdout}\n{logs.stderr}")
            raise
    finally:
        _run(compose + ["down", "--remove-orphans", "-t", "5"], timeout=120, env=env)


# --- a rolling restart behind the load balancer, under load ------------------------------------

ROLLING_PROJECT = "warrenroll"
ROLLING_PASSWORD = "docker-rolling-password"
BACKLOG = 20_000  # messages waiting in the queue while the nodes restart
BODY_PAD = b" " + b"." * 1000  # ~1 KB a message: the backlog is ~20 MB to synchronise
PUBLISH_RATE = 150.0  # per second; each of the three consumers takes at most 40
CONSUMER_DELAY = 1 / 40


@pytest.mark.timeout(1500)
def test_rolling_restart_behind_the_load_balancer_automatic_and_background(docker, tmp_path):
    """A maintenance window on the compose cluster, as a managed cluster has one: `warrenctl
    rolling_restart` (run inside n1) under load from clients on the host that reach the cluster
    only through the load balancer (the service "lb": HAProxy): a pika publisher with confirms,
    and consumers with acks on pika (a retry loop), aio-pika (`connect_robust`) and warren's own
    client (its reconnection), all slower than the publisher so that the queue keeps a backlog
    for every returning node to synchronise. Every confirmed message must be delivered (checked
    by id) and the queue must end empty.

    The maintenance runs twice, with `ha-sync-mode: automatic` (a returning node's sync blocks
    the queue) and warren's `background` (it does not), and prints both rows: how long queues
    were blocked by sync and the clients' longest delivery gap. The gaps are computed here, from
    the consumers' delivery logs and the time windows of rolling_restart's JSON report (the
    command runs in a container, the logs are on the host)."""
    _rolling_scenario(docker, tmp_path)


def _rolling_scenario(docker: str, tmp_path) -> None:
    env = dict(os.environ, WARREN_IMAGE=IMAGE, WARREN_PASSWORD=ROLLING_PASSWORD)
    for n in NODES:
        env[f"WARREN_PORT_{n.upper()}"] = str(free_port())
        env[f"WARREN_AMQP_PORT_{n.upper()}"] = str(free_port())
    env["WARREN_LB_AMQP_PORT"], env["WARREN_LB_PORT"] = str(free_port()), str(free_port())
    compose = ["docker-compose", "-f", str(COMPOSE_FILE), "-p", ROLLING_PROJECT]
    _run(compose + ["down", "--remove-orphans", "-t", "5"], timeout=120, env=env)
    try:
        up = _run(compose + ["up", "-d"], timeout=180, env=env)
        assert up.returncode == 0, f"docker-compose up failed:\n{up.stderr}"
        n1 = _run(compose + ["ps", "-q", "n1"], env=env).stdout.strip()
        _wait_for(docker, n1, lambda s: sorted(s.get("running_nodes", [])) == list(NODES), 60,
                  "the three nodes did not all run")
        rows = [_maintenance(docker, n1, env, mode, tmp_path) for mode in ("automatic", "background")]
        print("\nha-sync-mode\tnode restarts\tlongest queue block (s)\tclients' longest gap (s)\t"
              "messages confirmed")
        for r in rows:
            print(f"{r['mode']}\t{r['nodes']}\t{r['blocked_s']:.2f}\t{r['gap_s']:.2f}\t{r['confirmed']}")
        automatic, background = rows
        assert automatic["blocked_s"] > 0, "a returning node's automatic sync blocked nothing"
        assert background["blocked_s"] == 0, "a background sync blocked a queue"
    except BaseException:
        logs = _run(compose + ["logs", "--no-color", "--tail", "60"], env=env)
        print(f"--- docker-compose logs ---\n{logs.stdout[-20000:]}\n{logs.stderr[-2000:]}")
        raise
    finally:
        _run(compose + ["down", "--remove-orphans", "-t", "5"], timeout=120, env=env)


def _ctl(docker: str, container: str, *args: str, timeout: float = 60.0):
    return _run([docker, "exec", container, "warrenctl", "-n", "127.0.0.1:25672", *args],
                timeout=timeout)


def _prefill(native_addr: str, queue: str, count: int) -> None:
    """`count` messages (ids 0..count-1) through the balancer's native port, with confirms."""
    import trio

    from broker.client.aio import open_connection

    async def run():
        async with open_connection([native_addr], user="warren", password=ROLLING_PASSWORD) as conn:
            ch = await conn.channel()
            await ch.queue_declare(queue, durable=True)
            await ch.confirm_delivery()
            for i in range(count):
                await ch.basic_publish("", queue, str(i).encode() + BODY_PAD)
            assert await ch.wait_for_confirms(timeout=120), "the prefill was not all confirmed"
    trio.run(run)


def _maintenance(docker: str, n1: str, env: dict, mode: str, tmp_path) -> dict:
    queue = f"rolling.{mode}"
    policy = json.dumps({"ha-mode": "all", "ha-sync-mode": mode})
    assert _ctl(docker, n1, "set_policy", f"ha-{mode}", f"^{queue}$", policy).returncode == 0
    lb_amqp = ("127.0.0.1", int(env["WARREN_LB_AMQP_PORT"]))
    lb_native = f"127.0.0.1:{env['WARREN_LB_PORT']}"
    _prefill(lb_native, queue, BACKLOG)
    logs = [tmp_path / f"{mode}-{kind}.log" for kind in ("pika", "aio-pika", "warren")]
    consumers = [Consumer([lb_amqp], queue, logs[0], user="warren", password=ROLLING_PASSWORD),
                 RobustConsumer(f"amqp://warren:{ROLLING_PASSWORD}@{lb_amqp[0]}:{lb_amqp[1]}/%2F", queue, logs[1]),
                 WarrenConsumer([lb_native], queue, logs[2], user="warren", password=ROLLING_PASSWORD)]
    publisher = Publisher([lb_amqp], queue, rate=PUBLISH_RATE, user="warren", password=ROLLING_PASSWORD)
    publisher.confirmed = BACKLOG  # ids go on from the prefill's
    for c in consumers:
        c.delay = CONSUMER_DELAY
        c.start()
    publisher.start()
    try:
        time.sleep(3)
        done = _ctl(docker, n1, "rolling_restart", "--pause", "2", "--sync-timeout", "300",
                    "--formatter", "json", timeout=900)
        print(f"--- rolling_restart, ha-sync-mode {mode}:\n{done.stderr}")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
    finally:
        publisher.stop()
    for c in consumers:
        c.delay = 0.0  # drain
    missing = wait_for_ids(consumers, publisher.confirmed, timeout=180)
    queue_left = _wait_queue_empty(docker, n1, queue)
    for c in consumers:
        c.stop()
    errors = [c.error for c in consumers if getattr(c, "error", None)]
    assert not errors, errors
    assert not missing, f"{len(missing)} confirmed message(s) never delivered: {sorted(missing)[:20]}"
    assert queue_left == 0, f"{queue_left} message(s) stranded in {queue}"
    times = [delivery_times(str(log)) for log in logs]
    for row in report:
        row["longest_gap_s"] = max(longest_gap(t, row["stopped_at"], row["synced_at"]) for t in times)
        print(f"{mode}\t{row['node']}\tdown {row['down_s']:.2f} s\tsynced after "
              f"{row['synced_after_s']:.2f} s\tblocked {row['blocked_s']:.2f} s\t"
              f"longest gap {row['longest_gap_s']:.2f} s\tsyncs seen {row['blocking_syncs']}")
    assert sorted(r["node"] for r in report) == list(NODES)
    assert any(c.deliveries for c in consumers[1:]), "aio-pika and warren's client got nothing"
    return {"mode": mode, "nodes": len(report), "confirmed": publisher.confirmed,
            "blocked_s": max(r["blocked_s"] for r in report),
            "gap_s": max(r["longest_gap_s"] for r in report)}


def _wait_queue_empty(docker: str, n1: str, queue: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        listed = _ctl(docker, n1, "list_queues", "name", "messages", "--formatter", "json")
        rows = json.loads(listed.stdout) if listed.returncode == 0 else []
        left = next((r["messages"] for r in rows if r["name"] == queue), -1)
        if left == 0 or time.monotonic() >= deadline:
            return left
        time.sleep(1.0)
