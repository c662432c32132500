"""Unit tests of the queue rules of priority queues (mirroring/priority_store.py), single active
consumer and consumer priorities (mirroring/queue.py), and of reading a message's priority from
its AMQP property bytes (wire/props.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.queue import Limits, QueueState, check_arguments, limits_from
from wire.errors import ProtocolError
from wire.props import dict_to_raw, priority_of

A, B, C = ("n1", 1, 1), ("n1", 2, 1), ("n2", 3, 1)
MAX = 3


def props(p):
    return None if p is None else {"priority": p}


def order_of(q: QueueState) -> list[int]:
    return [m[0] for m in q.ready]


def expected_order(q: QueueState) -> list[int]:
    """RabbitMQ's order: the higher priority (above the maximum counted as it) first, then by id."""
    def key(m):
        return (-min(priority_of(m[2]), MAX), m[0])
    return [m[0] for m in sorted(q.ready, key=key)]


op = st.one_of(
    st.tuples(st.just("publish"), st.lists(st.sampled_from([None, 0, 1, 2, 3, 7]), min_size=1, max_size=5)),
    st.tuples(st.just("dispatch"), st.integers(1, 4)),
    st.tuples(st.just("get"), st.booleans()),
    st.tuples(st.sampled_from(["ack", "requeue"]), st.integers(0, 4), st.integers(1, 3)),
    st.tuples(st.just("expire_upto"), st.integers(0, 12)),
    st.tuples(st.just("drop_over"), st.integers(0, 6)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_ready_messages_stay_in_priority_then_publish_order(ops):
    q = QueueState("q", MAX)
    for o in ops:
        kind = o[0]
        if kind == "publish":
            q.publish([b"x"] * len(o[1]), [props(p) for p in o[1]])
        elif kind == "dispatch":
            if (A, "t") not in q.consumers:
                q.add_consumer(A, "t", False, o[1])
            q.dispatch()
        elif kind == "get":
            q.get(A, o[1])
        elif kind in ("ack", "requeue"):
            mine = sorted(q.unacked)[o[1]:o[1] + o[2]]  # any run: a requeue lands among the ready
            getattr(q, kind)(A, mine)
        elif kind == "expire_upto":
            q.drop_upto(o[1], True)
        else:
            q.drop_over(Limits(max_length=o[1]))
        assert order_of(q) == expected_order(q), o
        assert len(q.ready) == len(order_of(q))
        assert q.ready_bytes == len(q.ready)
        assert [m[0] for m in q.ready_by_id()] == sorted(order_of(q))
        if q.ready:
            assert q.ready[0] == next(iter(q.ready))


def test_drop_head_takes_the_highest_priority_first_and_a_mirror_follows():
    """RabbitMQ's priority queues drop from their head, which is the highest priority's: with
    a length limit of 2, the priority-3 message goes before older ones of lower priority. A
    mirror applying the leader's effects takes the same messages; with a dead-letter holder
    they are held as unacknowledged by it, on the mirror too."""
    for holder in (None, ("n1", 0, 0)):
        leader, mirror = QueueState("q", MAX), QueueState("q", MAX)
        leader.effects = []
        leader.publish([b"a", b"b", b"c", b"d"], [props(1), props(3), props(0), props(2)])
        if holder is None:
            assert leader.drop_over(Limits(max_length=2)) == 2
        else:
            assert [m[1] for m in leader.dead_over(Limits(max_length=2), holder)] == [b"b", b"d"]
        assert [m[1] for m in leader.ready] == [b"a", b"c"]
        assert leader.ready_bytes == 2
        mirror.apply_effects(leader.effects)
        assert [m[1] for m in mirror.ready] == [b"a", b"c"] and mirror.ready_bytes == 2
        held = {mid: e[0] for mid, e in mirror.unacked.items()}
        assert held == ({} if holder is None else {2: holder, 4: holder})


def test_requeued_message_goes_back_to_its_priority_position():
    q = QueueState("q", 3)
    q.publish([b"a", b"b"], [props(3), props(1)])
    got = q.get(A, False)
    assert got[1] == b"a"
    q.publish([b"c"], [props(2)])
    q.requeue(A, [got[0]])
    assert [(m[1], m[3]) for m in q.ready] == [(b"a", True), (b"c", False), (b"b", False)]


def test_priorities_are_ignored_without_max_priority_and_zero_means_plain():
    for q in (QueueState("q"), QueueState("q", limits_from({"x-max-priority": 0}).max_priority)):
        q.publish([b"1", b"9", b"5"], [props(1), props(9), props(5)])
        assert [m[1] for m in q.ready] == [b"1", b"9", b"5"]
        assert not q.prioritised


def test_a_sync_puts_older_messages_in_their_priority_places():
    leader = QueueState("q", 5)
    leader.effects = []
    leader.add_consumer(A, "a", False, 1)
    leader.publish([b"0", b"1", b"2", b"3"], [props(1), props(5), props(1), props(3)])
    leader.dispatch()  # "1" (priority 5) unacknowledged
    leader.effects = []
    m = QueueState("q", 5)
    m.reset_as_mirror(leader.mirror_snapshot())
    leader.publish([b"4", b"5"], [props(5), props(0)])
    m.apply_effects(leader.effects)
    assert [x[1] for x in m.ready] == [b"4", b"5"]
    older = sorted([list(x) for x in leader.ready if x[0] < 5] + [list(e[2]) for e in leader.unacked.values()])
    m.add_synced_messages(older)
    assert m.comparable() == leader.comparable()
    assert [x[1] for x in m.ready] == [b"4", b"3", b"0", b"2", b"5"]
    assert [x[0] for x in m.ready_between(0, 5, 10)] == [1, 3, 4]  # by id, below 5
    assert [x[0] for x in m.ready_between(1, 7, 2)] == [3, 4]


def test_priority_of_reads_the_octet_from_amqp_property_bytes():
    for p, extra in [(0, {}), (5, {"content_type": "text/plain", "headers": {"k": "v" * 300}}),
                     (255, {"content_encoding": "gzip", "delivery_mode": 2})]:
        raw = dict_to_raw({"priority": p, **extra})
        assert priority_of(["", "q", raw]) == p
    assert priority_of(["", "q", dict_to_raw({"headers": {"priority": 4}})]) == 0
    assert priority_of({"priority": 7}) == 7 and priority_of(None) == 0 and priority_of({}) == 0


# --- consumer priorities -------------------------------------------------------------------------

def by_tag(result):
    return {c.tag: [m[1] for m in batch] for c, batch in result}


def test_the_highest_consumer_priority_with_credit_is_served_first():
    q = QueueState("q")
    q.add_consumer(A, "low", False, 2, arguments={"x-priority": 1})
    q.add_consumer(B, "high", False, 2, arguments={"x-priority": 10})
    q.publish([b"0", b"1", b"2", b"3", b"4"], None)
    assert by_tag(q.dispatch()) == {"high": [b"0", b"1"], "low": [b"2", b"3"]}
    q.ack(A, [3])
    q.ack(B, [1])
    assert by_tag(q.dispatch()) == {"high": [b"4"]}


def test_consumers_of_one_priority_share_round_robin():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0, arguments={"x-priority": 5})
    q.add_consumer(B, "b", False, 0, arguments={"x-priority": 5})
    q.add_consumer(C, "low", False, 0, arguments={"x-priority": -1})
    q.publish([b"%d" % i for i in range(4)], None)
    assert by_tag(q.dispatch()) == {"a": [b"0", b"2"], "b": [b"1", b"3"]}


# --- single active consumer ----------------------------------------------------------------------

def test_single_active_consumer_serves_the_first_registered_alone():
    q = QueueState("q", single_active=True)
    q.add_consumer(A, "first", False, 1)
    q.add_consumer(B, "second", False, 0)
    q.publish([b"0", b"1", b"2"], None)
    assert by_tag(q.dispatch()) == {"first": [b"0"]}
    assert q.dispatch() == []  # the active one has no credit: nobody else is served
    q.ack(A, [1])
    assert by_tag(q.dispatch()) == {"first": [b"1"]}
    assert list(q.consumers) == [(A, "first"), (B, "second")]  # no rotation


def test_single_active_consumer_next_takes_over_when_the_channel_goes():
    q = QueueState("q", single_active=True)
    q.add_consumer(A, "first", False, 1)
    q.add_consumer(B, "second", True, 0)
    q.publish([b"0", b"1", b"2"], None)
    q.dispatch()
    q.owner_gone(A)
    assert [(m[1], m[3]) for _, batch in q.dispatch() for m in batch] == \
        [(b"0", True), (b"1", False), (b"2", False)]


def test_a_cancelled_active_consumer_hands_over_at_the_queues_next_run():
    """RabbitMQ: the next consumer is active at once but served when the queue next runs, so a
    cancel followed by the channel's close gets the unacknowledged message back first."""
    q = QueueState("q", single_active=True)
    q.add_consumer(A, "first", False, 1)
    q.add_consumer(B, "second", True, 0)
    q.publish([b"0", b"1"], None)
    q.dispatch()
    q.remove_consumer(A, "first")
    assert q.dispatch() == []
    q.owner_gone(A)
    assert by_tag(q.dispatch()) == {"second": [b"0", b"1"]}
    q.remove_consumer(B, "second")
    q.add_consumer(C, "third", True, 0)
    q.publish([b"2"], None)
    assert by_tag(q.dispatch()) == {"third": [b"2"]}


def test_single_active_consumer_order_survives_a_promotion():
    leader = QueueState("q", single_active=True)
    leader.effects = []
    mirror = QueueState("q", single_active=True)
    mirror.reset_as_mirror(leader.mirror_snapshot())
    for owner, tag in ((C, "on-n2"), (A, "on-n1"), (B, "on-n1-too")):
        leader.add_consumer(owner, tag, False, 0)
    leader.publish([b"0"], None)
    leader.dispatch()
    mirror.apply_effects(leader.effects)
    mirror.failover()
    mirror.node_gone("n2")  # the active consumer's node died with the leader
    mirror.publish([b"1"], None)
    assert by_tag(mirror.dispatch()) == {"on-n1": [b"0", b"1"]}


@pytest.mark.parametrize("arguments, text", [
    ({"x-max-priority": 256}, "{max_value_exceeded,256}"),
    ({"x-max-priority": -1}, "{value_negative,-1}"),
    ({"x-max-priority": True}, '"expected integer, got bool"'),
    ({"x-single-active-consumer": 1}, "{unacceptable_type,long}"),
])
def test_bad_arguments_refused_with_rabbitmqs_text(arguments, text):
    with pytest.raises(ProtocolError) as e:
        check_arguments("q", arguments)
    assert e.value.code == 406 and e.value.text.endswith(f"for queue 'q' in vhost '/': {text}")


def test_an_active_consumer_cancelled_by_a_failover_hands_over_to_the_next():
    """x-cancel-on-ha-failover: the promoted leader cancels it (its client is told with
    basic.cancel) and the next registered consumer is served."""
    q = QueueState("q", single_active=True)
    q.add_consumer(A, "first", False, 0, arguments={"x-cancel-on-ha-failover": True})
    q.add_consumer(B, "second", True, 0)
    q.publish([b"0"], None)
    q.dispatch()
    cancelled = q.failover()
    assert [c.tag for c in cancelled] == ["first"]
    assert by_tag(q.dispatch()) == {"second": [b"0"]}  # requeued by the failover, flagged
