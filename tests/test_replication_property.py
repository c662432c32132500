"""Property test: a leader's effects, applied by its mirrors in order, keep every mirror's state
equal to the leader's (spec: "The mirrors apply the operations that occur to the leader in
exactly the same order as the leader and thus maintain the same state").

The leader's own decisions are covered too: messages expiring (x-message-ttl, time passing
between operations, batches with and without a TTL mixed as per-message expirations make them),
the head dropped over a length limit (x-overflow drop-head), publishes refused by a full queue
(reject-publish), and dead-lettering: expired, over-limit and rejected messages passed to the
dead-letter publisher's holder (mirroring/dead_letter.py), which acknowledges them later.

A mirror that starts late (unsynchronised) is also checked: its ready messages are the leader's
ready messages from its start id on, and once the leader holds nothing older than that start,
it equals the leader exactly.

Each property runs on a plain queue and on the kinds with their own rules: a priority queue
(x-max-priority, messages of mixed priorities), a single active consumer queue, and consumers
with priorities (x-priority).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.queue import Limits, QueueState

OWNERS = [("n1", 1, 1), ("n1", 1, 2), ("n2", 5, 1), ("n3", 9, 1)]
HOLDER = ("n1", 77, 0)  # the dead-letter publisher of the leader's node

op = st.one_of(
    st.tuples(st.just("publish"), st.integers(1, 5), st.sampled_from(OWNERS)),
    st.tuples(st.just("consume"), st.sampled_from(OWNERS), st.sampled_from(["a", "b"]),
              st.booleans(), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("cancel"), st.sampled_from(OWNERS), st.sampled_from(["a", "b"])),
    st.tuples(st.just("dispatch")),
    st.tuples(st.just("get"), st.sampled_from(OWNERS), st.booleans()),
    st.tuples(st.sampled_from(["ack", "requeue", "discard"]), st.integers(0, 3),
              st.integers(0, 6)),
    st.tuples(st.just("ack"), st.integers(0, 3), st.integers(1, 6)),  # acks are the common case
    st.tuples(st.just("owner_gone"), st.sampled_from(OWNERS)),
    st.tuples(st.just("session_gone"), st.sampled_from(OWNERS)),
    st.tuples(st.just("node_gone"), st.sampled_from(["n2", "n3"]), st.booleans()),
    st.tuples(st.just("purge")),
    st.tuples(st.just("start_mirror")),
    st.tuples(st.just("publish_ttl"), st.integers(1, 4), st.sampled_from(OWNERS),
              st.sampled_from([0.0, 0.5, 2.0])),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.3, 1.0, 3.0])),
    st.tuples(st.just("expire"), st.booleans()),
    st.tuples(st.just("drop_over"), st.integers(0, 4), st.sampled_from([None, 3, 8])),
    st.tuples(st.just("publish_bounded"), st.integers(1, 4), st.sampled_from(OWNERS),
              st.integers(0, 4)),
    st.tuples(st.just("dead_expire"), st.booleans()),
    st.tuples(st.just("dead_over"), st.integers(0, 4)),
    st.tuples(st.just("dead_reject"), st.integers(0, 3), st.integers(1, 6)),
)


KINDS = {  # QueueState's arguments, and whether consumers get priorities
    "plain": ((), False),
    "priority": ((3,), False),
    "single-active": ((0, True), False),
    "consumer-priorities": ((), True),
}


def new_queue(kind: str) -> QueueState:
    return QueueState("q", *KINDS[kind][0])


def run_op(leader: QueueState, o, pseqs: dict, now: float = 0.0, consumer_priorities: bool = False) -> None:
    kind = o[0]
    if kind in ("publish", "publish_ttl", "publish_bounded"):
        origin = list(o[2][:2])
        pseqs[o[2][:2]] = pseqs.get(o[2][:2], 0) + 1
        bodies = [b"m%d" % i for i in range(o[1])]
        if kind == "publish_bounded":  # x-overflow reject-publish: what does not fit is refused
            refused = set(leader.admit(bodies, Limits(max_length=o[3], reject_publish=True)))
            bodies = [b for i, b in enumerate(bodies) if i not in refused]
        # priorities 0-4 (4 is above a priority queue's maximum of 3, counted as 3)
        props = [{"priority": (pseqs[o[2][:2]] * 3 + i) % 5} for i in range(len(bodies))]
        leader.publish(bodies, props, origin, pseqs[o[2][:2]], now,
                       o[3] if kind == "publish_ttl" else None)
    elif kind == "consume":
        _, owner, tag, no_ack, prefetch, exclusive = o
        try:
            arguments = {"x-cancel-on-ha-failover": exclusive}
            if consumer_priorities:
                arguments["x-priority"] = prefetch % 2
            leader.add_consumer(owner, tag, no_ack, prefetch, exclusive, arguments)
        except Exception:
            pass
    elif kind == "cancel":
        leader.remove_consumer(o[1], o[2])
    elif kind == "dispatch":
        leader.dispatch()
    elif kind == "get":
        leader.get(o[1], o[2])
    elif kind in ("ack", "requeue", "discard"):
        # settle for an owner that has something to settle, when one has
        holders = sorted({ow for ow, _, _ in leader.unacked.values()}) or OWNERS
        owner = holders[o[1] % len(holders)]
        mine = [mid for mid, (ow, _, _) in leader.unacked.items() if ow == owner][: o[2]]
        getattr(leader, kind)(owner, mine + [10_000])  # an unknown id is ignored
    elif kind == "owner_gone":
        leader.owner_gone(o[1])
    elif kind == "session_gone":
        leader.session_gone(o[1][0], o[1][1])
    elif kind == "node_gone":
        leader.node_gone(o[1], o[2])
    elif kind == "purge":
        leader.purge()
    elif kind == "expire":
        leader.expire(now, o[1])
    elif kind == "drop_over":
        leader.drop_over(Limits(max_length=o[1], max_bytes=o[2]))
    elif kind == "dead_expire":
        upto = leader.expired_by(now, o[1])
        if upto:
            leader.dead_head(upto, True, HOLDER)
    elif kind == "dead_over":
        leader.dead_over(Limits(max_length=o[1]), HOLDER)
    elif kind == "dead_reject":
        owners = sorted({ow for ow, _, _ in leader.unacked.values() if ow != HOLDER}) or OWNERS
        owner = owners[o[1] % len(owners)]
        mine = [mid for mid, (ow, _, _) in leader.unacked.items() if ow == owner][: o[2]]
        leader.dead_settle(owner, mine + [10_000], HOLDER)


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=60))
def test_mirrors_follow_the_leader(kind, ops):
    leader = new_queue(kind)
    leader.effects = []
    synced = new_queue(kind)  # a mirror from the start
    synced.reset_as_mirror(leader.mirror_snapshot())
    late: list[tuple[QueueState, int]] = []
    pseqs: dict = {}
    now = 0.0
    for o in ops + [("failover",)]:
        if o[0] == "start_mirror":
            m = new_queue(kind)
            m.reset_as_mirror(leader.mirror_snapshot(now=now), now)
            late.append((m, leader.next_id))
            continue
        if o[0] == "wait":
            now += o[1]
            continue
        if o[0] == "failover":
            leader.failover()
        else:
            run_op(leader, o, pseqs, now, KINDS[kind][1])
        effects, leader.effects = leader.effects, []
        synced.apply_effects(effects, now)
        assert synced.comparable() == leader.comparable(), o
        for m, start in late:
            m.apply_effects(effects, now)
            assert list(m.ready) == [x for x in leader.ready if x[0] >= start], o
            assert m.unacked.keys() == leader.unacked.keys()
            assert [c.in_flight for c in m.consumers.values()] == \
                [c.in_flight for c in leader.consumers.values()]
            held = [x[0] for x in leader.ready] + list(leader.unacked)
            oldest = min(held) if held else None  # the smallest id the leader holds
            if oldest is None or oldest >= start:
                assert m.comparable() == leader.comparable(), o
    # a mirror promoted now expires what its leader would have (the same batches, same times)
    leader.effects = None
    now += 10.0
    leader.expire(now)
    synced.expire(now)
    assert synced.comparable() == leader.comparable()


def test_ttl_expires_whole_batches_and_requeued_messages():
    q = QueueState("q")
    q.effects = []
    q.publish([b"a", b"b"], None, now=0.0, ttl=1.0)
    q.publish([b"c"], None, now=0.5, ttl=1.0)
    owner = OWNERS[0]
    q.add_consumer(owner, "t", False, 1)
    (c, batch), = q.dispatch()  # "a" is out, unacknowledged
    assert [x[1] for x in batch] == [b"a"]
    assert q.expire(0.99) == 0
    assert q.expire(1.0) == 1  # "b" (same batch as "a") expires; "a" is with the consumer
    assert [x[1] for x in q.ready] == [b"c"]
    q.requeue(owner, [batch[0][0]])  # "a" comes back after its expiry: dropped at once
    assert q.expire(1.2) == 1 and [x[1] for x in q.ready] == [b"c"]
    assert q.expire(1.5) == 1 and not q.ready
    mirror = QueueState("q")
    mirror.apply_effects([e for e in q.effects], 0.0)
    assert mirror.comparable() == q.comparable()


def test_length_limits():
    q = QueueState("q")
    q.publish([b"1", b"22", b"333"], None)
    assert q.admit([b"x", b"yy"], Limits(max_length=4, reject_publish=True)) == [1]
    assert q.admit([b"12345", b"1"], Limits(max_bytes=8, reject_publish=True)) == [0]
    assert q.drop_over(Limits(max_length=2)) == 1
    assert [x[1] for x in q.ready] == [b"22", b"333"]
    assert q.drop_over(Limits(max_bytes=3)) == 1
    assert [x[1] for x in q.ready] == [b"333"] and q.ready_bytes == 3
    assert q.drop_over(Limits(max_length=0)) == 1 and q.ready_bytes == 0


def test_full_sync_makes_a_late_mirror_equal():
    """A late mirror given the leader's older messages (a batch sync) equals the leader."""
    leader = QueueState("q")
    leader.effects = []
    leader.add_consumer(OWNERS[0], "a", False, 2)
    leader.publish([b"1", b"2", b"3", b"4"], None)
    leader.dispatch()  # 1, 2 unacked; 3, 4 ready
    leader.effects = []
    m = QueueState("q")
    m.reset_as_mirror(leader.mirror_snapshot())
    assert m.comparable() != leader.comparable()
    older = [list(x) for x in leader.ready] + [list(e[2]) for e in leader.unacked.values()]
    m.add_synced_messages(sorted(older))
    assert m.comparable() == leader.comparable()
