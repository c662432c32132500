"""Process tests of maintenance one node at a time: `warrenctl rolling_restart` on real
warren-server processes under a pika publisher with confirms and a consumer with acks (every
confirmed message delivered, checked by id), and `node_is_mirror_sync_critical` with the
refusal it makes rolling_restart give."""

from __future__ import annotations

import json
import time

import pytest

from cluster_procs import running_cluster
from rolling_load import Consumer, Publisher, wait_for_ids

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        yield c


def _queue(cluster, node: str, name: str) -> dict:
    rows = cluster.ctl_json(node, "list_queues", "name", "messages", "pid", "mirror_pids",
                            "synchronised_mirror_pids")
    return next(r for r in rows if r["name"] == name)


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_rolling_restart_under_load_delivers_every_confirmed_message(cluster, tmp_path):
    cluster.ctl_ok("n1", "set_policy", "ha", "^rolling", '{"ha-mode":"all","ha-sync-mode":"automatic"}')
    amqp = {n: ("127.0.0.1", cluster.amqp_port(n)) for n in cluster.names}
    log = tmp_path / "deliveries.log"
    # the consumer starts on n1, the first node the rolling restart takes down
    consumer = Consumer([amqp["n1"], amqp["n2"], amqp["n3"]], "rolling", log)
    publisher = Publisher([amqp["n3"], amqp["n2"], amqp["n1"]], "rolling", rate=150)
    consumer.start()
    publisher.start()
    try:
        _wait(lambda: consumer.deliveries > 100, 30, "the first deliveries")
        assert len(_queue(cluster, "n2", "rolling")["synchronised_mirror_pids"]) == 2
        done = cluster.ctl("n2", "rolling_restart", "--pause", "1", "--client-log", str(log),
                           "--formatter", "json", timeout=180)
        assert done.returncode == 0, done.stderr
        progress = done.stderr
        report = json.loads(done.stdout)
        time.sleep(1)  # a little more load after the last node
    finally:
        publisher.stop()
    confirmed = publisher.confirmed
    missing = wait_for_ids([consumer], confirmed, timeout=60)
    consumer.stop()
    print(progress)
    print(json.dumps(report, indent=1))
    assert not missing, f"{len(missing)} confirmed message(s) never delivered: {sorted(missing)[:20]}"
    assert confirmed > 300
    assert [r["node"] for r in report] == ["n1", "n2", "n3"]
    for row in report:
        assert row["down_s"] >= 1.0  # the --pause
        assert row["longest_gap_s"] is not None and row["longest_gap_s"] > 0
    assert "Restarting node n1" in progress and "waiting for" in progress
    assert consumer.reconnects >= 1  # it was on n1 when n1 stopped
    # nothing stranded: the queue is empty once the consumer has everything, and mirrored again
    row = _wait(lambda: (r := _queue(cluster, "n1", "rolling"))["messages"] == 0
                and len(r["synchronised_mirror_pids"]) == 2 and r, 20, "an empty, synchronised queue")
    assert row["messages"] == 0


def test_sync_critical_node_is_reported_and_rolling_restart_refuses_it(cluster):
    cluster.ctl_ok("n1", "set_policy", "ha", "^critical", '{"ha-mode":"all","ha-sync-mode":"manual"}')
    import pika
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", cluster.amqp_port("n1")))
    ch = conn.channel()
    ch.queue_declare("critical", durable=True)  # led by n1 (declared there)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", "critical", str(i).encode())
    conn.close()
    ok = cluster.ctl("n1", "node_is_mirror_sync_critical")
    assert ok.returncode == 0, ok.stderr
    # the mirrors on n2 and n3 restart empty; a manual-sync queue leaves them unsynchronised
    for node in ("n2", "n3"):
        cluster.ctl_ok(node, "stop_app")
        cluster.ctl_ok(node, "start_app")
    _wait(lambda: len(_queue(cluster, "n1", "critical")["mirror_pids"]) == 2, 30, "the mirrors back")
    assert _queue(cluster, "n1", "critical")["synchronised_mirror_pids"] == []

    bad = cluster.ctl("n1", "node_is_mirror_sync_critical")
    assert bad.returncode == 1
    assert "critical" in bad.stderr and "only synchronised replica" in bad.stderr
    as_json = json.loads(cluster.ctl("n1", "node_is_mirror_sync_critical", "--formatter", "json").stdout)
    assert as_json["result"] == "error" and as_json["queues"] == ["critical"]
    assert cluster.ctl("n2", "node_is_mirror_sync_critical").returncode == 0

    refused = cluster.ctl("n2", "rolling_restart", "--nodes", "n1", timeout=60)
    assert refused.returncode == 1
    assert "n1 holds the only synchronised replica" in refused.stderr and "--force" in refused.stderr
    assert cluster.call("n1", "status")["app_running"]  # nothing was stopped
    assert _queue(cluster, "n1", "critical")["messages"] == 50
