"""The features on a 3-node cluster whose queues are mirrored to every node (the `mirrored`
fixture's policy), with the publisher, the queue's leader and the consumer on different nodes:
what a client sees must not depend on where it is connected. Each client declares the queues it
uses, as applications do; one case checks that a queue declared through one node is routable
through another as soon as the declare is answered."""

from __future__ import annotations

import pika.exceptions

from amqp_helpers import QUIET, Consumer, bodies, channel, get, message_count, publish, pump_until


def mirrored_name(names, suffix):
    return "mirrored." + names + suffix


def declare(channels, queue, arguments=None):
    for ch in channels:
        ch.queue_declare(queue, arguments=arguments)


def test_queue_declared_through_one_node_is_routable_through_another_at_once(mirrored, names):
    """A declare answered by one node is seen by every node: a mandatory publish through another
    node right after it is routed, never returned (tried many times: a lag shows in some)."""
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[1]) as b:
        b.confirm_delivery()
        returned = []
        for i in range(40):
            q = mirrored_name(names, f"q{i}")
            a.queue_declare(q)
            try:
                b.basic_publish("", q, b"x", mandatory=True)
            except pika.exceptions.UnroutableError:
                returned.append(q)
        assert returned == []


def test_mirrored_round_trip_across_nodes(mirrored, names):
    q = mirrored_name(names, "q")
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[1]) as b:
        declare([a, b], q)
        for i in range(5):
            publish(b, "", q, str(i))
        assert bodies(a, q) == [str(i).encode() for i in range(5)]


def test_mirrored_queue_ttl_expires(mirrored, names):
    q = mirrored_name(names, "q")
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[2]) as c:
        declare([a, c], q, {"x-message-ttl": 100})
        publish(c, "", q, "old")
        c.connection.sleep(0.4)
        assert message_count(c, q) == 0


def test_mirrored_dead_lettering_across_nodes(mirrored, names):
    work, dead = mirrored_name(names, "work"), mirrored_name(names, "dead")
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[1]) as b, channel(mirrored.urls[2]) as c:
        declare([a, b, c], dead)
        declare([a, b, c], work, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead})
        publish(b, "", work, "job")
        method, _, _ = get(c, work, auto_ack=False)
        c.basic_reject(method.delivery_tag, requeue=False)
        _, props, body = get(b, dead)
        assert body == b"job"
        assert [(d["queue"], d["reason"]) for d in props.headers["x-death"]] == [(work, "rejected")]


def test_mirrored_priority_queue_across_nodes(mirrored, names):
    q = mirrored_name(names, "q")
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[1]) as b, channel(mirrored.urls[2]) as c:
        declare([a, b, c], q, {"x-max-priority": 9})
        for i, priority in enumerate([0, 9, 4, 9]):
            publish(b, "", q, str(i), priority=priority)
        assert bodies(c, q) == [b"1", b"3", b"2", b"0"]


def test_mirrored_per_message_expiration(mirrored, names):
    q = mirrored_name(names, "q")
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[1]) as b:
        declare([a, b], q)
        publish(b, "", q, "short", expiration="100")
        publish(b, "", q, "long", expiration="60000")
        b.connection.sleep(0.4)
        assert get(a, q)[2] == b"long"
        assert get(a, q, QUIET) is None


def test_mirrored_single_active_consumer_takeover_across_nodes(mirrored, names):
    q = mirrored_name(names, "sac")
    with channel(mirrored.urls[0]) as a, channel(mirrored.urls[1]) as b, channel(mirrored.urls[2]) as c:
        declare([a, b, c], q, {"x-single-active-consumer": True})
        first = Consumer(mirrored.urls[1], q, auto_ack=False, prefetch=1)
        second = Consumer(mirrored.urls[2], q)
        try:
            for i in range(3):
                publish(a, "", q, str(i))
            assert pump_until([first, second], lambda: first.got == [(b"0", False)])
            first.close()
            assert pump_until([second], lambda: len(second.got) == 3)
            assert second.got == [(b"0", True), (b"1", False), (b"2", False)]
        finally:
            first.close()
            second.close()
