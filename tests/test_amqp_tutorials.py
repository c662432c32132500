"""RabbitMQ's Python tutorials 2 to 6, written afresh for warren, with real pika against a real
3-node cluster's AMQP ports: work queues (prefetch 1, manual acks), publish/subscribe (fanout,
exclusive server-named queues), routing (direct), topics, and RPC (reply_to, correlation_id).
Publishers, consumers and servers connect to different nodes, so routing happens on one node
and the queues live on others."""

from __future__ import annotations

import threading
import time
import uuid

import pika
import pytest

from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        yield c


def connect(cluster, node):
    return pika.BlockingConnection(pika.ConnectionParameters("localhost", cluster.amqp_port(node)))


def drain(channel, queue, idle=0.3, limit=1000, ack=True):
    """Every message a queue has for us (until it is quiet for `idle` seconds)."""
    got = []
    for method, props, body in channel.consume(queue, inactivity_timeout=idle):
        if method is None:
            break
        got.append(body.decode())
        if ack:
            channel.basic_ack(method.delivery_tag)
        if len(got) >= limit:
            break
    channel.cancel()
    return got


def test_work_queues_share_tasks_fairly_with_prefetch_one(cluster):
    """Tutorial 2: a durable task queue, persistent messages, two workers taking one task at a
    time; a busy worker gets no new task until it acknowledges."""
    boss = connect(cluster, "n1")
    ch = boss.channel()
    ch.queue_declare(queue="task_queue", durable=True)
    workers = []
    for node in ("n2", "n3"):
        conn = connect(cluster, node)
        wch = conn.channel()
        wch.queue_declare(queue="task_queue", durable=True)
        wch.basic_qos(prefetch_count=1)
        workers.append((conn, wch))
    for i in range(10):
        ch.basic_publish(exchange="", routing_key="task_queue", body=f"task {i}",
                         properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent))
    # worker A takes a task and sits on it; worker B does everything else
    a_ch, b_ch = workers[0][1], workers[1][1]
    a_gen = a_ch.consume("task_queue", inactivity_timeout=2)
    a_method, _, a_body = next(a_gen)
    assert a_method is not None
    b_done = drain(b_ch, "task_queue", idle=0.5)
    assert len(b_done) == 9 and a_body.decode() not in b_done
    a_ch.basic_ack(a_method.delivery_tag)
    a_ch.cancel()
    assert sorted(b_done + [a_body.decode()]) == sorted(f"task {i}" for i in range(10))
    rows = cluster.ctl_json("n1", "list_queues", "name", "messages")
    assert {"name": "task_queue", "messages": 0} in rows
    for conn, _ in workers:
        conn.close()
    boss.close()


def test_publish_subscribe_to_exclusive_server_named_queues(cluster):
    """Tutorial 3: a fanout exchange; each subscriber binds its own exclusive, server-named
    queue, which goes when its connection closes."""
    subs = []
    for node in ("n2", "n3"):
        conn = connect(cluster, node)
        sch = conn.channel()
        sch.exchange_declare(exchange="logs", exchange_type="fanout")
        q = sch.queue_declare(queue="", exclusive=True).method.queue
        assert q.startswith("amq.gen-")
        sch.queue_bind(exchange="logs", queue=q)
        subs.append((conn, sch, q))
    pub = connect(cluster, "n1")
    pch = pub.channel()
    pch.exchange_declare(exchange="logs", exchange_type="fanout")
    for i in range(5):
        pch.basic_publish(exchange="logs", routing_key="", body=f"log {i}")
    for conn, sch, q in subs:
        assert drain(sch, q) == [f"log {i}" for i in range(5)]
    # another connection may not consume from an exclusive queue (405)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        pch.basic_consume(subs[0][2], lambda *a: None)
    assert e.value.reply_code == 405 and "RESOURCE_LOCKED" in e.value.reply_text
    names = [q for _, _, q in subs]
    for conn, _, _ in subs:
        conn.close()
    pub.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = {r["name"] for r in cluster.ctl_json("n1", "list_queues", "name")}
        if not listed & set(names):
            break
        time.sleep(0.1)
    assert not listed & set(names), "exclusive queues outlived their connections"


def test_routing_with_a_direct_exchange(cluster):
    """Tutorial 4: messages go to the queues bound with their severity."""
    con = connect(cluster, "n3")
    cch = con.channel()
    cch.exchange_declare(exchange="direct_logs", exchange_type="direct")
    errors = cch.queue_declare(queue="", exclusive=True).method.queue
    everything = cch.queue_declare(queue="", exclusive=True).method.queue
    cch.queue_bind(exchange="direct_logs", queue=errors, routing_key="error")
    for severity in ("info", "warning", "error"):
        cch.queue_bind(exchange="direct_logs", queue=everything, routing_key=severity)
    pub = connect(cluster, "n2")
    pch = pub.channel()
    for severity in ("info", "error", "debug", "warning", "error"):
        pch.basic_publish(exchange="direct_logs", routing_key=severity, body=f"{severity} message")
    assert drain(cch, errors) == ["error message", "error message"]
    assert drain(cch, everything) == ["info message", "error message", "warning message", "error message"]
    con.close()
    pub.close()


def test_topics(cluster):
    """Tutorial 5: `*` stands for one word, `#` for any number."""
    con = connect(cluster, "n1")
    cch = con.channel()
    cch.exchange_declare(exchange="topic_logs", exchange_type="topic")
    q1 = cch.queue_declare(queue="", exclusive=True).method.queue
    q2 = cch.queue_declare(queue="", exclusive=True).method.queue
    cch.queue_bind(exchange="topic_logs", queue=q1, routing_key="*.orange.*")
    cch.queue_bind(exchange="topic_logs", queue=q2, routing_key="*.*.rabbit")
    cch.queue_bind(exchange="topic_logs", queue=q2, routing_key="lazy.#")
    pub = connect(cluster, "n3")
    pch = pub.channel()
    keys = ["quick.orange.rabbit", "lazy.orange.elephant", "quick.orange.fox", "lazy.brown.fox",
            "lazy.pink.rabbit", "quick.brown.fox", "orange", "quick.orange.male.rabbit",
            "lazy.orange.male.rabbit", "lazy"]
    for key in keys:
        pch.basic_publish(exchange="topic_logs", routing_key=key, body=key)
    assert drain(cch, q1) == ["quick.orange.rabbit", "lazy.orange.elephant", "quick.orange.fox"]
    assert drain(cch, q2) == ["quick.orange.rabbit", "lazy.orange.elephant", "lazy.brown.fox",
                              "lazy.pink.rabbit", "lazy.orange.male.rabbit", "lazy"]
    con.close()
    pub.close()


def fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def test_rpc_with_reply_to_and_correlation_id(cluster):
    """Tutorial 6: a server answers requests on `rpc_queue` to each request's reply_to (the
    client's exclusive callback queue), with its correlation_id."""
    ready = threading.Event()
    stop = threading.Event()
    errors = []

    def server():
        try:
            conn = connect(cluster, "n2")
            ch = conn.channel()
            ch.queue_declare(queue="rpc_queue")
            ch.basic_qos(prefetch_count=1)

            def on_request(chan, method, props, body):
                chan.basic_publish(exchange="", routing_key=props.reply_to, body=str(fib(int(body))),
                                   properties=pika.BasicProperties(correlation_id=props.correlation_id))
                chan.basic_ack(method.delivery_tag)

            ch.basic_consume(queue="rpc_queue", on_message_callback=on_request)
            ready.set()
            while not stop.is_set():
                conn.process_data_events(time_limit=0.1)
            conn.close()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            ready.set()

    t = threading.Thread(target=server, daemon=True)
    t.start()
    assert ready.wait(20) and not errors, errors
    conn = connect(cluster, "n3")
    ch = conn.channel()
    callback_queue = ch.queue_declare(queue="", exclusive=True).method.queue
    answers: dict = {}

    def on_response(chan, method, props, body):
        answers[props.correlation_id] = int(body)

    ch.basic_consume(queue=callback_queue, on_message_callback=on_response, auto_ack=True)
    asked = {}
    for n in (1, 10, 30):
        corr = str(uuid.uuid4())
        asked[corr] = n
        ch.basic_publish(exchange="", routing_key="rpc_queue", body=str(n),
                         properties=pika.BasicProperties(reply_to=callback_queue, correlation_id=corr))
    deadline = time.monotonic() + 20
    while len(answers) < len(asked) and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
    stop.set()
    t.join(10)
    assert not errors, errors
    assert answers == {corr: fib(n) for corr, n in asked.items()}
    conn.close()
