"""Publishing as RabbitMQ 3.10 answers it: a plain round trip with its properties, and the
`mandatory` flag: an unroutable mandatory message comes back as basic.return, also when a
non-mandatory publish to the same exchange and key reaches the broker in the same read."""

from __future__ import annotations

import contextlib
import socket

import pika

from amqp_helpers import channel, connect, get, publish, wait_until


def test_round_trip_keeps_body_and_properties(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        props = dict(content_type="text/plain", headers={"a": 1, "b": "two"}, correlation_id="c",
                     message_id="m", delivery_mode=2, priority=4, expiration="60000", app_id="conf")
        publish(ch, "", q, "hello", **props)
        method, got, body = get(ch, q)
        assert body == b"hello" and method.routing_key == q and not method.redelivered
        for key, value in props.items():
            assert getattr(got, key) == value, key


def test_consume_ack_and_requeue(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        for i in range(3):
            publish(ch, "", q, str(i))
        seen = []
        for method, _, body in ch.consume(q, inactivity_timeout=1):
            if method is None:
                break
            seen.append((body, method.redelivered))
            if body == b"1" and not method.redelivered:
                ch.basic_nack(method.delivery_tag, requeue=True)
            else:
                ch.basic_ack(method.delivery_tag)
            if len(seen) == 4:
                break
        ch.cancel()
        assert sorted(seen) == [(b"0", False), (b"1", False), (b"1", True), (b"2", False)]


def test_unroutable_mandatory_message_is_returned(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "x", "direct")
        returned = []
        ch.add_on_return_callback(lambda c, m, p, b: returned.append((m.reply_code, m.reply_text, m.exchange,
                                                                      m.routing_key, b)))
        ch.basic_publish(names + "x", "nowhere", b"back", mandatory=True)
        ch.basic_publish(names + "x", "nowhere", b"dropped")
        assert wait_until(lambda: returned, conn=ch.connection)
        ch.connection.process_data_events(0.2)
        assert returned == [(312, "NO_ROUTE", names + "x", "nowhere", b"back")]


@contextlib.contextmanager
def corked(conn: pika.BlockingConnection):
    """Holds what pika writes in the kernel (TCP_CORK) and sends it as one segment afterwards, so
    the broker reads it in one read."""
    sock = conn._impl._transport._sock  # pika keeps its socket private
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    try:
        yield
    finally:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)


def test_mandatory_flag_kept_when_batched_with_a_plain_publish_in_one_read(broker, names):
    conn = connect(broker.url)
    try:
        ch = conn.channel()
        ch.exchange_declare(names + "x", "direct")
        returned = []
        ch.add_on_return_callback(lambda c, m, p, b: returned.append((m.reply_code, m.reply_text, b)))
        for order in (("plain", "mandatory"), ("mandatory", "plain")):
            returned.clear()
            with corked(conn):
                for kind in order:
                    ch.basic_publish(names + "x", "nowhere", kind.encode(), mandatory=kind == "mandatory")
            assert wait_until(lambda: returned, conn=conn), order
            conn.process_data_events(0.2)
            assert returned == [(312, "NO_ROUTE", b"mandatory")], order
    finally:
        conn.close()
