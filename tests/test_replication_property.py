"""Property test: a leader's effects, applied by its mirrors in order, keep every mirror's state
equal to the leader's (spec: "The mirrors apply the operations that occur to the leader in
exactly the same order as the leader and thus maintain the same state").

A mirror that starts late (unsynchronised) is also checked: its ready messages are the leader's
ready messages from its start id on, and once the leader holds nothing older than that start,
it equals the leader exactly.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.queue import QueueState

OWNERS = [("n1", 1, 1), ("n1", 1, 2), ("n2", 5, 1), ("n3", 9, 1)]

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
)


def run_op(leader: QueueState, o, pseqs: dict) -> None:
    kind = o[0]
    if kind == "publish":
        origin = list(o[2][:2])
        pseqs[o[2][:2]] = pseqs.get(o[2][:2], 0) + 1
        leader.publish([b"m%d" % i for i in range(o[1])], None, origin, pseqs[o[2][:2]])
    elif kind == "consume":
        _, owner, tag, no_ack, prefetch, exclusive = o
        try:
            leader.add_consumer(owner, tag, no_ack, prefetch, exclusive,
                                {"x-cancel-on-ha-failover": exclusive})
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


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60))
def test_mirrors_follow_the_leader(ops):
    leader = QueueState("q")
    leader.effects = []
    synced = QueueState("q")  # a mirror from the start
    synced.reset_as_mirror(leader.mirror_snapshot())
    late: list[tuple[QueueState, int]] = []
    pseqs: dict = {}
    for o in ops + [("failover",)]:
        if o[0] == "start_mirror":
            m = QueueState("q")
            m.reset_as_mirror(leader.mirror_snapshot())
            late.append((m, leader.next_id))
            continue
        if o[0] == "failover":
            leader.failover()
        else:
            run_op(leader, o, pseqs)
        effects, leader.effects = leader.effects, []
        synced.apply_effects(effects)
        assert synced.comparable() == leader.comparable(), o
        for m, start in late:
            m.apply_effects(effects)
            assert list(m.ready) == [x for x in leader.ready if x[0] >= start], o
            assert m.unacked.keys() == leader.unacked.keys()
            assert [c.in_flight for c in m.consumers.values()] == \
                [c.in_flight for c in leader.consumers.values()]
            oldest = leader.oldest_id()
            if oldest is None or oldest >= start:
                assert m.comparable() == leader.comparable(), o


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
