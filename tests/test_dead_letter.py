"""Dead-lettering's rules (mirroring/dead_letter.py) and the TTL rules they rely on
(mirroring/queue.py): where a queue dead-letters to, the x-death header, cycle detection, the
head-only expiry of messages with deadlines of their own, and what a queue holds for its
dead-letter publisher."""

from __future__ import annotations

import datetime

import pytest
from pamqp import commands

from mirroring import dead_letter as dl
from mirroring.queue import Limits, QueueState, check_arguments, limits_from
from wire import props as propsmod
from wire.errors import ProtocolError

HOLDER = ("n1", 99, 0)
WALL = 1_800_000_000.0


def amqp_item(exchange="", key="q", **props):
    return [exchange, key, commands.Basic.Properties(**props).marshal()]


def headers(item):
    return propsmod.decode_raw(item[2]).headers


def test_each_dead_letter_key_is_the_arguments_else_the_policys():
    assert dl.target_from({}, {}) is None
    assert dl.target_from({"x-dead-letter-exchange": "a"}, {"dead-letter-exchange": "p",
                                                            "dead-letter-routing-key": "pk"}) == \
        dl.Target("a", "pk")
    assert dl.target_from({"x-dead-letter-routing-key": "ak"}, {"dead-letter-exchange": ""}) == \
        dl.Target("", "ak")
    assert limits_from({}, {"dead-letter-exchange": "x"}).dead_letter == dl.Target("x", None)
    lim = limits_from({"x-overflow": "reject-publish-dlx", "x-max-length": 1}, {})
    assert lim.reject_publish and lim.reject_publish_dlx


@pytest.mark.parametrize("arguments, text", [
    ({"x-dead-letter-routing-key": "k"},
     "invalid arg 'x-dead-letter-routing-key' for queue 'q' in vhost '/': routing_key_but_no_dlx_defined"),
    ({"x-dead-letter-exchange": 5}, "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue 'q'"),
    ({"x-overflow": "nope"}, "invalid arg 'x-overflow' for queue 'q' in vhost '/': invalid_overflow"),
    ({"x-message-ttl": "x"}, "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': "
                             '"expected integer, got longstr"'),
])
def test_bad_arguments_get_rabbitmqs_texts(arguments, text):
    with pytest.raises(ProtocolError) as info:
        check_arguments("q", arguments)
    assert text in info.value.text


def test_x_death_counts_per_queue_and_reason_most_recent_first():
    item = amqp_item("src", "a.b", headers={"app": "kept", "CC": ["c.d"]}, expiration="60000")
    first = dl.dead_props(item, "work", dl.REJECTED, WALL)
    h = headers(first)
    (death,) = h["x-death"]
    assert death["count"] == 1 and death["reason"] == "rejected" and death["queue"] == "work"
    assert death["exchange"] == "src" and death["routing-keys"] == ["a.b", "c.d"]
    assert death["original-expiration"] == "60000"
    assert death["time"] == datetime.datetime.fromtimestamp(WALL, datetime.timezone.utc)
    assert propsmod.decode_raw(first[2]).expiration is None
    assert (h["x-first-death-queue"], h["x-first-death-reason"], h["x-first-death-exchange"]) == \
        ("work", "rejected", "src")
    assert h["app"] == "kept"
    second = dl.dead_props(["", "work", first[2]], "retry", dl.EXPIRED, WALL)
    third = dl.dead_props(["", "retry", second[2]], "work", dl.REJECTED, WALL)
    deaths = headers(third)["x-death"]
    assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [
        ("work", "rejected", 2), ("retry", "expired", 1)]
    assert headers(third)["x-first-death-queue"] == "work"


def test_cycles_only_when_every_death_since_is_automatic():
    expired_here = dl.dead_props(amqp_item(key="a"), "a", dl.EXPIRED, WALL)
    assert dl.cycles(expired_here, "a")
    assert not dl.cycles(expired_here, "b")
    via_b = dl.dead_props(["", "b", expired_here[2]], "b", dl.EXPIRED, WALL)
    assert dl.cycles(via_b, "a") and dl.cycles(via_b, "b")
    rejected = dl.dead_props(amqp_item(key="a"), "a", dl.REJECTED, WALL)
    assert not dl.cycles(rejected, "a")
    retried = dl.dead_props(["", "r", rejected[2]], "r", dl.EXPIRED, WALL)
    assert not dl.cycles(retried, "a")  # the cycle holds a rejection: the retry loop goes on


def ids(msgs):
    return [m[0] for m in msgs]


def test_only_the_head_expires_and_messages_without_a_deadline_are_kept():
    q = QueueState("q")
    q.publish([b"plain"], None, now=0.0)
    q.publish([b"short"], None, now=0.0, ttl=0.1)
    q.publish([b"long"], None, now=0.0, ttl=60.0)
    q.publish([b"plain2"], None, now=0.0)
    assert q.expire(1.0) == 0  # "plain" has no deadline and is at the head: nothing expires
    assert q.next_expiry() is None
    assert ids(q.get(("n1", 1, 1), True) for _ in range(1)) == [1]
    assert q.next_expiry() == 0.1
    assert q.expire(1.0) == 1 and ids(q.ready) == [3, 4]  # "short" went; "long" blocks
    q.get(("n1", 1, 1), True)
    assert q.expire(61.0) == 0 and ids(q.ready) == [4]  # "plain2" never expires
    assert q.next_expiry() is None


def test_an_acknowledged_message_does_not_hold_back_the_expiry_behind_it():
    """While "long" is unacknowledged it may come back (requeued) before its own deadline, so
    the expiry behind it waits; once it is acknowledged, "short" is the head."""
    q = QueueState("q")
    q.publish([b"long"], None, now=0.0, ttl=60.0)
    q.publish([b"short"], None, now=0.0, ttl=0.1)
    assert q.expire(1.0) == 0
    owner = ("n1", 1, 1)
    q.add_consumer(owner, "t", False, 1)
    q.dispatch()
    assert q.next_expiry() == 60.0 and q.expire(1.0) == 0
    q.ack(owner, [1])
    assert q.next_expiry() == 0.1
    assert q.expire(1.0) == 1 and not q.ready


def test_dead_lettered_messages_are_held_until_the_holder_acks():
    q = QueueState("q")
    q.effects = []
    mirror = QueueState("q")
    mirror.reset_as_mirror(q.mirror_snapshot())
    q.publish([b"a", b"b", b"c"], None, now=0.0, ttl=1.0)
    owner = ("n2", 5, 1)
    q.add_consumer(owner, "t", False, 1)
    (_, [delivered]), = q.dispatch()
    assert ids(q.dead_settle(owner, [delivered[0]], HOLDER)) == [1]
    assert q.consumers[(owner, "t")].in_flight == 0
    taken = q.dead_head(q.expired_by(2.0), True, HOLDER)
    assert ids(taken) == [2, 3] and not q.ready
    assert {mid: e[0] for mid, e in q.unacked.items()} == {1: HOLDER, 2: HOLDER, 3: HOLDER}
    mirror.apply_effects(q.effects, 0.0)
    assert mirror.comparable() == q.comparable()
    q.effects = []
    q.failover()  # a new leader gives them back (flagged), to be dead-lettered again
    assert [(m[0], m[3]) for m in q.ready] == [(1, True), (2, True), (3, True)]
    assert q.expire(2.0) == 3


def test_over_limits_names_the_head_that_must_go():
    q = QueueState("q")
    q.publish([b"aaaa", b"bbbb", b"cccc"], None)
    assert q.over_limits(Limits(max_length=3)) == 0
    assert q.over_limits(Limits(max_length=1)) == 2
    assert q.over_limits(Limits(max_bytes=10)) == 1


def test_a_mirror_keeps_the_deadline_its_leader_gave_not_a_new_one():
    """The leader enqueues at 0.0 with a 10 s TTL and ships the batch at 0.5 (a linger); the
    mirror, whose clock reads 100.7 when it applies it, expires it at the leader's deadline on its
    own clock (10 - 0.5 + 100.7 = 110.2), not 10 s after it applied it."""
    leader = QueueState("q")
    leader.effects = []
    mirror = QueueState("q")
    mirror.reset_as_mirror(leader.mirror_snapshot())
    leader.publish([b"a"], None, now=0.0, ttl=10.0)
    mirror.apply_effects(leader.effects, 100.7, sent=0.5)
    assert list(mirror.expiry) == [(1, pytest.approx(110.2))]
    assert mirror.expire(110.19) == 0 and mirror.expire(110.21) == 1
