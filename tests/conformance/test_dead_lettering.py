"""Dead-lettering as RabbitMQ 3.10 does it: what sends a message to the dead-letter exchange
(reject or nack without requeue, expiry, a length limit, `reject-publish-dlx`), the `x-death`
header and `x-first-death-*` it writes, the dead-letter routing key, cycle detection, and the
`dead-letter-*` policy keys."""

from __future__ import annotations

import datetime
import re

import pika
import pika.exceptions
import pytest

from amqp_helpers import QUIET, channel, channel_closed, get, message_count, publish


def dead_letter_setup(ch, names, **queue_args):
    """A fanout DLX `names+dlx` feeding queue `names+dead`, and a work queue `names+work` with the
    given arguments that dead-letters to it."""
    ch.exchange_declare(names + "dlx", "fanout")
    ch.queue_declare(names + "dead")
    ch.queue_bind(names + "dead", names + "dlx")
    ch.queue_declare(names + "work", arguments={"x-dead-letter-exchange": names + "dlx", **queue_args})
    return names + "work", names + "dead"


def only_death(props) -> dict:
    deaths = props.headers["x-death"]
    assert len(deaths) == 1, deaths
    return deaths[0]


def assert_death(death: dict, *, reason: str, queue: str, exchange: str, routing_keys: list[str]):
    assert death["count"] == 1
    assert death["reason"] == reason
    assert death["queue"] == queue
    assert death["exchange"] == exchange
    assert death["routing-keys"] == routing_keys
    assert isinstance(death["time"], datetime.datetime)  # an AMQP timestamp
    age = datetime.datetime.now(datetime.timezone.utc) - death["time"]
    assert abs(age.total_seconds()) < 60


def test_rejected_message_is_dead_lettered_with_x_death(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names)
        ch.exchange_declare(names + "src", "topic")
        ch.queue_bind(work, names + "src", "a.#")
        publish(ch, names + "src", "a.b", "m", headers={"app": "kept"}, priority=3)
        method, _, _ = get(ch, work, auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
        method, props, body = get(ch, dead)
        assert body == b"m"
        assert (method.exchange, method.routing_key) == (names + "dlx", "a.b")
        assert props.headers["app"] == "kept" and props.priority == 3
        assert_death(only_death(props), reason="rejected", queue=work, exchange=names + "src",
                     routing_keys=["a.b"])
        assert props.headers["x-first-death-reason"] == "rejected"
        assert props.headers["x-first-death-queue"] == work
        assert props.headers["x-first-death-exchange"] == names + "src"


def test_nack_multiple_without_requeue_dead_letters_each(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names)
        for i in range(3):
            publish(ch, "", work, f"n{i}")
        tags = [get(ch, work, auto_ack=False)[0].delivery_tag for _ in range(3)]
        ch.basic_nack(tags[-1], multiple=True, requeue=False)
        got = []
        while len(got) < 3 and (message := get(ch, dead)) is not None:
            got.append(message)
        assert [g[2] for g in got] == [b"n0", b"n1", b"n2"]
        assert {only_death(g[1])["reason"] for g in got} == {"rejected"}
        assert message_count(ch, work) == 0


def test_requeued_reject_is_not_dead_lettered(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names)
        publish(ch, "", work, "again")
        method, _, _ = get(ch, work, auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=True)
        method, _, body = get(ch, work)
        assert (body, method.redelivered) == (b"again", True)
        assert get(ch, dead, QUIET) is None


def test_queue_ttl_expiry_is_dead_lettered(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names, **{"x-message-ttl": 100})
        publish(ch, "", work, "old")
        method, props, body = get(ch, dead)
        assert body == b"old" and method.routing_key == work
        assert_death(only_death(props), reason="expired", queue=work, exchange="", routing_keys=[work])
        assert "original-expiration" not in only_death(props)
        assert props.headers["x-first-death-reason"] == "expired"


def test_per_message_expiry_is_dead_lettered_with_original_expiration(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names)
        publish(ch, "", work, "short", expiration="100")
        method, props, body = get(ch, dead)
        assert body == b"short"
        death = only_death(props)
        assert_death(death, reason="expired", queue=work, exchange="", routing_keys=[work])
        assert death["original-expiration"] == "100"
        assert props.expiration is None  # removed, so it does not expire again


def test_rejected_message_loses_its_expiration(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names)
        publish(ch, "", work, "m", expiration="60000")
        method, _, _ = get(ch, work, auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
        _, props, _ = get(ch, dead)
        assert props.expiration is None
        assert only_death(props)["original-expiration"] == "60000"


def test_max_length_drop_head_dead_letters_the_oldest(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names, **{"x-max-length": 1})
        publish(ch, "", work, "first")
        publish(ch, "", work, "second")
        _, props, body = get(ch, dead)
        assert body == b"first"
        assert_death(only_death(props), reason="maxlen", queue=work, exchange="", routing_keys=[work])
        assert get(ch, work)[2] == b"second"


def test_reject_publish_dlx_nacks_and_dead_letters_the_new_message(broker, names):
    with channel(broker.url) as ch:
        work, dead = dead_letter_setup(ch, names, **{"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
        ch.confirm_delivery()
        publish(ch, "", work, "kept")
        with pytest.raises(pika.exceptions.NackError):
            publish(ch, "", work, "refused")
        _, props, body = get(ch, dead)
        assert body == b"refused"
        assert_death(only_death(props), reason="maxlen", queue=work, exchange="", routing_keys=[work])
        assert get(ch, work)[2] == b"kept"


def test_dead_letter_routing_key_replaces_the_key(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "dlx", "direct")
        ch.queue_declare(names + "dead")
        ch.queue_bind(names + "dead", names + "dlx", "retry")
        ch.queue_declare(names + "work", arguments={"x-dead-letter-exchange": names + "dlx",
                                                   "x-dead-letter-routing-key": "retry"})
        publish(ch, "", names + "work", "m", expiration="50")
        method, props, _ = get(ch, names + "dead")
        assert method.routing_key == "retry"
        assert only_death(props)["routing-keys"] == [names + "work"]  # the keys it was published with


def test_default_exchange_as_dead_letter_exchange(broker, names):
    with channel(broker.url) as ch:
        ch.queue_declare(names + "dead")
        ch.queue_declare(names + "work", arguments={"x-dead-letter-exchange": "",
                                                   "x-dead-letter-routing-key": names + "dead"})
        publish(ch, "", names + "work", "m")
        method, _, _ = get(ch, names + "work", auto_ack=False)
        ch.basic_nack(method.delivery_tag, requeue=False)
        method, props, body = get(ch, names + "dead")
        assert (method.exchange, method.routing_key, body) == ("", names + "dead", b"m")
        assert only_death(props)["queue"] == names + "work"


def test_retry_loop_counts_deaths_most_recent_first(broker, names):
    """work rejects -> retry (TTL) expires -> back to work: one x-death entry per (queue, reason),
    its count growing, the most recent first; x-first-death-* stay those of the first."""
    work, retry = names + "work", names + "retry"
    with channel(broker.url) as ch:
        ch.queue_declare(work, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": retry})
        ch.queue_declare(retry, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": work,
                                           "x-message-ttl": 50})
        publish(ch, "", work, "job")
        seen = []
        for _ in range(3):
            method, props, _ = get(ch, work, auto_ack=False)
            seen.append(props.headers)
            ch.basic_reject(method.delivery_tag, requeue=False)
        assert seen[0] is None or "x-death" not in seen[0]
        for round_, headers in enumerate(seen[1:], 1):
            deaths = headers["x-death"]
            assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [
                (retry, "expired", round_), (work, "rejected", round_)]
            assert (headers["x-first-death-queue"], headers["x-first-death-reason"]) == (work, "rejected")


def test_retry_queue_set_by_policy_alone(broker, names):
    """The retry pattern applications build: a retry queue whose TTL and dead-letter target come
    from a policy sends a rejected job back to its work queue after the delay."""
    work, retry = names + "work", names + "retry"
    broker.set_policy(names + "retry", "^" + re.escape(retry) + "$",
                      {"message-ttl": 100, "dead-letter-exchange": "", "dead-letter-routing-key": work},
                      apply_to="queues")
    with channel(broker.url) as ch:
        ch.queue_declare(work, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": retry})
        ch.queue_declare(retry)
        publish(ch, "", work, "job")
        method, _, _ = get(ch, work, auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
        _, props, body = get(ch, work)
        assert body == b"job"
        assert [(d["queue"], d["reason"]) for d in props.headers["x-death"]] == [
            (retry, "expired"), (work, "rejected")]


def test_expiry_cycle_to_the_same_queue_is_dropped(broker, names):
    q = names + "self"
    with channel(broker.url) as ch:
        ch.queue_declare(q, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q,
                                       "x-message-ttl": 50})
        publish(ch, "", q, "loop")
        ch.connection.sleep(0.5)
        assert message_count(ch, q) == 0
        assert get(ch, q, QUIET) is None


def test_expiry_cycle_through_two_queues_is_dropped(broker, names):
    a, b = names + "a", names + "b"
    with channel(broker.url) as ch:
        ch.queue_declare(a, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": b,
                                       "x-message-ttl": 50})
        ch.queue_declare(b, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": a,
                                       "x-message-ttl": 50})
        publish(ch, "", a, "loop")
        ch.connection.sleep(0.6)
        assert (message_count(ch, a), message_count(ch, b)) == (0, 0)


def test_dead_letter_exchange_that_does_not_exist_drops_quietly(broker, names):
    with channel(broker.url) as ch:
        ch.queue_declare(names + "work", arguments={"x-dead-letter-exchange": names + "missing"})
        publish(ch, "", names + "work", "m")
        method, _, _ = get(ch, names + "work", auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
        assert message_count(ch, names + "work") == 0
        assert ch.is_open


def test_dead_letter_policy_keys_apply_to_a_live_queue(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "dlx", "direct")
        ch.queue_declare(names + "dead")
        ch.queue_bind(names + "dead", names + "dlx", "by-policy")
        ch.queue_declare(names + "work")
        publish(ch, "", names + "work", "m")
        broker.set_policy(names + "dl", "^" + re.escape(names + "work") + "$",
                          {"dead-letter-exchange": names + "dlx", "dead-letter-routing-key": "by-policy"},
                          apply_to="queues")
        ch.connection.sleep(0.3)  # the queue hears of its policy asynchronously
        method, _, _ = get(ch, names + "work", auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
        method, props, _ = get(ch, names + "dead")
        assert method.routing_key == "by-policy"
        assert only_death(props)["reason"] == "rejected"


def test_dead_letter_exchange_argument_beats_policy_but_policy_key_fills_in(broker, names):
    """RabbitMQ 3.10 resolves each key on its own: the queue's x-dead-letter-exchange wins over the
    policy's, while the policy's dead-letter-routing-key applies since the queue sets none."""
    with channel(broker.url) as ch:
        for side in ("arg", "pol"):
            ch.exchange_declare(names + side, "fanout")
            ch.queue_declare(names + "dead-" + side)
            ch.queue_bind(names + "dead-" + side, names + side)
        ch.queue_declare(names + "work", arguments={"x-dead-letter-exchange": names + "arg"})
        broker.set_policy(names + "dl", "^" + re.escape(names + "work") + "$",
                     {"dead-letter-exchange": names + "pol", "dead-letter-routing-key": "polkey"},
                     apply_to="queues")
        ch.connection.sleep(0.3)  # the queue hears of its policy asynchronously
        publish(ch, "", names + "work", "m")
        method, _, _ = get(ch, names + "work", auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
        method, _, _ = get(ch, names + "dead-arg")
        assert method.routing_key == "polkey"
        assert get(ch, names + "dead-pol", QUIET) is None


@pytest.mark.parametrize("arguments, text", [
    ({"x-dead-letter-routing-key": "k"},
     "invalid arg 'x-dead-letter-routing-key' for queue '{q}' in vhost '/': routing_key_but_no_dlx_defined"),
    ({"x-dead-letter-exchange": 5},
     "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue '{q}' in vhost '/'"),
], ids=["key-without-exchange", "exchange-not-a-string"])
def test_bad_dead_letter_arguments(broker, names, arguments, text):
    q = names + "bad"
    with channel(broker.url) as ch:
        with channel_closed(406, "PRECONDITION_FAILED - " + text.format(q=q)):
            ch.queue_declare(q, arguments=arguments)
