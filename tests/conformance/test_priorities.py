"""Queue priorities as RabbitMQ 3.10 has them: `x-max-priority` (argument only) and its bad
values, higher priority delivered first, FIFO within a priority, priorities above the maximum
counted as the maximum and no priority as 0, and a length limit's drop-head taking from the head
in that order (the highest priority's first)."""

from __future__ import annotations

import pytest

from amqp_helpers import bodies, channel, channel_closed, publish


def publish_priorities(ch, q, priorities):
    for i, priority in enumerate(priorities):
        publish(ch, "", q, f"{i}:{priority}", priority=priority)


def test_higher_priority_first_fifo_within_a_priority(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-priority": 10})
        publish_priorities(ch, q, [1, 5, 1, 10, 5, 0])
        assert bodies(ch, q) == [b"3:10", b"1:5", b"4:5", b"0:1", b"2:1", b"5:0"]


def test_priority_above_the_maximum_counts_as_the_maximum(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-priority": 5})
        publish_priorities(ch, q, [None, 1, 5, 9, 1, 0, 5, None])
        assert bodies(ch, q) == [b"2:5", b"3:9", b"6:5", b"1:1", b"4:1", b"0:None", b"5:0", b"7:None"]


def test_drop_head_takes_the_highest_priority_first(broker, names):
    """x-overflow drop-head drops from the head, and a priority queue's head is its highest
    priority: the newest, lower-priority messages stay."""
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-priority": 10, "x-max-length": 3})
        publish_priorities(ch, q, [1, 9, 5, 1, 0, 9])
        assert bodies(ch, q) == [b"0:1", b"3:1", b"4:0"]


def test_priorities_ignored_without_max_priority(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        publish_priorities(ch, q, [1, 9, 5])
        assert bodies(ch, q) == [b"0:1", b"1:9", b"2:5"]


def test_priority_order_among_unacknowledged_and_requeued(broker, names):
    """A requeued message goes back in its priority's place."""
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-priority": 3})
        publish_priorities(ch, q, [3, 1])
        method, _, body = ch.basic_get(q, auto_ack=False)
        assert body == b"0:3"
        publish_priorities(ch, q, [2])
        ch.basic_nack(method.delivery_tag, requeue=True)
        assert bodies(ch, q) == [b"0:3", b"0:2", b"1:1"]


@pytest.mark.parametrize("value", [1, 255])
def test_max_priority_bounds_accepted(broker, names, value):
    with channel(broker.url) as ch:
        ch.queue_declare(names + "q", arguments={"x-max-priority": value})


@pytest.mark.parametrize("value, reason", [
    (256, "{max_value_exceeded,256}"),
    (-1, "{value_negative,-1}"),
    ("x", '"expected integer, got longstr"'),
], ids=["too-large", "negative", "string"])
def test_bad_max_priority_refused(broker, names, value, reason):
    q = names + "q"
    with channel(broker.url) as ch:
        with channel_closed(406, f"PRECONDITION_FAILED - invalid arg 'x-max-priority' for queue '{q}' "
                                 f"in vhost '/': {reason}"):
            ch.queue_declare(q, arguments={"x-max-priority": value})
