"""Direct reply-to (`amq.rabbitmq.reply-to`) as RabbitMQ 3.10 does it: no queue declared, the
reply goes straight to the requesting channel, the consumer must be no-ack, and the errors when it
is not or when nobody consumes; with pika (the tutorial's RPC client and server, on two nodes)
and with aio-pika (an async RPC client)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import aio_pika
import pika
import pytest

from amqp_helpers import channel, channel_closed, connect, get, publish, wait_until

REPLY_TO = "amq.rabbitmq.reply-to"


def test_rpc_round_trip_through_direct_reply_to(broker, names):
    q = names + "rpc"
    client = connect(broker.url)
    try:
        cch = client.channel()
        replies = []
        cch.basic_consume(REPLY_TO, lambda c, m, p, b: replies.append(
            (m.exchange, m.routing_key, p.correlation_id, b)), auto_ack=True)
        with channel(broker.url) as server:
            server.queue_declare(q)
            publish(cch, "", q, "2+2", reply_to=REPLY_TO, correlation_id="c-1")
            _, props, body = get(server, q)
            assert props.reply_to.startswith(REPLY_TO + ".") and props.reply_to != REPLY_TO + "."
            publish(server, "", props.reply_to, "4", correlation_id=props.correlation_id)
            assert wait_until(lambda: replies, conn=client)
            assert replies == [("", props.reply_to, "c-1", b"4")]
    finally:
        client.close()


def test_reply_consumer_must_be_no_ack(broker):
    with channel(broker.url) as ch:
        with channel_closed(406, "PRECONDITION_FAILED - reply consumer cannot acknowledge"):
            ch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=False)


def test_request_with_reply_to_needs_a_reply_consumer(broker, names):
    with channel(broker.url) as ch:
        ch.queue_declare(names + "rpc")
        with channel_closed(406, "PRECONDITION_FAILED - fast reply consumer does not exist"):
            publish(ch, "", names + "rpc", "req", reply_to=REPLY_TO)
            ch.queue_declare(names + "rpc", passive=True)


def test_reply_to_a_gone_client_is_unroutable(broker, names):
    q = names + "rpc"
    client = connect(broker.url)
    cch = client.channel()
    cch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    with channel(broker.url) as server:
        server.queue_declare(q)
        publish(cch, "", q, "req", reply_to=REPLY_TO)
        _, props, _ = get(server, q)
        client.close()
        server.confirm_delivery()
        with pytest.raises(pika.exceptions.UnroutableError):
            server.basic_publish("", props.reply_to, b"late", mandatory=True)


def test_aio_pika_rpc_client_with_direct_reply_to(broker, names):
    q = names + "rpc"

    async def main():
        server_conn = await aio_pika.connect(broker.url)
        client_conn = await aio_pika.connect(broker.url)
        try:
            server_ch = await server_conn.channel()
            requests = await server_ch.declare_queue(q)

            async def serve(message: aio_pika.abc.AbstractIncomingMessage):
                async with message.process():
                    n = int(message.body)
                    await server_ch.default_exchange.publish(
                        aio_pika.Message(str(n * n).encode(), correlation_id=message.correlation_id),
                        routing_key=message.reply_to)

            await requests.consume(serve)
            client_ch = await client_conn.channel()
            reply_queue = await client_ch.get_queue(REPLY_TO, ensure=False)
            futures: dict[str, asyncio.Future] = {}

            async def on_reply(message: aio_pika.abc.AbstractIncomingMessage):
                futures.pop(message.correlation_id).set_result(message.body)

            await reply_queue.consume(on_reply, no_ack=True)
            loop = asyncio.get_running_loop()
            for n in range(5):
                futures[str(n)] = loop.create_future()
            waiting = list(futures.values())
            for n in range(5):
                await client_ch.default_exchange.publish(
                    aio_pika.Message(str(n).encode(), correlation_id=str(n), reply_to=REPLY_TO),
                    routing_key=q)
            return await asyncio.wait_for(asyncio.gather(*waiting), 5)
        finally:
            await client_conn.close()
            await server_conn.close()

    assert asyncio.run(main()) == [b"0", b"1", b"4", b"9", b"16"]


class FibonacciRpcClient:
    """The RPC client of RabbitMQ's pika tutorial, on direct reply-to (as RabbitMQ's guide to it
    shows): a no-ack consumer on the pseudo-queue, requests with reply_to set to it."""

    def __init__(self, url: str, queue: str):
        self.queue = queue
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()
        self.channel.basic_consume(queue=REPLY_TO, on_message_callback=self.on_response,
                                   auto_ack=True)
        self.response = None
        self.corr_id = None

    def on_response(self, ch, method, props, body):
        if self.corr_id == props.correlation_id:
            self.response = body

    def call(self, n: int) -> int:
        self.response = None
        self.corr_id = str(uuid.uuid4())
        self.channel.basic_publish(
            exchange="", routing_key=self.queue,
            properties=pika.BasicProperties(reply_to=REPLY_TO, correlation_id=self.corr_id),
            body=str(n))
        deadline = time.monotonic() + 5
        while self.response is None and time.monotonic() < deadline:
            self.connection.process_data_events(time_limit=0.1)
        return int(self.response)


def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def rpc_server(url: str, queue: str, requests: int, ready: threading.Event) -> None:
    """The tutorial's server, answering `requests` requests."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(queue=queue)
    served = []

    def on_request(ch, method, props, body):
        ch.basic_publish(exchange="", routing_key=props.reply_to,
                         properties=pika.BasicProperties(correlation_id=props.correlation_id),
                         body=str(fib(int(body))))
        ch.basic_ack(delivery_tag=method.delivery_tag)
        served.append(props.reply_to)
        if len(served) == requests:
            ch.stop_consuming()

    channel.basic_qos(prefetch_count=1)
    channel.basic_consume(queue=queue, on_message_callback=on_request)
    ready.set()
    channel.start_consuming()
    connection.close()


def test_pika_tutorial_rpc_client_and_server_on_different_nodes(mirrored, names):
    """The tutorial's client on one node, its server on another: each reply crosses to the
    client's node and reaches it with no queue declared for it."""
    queue = names + "rpc_queue"
    ready = threading.Event()
    server = threading.Thread(target=rpc_server, args=(mirrored.urls[1], queue, 4, ready), daemon=True)
    server.start()
    assert ready.wait(5)
    client = FibonacciRpcClient(mirrored.urls[0], queue)
    try:
        assert [client.call(n) for n in (1, 5, 10, 12)] == [1, 5, 55, 144]
    finally:
        client.connection.close()
    server.join(5)
    assert not server.is_alive()


def test_declaring_reply_to_names_is_passive(broker, names):
    """A queue.declare of the pseudo-queue answers it exists with its one consumer; of a reply-to
    name whose client is gone, 404."""
    client = connect(broker.url)
    cch = client.channel()
    cch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    with channel(broker.url) as ch:
        ok = ch.queue_declare(REPLY_TO).method
        assert (ok.queue, ok.message_count, ok.consumer_count) == (REPLY_TO, 0, 1)
        ch.queue_declare(names + "rpc")
        publish(cch, "", names + "rpc", "req", reply_to=REPLY_TO)
        _, props, _ = get(ch, names + "rpc")
        assert ch.queue_declare(props.reply_to, passive=True).method.consumer_count == 1
        client.close()
        ch.connection.sleep(0.2)
        with channel_closed(404, f"NOT_FOUND - no queue '{props.reply_to}' in vhost '/'"):
            ch.queue_declare(props.reply_to, passive=True)
