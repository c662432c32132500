"""Message TTLs as RabbitMQ 3.10 applies them: the queue's `x-message-ttl`, the `message-ttl`
policy key, the per-message `expiration` property, their bad values, and which of argument and
policy counts."""

from __future__ import annotations

import re

import pytest

from amqp_helpers import QUIET, channel, channel_closed, get, message_count, publish


def test_queue_ttl_expires_messages(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-message-ttl": 100})
        publish(ch, "", q, "old")
        ch.connection.sleep(0.4)
        assert get(ch, q, QUIET) is None


def test_queue_ttl_keeps_fresh_messages(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-message-ttl": 60000})
        publish(ch, "", q, "fresh")
        assert get(ch, q)[2] == b"fresh"


def test_per_message_expiration_applies(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        publish(ch, "", q, "short", expiration="100")
        publish(ch, "", q, "long", expiration="60000")
        ch.connection.sleep(0.4)
        _, props, body = get(ch, q)
        assert body == b"long" and props.expiration == "60000"  # carried to the consumer
        assert get(ch, q, QUIET) is None


def test_lower_of_per_message_and_queue_ttl_applies(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-message-ttl": 100})
        publish(ch, "", q, "m", expiration="60000")
        ch.connection.sleep(0.4)
        assert get(ch, q, QUIET) is None


def test_expiration_zero_expires_without_a_waiting_consumer(broker, names):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        publish(ch, "", q, "now-or-never", expiration="0")
        ch.connection.sleep(0.2)
        assert get(ch, q, QUIET) is None


@pytest.mark.parametrize("expiration, reason", [("abc", "no_integer"), ("-1", "{value_negative,-1}")],
                         ids=["not-a-number", "negative"])
def test_bad_expiration_closes_the_channel(broker, names, expiration, reason):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        with channel_closed(406, f"PRECONDITION_FAILED - invalid expiration '{expiration}': {reason}"):
            publish(ch, "", q, "m", expiration=expiration)
            ch.queue_declare(q, passive=True)  # a round trip, to hear of the error


@pytest.mark.parametrize("value, reason", [(-1, "{value_negative,-1}"),
                                           ("x", '"expected integer, got longstr"')],
                         ids=["negative", "string"])
def test_bad_queue_ttl_refused(broker, names, value, reason):
    q = names + "q"
    with channel(broker.url) as ch:
        with channel_closed(406, f"PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue '{q}' "
                                 f"in vhost '/': {reason}"):
            ch.queue_declare(q, arguments={"x-message-ttl": value})


def test_message_ttl_policy_expires_messages(broker, names):
    q = names + "q"
    broker.set_policy(names + "ttl", "^" + re.escape(q) + "$", {"message-ttl": 100}, apply_to="queues")
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        publish(ch, "", q, "m")
        ch.connection.sleep(0.4)
        assert get(ch, q, QUIET) is None


@pytest.mark.parametrize("argument, policy", [(100, 60000), (60000, 100)],
                         ids=["argument-lower", "policy-lower"])
def test_lower_of_argument_and_policy_ttl_applies(broker, names, argument, policy):
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-message-ttl": argument})
        broker.set_policy(names + "ttl", "^" + re.escape(q) + "$", {"message-ttl": policy}, apply_to="queues")
        ch.connection.sleep(0.3)  # the queue hears of its policy asynchronously
        publish(ch, "", q, "m")
        ch.connection.sleep(0.4)
        assert message_count(ch, q) == 0


def test_message_ttl_policy_set_later_spares_messages_already_queued(broker, names):
    """RabbitMQ 3.10 gives a message its deadline when it is enqueued: a message-ttl set by a policy
    afterwards expires the messages published after it only."""
    q = names + "q"
    with channel(broker.url) as ch:
        ch.queue_declare(q)
        publish(ch, "", q, "before")
        broker.set_policy(names + "ttl", "^" + re.escape(q) + "$", {"message-ttl": 100}, apply_to="queues")
        ch.connection.sleep(0.3)
        publish(ch, "", q, "after")
        ch.connection.sleep(0.4)
        assert get(ch, q)[2] == b"before"
        assert get(ch, q, QUIET) is None
