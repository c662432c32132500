"""Property test of mirroring/replica.py: a leader and its mirrors, wired by in-order links, under
random client operations, mirrors added late, batch syncs (blocking and background) that start,
stop, get cancelled and overlap with every operation, up to two promotions (the leader's node
stops, a synchronised mirror leads, the others resume or start again), and random interleavings
of the links.

What must hold (spec, "Mirrored Queue Implementation and Semantics" and "Unsynchronised Mirrors"):
* a mirror the leader counts as synchronised holds exactly the leader's state;
* an unsynchronised mirror holds the leader's messages from its start on, never one the leader
  does not hold;
* a publish is confirmed only once every mirror has it;
* while a blocking sync runs the leader serves nothing else; a background sync serves on;
* with queue limits (x-message-ttl, x-max-length / -bytes, drop-head or reject-publish) the
  leader's expiries and drops reach every mirror, a refused publish is reported to its session
  and never enqueued, and no message is ever delivered after its TTL ran out.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.changes import DropMirror, QueueDelete
from mirroring.policy import HA
from mirroring.queue import NO_LIMITS, Limits
from mirroring.replica import LEADING, Assign, Propose, Replica, ReplicaConfig, Send, State
from wire import messages as m

OWNERS = [("n1", 1, 1), ("n2", 5, 1), ("n3", 9, 2)]


class World:
    def __init__(self, rng: random.Random, sync_mode: str, batch: int, throughput: int = 0,
                 limits: Limits = NO_LIMITS):
        self.rng = rng
        self.limits = limits
        self.published_at: dict[int, float] = {}  # message id -> when the leader enqueued it
        self.late_deliveries: list = []
        self.rejected: dict[tuple, int] = {}
        self.proposals: list = []
        self.throughput = throughput
        self.now = 0.0
        self.ha = HA(mode="all", sync_mode=sync_mode, sync_batch_size=batch)
        self.mirrors: list[str] = []
        self.replicas: dict[str, Replica] = {}
        self.leader_name = "L"
        self.epoch = 1
        self.made = 0  # mirrors made so far (their names)
        self.promotions = 0
        self.links: dict[tuple, list] = {}  # (src, dst) -> messages in order
        self.events: list = []
        self.pseq = {o[:2]: 0 for o in OWNERS}
        self.published: dict[tuple, int] = {}  # (session, pseq) -> ids count
        self.delivered: dict[tuple, list] = {o: [] for o in OWNERS}
        self.accepted: dict[tuple, int] = {}
        self.add_replica("L")

    def assign(self) -> Assign:
        return Assign(self.leader_name, self.epoch, list(self.mirrors), [], self.ha, limits=self.limits)

    def cfg(self, name):
        return ReplicaConfig(node=name, pid=f"<{name}.1.0>", sync_batch_size=4,
                             max_sync_bytes=1 << 20, sync_max_throughput=self.throughput,
                             stall_after=1e9)

    def add_replica(self, name: str) -> None:
        if name != self.leader_name:
            self.mirrors.append(name)
            self.made += 1
        self.replicas[name] = Replica("q", self.cfg(name), self.assign(), self.now)
        for r in self.replicas.values():
            r.assign_now(self.assign(), self.now)
        self.pump(self.leader_name)
        self.pump(name)

    def promote(self) -> None:
        """The leader's node stops: what its links carried is gone, and a mirror it counts as
        synchronised leads the next epoch; the other mirrors resume under it or start again.
        The consumers stay: their sessions are on nodes that keep running."""
        L = self.leader
        synced = [n for n in self.mirrors if (t := L.rep.mirrors.get(n)) is not None and t.ready and t.synced]
        if not synced:
            return
        old, new = self.leader_name, self.rng.choice(synced)
        self.links = {k: v for k, v in self.links.items() if old not in k}
        del self.replicas[old]
        self.mirrors.remove(new)
        self.leader_name = new
        self.epoch += 1
        self.promotions += 1
        for r in self.replicas.values():
            r.assign_now(self.assign(), self.now)
        for name in self.replicas:
            self.pump(name)

    @property
    def leader(self) -> Replica:
        return self.replicas[self.leader_name]

    def pump(self, name: str) -> None:
        r = self.replicas[name]
        r.flush(self.now)
        out, events = r.take_output()
        for o in out:
            if isinstance(o, Send):
                self.links.setdefault((name, o.node), []).append(o.msg)
            elif isinstance(o, Propose):
                self.proposals.append(o.change)
        for key, evs in events.items():
            for ev in evs:
                if isinstance(ev, m.EvDeliver):
                    owner = (key[0], key[1], ev.ch)
                    self.delivered[owner].extend(ev.ids)
                    self._check_fresh(ev.ids)
                elif isinstance(ev, m.EvAccepted):
                    self.accepted[key] = max(self.accepted.get(key, 0), ev.pseq)
                elif isinstance(ev, m.EvGetOk) and ev.msg is not None:
                    owner = (key[0], key[1], ev.ch)
                    self.delivered[owner].append(ev.msg[0])
                    self._check_fresh([ev.msg[0]])
                elif isinstance(ev, m.EvRejected):
                    self.rejected[key] = self.rejected.get(key, 0) + len(ev.indexes)

    def _check_fresh(self, ids) -> None:
        ttl = self.limits.message_ttl
        if ttl is None:
            return
        for mid in ids:
            at = self.published_at.get(mid)
            if at is not None and self.now > at + ttl:
                self.late_deliveries.append((mid, at, self.now))

    def deliver_one(self) -> bool:
        busy = [k for k, v in self.links.items() if v]
        if not busy:
            return False
        src, dst = self.rng.choice(busy)
        msg = self.links[(src, dst)].pop(0)
        self.replicas[dst].handle(msg, self.now)
        self.pump(dst)
        return True

    def settle_all(self) -> None:
        quiet = 0
        for _ in range(100_000):
            self.now += 0.001
            for name in list(self.replicas):
                self.replicas[name].tick(self.now)
                self.pump(name)
            if self.deliver_one() or self.leader.sync is not None:
                quiet = 0
                continue
            # acks alone may wait SETTLE_LINGER on the leader: the world has settled once they
            # have gone out too, or once they have waited far longer than that (the checks
            # then say what the mirrors lack)
            quiet += 1
            if not self.leader.q.effects or quiet > 20:
                return
        raise AssertionError("the world did not settle")

    def op(self, kind, *args) -> None:
        L = self.leader
        if kind == "publish":
            owner, n = args
            self.pseq[owner[:2]] += 1
            first = L.q.next_id
            # to the leader's present epoch, as a session whose route names it sends
            L.handle(m.QPublish("q", owner, self.pseq[owner[:2]], [b"m%d" % i for i in range(n)], None, False,
                                max(L.epoch, 1), None), self.now)
            for mid in range(first, L.q.next_id):
                self.published_at[mid] = self.now
        elif kind == "consume":
            owner, prefetch = args
            L.handle(m.QConsume("q", owner, 1, "t", False, prefetch, False, {}), self.now)
        elif kind == "cancel":
            L.handle(m.QCancel("q", args[0], 2, "t"), self.now)
        elif kind == "settle":
            owner, how, k = args
            ids = self.delivered[owner][:k]
            del self.delivered[owner][:k]
            L.handle(m.QSettle("q", owner, how, ids), self.now)
        elif kind == "get":
            L.handle(m.QGet("q", args[0], 3, args[1]), self.now)
        elif kind == "owner_gone":
            self.delivered[args[0]] = []
            L.handle(m.QOwnerGone("q", args[0]), self.now)
        elif kind == "purge":
            L.handle(m.QPurge("q", OWNERS[0], 4), self.now)
        elif kind == "add_mirror":
            if len(self.mirrors) < 3:
                self.add_replica(f"M{self.made + 1}")
                return
        elif kind == "promote":
            if self.promotions < 2:
                self.promote()
        elif kind == "sync":
            L.request_sync("test", self.now)
        elif kind == "cancel_sync":
            L.cancel_sync(self.now)
        elif kind == "step":
            for _ in range(args[0]):
                self.now += 0.001
                if not self.deliver_one():
                    break
        elif kind == "wait":
            self.now += args[0]
            for r in self.replicas.values():
                r.tick(self.now)
        self.pump(self.leader_name)

    def check(self, final: bool) -> None:
        L = self.leader
        lq = L.q
        for name in self.mirrors:
            r = self.replicas[name]
            track = L.rep.mirrors.get(name)
            if track is None or not track.ready or self.links.get((self.leader_name, name)):
                continue  # not started yet, or still catching up
            mq = r.q
            held = {x[0] for x in lq.ready} | set(lq.unacked)
            assert {x[0] for x in mq.ready} <= held, f"{name} holds a message the leader does not"
            if final and track.synced:
                assert mq.comparable() == lq.comparable(), f"synced mirror {name} differs"
        # confirms: every accepted publish is on every mirror that was following when applied
        for key, upto in self.accepted.items():
            assert upto <= self.pseq[key]


op = st.one_of(
    st.tuples(st.just("publish"), st.sampled_from(OWNERS), st.integers(1, 4)),
    st.tuples(st.just("consume"), st.sampled_from(OWNERS), st.integers(0, 3)),
    st.tuples(st.just("cancel"), st.sampled_from(OWNERS)),
    st.tuples(st.just("settle"), st.sampled_from(OWNERS), st.sampled_from([m.ACK, m.REQUEUE, m.DISCARD]),
              st.integers(0, 3)),
    st.tuples(st.just("settle"), st.sampled_from(OWNERS), st.just(m.ACK), st.integers(1, 5)),
    st.tuples(st.just("get"), st.sampled_from(OWNERS), st.booleans()),
    st.tuples(st.just("owner_gone"), st.sampled_from(OWNERS)),
    st.tuples(st.just("purge")),
    st.tuples(st.just("add_mirror")),
    st.tuples(st.just("promote")),
    st.tuples(st.just("sync")),
    st.tuples(st.just("cancel_sync")),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("wait"), st.sampled_from([0.001, 0.004, 0.02])),
)
LIMITS = [NO_LIMITS, Limits(message_ttl=0.005), Limits(message_ttl=0.0), Limits(max_length=3),
          Limits(max_bytes=7), Limits(max_length=3, reject_publish=True),
          Limits(max_length=4, max_bytes=9, reject_publish=True, message_ttl=0.01)]


@settings(max_examples=400, deadline=None)
@given(st.lists(op, max_size=80), st.sampled_from(["manual", "automatic", "background"]),
       st.integers(1, 5), st.randoms(use_true_random=False), st.sampled_from(LIMITS))
def test_mirrors_equal_the_leader_through_syncs(ops, sync_mode, batch, rng, limits):
    w = World(rng, sync_mode, batch, limits=limits)
    w.add_replica("M1")
    blocked_ops = 0
    for o in ops:
        before = w.leader.state
        w.op(*o)
        if before is State.LEADER_SYNCING and o[0] in ("publish", "consume", "settle", "get"):
            blocked_ops += 1
        w.check(final=False)
    # let everything arrive, then make every mirror synchronised and compare
    w.settle_all()
    w.leader.request_sync("final", w.now)
    w.pump(w.leader_name)
    w.settle_all()
    w.check(final=True)
    for name in w.mirrors:
        assert name in w.leader.rep.synced(), f"{name} not synchronised after a full sync"
    assert w.leader.state in LEADING and not w.leader.parked
    assert not w.late_deliveries, "a message was delivered after its TTL ran out"
    q = w.leader.q
    if limits.bounded and not limits.reject_publish:
        assert limits.max_length is None or len(q.ready) <= limits.max_length
        assert limits.max_bytes is None or q.ready_bytes <= limits.max_bytes
    if not limits.reject_publish:
        assert not w.rejected


def test_reject_publish_reports_refused_messages_and_the_rest_is_accepted():
    w = World(random.Random(5), "manual", 4, limits=Limits(max_length=3, reject_publish=True))
    w.add_replica("M1")
    w.op("publish", OWNERS[0], 2)
    w.op("publish", OWNERS[0], 3)  # one fits, two are refused
    w.settle_all()
    assert w.rejected == {OWNERS[0][:2]: 2}
    assert w.accepted[OWNERS[0][:2]] == 2  # both batches accepted (their refused part nacked)
    assert len(w.leader.q.ready) == 3
    assert w.replicas["M1"].q.comparable() == w.leader.q.comparable()


def test_ttl_expires_on_the_leader_and_its_mirrors_without_consumers():
    w = World(random.Random(6), "manual", 4, limits=Limits(message_ttl=0.05))
    w.add_replica("M1")
    w.op("publish", OWNERS[0], 3)
    w.settle_all()
    assert len(w.replicas["M1"].q.ready) == 3
    deadline = w.leader.next_deadline(w.now)
    assert deadline is not None and deadline <= w.now + 0.05
    w.op("wait", 0.06)
    w.settle_all()
    assert not w.leader.q.ready and not w.replicas["M1"].q.ready


def test_an_expired_message_is_not_delivered_when_credit_comes_back():
    w = World(random.Random(8), "manual", 4, limits=Limits(message_ttl=0.01))
    w.op("consume", OWNERS[0], 1)
    w.op("publish", OWNERS[0], 2)  # one delivered, one waits for credit
    assert len(w.delivered[OWNERS[0]]) == 1
    w.now += 0.02  # the waiting one expires while nothing runs
    w.op("settle", OWNERS[0], m.ACK, 1)
    assert len(w.delivered[OWNERS[0]]) == 0 and not w.late_deliveries
    assert not w.leader.q.ready


def test_x_expires_proposes_deleting_an_unused_queue():
    w = World(random.Random(7), "manual", 4, limits=Limits(expires=1.0))
    w.op("consume", OWNERS[0], 0)
    w.op("wait", 2.0)
    assert not w.proposals  # a consumer: in use
    w.op("cancel", OWNERS[0])
    w.op("wait", 0.5)
    assert not w.proposals
    assert w.leader.next_deadline(w.now) == w.now + 0.5
    w.op("wait", 0.6)
    assert w.proposals == [QueueDelete("q", "L")]


def test_blocking_sync_parks_operations_and_background_sync_serves_them():
    for mode, parked in (("automatic", True), ("background", False)):
        w = World(random.Random(1), mode, 1)
        for i in range(50):
            w.op("publish", OWNERS[0], 2)
        w.op("add_mirror")  # automatic/background: a sync starts once the mirror is ready
        w.op("step", 4)
        assert w.leader.sync is not None
        w.op("publish", OWNERS[1], 1)
        assert bool(w.leader.parked) is parked, mode
        w.settle_all()
        assert not w.leader.parked
        assert w.leader.rep.synced() == ["M1"]
        assert w.replicas["M1"].q.comparable() == w.leader.q.comparable()


def test_policy_change_from_manual_to_automatic_syncs_an_unsynchronised_mirror():
    w = World(random.Random(2), "manual", 4)
    for _ in range(20):
        w.op("publish", OWNERS[0], 3)
    w.op("add_mirror")
    w.settle_all()
    assert w.leader.rep.synced() == []  # manual: the head is still missing
    w.ha = HA(mode="all", sync_mode="automatic", sync_batch_size=4)
    for r in w.replicas.values():
        r.assign_now(w.assign(), w.now)
    w.pump("L")
    w.settle_all()
    assert w.leader.rep.synced() == ["M1"]


def test_cancel_and_resume_sync():
    w = World(random.Random(3), "manual", 1, throughput=200)  # 2-byte bodies: ~100 msgs/s
    for _ in range(30):
        w.op("publish", OWNERS[0], 1)
    w.op("add_mirror")
    w.settle_all()
    w.op("sync")
    for _ in range(100):
        w.now += 0.001
        w.leader.tick(w.now)
        w.op("step", 2)
    w.op("cancel_sync")
    w.settle_all()
    assert w.leader.last_sync["status"] == "cancelled"
    upto = w.leader.rep.mirrors["M1"].synced_upto
    assert 0 < upto < 30
    w.op("sync")
    w.settle_all()
    assert w.leader.last_sync["status"] == "completed"
    assert w.leader.last_sync["messages"] <= 30 - upto + 1  # it resumed where it stopped
    assert w.replicas["M1"].q.comparable() == w.leader.q.comparable()


def test_sync_request_is_a_noop_without_unsynchronised_mirrors():
    w = World(random.Random(4), "manual", 4)
    w.op("add_mirror")
    w.settle_all()
    assert w.leader.rep.synced() == ["M1"]
    assert not w.leader.request_sync("x", w.now)
    assert not w.leader.cancel_sync(w.now)


def test_losing_touch_with_a_mirror_confirms_nothing_until_the_metadata_drops_it():
    """A leader that loses its link to a mirror (the mirror may be fine and the leader the one
    cut off) asks the metadata to drop it, and confirms what waited for that mirror only once the
    metadata has dropped it."""
    from mirroring.replica import LinkDown, Propose
    w = World(random.Random(5), "manual", 4)
    w.op("add_mirror")
    w.settle_all()
    w.op("publish", OWNERS[0], 3)  # reaches the leader; the mirror's ack is still to come
    w.leader.link_down(LinkDown("M1"), w.now)
    out, _ = w.leader.take_output()
    assert DropMirror("q", 1, "M1") in [o.change for o in out if isinstance(o, Propose)]
    w.links[("L", "M1")] = []  # what the leader sent the mirror is lost with the link
    w.settle_all()
    assert w.accepted.get(OWNERS[0][:2], 0) == 0, "confirmed without the mirror"
    # the metadata drops the mirror (what the leader asked for): now it is confirmed
    w.mirrors.remove("M1")
    w.leader.assign_now(w.assign(), w.now)
    w.pump("L")
    assert w.accepted.get(OWNERS[0][:2]) == 1


def test_a_replaced_link_gives_back_what_that_nodes_sessions_had_not_acknowledged():
    """Both nodes dialed at once and a second link replaced the first: deliveries sent on the
    first (and the acks that came back on it) may be lost, though the node never went (chaos
    seed 20032: 500 messages stranded with a consumer's credit). The leader gives back what the
    node's sessions had not acknowledged, flagged, and drops their consumers until they register
    again over the new link; nothing else moves, no mirror is dropped, no auto-delete."""
    from mirroring.replica import LinkReplaced
    w = World(random.Random(6), "manual", 4)
    w.op("add_mirror")
    w.settle_all()
    w.op("consume", OWNERS[1], 10)  # a consumer on n2
    w.op("consume", OWNERS[0], 0)   # and one on n1 (no prefetch limit)
    w.op("publish", OWNERS[0], 6)
    w.settle_all()
    on_n2 = list(w.delivered[OWNERS[1]])
    assert on_n2 and w.delivered[OWNERS[0]]
    before = list(w.delivered[OWNERS[0]])
    w.proposals.clear()
    w.leader.link_replaced(LinkReplaced("n2"), w.now)
    w.pump("L")
    w.settle_all()
    assert not w.proposals, w.proposals
    assert (OWNERS[1], "t") not in w.leader.q.consumers
    assert all(o != OWNERS[1] for o, _, _ in w.leader.q.unacked.values())
    # what n2 held went to the consumer on n1, flagged; n1's own deliveries were not touched
    assert w.delivered[OWNERS[0]][:len(before)] == before
    assert sorted(w.delivered[OWNERS[0]][len(before):]) == sorted(on_n2)
    w.check(final=True)
    # the session registers its consumer again over the new link and gets new deliveries
    w.op("consume", OWNERS[1], 10)
    w.op("publish", OWNERS[0], 1)
    w.settle_all()
    assert (OWNERS[1], "t") in w.leader.q.consumers


def test_a_publish_parked_for_an_epoch_before_the_promotion_goes_out_flagged():
    """dst seed 5581: right after a full restart n1's session sent a batch to n2, leader of
    epoch 1 by its stale metadata; n2's new replica, a mirror of epoch 3 (led by n3), parked it.
    The session resent it to n3, which delivered it (flagged); then n2 was promoted (epoch 4)
    and replayed the parked batch as a fresh one: the same consumer got it again, unflagged.
    A batch first sent to an epoch before the leader's reign goes out flagged; one sent to the
    reign itself (a sender whose metadata was ahead) does not."""
    ha = HA(mode="all")
    cfg = ReplicaConfig(node="n2", pid="<n2.1.0>")
    r = Replica("q", cfg, Assign("n3", 3, ["n2"], [], ha), 0.0)
    old, ahead = ("n1", 1, 1), ("n1", 2, 1)
    r.handle(m.QPublish("q", old, 1, [b"old"], None, False, 1, None), 0.0)
    r.handle(m.QPublish("q", ahead, 1, [b"new"], None, False, 4, None), 0.0)
    assert r.state is State.WAITING and len(r.parked) == 2
    r.assign_now(Assign("n2", 4, [], [], ha), 0.0)
    assert r.state is State.LEADER
    r.handle(m.QConsume("q", ("n1", 3, 1), 1, "t", False, 0, False, {}), 0.0)
    r.flush(0.0)
    _, events = r.take_output()
    [ev] = [e for e in events[("n1", 3)] if isinstance(e, m.EvDeliver)]
    assert ev.bodies == [b"old", b"new"] and ev.redelivered == [0]
    # the session's resend of the old batch (flagged, to epoch 4) is recognised: not enqueued again
    r.handle(m.QPublish("q", old, 1, [b"old"], None, True, 4, None), 0.0)
    assert r.q.next_id == 3


def test_a_batch_sent_to_an_earlier_epoch_waits_for_its_resend_when_one_before_it_is_missing():
    """dst seed 122307: a new leader's replica (started empty, epoch 3) first got batches 115-130
    of a publisher, sent to epoch 2 and waiting for it; then the session's resend of 72-130.
    Applied as they came, 115-130 counted as accepted for 72-114 too (confirms are cumulative),
    and the resend of 72-114 looked applied: confirmed, never enqueued, 645 lost. A batch sent
    to an earlier epoch that does not follow the last one applied here is left to its resend,
    which brings the missing ones first, in order."""
    ha = HA(mode="all")
    cfg = ReplicaConfig(node="n2", pid="<n2.1.0>")
    r = Replica("q", cfg, Assign("n2", 3, [], [], ha), 0.0)
    pub = ("n1", 7, 1)
    r.handle(m.QPublish("q", pub, 5, [b"e", b"f"], None, False, 2, None), 0.0)  # 3 and 4 missing
    assert r.q.next_id == 1 and r.accepted.get(("n1", 7), 0) == 0
    for pseq, bodies in ((3, [b"c"]), (4, [b"d"]), (5, [b"e", b"f"])):  # the resend, to epoch 3
        r.handle(m.QPublish("q", pub, pseq, bodies, None, True, 3, None), 0.0)
    assert [msg[1] for msg in r.q.ready] == [b"c", b"d", b"e", b"f"]
    assert r.accepted[("n1", 7)] == 5
    r.handle(m.QPublish("q", pub, 6, [b"g"], None, False, 2, None), 0.0)  # follows on: applied, flagged
    assert [msg[1] for msg in r.q.ready][-1] == b"g" and r.q.ready[-1][3]


def test_a_new_epoch_confirms_what_the_leader_had_accepted_and_not_confirmed():
    """dst seed 31170: a leader's node, frozen, was counted down and came back; the publishing
    session's node learned of the leader's new epoch first and resent its in-flight batches,
    which reached the leader before the new epoch did. The leader recognised them, then started
    the epoch and dropped what it had accepted: 500 publishes never confirmed, and no resend
    came again. Whatever a leader accepted and had not confirmed (held while out of step, or
    waiting for an old mirror) is confirmed in the new epoch once its mirrors acknowledge it."""
    w = World(random.Random(8), "manual", 4)
    w.op("add_mirror")
    w.settle_all()
    session = OWNERS[0][:2]

    def new_epoch(epoch: int) -> None:
        w.links.clear()  # the node was counted down: what its links carried is gone
        for r in w.replicas.values():
            r.assign_now(Assign("L", epoch, list(w.mirrors), [], w.ha), w.now)
        w.leader.in_step = True
        w.pump("L")
        w.pump("M1")
        w.settle_all()

    w.leader.in_step = False
    w.op("publish", OWNERS[0], 3)  # pseq 1: the mirror acknowledges it, the confirm is held
    w.settle_all()
    assert w.accepted.get(session, 0) == 0
    new_epoch(2)
    assert w.accepted[session] == 1
    w.op("publish", OWNERS[0], 2)  # pseq 2: waits for the mirror's acknowledgement
    assert w.accepted[session] == 1
    new_epoch(3)
    assert w.accepted[session] == 2


def test_a_resend_the_leader_already_applied_uses_no_replication_batch_number():
    """dst seed 36073: sessions resent their in-flight publishes to the same leader (their
    link to it came back); it recognised them, and accepting them took a replication batch
    number that no batch carried. Its mirror saw the gap, restarted empty, and the leader asked
    to drop it: the only synchronised copy, 268 confirmed messages lost when the leader's node
    then stopped. A recognised resend waits for the mirrors' acknowledgement of what was sent
    so far, under no new number."""
    w = World(random.Random(9), "manual", 4)
    w.op("add_mirror")
    w.settle_all()
    owner = OWNERS[0]
    w.op("publish", owner, 3)
    w.settle_all()
    assert w.accepted[owner[:2]] == 1
    seq = w.leader.rep.seq
    w.leader.handle(m.QPublish("q", owner, 1, [b"m0", b"m1", b"m2"], None, True, 1, None), w.now)
    w.pump("L")
    assert w.leader.rep.seq == seq, "a recognised resend took a batch number"
    w.settle_all()
    w.op("publish", owner, 2)
    w.settle_all()
    mirror = w.replicas["M1"]
    assert mirror.follow.last_seq == w.leader.rep.seq and w.leader.rep.mirrors["M1"].synced
    assert w.accepted[owner[:2]] == 2 and mirror.q.comparable() == w.leader.q.comparable()


def test_acks_alone_wait_for_the_next_publish_batch_at_most_settle_linger():
    from mirroring.replica import SETTLE_LINGER

    w = World(random.Random(1), "manual", 4)
    w.op("add_mirror", "M1")
    w.settle_all()
    owner = OWNERS[0]
    w.op("consume", owner, 10)
    w.op("publish", owner, 2)
    w.pump("L")
    w.settle_all()
    assert w.delivered[owner] == [1, 2] and len(w.replicas["M1"].q.unacked) == 2
    sent = len(w.links.get(("L", "M1"), []))
    w.op("settle", owner, "ack", 1)
    w.pump("L")
    assert len(w.links.get(("L", "M1"), [])) == sent, "an ack alone made a batch at once"
    assert w.leader.next_deadline(w.now) <= w.now + SETTLE_LINGER
    # a publish within the window carries the ack in its batch
    w.op("publish", owner, 1)
    w.pump("L")
    batch = w.links[("L", "M1")][-1]
    assert [type(e) for e in batch.effects][:2] == [m.ESettle, m.EEnqueue]
    # an ack with nothing after it leaves once the window has passed
    w.settle_all()
    w.op("settle", owner, "ack", 1)
    w.pump("L")
    w.now += SETTLE_LINGER
    w.pump("L")
    assert type(w.links[("L", "M1")][-1].effects[0]) is m.ESettle
    w.settle_all()
    assert 2 not in w.replicas["M1"].q.unacked


def test_a_mirror_that_resumes_under_a_promoted_leader_gives_back_the_deliveries_it_does():
    """dst seed 92168: a consumer on n3 held two unacknowledged deliveries when the leader n1
    stopped. n2 was promoted and requeued them (spec: a new leader requeues every unacknowledged
    message), then delivered them again, flagged. n3, a mirror that resumed under n2, never saw
    the requeue: it had been shipped as the new epoch's first batch before n3 was a mirror of
    it. So n3 counted the same deliveries twice against the consumer's prefetch, and when n3
    was promoted in turn its consumer had no credit left: every message published after that
    stayed in the queue while the consumer was subscribed. A resumed mirror applies the
    promotion's requeue like everything after it, and stays equal to its leader."""
    ha = HA(mode="all")
    names = ("n1", "n2", "n3")
    reps = {n: Replica("q", ReplicaConfig(node=n, pid=f"<{n}.1.0>"), Assign("n1", 1, list(names), [], ha), 0.0)
            for n in names}
    consumer = ("n3", 9, 1)
    links: list = []  # (to, message), in order
    delivered: list = []

    def pump(name: str) -> None:
        reps[name].flush(0.0)
        out, events = reps[name].take_output()
        links.extend((o.node, o.msg) for o in out if isinstance(o, Send))
        for ev in events.get(consumer[:2], ()):
            if isinstance(ev, m.EvDeliver):
                delivered.extend(ev.ids)

    def settle() -> None:
        for name in reps:
            pump(name)
        while links:
            to, msg = links.pop(0)
            if to in reps:
                reps[to].handle(msg, 0.0)
                pump(to)

    def promote(leader: str, epoch: int) -> None:
        links[:] = [(to, msg) for to, msg in links if to in reps]
        for r in reps.values():
            r.assign_now(Assign(leader, epoch, list(reps), list(reps), ha), 0.0)
        settle()

    settle()
    first = reps["n1"]
    first.handle(m.QConsume("q", consumer, 1, "t", False, 2, False, {}), 0.0)
    first.handle(m.QPublish("q", ("n2", 5, 1), 1, [b"a", b"b", b"c"], None, False, 1, None), 0.0)
    settle()
    assert delivered == [1, 2]
    assert reps["n2"].q.comparable() == reps["n3"].q.comparable() == first.q.comparable()

    del reps["n1"]  # the leader's node stops; the consumer's node stays
    promote("n2", 2)
    assert reps["n2"].rep.mirrors["n3"].ready
    assert delivered == [1, 2, 1, 2]  # requeued, then delivered again (flagged)
    assert reps["n3"].q.comparable() == reps["n2"].q.comparable()

    reps["n2"].handle(m.QSettle("q", consumer, m.ACK, [1, 2]), 0.0)
    settle()
    assert delivered == [1, 2, 1, 2, 3]
    assert reps["n3"].q.comparable() == reps["n2"].q.comparable()
    reps["n2"].handle(m.QSettle("q", consumer, m.ACK, [3]), 0.0)
    settle()

    del reps["n2"]
    promote("n3", 3)
    reps["n3"].handle(m.QPublish("q", ("n3", 7, 1), 1, [b"d"], None, False, 3, None), 0.0)
    settle()
    assert delivered[-1] == 4, "the promoted mirror's consumer has no credit"
