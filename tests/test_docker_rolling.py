"""A maintenance window on the compose cluster, as a managed cluster has one: `warrenctl
rolling_restart` (run inside n1) under load from clients on the host that reach the cluster only
through the load balancer (the service "lb": HAProxy): a pika publisher with confirms, and
consumers with acks on pika (a retry loop), aio-pika (`connect_robust`) and warren's own client
(its reconnection), all slower than the publisher so that the queue keeps a backlog for every
returning node to synchronise. Every confirmed message must be delivered (checked by id) and
the queue must end empty.

The maintenance runs twice, with `ha-sync-mode: automatic` (a returning node's sync blocks the
queue) and warren's `background` (it does not), and prints both rows: how long queues were
blocked by sync and the clients' longest delivery gap. The gaps are computed here, from the
consumers' delivery logs and the time windows of rolling_restart's JSON report (the command
runs in a container, the logs are on the host).

Skipped, with the reason, where no Docker engine can be had (see test_docker_cluster.py, whose
engine, image and lock handling this test shares).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from broker.localcluster import free_port
from broker.rolling import delivery_times, longest_gap
from rolling_load import Consumer, Publisher, RobustConsumer, WarrenConsumer, wait_for_ids
from test_docker_cluster import (COMPOSE_FILE, IMAGE, NODES, _build_image, _engine_or_skip,
                                 _exclusive_run, _run, _stop_engine, _wait_for)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1500)]

PROJECT = "warrenroll"
PASSWORD = "docker-rolling-password"
BACKLOG = 20_000  # messages waiting in the queue while the nodes restart
BODY_PAD = b" " + b"." * 1000  # ~1 KB a message: the backlog is ~20 MB to synchronise
PUBLISH_RATE = 150.0  # per second; each of the three consumers takes at most 40
CONSUMER_DELAY = 1 / 40


def test_rolling_restart_behind_the_load_balancer_automatic_and_background(tmp_path):
    with _exclusive_run():
        started: list = []
        try:
            docker = _engine_or_skip(started)
            _build_image()
            _scenario(docker, tmp_path)
        finally:
            if started:
                _stop_engine()


def _scenario(docker: str, tmp_path) -> None:
    env = dict(os.environ, WARREN_IMAGE=IMAGE, WARREN_PASSWORD=PASSWORD)
    for n in NODES:
        env[f"WARREN_PORT_{n.upper()}"] = str(free_port())
        env[f"WARREN_AMQP_PORT_{n.upper()}"] = str(free_port())
    env["WARREN_LB_AMQP_PORT"], env["WARREN_LB_PORT"] = str(free_port()), str(free_port())
    compose = ["docker-compose", "-f", str(COMPOSE_FILE), "-p", PROJECT]
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
        async with open_connection([native_addr], user="warren", password=PASSWORD) as conn:
            ch = await conn.channel()
            await ch.queue_declare(queue, durable=True)
            await ch.confirm_delivery()
            for i in range(count):
                await ch.basic_publish("", queue, str(i).encode() + BODY_PAD)
            assert await ch.wait_for_confirms(timeout=120)
    trio.run(run)


def _maintenance(docker: str, n1: str, env: dict, mode: str, tmp_path) -> dict:
    queue = f"rolling.{mode}"
    policy = json.dumps({"ha-mode": "all", "ha-sync-mode": mode})
    assert _ctl(docker, n1, "set_policy", f"ha-{mode}", f"^{queue}$", policy).returncode == 0
    lb_amqp = ("127.0.0.1", int(env["WARREN_LB_AMQP_PORT"]))
    lb_native = f"127.0.0.1:{env['WARREN_LB_PORT']}"
    _prefill(lb_native, queue, BACKLOG)
    logs = [tmp_path / f"{mode}-{kind}.log" for kind in ("pika", "aio-pika", "warren")]
    consumers = [Consumer([lb_amqp], queue, logs[0], user="warren", password=PASSWORD),
                 RobustConsumer(f"amqp://warren:{PASSWORD}@{lb_amqp[0]}:{lb_amqp[1]}/%2F", queue, logs[1]),
                 WarrenConsumer([lb_native], queue, logs[2], user="warren", password=PASSWORD)]
    publisher = Publisher([lb_amqp], queue, rate=PUBLISH_RATE, user="warren", password=PASSWORD)
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
