"""Consumers as RabbitMQ 3.10 serves them: single active consumer (one consumer receives; the next
takes over when it cancels or its connection closes, and gets what the first left unacknowledged)
and consumer priorities (`x-priority` on basic.consume)."""

from __future__ import annotations

import pytest

from amqp_helpers import Consumer, channel, channel_closed, message_count, publish, pump_until


@pytest.fixture
def consumers():
    made = []
    yield made
    for c in made:
        c.close()


def test_single_active_consumer_only_the_first_receives(broker, names, consumers):
    q = names + "sac"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-single-active-consumer": True})
        first, second = (Consumer(broker.url, q) for _ in range(2))
        consumers += [first, second]
        for i in range(4):
            publish(ch, "", q, str(i))
        assert pump_until(consumers, lambda: len(first.got) == 4)
        pump_until(consumers, lambda: False, timeout=0.2)
        assert first.bodies == [b"0", b"1", b"2", b"3"] and second.got == []
        assert ch.queue_declare(q, passive=True).method.consumer_count == 2


def test_single_active_consumer_takeover_on_cancel(broker, names, consumers):
    q = names + "sac"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-single-active-consumer": True})
        first, second = (Consumer(broker.url, q) for _ in range(2))
        consumers += [first, second]
        publish(ch, "", q, "a")
        assert pump_until(consumers, lambda: first.bodies == [b"a"])
        first.ch.basic_cancel(first.tag)
        publish(ch, "", q, "b")
        assert pump_until(consumers, lambda: second.bodies == [b"b"])
        assert first.bodies == [b"a"]


def test_single_active_consumer_takeover_on_connection_close_gets_unacked(broker, names, consumers):
    q = names + "sac"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-single-active-consumer": True})
        for i in range(3):
            publish(ch, "", q, str(i))
        first = Consumer(broker.url, q, auto_ack=False, prefetch=1)
        consumers.append(first)
        assert pump_until(consumers, lambda: first.got == [(b"0", False)])
        second = Consumer(broker.url, q)
        consumers.append(second)
        pump_until(consumers, lambda: False, timeout=0.2)
        assert second.got == []
        first.close()
        assert pump_until(consumers, lambda: len(second.got) == 3)
        assert second.got == [(b"0", True), (b"1", False), (b"2", False)]


def test_bad_single_active_consumer_argument(broker, names):
    q = names + "sac"
    with channel(broker.url) as ch:
        with channel_closed(406, f"PRECONDITION_FAILED - invalid arg 'x-single-active-consumer' for queue "
                                 f"'{q}' in vhost '/': {{unacceptable_type,longstr}}"):
            ch.queue_declare(q, arguments={"x-single-active-consumer": "yes"})


def test_higher_priority_consumer_served_first_until_its_prefetch_is_full(broker, names, consumers):
    q = names + "cp"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        low = Consumer(broker.url, q, auto_ack=False, prefetch=2, arguments={"x-priority": 1})
        high = Consumer(broker.url, q, auto_ack=False, prefetch=2, arguments={"x-priority": 10})
        consumers += [low, high]
        for i in range(5):
            publish(ch, "", q, str(i))
        assert pump_until(consumers, lambda: len(low.got) + len(high.got) == 4)
        assert high.bodies == [b"0", b"1"] and low.bodies == [b"2", b"3"]
        assert message_count(ch, q) == 1


def test_higher_priority_consumer_takes_everything_it_can(broker, names, consumers):
    q = names + "cp"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        low = Consumer(broker.url, q, arguments={"x-priority": -5})
        high = Consumer(broker.url, q, arguments={"x-priority": 5})
        consumers += [low, high]
        for i in range(6):
            publish(ch, "", q, str(i))
        assert pump_until(consumers, lambda: len(high.got) == 6)
        pump_until(consumers, lambda: False, timeout=0.2)
        assert low.got == []


def test_bad_consumer_priority(broker, names):
    q = names + "cp"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        with channel_closed(406, f"PRECONDITION_FAILED - invalid arg 'x-priority' for queue '{q}' in "
                                 f"vhost '/': \"expected integer, got longstr\""):
            ch.basic_consume(q, lambda *a: None, arguments={"x-priority": "x"})
