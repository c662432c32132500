"""RabbitMQ's classic mirroring tutorial for pika, run verbatim (bar the import and the port)
against a real node through warren's blocking client."""

from __future__ import annotations

import os
import subprocess
import sys

import time

import pytest

import tutorial_text
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


def _scripts(cluster, tmp_path):
    port = cluster.client_port("n1")
    pub = tmp_path / "publisher.py"
    con = tmp_path / "consumer.py"
    pub.write_text(tutorial_text.publisher(port, "import broker.client as pika"))
    con.write_text(tutorial_text.consumer(port, "import broker.client as pika"))
    return pub, con


ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def _publish(pub):
    r = subprocess.run([sys.executable, str(pub)], capture_output=True, text=True, timeout=30, env=ENV)
    assert r.returncode == 0, r.stderr


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _run_consumer_until_received(con, out_path, before_wait=None):
    with open(out_path, "w") as out:
        p = subprocess.Popen([sys.executable, str(con)], stdout=out, stderr=subprocess.STDOUT, env=ENV)
        try:
            if before_wait is not None:
                before_wait(p)
            _wait_for(lambda: tutorial_text.LINE in out_path.read_text()
                      or p.poll() is not None, 15, "the consumer to print the message")
            assert p.poll() is None, f"the consumer exited: {out_path.read_text()}"
        finally:
            p.kill()
            p.wait(10)
    return out_path.read_text()


def _purge(cluster):
    cluster.ctl("n1", "purge_queue", "my_mirrored_queue")


def test_tutorial_publisher_then_consumer(cluster, tmp_path):
    """The tutorial's order: publish first, then start the consumer."""
    pub, con = _scripts(cluster, tmp_path)
    _purge(cluster)
    _publish(pub)
    rows = cluster.ctl_json("n1", "list_queues", "name", "durable", "messages")
    assert {"name": "my_mirrored_queue", "durable": True, "messages": 1} in rows
    text = _run_consumer_until_received(con, tmp_path / "consumer.out")
    assert tutorial_text.LINE in text


def test_tutorial_consumer_running_then_publisher(cluster, tmp_path):
    """Consumer script first (on the queue the publisher script declared), then publish."""
    pub, con = _scripts(cluster, tmp_path)
    if not any(r["name"] == "my_mirrored_queue" for r in cluster.ctl_json("n1", "list_queues", "name")):
        _publish(pub)  # declares the durable queue (and leaves one message)
    _purge(cluster)

    def publish_once_consuming(p):
        _wait_for(lambda: any(r["queue_name"] == "my_mirrored_queue"
                              for r in cluster.ctl_json("n1", "list_consumers")) or p.poll() is not None,
                  15, "the consumer script to register its consumer")
        _publish(pub)

    text = _run_consumer_until_received(con, tmp_path / "consumer.out", publish_once_consuming)
    assert tutorial_text.LINE in text
    rows = cluster.ctl_json("n1", "list_queues", "name", "durable", "messages", "consumers")
    assert {"name": "my_mirrored_queue", "durable": True, "messages": 0, "consumers": 0} in rows
