"""kombu and a real Celery worker on a real node's AMQP port: kombu's simple queues and a topic
exchange, then a task sent through warren runs on a Celery worker (a separate process) and its
result comes back through Celery's `rpc://` result backend (a reply queue with x-expires)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

APP = textwrap.dedent("""\
    import os
    from celery import Celery

    app = Celery("warren_tasks", broker=os.environ["WARREN_TEST_BROKER"], backend="rpc://")
    app.conf.broker_connection_retry_on_startup = True

    @app.task
    def add(x, y):
        return x + y

    @app.task
    def fails():
        raise ValueError("as intended")
""")


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


def broker_url(cluster) -> str:
    return f"amqp://guest:guest@127.0.0.1:{cluster.amqp_port('n1')}//"


def test_kombu_simple_queue_and_topic_exchange(cluster):
    from kombu import Connection, Consumer, Exchange, Producer, Queue

    with Connection(broker_url(cluster)) as conn:
        q = conn.SimpleQueue("kombu.simple")
        q.put({"hello": "world"})
        msg = q.get(timeout=10)
        assert msg.payload == {"hello": "world"}
        msg.ack()
        q.close()
        exchange = Exchange("kombu.topic", type="topic")
        queue = Queue("kombu.a", exchange, routing_key="a.*")
        got = []
        with conn.channel() as ch:
            consumer = Consumer(ch, [queue], callbacks=[lambda body, message: (got.append(body), message.ack())])
            consumer.consume()
            producer = Producer(ch, exchange=exchange)
            producer.publish({"n": 1}, routing_key="a.b", declare=[queue])
            producer.publish({"n": 2}, routing_key="b.a")  # matches nothing
            producer.publish({"n": 3}, routing_key="a.c")
            while len(got) < 2:
                conn.drain_events(timeout=10)
            consumer.cancel()
        assert got == [{"n": 1}, {"n": 3}]


def test_celery_worker_runs_a_task_and_its_result_comes_back(cluster, tmp_path, monkeypatch):
    (tmp_path / "warren_tasks.py").write_text(APP)
    env = dict(os.environ, WARREN_TEST_BROKER=broker_url(cluster),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "warren_tasks", "worker", "--pool=solo",
         "--without-gossip", "--without-mingle", "-l", "info"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        monkeypatch.setenv("WARREN_TEST_BROKER", broker_url(cluster))
        monkeypatch.syspath_prepend(str(tmp_path))
        tasks = importlib.import_module("warren_tasks")
        assert tasks.add.delay(2, 3).get(timeout=30) == 5
        results = [tasks.add.delay(i, i) for i in range(5)]
        assert [r.get(timeout=30) for r in results] == [0, 2, 4, 6, 8]
        with pytest.raises(ValueError, match="as intended"):
            tasks.fails.delay().get(timeout=30)
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
        sys.modules.pop("warren_tasks", None)
    text = (tmp_path / "worker.log").read_text()
    assert "succeeded" in text and "Connected to amqp://" in text
