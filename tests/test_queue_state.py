"""Unit tests of mirroring.queue.QueueState, plus a seeded random-operation invariant test."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.queue import QueueState
from wire.errors import ACCESS_REFUSED, PRECONDITION_FAILED, ProtocolError

A = ("n1", 1, 1)
B = ("n1", 2, 1)


def ids(batch):
    return [m[0] for m in batch]


def by_tag(result):
    return {c.tag: ids(batch) for c, batch in result}


def test_publish_assigns_increasing_ids_and_dispatches_in_order():
    q = QueueState("q")
    assert q.publish([b"a", b"b"], None) == (1, 2)
    assert q.publish([b"c"], [{"x": 1}]) == (3, 3)
    assert q.stats()["ready_bytes"] == 3
    q.add_consumer(A, "c1", no_ack=False, prefetch=0)
    ((c, batch),) = q.dispatch()
    assert c.tag == "c1"
    assert batch == [(1, b"a", None, False), (2, b"b", None, False), (3, b"c", {"x": 1}, False)]
    assert c.in_flight == 3 and sorted(q.unacked) == [1, 2, 3]
    assert q.stats()["ready_bytes"] == 0
    assert q.dispatch() == []


def test_prefetch_one_two_consumers_round_robin():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 1)
    q.add_consumer(B, "b", False, 1)
    q.publish([b"%d" % i for i in range(6)], None)
    assert by_tag(q.dispatch()) == {"a": [1], "b": [2]}
    assert q.dispatch() == []  # no credit left
    assert q.ack(A, [1]) == 1
    assert by_tag(q.dispatch()) == {"a": [3]}
    q.ack(A, [3])
    q.ack(B, [2])
    got = by_tag(q.dispatch())
    assert sorted(got) == ["a", "b"] and sorted(got["a"] + got["b"]) == [4, 5]
    assert q.dispatch() == []


def test_prefetch_two_two_consumers_interleaves():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 2)
    q.add_consumer(B, "b", False, 2)
    q.publish([b"x"] * 10, None)
    got = by_tag(q.dispatch())
    assert got == {"a": [1, 3], "b": [2, 4]}
    assert q.consumers[(A, "a")].in_flight == 2
    assert q.consumers[(B, "b")].credit() == 0
    assert q.dispatch() == []
    # ack frees credit
    q.ack(B, [2, 4])
    assert by_tag(q.dispatch()) == {"b": [5, 6]}


def test_ack_of_foreign_or_unknown_ids_is_ignored():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    q.publish([b"x"], None)
    q.dispatch()
    assert q.ack(B, [1]) == 0
    assert q.ack(A, [99]) == 0
    assert q.ack(A, [1]) == 1
    assert q.ack(A, [1]) == 0


def test_requeue_restores_id_order_with_redelivered():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 3)
    q.publish([b"1", b"2", b"3", b"4", b"5"], None)
    assert by_tag(q.dispatch()) == {"a": [1, 2, 3]}
    assert q.requeue(A, [3, 1]) == 2
    assert [(m[0], m[3]) for m in q.ready] == [(1, True), (3, True), (4, False), (5, False)]
    assert q.consumers[(A, "a")].in_flight == 1
    assert q.stats()["ready_bytes"] == 4
    assert q.requeue(A, [2]) == 1
    assert ids(q.ready) == [1, 2, 3, 4, 5]
    assert [m[3] for m in q.ready] == [True, True, True, False, False]


def test_requeue_after_all_ready_delivered_goes_to_front():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 2)
    q.publish([b"1", b"2", b"3", b"4"], None)
    q.dispatch()
    q.remove_consumer(A, "a")
    q.add_consumer(B, "b", False, 0)
    assert by_tag(q.dispatch()) == {"b": [3, 4]}
    assert q.requeue(A, [1, 2]) == 2
    assert ids(q.ready) == [1, 2]


def test_owner_gone_requeues_and_drops_consumers():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    q.add_consumer(B, "b", False, 0)
    q.publish([b"x"] * 4, None)
    q.dispatch()
    a_ids = [mid for mid, (o, _, _) in q.unacked.items() if o == A]
    assert q.owner_gone(A) == len(a_ids)
    assert (A, "a") not in q.consumers and (B, "b") in q.consumers
    assert ids(q.ready) == sorted(a_ids)
    assert all(m[3] for m in q.ready)


def test_node_gone_drops_that_nodes_owners():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    q.add_consumer(("n2", 7, 1), "c", False, 0)
    q.publish([b"x"] * 4, None)
    q.dispatch()
    q.node_gone("n2")
    assert all(o[0] == "n1" for (o, _, _) in q.unacked.values())
    assert len(q.consumers) == 1


def test_cancel_keeps_unacked_ackable():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    q.publish([b"x", b"y"], None)
    q.dispatch()
    c = q.remove_consumer(A, "a")
    assert c is not None and c.tag == "a"
    assert q.remove_consumer(A, "a") is None
    assert all(key is None for (_, key, _) in q.unacked.values())
    q.publish([b"z"], None)
    assert q.dispatch() == []  # nobody to deliver to
    assert q.ack(A, [1]) == 1
    assert q.requeue(A, [2]) == 1
    assert ids(q.ready) == [2, 3]


def test_exclusive_consumer_refused():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    with pytest.raises(ProtocolError) as ei:
        q.add_consumer(B, "b", False, 0, exclusive=True)
    assert ei.value.code == ACCESS_REFUSED
    assert "queue 'q' in vhost '/' in exclusive use" in ei.value.text
    q2 = QueueState("q2")
    q2.add_consumer(A, "a", False, 0, exclusive=True)
    with pytest.raises(ProtocolError) as ei:
        q2.add_consumer(B, "b", False, 0)
    assert ei.value.code == ACCESS_REFUSED


def test_duplicate_consumer_tag_refused():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    with pytest.raises(ProtocolError) as ei:
        q.add_consumer(A, "a", False, 0)
    assert ei.value.code == PRECONDITION_FAILED
    q.add_consumer(B, "a", False, 0)  # same tag on another channel is fine


def test_get_and_no_ack():
    q = QueueState("q")
    assert q.get(A, no_ack=False) is None
    q.publish([b"1", b"2"], None)
    m = q.get(A, no_ack=False)
    assert m[0] == 1 and 1 in q.unacked
    m2 = q.get(A, no_ack=True)
    assert m2[0] == 2 and 2 not in q.unacked
    assert q.stats()["messages"] == 1
    q.requeue(A, [1])
    assert ids(q.ready) == [1] and q.ready[0][3] is True


def test_no_ack_consumer_not_tracked():
    q = QueueState("q")
    c = q.add_consumer(A, "a", True, 1)
    q.publish([b"x"] * 5, None)
    assert by_tag(q.dispatch()) == {"a": [1, 2, 3, 4, 5]}
    assert q.unacked == {} and c.in_flight == 0


def test_purge_counts_only_ready():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 2)
    q.publish([b"x"] * 5, None)
    q.dispatch()
    assert q.purge() == 3
    assert q.stats() == {"messages_ready": 0, "messages_unacknowledged": 2, "messages": 2,
                         "consumers": 1, "ready_bytes": 0, "published": 5, "delivered": 2,
                         "acked": 0}
    q.requeue(A, [1])
    assert ids(q.ready) == [1]


def test_discard_drops():
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    q.publish([b"x", b"y"], None)
    q.dispatch()
    assert q.discard(A, [1]) == 1
    assert q.owner_gone(A) == 1
    assert ids(q.ready) == [2]


# --- random operations ----------------------------------------------------------------------

OWNERS = [("n1", 1, 1), ("n1", 1, 2), ("n2", 5, 1)]
TAGS = ["t1", "t2"]


def check_invariants(q: QueueState, published: set, settled: set):
    ready_ids = [m[0] for m in q.ready]
    assert ready_ids == sorted(ready_ids), "ready is not sorted by id"
    assert len(set(ready_ids)) == len(ready_ids)
    unacked = set(q.unacked)
    assert not (set(ready_ids) & unacked)
    assert not (set(ready_ids) & settled)
    assert not (unacked & settled)
    assert set(ready_ids) | unacked | settled == published
    for key, c in q.consumers.items():
        n = sum(1 for (_, k, _) in q.unacked.values() if k == key)
        assert c.in_flight == n, f"in_flight of {key} is {c.in_flight}, has {n} unacked"
        if not c.no_ack and c.prefetch:
            assert c.in_flight <= c.prefetch
    for (_, k, _) in q.unacked.values():
        assert k is None or k in q.consumers
    assert q.ready_bytes == sum(len(m[1]) for m in q.ready)


def run_random(seed: int, steps: int = 150):
    rng = random.Random(seed)
    q = QueueState("q")
    published: set[int] = set()
    settled: set[int] = set()  # acked, discarded, purged or taken with no_ack
    for _ in range(steps):
        op = rng.choice(["publish", "publish", "consume", "cancel", "dispatch", "dispatch", "ack",
                         "nack", "requeue", "gone", "get", "purge"])
        owner = rng.choice(OWNERS)
        if op == "publish":
            n = rng.randint(1, 4)
            first, last = q.publish([b"x" * rng.randint(0, 3) for _ in range(n)], None)
            published.update(range(first, last + 1))
        elif op == "consume":
            try:
                q.add_consumer(owner, rng.choice(TAGS), rng.random() < 0.2, rng.choice([0, 1, 2, 3]),
                               exclusive=rng.random() < 0.1)
            except ProtocolError:
                pass
        elif op == "cancel":
            q.remove_consumer(owner, rng.choice(TAGS))
        elif op == "dispatch":
            for c, batch in q.dispatch():
                if c.no_ack:
                    settled.update(m[0] for m in batch)
        elif op in ("ack", "nack", "requeue"):
            mine = [mid for mid, (o, _, _) in q.unacked.items() if o == owner]
            pick = rng.sample(mine, rng.randint(0, len(mine))) + [rng.randint(1, q.next_id + 2)]
            if op == "requeue":
                q.requeue(owner, pick)
            else:
                before = set(q.unacked)
                (q.ack if op == "ack" else q.discard)(owner, pick)
                settled.update(before - set(q.unacked))
        elif op == "gone":
            q.owner_gone(owner)
        elif op == "get":
            no_ack = rng.random() < 0.5
            m = q.get(owner, no_ack)
            if m is not None and no_ack:
                settled.add(m[0])
        elif op == "purge":
            settled.update(m[0] for m in q.ready)
            q.purge()
        check_invariants(q, published, settled)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_operations_keep_invariants(seed):
    try:
        run_random(seed)
    except AssertionError as exc:
        raise AssertionError(f"invariant broken with random.Random({seed}): {exc}") from exc


def test_ready_between_is_the_ready_run_in_a_window():
    q = QueueState("q")
    q.publish([b"m%d" % i for i in range(1, 11)], None)  # ids 1..10
    assert [m[0] for m in q.ready_between(3, 8, 10)] == [4, 5, 6, 7]
    assert [m[0] for m in q.ready_between(0, 100, 3)] == [1, 2, 3]
    assert q.ready_between(10, 100, 5) == [] and q.ready_between(4, 5, 5) == []


def test_node_gone_of_one_run_keeps_the_sessions_of_a_newer_run():
    """A node's run (its incarnation) is in its session ids' high bits. When the metadata says
    run 5 of n2 went, a session of run 7 that registered before this replica heard of it stays
    (dst seed 1554); `run` 0 (a lost link) takes every run's."""
    old, new = (5 << 32) | 1, (7 << 32) | 1
    q = QueueState("q")
    q.effects = []
    q.add_consumer(("n2", old, 1), "c-old", False, 0)
    q.add_consumer(("n2", new, 1), "c-new", False, 0)
    q.publish([b"a", b"b"], None, ["n2", new], 1)
    q.dispatch()
    requeued = q.node_gone("n2", True, 5)
    assert [key[1] for key in q.consumers] == ["c-new"]
    assert requeued == 1  # what the old run's consumer held goes back
    assert ("n2", new) in q.last_pseq  # the new run's publisher is still known
    assert q.effects[-1].run == 5  # mirrors apply the same (ENodeGone carries the run)
    q.node_gone("n2", False)
    assert not q.consumers


def test_one_consumers_dispatch_stops_at_the_byte_limit_and_a_mirror_follows_it():
    """A dispatch hands one consumer messages up to MAX_DISPATCH_BYTES (the one that reaches it
    included) and leaves the rest at the head in order; a mirror applying the leader's effects
    ends in the same state, and so does one given the same delivery with its ids out of order
    or without its size."""
    from mirroring.queue import MAX_DISPATCH_BYTES
    from wire.messages import EDeliver
    leader, mirror, other, unsized = (QueueState("q") for _ in range(4))
    body = b"x" * (MAX_DISPATCH_BYTES // 3 + 1)
    for q in (leader, mirror, other, unsized):
        q.add_consumer(A, "c", no_ack=False, prefetch=0)
        q.publish([body] * 5 + [b"tail"], None)
    leader.effects = []
    ((c, batch),) = leader.dispatch()
    assert ids(batch) == [1, 2, 3]  # the third reaches the limit and goes too
    assert [m[0] for m in leader.ready] == [4, 5, 6]
    assert leader.ready_bytes == 2 * len(body) + 4 and c.in_flight == 3
    assert sorted(leader.unacked) == [1, 2, 3] and leader.unacked[2] == (A, (A, "c"), batch[1])
    effects, leader.effects = leader.effects, None
    assert effects == [EDeliver([(A, "c", [1, 2, 3])], 3 * len(body))]  # and the bytes it took
    mirror.apply_effects(effects)
    assert mirror.comparable() == leader.comparable()
    other.apply_effects([EDeliver([(A, "c", [2, 1, 3])])])
    assert other.comparable() == leader.comparable()
    unsized.apply_effects([EDeliver([(A, "c", [1, 2, 3])])])  # no size given: counted here
    assert unsized.comparable() == leader.comparable()


def four_given_to(owner_of_b: tuple) -> QueueState:
    """A queue whose consumers "a" (owner A) and "b" (`owner_of_b`) hold ids 1, 3 and 2, 4."""
    q = QueueState("q")
    q.add_consumer(A, "a", False, 0)
    q.add_consumer(owner_of_b, "b", False, 0)
    q.publish([b"x"] * 4, None)
    assert by_tag(q.dispatch()) == {"a": [1, 3], "b": [2, 4]}
    return q


def test_one_ack_over_two_consumers_of_an_owner_frees_both_their_credit():
    """An owner (a channel) with two consumers acks what both were given in one settle: each
    consumer gets its own share of credit back."""
    q = four_given_to(A)
    assert q.ack(A, [1, 2, 3, 4]) == 4
    assert q.consumers[(A, "a")].in_flight == 0 and q.consumers[(A, "b")].in_flight == 0
    assert not q.unacked


def test_a_settle_naming_another_owners_message_takes_only_the_owners_own():
    """A settle may name ids that are no longer the owner's (requeued by a failover and given to
    another consumer since): those stay with their new owner, unacknowledged, and a repeated id
    counts once."""
    q = four_given_to(B)
    assert q.ack(A, [1, 2, 3, 3]) == 2
    assert sorted(q.unacked) == [2, 4] and q.unacked[2][0] == B
    assert q.consumers[(A, "a")].in_flight == 0 and q.consumers[(B, "b")].in_flight == 2
    assert q.requeue(A, [2, 4]) == 0 and sorted(q.unacked) == [2, 4]


# --- unacknowledged deliveries kept as runs (QueueState._runs) ----------------------------------

def test_in_order_acks_settle_runs_without_an_entry_per_message():
    """The usual ack is a prefix of the oldest run of deliveries: it is settled by cutting the
    run, with no per-message dict entry made; a partial ack, one spanning two runs, and the
    counts all stay exact."""
    q = QueueState("q")
    q.add_consumer(A, "c", False, 0)
    q.publish([b"m%d" % i for i in range(1, 7)], None)
    for _ in range(2):  # two runs: 1-3, then 4-6
        q.consumers[(A, "c")].prefetch = q.consumers[(A, "c")].in_flight + 3
        q.dispatch()
    assert q.stats()["messages_unacknowledged"] == 6 and not q._unacked
    assert q.ack(A, [1, 2]) == 2  # the head of the first run
    assert q.ack(A, [3, 4]) == 2  # its tail and the head of the next
    assert not q._unacked and q.unacked_count == 2
    assert q.consumers[(A, "c")].in_flight == 2
    assert q.ack(A, [5, 6, 99]) == 2  # the rest, and an id nobody holds
    assert q.unacked_count == 0 and q.consumers[(A, "c")].in_flight == 0 and not q.unacked


def test_an_ack_out_of_order_or_of_another_owner_falls_back_to_the_dict():
    q = four_given_to(A)  # A's consumers a and b: 1, 3 to a, 2, 4 to b (two runs)
    assert q.ack(A, [4]) == 1  # not a prefix of the oldest run: every run goes to the dict
    assert q._runs == deque() and sorted(q._unacked) == [1, 2, 3]
    assert q.consumers[(A, "b")].in_flight == 1 and q.consumers[(A, "a")].in_flight == 2
    assert q.ack(A, [1, 2, 3]) == 3 and not q.unacked
    q = four_given_to(B)
    assert q.ack(A, [2]) == 0  # B's, behind A's run: A's run is not cut
    assert q.unacked_count == 4 and q.consumers[(A, "a")].in_flight == 2


def test_held_bodies_finds_a_recent_run_only():
    q = QueueState("q")
    q.add_consumer(A, "c", False, 2)
    q.publish([b"a", b"b", b"c"], None)
    q.dispatch()
    assert q.held_bodies([1, 2]) == [b"a", b"b"]
    assert q.held_bodies([1]) is None and q.held_bodies([2, 3]) is None
    q.ack(A, [1])  # the run is cut: it no longer names [1, 2]
    assert q.held_bodies([1, 2]) is None and q.held_bodies([2]) == [b"b"]


def _ack_pick(rng: random.Random, ref: QueueState, owner) -> list:
    """What a client acks: mostly the oldest of its owner's deliveries in order, sometimes a
    random subset with an unknown id."""
    mine = sorted(mid for mid, (o, _, _) in ref.unacked.items() if o == owner)
    if rng.random() < 0.7:
        return mine[:rng.randint(0, len(mine))]
    return rng.sample(mine, rng.randint(0, len(mine))) + [rng.randint(1, ref.next_id + 2)]


@pytest.mark.parametrize("seed", range(40))
def test_runs_settle_exactly_as_the_dict_alone(seed):
    """Differential: one queue keeps deliveries as runs, the other spills every run into the
    dict at once (the plain id-by-id rules). The same operations give the same answers, the
    same consumer credit after every step, and the same state at the end."""
    rng = random.Random(seed)
    runs, ref = QueueState("q"), QueueState("q")
    plain_hold = QueueState._hold

    def hold_and_spill(self, *args):
        plain_hold(self, *args)
        self._spill()
    ref._hold = hold_and_spill.__get__(ref)
    for step in range(300):
        op = rng.choice(["publish", "consume", "dispatch", "dispatch", "ack", "ack", "ack",
                         "nack", "requeue", "cancel", "gone", "get", "bodies"])
        owner = rng.choice(OWNERS)
        if op == "publish":
            bodies = [b"x%d" % rng.randint(0, 9) for _ in range(rng.randint(1, 5))]
            outs = [q.publish(list(bodies), None) for q in (runs, ref)]
        elif op == "consume":
            args = (owner, rng.choice(TAGS), rng.random() < 0.1, rng.choice([0, 1, 2, 3, 8]))
            outs = []
            for q in (runs, ref):
                try:
                    outs.append(q.add_consumer(*args).tag)
                except ProtocolError as exc:
                    outs.append(exc.code)
        elif op == "dispatch":
            outs = [[(c.tag, ids(b)) for c, b in q.dispatch()] for q in (runs, ref)]
        elif op in ("ack", "nack", "requeue"):
            pick = _ack_pick(rng, ref, owner)
            how = {"ack": ref.ack, "nack": ref.discard, "requeue": ref.requeue}[op].__name__
            outs = [getattr(q, how)(owner, list(pick)) for q in (runs, ref)]
        elif op == "cancel":
            tag = rng.choice(TAGS)
            outs = [q.remove_consumer(owner, tag) is not None for q in (runs, ref)]
        elif op == "gone":
            outs = [q.owner_gone(owner) for q in (runs, ref)]
        elif op == "get":
            no_ack = rng.random() < 0.5
            outs = [q.get(owner, no_ack) for q in (runs, ref)]
        else:
            recent = [r[2][r[4]:] for r in runs._runs][-2:]  # what is unacked of each
            outs = [[runs.held_bodies(list(r)) for r in recent],
                    [[ref.unacked[mid][2][1] for mid in r] for r in recent]]
        assert outs[0] == outs[1], f"seed {seed} step {step} {op}: {outs}"
        assert runs.unacked_count == len(ref.unacked)
        assert [(k, c.in_flight) for k, c in runs.consumers.items()] == \
               [(k, c.in_flight) for k, c in ref.consumers.items()], f"seed {seed} step {step}"
    assert runs.comparable() == ref.comparable()


def test_acks_one_at_a_time_move_a_runs_mark_and_let_each_message_go():
    """A consumer that acks one message at a time from a run of a thousand: each ack costs in
    proportion to itself (the run is not copied or cut; its mark moves) and the acknowledged
    message is let go at once."""
    q = QueueState("q")
    q.add_consumer(A, "c", False, 0)
    q.publish([b"m%d" % i for i in range(1000)], None)
    q.dispatch()
    run = q._runs[0]
    ids_list, msgs = run[2], run[3]
    for i in range(1, 11):
        assert q.ack(A, [i]) == 1
    assert q._runs[0] is run and run[2] is ids_list and run[3] is msgs and run[4] == 10
    assert msgs[:10] == [None] * 10 and msgs[10][0] == 11
    assert q.unacked_count == 990 and q.consumers[(A, "c")].in_flight == 990
    assert q.held_bodies(list(range(11, 1001)))[0] == b"m10"
    assert sorted(q.unacked)[:2] == [11, 12]  # the rest, spilled, starts after the mark


def test_limits_of_a_policy_and_of_the_queue_arguments_combine_as_in_rabbitmq():
    """The lower of the two for lengths, sizes, TTLs and expiries; the queue's own x-overflow
    over the policy's overflow; either alone counts as given."""
    from mirroring.queue import NO_LIMITS, limits_from
    assert limits_from(None, None) is NO_LIMITS and limits_from({}, {"queue-mode": "lazy"}) is NO_LIMITS
    lim = limits_from({"x-max-length": 10, "x-message-ttl": 5000, "x-overflow": "drop-head"},
                      {"max-length": 4, "max-length-bytes": 2048, "message-ttl": 60000, "expires": 3000,
                       "overflow": "reject-publish"})
    assert (lim.max_length, lim.max_bytes, lim.message_ttl, lim.expires) == (4, 2048, 5.0, 3.0)
    assert lim.reject_publish is False  # the queue's own x-overflow wins
    assert limits_from({}, {"overflow": "reject-publish", "max-length": 1}).reject_publish is True
    assert limits_from({"x-expires": 1000}, {"expires": 9000}).expires == 1.0


def test_running_totals_count_deliveries_gets_and_acks():
    """The management API's rates read these totals: a dispatch and a get count as deliveries,
    an ack (in runs or id by id) as acks; a requeue or a discard is no ack."""
    q = QueueState("q")
    q.add_consumer(A, "a", False, 3)
    q.publish([b"x"] * 6, None)
    q.dispatch()
    q.get(B, no_ack=False)
    assert (q.delivered_total, q.acked_total) == (4, 0)
    q.ack(A, [1, 2])
    q.requeue(A, [3])
    q.discard(B, [4])
    assert q.acked_total == 2
    q.ack(A, [99])  # not unacknowledged: counts nothing
    assert q.stats()["acked"] == 2 and q.stats()["published"] == 6
