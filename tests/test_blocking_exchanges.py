"""warren's blocking client (`import broker.client as pika`) with exchanges, against a real
node: RabbitMQ's Python tutorials 3 to 5 as they are written (publish/subscribe with a fanout
exchange, routing with a direct one, topics), their subscribers on exclusive server-named
queues, and 6 (RPC); mandatory messages no queue takes, raised as UnroutableError in confirm
mode and handed to the return callbacks otherwise; and pika's `consume()` generator."""

from __future__ import annotations

import threading
import time

import pytest

import broker.client as pika
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


def connect(cluster):
    return pika.BlockingConnection(pika.ConnectionParameters(host="localhost",
                                                             port=cluster.client_port("n1")))


def subscribe(cluster, exchange: str, exchange_type, binding_keys, expect: int):
    """A tutorial's receiver: its own exclusive queue bound with each key; consumes in a thread
    until `expect` messages came. Returns (thread, what it got as (routing_key, body))."""
    connection = connect(cluster)
    channel = connection.channel()
    channel.exchange_declare(exchange=exchange, exchange_type=exchange_type)
    result = channel.queue_declare(queue="", exclusive=True)
    queue_name = result.method.queue
    for key in binding_keys or [None]:
        if key is None:
            channel.queue_bind(exchange=exchange, queue=queue_name)
        else:
            channel.queue_bind(exchange=exchange, queue=queue_name, routing_key=key)
    got = []

    def callback(ch, method, properties, body):
        got.append((method.exchange, method.routing_key, body.decode()))
        if len(got) == expect:
            ch.stop_consuming()

    channel.basic_consume(queue=queue_name, on_message_callback=callback, auto_ack=True)

    def run():
        channel.start_consuming()
        connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def emit(cluster, exchange: str, exchange_type, messages) -> None:
    connection = connect(cluster)
    channel = connection.channel()
    channel.exchange_declare(exchange=exchange, exchange_type=exchange_type)
    for routing_key, body in messages:
        channel.basic_publish(exchange=exchange, routing_key=routing_key, body=body)
    connection.close()


def finished(thread, got, expected):
    thread.join(15)
    assert not thread.is_alive(), f"the subscriber is still waiting; it got {got}"
    assert got == expected


def test_tutorial_three_publish_subscribe_with_a_fanout_exchange(cluster):
    subscribers = [subscribe(cluster, "logs", "fanout", None, 2) for _ in range(2)]
    emit(cluster, "logs", "fanout", [("", "info: one"), ("", "info: two")])
    for thread, got in subscribers:
        finished(thread, got, [("logs", "", "info: one"), ("logs", "", "info: two")])


def test_tutorial_four_routing_with_a_direct_exchange(cluster):
    errors = subscribe(cluster, "direct_logs", pika.ExchangeType.direct, ["error"], 1)
    everything = subscribe(cluster, "direct_logs", "direct", ["info", "warning", "error"], 3)
    emit(cluster, "direct_logs", "direct", [("info", "a"), ("warning", "b"), ("error", "c")])
    finished(*errors, [("direct_logs", "error", "c")])
    finished(*everything, [("direct_logs", "info", "a"), ("direct_logs", "warning", "b"),
                           ("direct_logs", "error", "c")])


def test_tutorial_five_topics(cluster):
    kern = subscribe(cluster, "topic_logs", "topic", ["kern.*"], 2)
    critical = subscribe(cluster, "topic_logs", "topic", ["*.critical"], 2)
    emit(cluster, "topic_logs", "topic", [("kern.critical", "A critical kernel error"),
                                          ("kern.info", "boot"), ("disk.critical", "full"),
                                          ("anonymous.info", "nobody listens")])
    finished(*kern, [("topic_logs", "kern.critical", "A critical kernel error"),
                     ("topic_logs", "kern.info", "boot")])
    finished(*critical, [("topic_logs", "kern.critical", "A critical kernel error"),
                         ("topic_logs", "disk.critical", "full")])


def test_mandatory_messages_no_queue_takes_come_back(cluster):
    connection = connect(cluster)
    channel = connection.channel()
    channel.exchange_declare(exchange="nowhere", exchange_type="direct")
    returned = []
    channel.add_on_return_callback(
        lambda ch, method, properties, body: returned.append((method.reply_code, method.reply_text,
                                                              method.routing_key, properties.type, body)))
    channel.basic_publish("nowhere", "k", b"lost", pika.BasicProperties(type="t"), mandatory=True)
    channel.basic_publish("nowhere", "k", b"dropped quietly")  # not mandatory: no return
    connection.process_data_events(time_limit=2)  # returns once the return has been run
    connection.sleep(0.3)  # time for a wrong second return to show
    assert returned == [(312, "NO_ROUTE", "k", "t", b"lost")]

    channel.confirm_delivery()
    with pytest.raises(pika.UnroutableError) as ei:
        channel.basic_publish("nowhere", "k", b"again", mandatory=True)
    (back,) = ei.value.messages
    assert (back.method.reply_code, back.method.exchange, back.body) == (312, "nowhere", b"again")
    channel.queue_declare("somewhere")
    channel.queue_bind("somewhere", "nowhere", "k")
    persistent = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
    channel.basic_publish("nowhere", "k", b"taken", persistent, mandatory=True)
    method, properties, body = channel.basic_get("somewhere", auto_ack=True)
    assert (method.exchange, method.routing_key, properties.delivery_mode, body) == (
        "nowhere", "k", 2, b"taken")
    assert returned == [(312, "NO_ROUTE", "k", "t", b"lost")]
    connection.close()


def test_tutorial_six_rpc_with_a_callback_queue_and_correlation_ids(cluster):
    """The RPC tutorial: a server consuming `rpc_queue` with prefetch 1, a client waiting for
    its answer with `process_data_events(time_limit=None)` on an exclusive callback queue."""
    server_conn = connect(cluster)
    server = server_conn.channel()
    server.queue_declare(queue="rpc_queue")

    def fib(n: int) -> int:
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    def on_request(ch, method, props, body):
        ch.basic_publish(exchange="", routing_key=props.reply_to,
                         properties=pika.BasicProperties(correlation_id=props.correlation_id),
                         body=str(fib(int(body))))
        ch.basic_ack(delivery_tag=method.delivery_tag)

    server.basic_qos(prefetch_count=1)
    server.basic_consume(queue="rpc_queue", on_message_callback=on_request)
    thread = threading.Thread(target=server.start_consuming, daemon=True)
    thread.start()

    client_conn = connect(cluster)
    client = client_conn.channel()
    callback_queue = client.queue_declare(queue="", exclusive=True).method.queue
    answers = {}
    client.basic_consume(queue=callback_queue, auto_ack=True,
                         on_message_callback=lambda ch, method, props, body:
                         answers.__setitem__(props.correlation_id, int(body)))
    for n in (10, 20):
        corr_id = f"call-{n}"
        client.basic_publish(exchange="", routing_key="rpc_queue",
                             properties=pika.BasicProperties(reply_to=callback_queue, correlation_id=corr_id),
                             body=str(n))
        while corr_id not in answers:
            client_conn.process_data_events(time_limit=None)
    assert answers == {"call-10": 55, "call-20": 6765}
    client_conn.close()
    server_conn.close()  # the server's start_consuming() returns
    thread.join(5)
    assert not thread.is_alive()


def test_the_consume_generator_yields_messages_and_none_when_quiet(cluster):
    """pika's `channel.consume(queue, inactivity_timeout=...)`: messages as they come, (None,
    None, None) when quiet; `cancel()` gives back what it had not yielded (requeued)."""
    connection = connect(cluster)
    channel = connection.channel()
    channel.queue_declare("generated")
    for i in range(5):
        channel.basic_publish("", "generated", f"m{i}")
    got = []
    for method, properties, body in channel.consume("generated", inactivity_timeout=0.5):
        if method is None:
            break
        got.append(body)
        channel.basic_ack(method.delivery_tag)
        if len(got) == 3:
            channel.basic_publish("", "generated", b"late")
    assert got == [b"m0", b"m1", b"m2", b"m3", b"m4", b"late"]
    assert channel.cancel() == 0
    for i in range(3):
        channel.basic_publish("", "generated", f"again{i}")
    first = next(channel.consume("generated", inactivity_timeout=2))
    assert first[2] == b"again0"
    channel.basic_ack(first[0].delivery_tag)
    time.sleep(0.3)  # the other two arrive, unyielded
    assert channel.cancel() == 2
    assert channel.queue_declare("generated", passive=True).method.message_count == 2
    connection.close()
