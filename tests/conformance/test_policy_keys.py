"""Policy keys RabbitMQ 3.10 applies to classic queues, taking effect live on a queue that
already exists (`max-length`, `max-length-bytes`, `overflow`, `expires`), and the precedence
between a queue's own argument and its policy (the lower limit counts; the argument's overflow
wins)."""

from __future__ import annotations

import re
import time

import pika.exceptions
import pytest

from amqp_helpers import bodies, channel, channel_closed, get, message_count, publish, wait_until


def only(q):
    return "^" + re.escape(q) + "$"


def test_max_length_policy_trims_a_live_queue(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        for i in range(6):
            publish(ch, "", q, str(i))
        broker.set_policy(names + "p", only(q), {"max-length": 2}, apply_to="queues")
        assert wait_until(lambda: message_count(ch, q) == 2, conn=ch.connection)
        assert bodies(ch, q) == [b"4", b"5"]


def test_max_length_policy_cleared_lifts_the_limit(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        broker.set_policy(names + "p", only(q), {"max-length": 1}, apply_to="queues")
        ch.connection.sleep(0.2)
        broker.clear_policy(names + "p")
        ch.connection.sleep(0.2)
        for i in range(3):
            publish(ch, "", q, str(i))
        assert bodies(ch, q) == [b"0", b"1", b"2"]


def test_max_length_bytes_policy_counts_bodies(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        broker.set_policy(names + "p", only(q), {"max-length-bytes": 10}, apply_to="queues")
        ch.connection.sleep(0.2)
        for body in ("aaaa", "bbbb", "cccc"):
            publish(ch, "", q, body)
        assert bodies(ch, q) == [b"bbbb", b"cccc"]


def test_max_length_bytes_policy_trims_a_live_queue(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        for body in ("aaaa", "bbbb", "cccc"):
            publish(ch, "", q, body)
        broker.set_policy(names + "p", only(q), {"max-length-bytes": 10}, apply_to="queues")
        assert wait_until(lambda: message_count(ch, q) == 2, conn=ch.connection)
        assert bodies(ch, q) == [b"bbbb", b"cccc"]


def test_max_length_bytes_argument(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-length-bytes": 10})
        for body in ("aaaa", "bbbb", "cccc"):
            publish(ch, "", q, body)
        assert bodies(ch, q) == [b"bbbb", b"cccc"]


def test_overflow_reject_publish_policy_nacks(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        broker.set_policy(names + "p", only(q), {"max-length": 1, "overflow": "reject-publish"},
                          apply_to="queues")
        ch.connection.sleep(0.2)
        ch.confirm_delivery()
        publish(ch, "", q, "kept")
        with pytest.raises(pika.exceptions.NackError):
            publish(ch, "", q, "refused")
        assert bodies(ch, q) == [b"kept"]


def test_expires_policy_deletes_an_unused_queue(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
    broker.set_policy(names + "p", only(q), {"expires": 200}, apply_to="queues")
    time.sleep(0.5)

    def gone():
        try:
            with channel(broker.url) as ch:
                ch.queue_declare(q, passive=True)
        except pika.exceptions.ChannelClosedByBroker as e:
            assert (e.reply_code, e.reply_text) == (404, f"NOT_FOUND - no queue '{q}' in vhost '/'")
            return True
        return False

    # a passive declare may renew the lease: ask less often than it lasts
    assert wait_until(gone, timeout=3, step=0.5)


def test_lower_max_length_of_argument_and_policy_counts(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-length": 5})
        broker.set_policy(names + "p", only(q), {"max-length": 2}, apply_to="queues")
        ch.connection.sleep(0.2)
        for i in range(6):
            publish(ch, "", q, str(i))
        assert bodies(ch, q) == [b"4", b"5"]
        broker.set_policy(names + "p", only(q), {"max-length": 10}, apply_to="queues")
        ch.connection.sleep(0.2)
        for i in range(8):
            publish(ch, "", q, str(i))
        assert bodies(ch, q) == [b"3", b"4", b"5", b"6", b"7"]


def test_overflow_argument_beats_policy(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-max-length": 1, "x-overflow": "drop-head"})
        broker.set_policy(names + "p", only(q), {"overflow": "reject-publish"}, apply_to="queues")
        ch.connection.sleep(0.2)
        for i in range(3):
            publish(ch, "", q, str(i))
        assert bodies(ch, q) == [b"2"]


def test_bad_overflow_argument(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        with channel_closed(406, f"PRECONDITION_FAILED - invalid arg 'x-overflow' for queue '{q}' in "
                                 f"vhost '/': invalid_overflow"):
            ch.queue_declare(q, arguments={"x-overflow": "nope"})


def test_policy_of_higher_priority_wins(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        broker.set_policy(names + "low", only(q), {"max-length": 1}, priority=1, apply_to="queues")
        broker.set_policy(names + "high", "^" + re.escape(names), {"max-length": 3}, priority=5,
                          apply_to="queues")
        ch.connection.sleep(0.2)
        for i in range(5):
            publish(ch, "", q, str(i))
        assert get(ch, q) is not None and message_count(ch, q) == 2
