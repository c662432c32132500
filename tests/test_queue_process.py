"""broker/queue_process.py: the pump around one replica. Here, how it hands the replica the
metadata's news: a replica acts only on the newest Assign its inbox holds, and not on any
Assign a Stop follows. And the rounds of replication traffic alone: a leader's of its mirrors'
acknowledgements (its confirms leave without the rest of a round, and only while the node is
in step), a mirror's of its leader's batches (its acknowledgement leaves at once)."""

from __future__ import annotations

import structlog

from broker.queue_process import QueueProcess
from mirroring.policy import HA
from mirroring.replica import Assign, Replica, ReplicaConfig, State
from wire import messages as m

OWNER = ("n1", 7, 1)


class Host:
    """What a QueueProcess asks of its node (broker/router.py), recorded."""

    def __init__(self):
        self.log = structlog.get_logger()
        self.batch = None
        self.batch_now = 0.0
        self.events: list = []
        self.sent: list = []  # (node, message) to other replicas
        self.dead: list = []  # (queue, DeadLetter) to republish
        self.leaving = False  # the node is not stopping

    in_step = True  # the node is in step with the metadata log

    def may_deliver(self, qp, now) -> bool:
        return self.in_step

    def encode_once(self, msg):
        return None

    def to_node(self, node, msg, encoded=None):
        self.sent.append((node, msg))

    def to_session(self, node, sid, evs):
        self.events.extend(evs)

    def propose(self, change):
        pass

    def replica_ended(self, qp):
        pass

    def delete_for_client(self, qname, owner, rid, count):
        pass

    def auto_delete(self, qname):
        pass

    def dead_letter(self, qname, d):
        self.dead.append((qname, d))


def _declared(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


def test_the_router_and_this_stand_in_answer_everything_a_replica_task_asks():
    """QueueProcess asks its host only for what ReplicaHost declares, and both the Router and
    the stand-in here have all of it."""
    import inspect

    from broker.queue_process import ReplicaHost
    from broker.router import Router
    declared = _declared(ReplicaHost)
    router_init = inspect.getsource(Router.__init__)
    missing = [n for n in sorted(declared) if not hasattr(Router, n) and f"self.{n}" not in router_init]
    assert missing == []
    assert [n for n in sorted(declared) if not hasattr(Host(), n)] == []
    source = inspect.getsource(QueueProcess)
    import re
    asked = set(re.findall(r"host\.([a-z_]+)", source))
    assert asked <= declared, asked - declared


def config(node: str) -> ReplicaConfig:
    return ReplicaConfig(node=node, pid=f"<{node}.1.0>", sync_batch_size=4, max_sync_bytes=1 << 20,
                         sync_max_throughput=0, stall_after=1e9)


def leader_with_a_mirror() -> tuple[QueueProcess, Host]:
    """n3 leads epoch 1 of queue q, n2 follows; one publish waits for n2's acknowledgement."""
    host = Host()
    ha = HA(mode="all")
    replica = Replica("q", config("n3"), Assign("n3", 1, ["n2"], ["n2"], ha), 0.0)
    qp = QueueProcess(host, replica)
    qp._carry_out()
    qp.deliver(m.QPublish("q", OWNER, 1, [b"only the leader has this"], None, False, 1, None))
    qp._round(0.1)
    assert not [e for e in host.events if isinstance(e, m.EvAccepted)], "confirmed before n2 had it"
    return qp, host


def test_an_assign_overtaken_in_the_inbox_is_not_acted_on():
    """A node catching up after a partition applies two changes at once: an older one that
    drops the leader's only mirror, and a newer one that promotes the replica on n1. Acting on
    the older would confirm a publish only this leader holds, just before it steps down and
    loses it (dst seed 53705). Only the newer one is acted on: the leader steps down, nothing
    is confirmed (the publisher's session resends to n1)."""
    qp, host = leader_with_a_mirror()
    ha = qp.replica.assign.ha
    qp.deliver(Assign("n3", 1, [], [], ha))  # the older change: n2's mirror dropped
    qp.deliver(Assign("n1", 2, ["n3"], [], ha))  # the newer: n1 leads epoch 2
    qp._round(0.2)
    assert qp.replica.state is State.WAITING
    assert not [e for e in host.events if isinstance(e, m.EvAccepted)]


def test_a_stop_overtakes_the_assigns_before_it():
    """The same catching up, but the newest change moves the queue off this node altogether, so
    it reaches the replica as a Stop, not an Assign (dst seed 105284: 730 confirmed messages
    lost). The drop before it is not acted on either: the leader stops, nothing is confirmed."""
    from mirroring.replica import Stop
    qp, host = leader_with_a_mirror()
    qp.deliver(Assign("n3", 1, [], [], qp.replica.assign.ha))  # the older change: n2 dropped
    qp.deliver(Stop("queue moved", False))  # the newer: this node holds no replica
    qp._round(0.2)
    assert qp.replica.state is State.STOPPED
    assert not [e for e in host.events if isinstance(e, m.EvAccepted)]


def test_the_same_drop_alone_confirms_what_waited_for_the_dropped_mirror():
    """The control: the drop as the metadata's newest word releases the confirm at once."""
    qp, host = leader_with_a_mirror()
    qp.deliver(Assign("n3", 1, [], [], qp.replica.assign.ha))
    qp._round(0.2)
    assert qp.replica.state is State.LEADER
    assert [e.pseq for e in host.events if isinstance(e, m.EvAccepted)] == [1]


def test_a_promotion_reports_what_the_overtaken_assign_listed():
    """A mirror the metadata listed synchronised, promoted by the next change in the same batch,
    is logged as a synchronised promotion (the chaos checkers read that line)."""
    host = Host()
    ha = HA(mode="all")
    replica = Replica("q", config("n2"), Assign("n3", 1, ["n2"], [], ha), 0.0)
    qp = QueueProcess(host, replica)
    qp.deliver(Assign("n3", 1, ["n2"], ["n2"], ha))  # n2 recorded synchronised
    qp.deliver(Assign("n2", 2, [], [], ha))  # n3 gone: n2 promoted
    logged = []
    qp.log = type("L", (), {"info": lambda self, ev, **kw: logged.append((ev, kw)),
                            "warning": lambda self, ev, **kw: logged.append((ev, kw))})()
    qp._round(0.1)
    promoted = [kw for ev, kw in logged if "Promoting mirror" in ev]
    assert promoted and promoted[0]["synchronised"] is True


def after_a_peer_batch(qp: QueueProcess, host: Host, now: float, *msgs) -> None:
    """Hand `msgs` to an idle replica as a peer link's read does (Router.peer_messages): the
    replica is noted in the batch, and its round runs at the batch's end, in the reader."""
    qp._idle = True
    host.batch, host.batch_now = [], now
    for msg in msgs:
        qp.deliver(msg)
    batch, host.batch = host.batch, None
    for p in batch:
        p.after_batch()


def count_rounds(monkeypatch) -> list:
    """The ends of full rounds (Replica.flush) from now on."""
    ends = []
    real = Replica.flush
    monkeypatch.setattr(Replica, "flush", lambda self, now: ends.append(now) or real(self, now))
    return ends


def accepted(host: Host) -> list:
    return [e.pseq for e in host.events if isinstance(e, m.EvAccepted)]


def test_a_mirrors_acknowledgement_alone_confirms_without_a_round(monkeypatch):
    qp, host = leader_with_a_mirror()
    rounds = count_rounds(monkeypatch)
    after_a_peer_batch(qp, host, 0.2, m.RRepOk("q", 1, "n2", qp.replica.rep.seq))
    assert accepted(host) == [1]
    assert rounds == [] and not qp.inbox


def test_acknowledgements_alone_hold_their_confirms_while_the_node_is_out_of_step(monkeypatch):
    """Out of step with the metadata log, a leader confirms nothing (a node woken from a freeze
    may have been replaced): the acknowledgement is taken, the confirm held until in step."""
    qp, host = leader_with_a_mirror()
    host.in_step = False
    after_a_peer_batch(qp, host, 0.2, m.RRepOk("q", 1, "n2", qp.replica.rep.seq))
    assert accepted(host) == [] and not qp.inbox
    host.in_step = True
    qp._round(0.3)
    assert accepted(host) == [1]


def test_an_acknowledgement_with_other_input_gets_a_full_round(monkeypatch):
    qp, host = leader_with_a_mirror()
    rounds = count_rounds(monkeypatch)
    after_a_peer_batch(qp, host, 0.2, m.RRepOk("q", 1, "n2", qp.replica.rep.seq),
                       m.QPublish("q", OWNER, 2, [b"next"], None, False, 1, None))
    assert rounds == [0.2] and accepted(host) == [1]


def test_an_acknowledgement_gets_a_full_round_when_a_sync_is_wanted(monkeypatch):
    """A sync asked for starts at the end of the leader's next round: acknowledgements alone
    must not skip it."""
    qp, host = leader_with_a_mirror()
    qp.replica.sync_wanted = "asked for"
    rounds = count_rounds(monkeypatch)
    after_a_peer_batch(qp, host, 0.2, m.RRepOk("q", 1, "n2", qp.replica.rep.seq))
    assert rounds == [0.2] and accepted(host) == [1]



def test_confirms_held_out_of_step_leave_with_the_next_acknowledgement():
    """Publish 2 is in flight when the node falls out of step; publish 1's acknowledgement
    comes then, and its confirm is held. Back in step, publish 2's acknowledgement alone
    brings both confirms out at once (not the later one alone, the held one waiting for some
    later round)."""
    qp, host = leader_with_a_mirror()
    qp.deliver(m.QPublish("q", OWNER, 2, [b"next"], None, False, 1, None))
    qp._round(0.15)
    first, second = qp.replica.rep.seq - 1, qp.replica.rep.seq
    host.in_step = False
    after_a_peer_batch(qp, host, 0.2, m.RRepOk("q", 1, "n2", first))
    assert accepted(host) == []
    host.in_step = True
    after_a_peer_batch(qp, host, 0.3, m.RRepOk("q", 1, "n2", second))
    assert sorted(accepted(host)) == [1, 2]


def leader_and_mirror() -> tuple[QueueProcess, QueueProcess, Host, Host]:
    """n3 leads queue q, n2 mirrors it, each with its own host; the mirror has started."""
    ha = HA(mode="all")
    lhost, mhost = Host(), Host()
    leader = QueueProcess(lhost, Replica("q", config("n3"), Assign("n3", 1, ["n2"], ["n2"], ha), 0.0))
    mirror = QueueProcess(mhost, Replica("q", config("n2"), Assign("n3", 1, ["n2"], ["n2"], ha), 0.0))
    leader._carry_out()
    mirror._carry_out()
    pump(leader, lhost, mirror, mhost, 0.01)
    assert mirror.replica.state is State.MIRROR
    return leader, mirror, lhost, mhost


def pump(leader, lhost, mirror, mhost, now):
    """Run rounds, handing what each sends the other, until neither sends more."""
    for _ in range(10):
        leader._round(now)
        mirror._round(now)
        to_mirror, lhost.sent = [msg for _, msg in lhost.sent], []
        to_leader, mhost.sent = [msg for _, msg in mhost.sent], []
        if not to_mirror and not to_leader:
            return
        for msg in to_mirror:
            mirror.deliver(msg)
        for msg in to_leader:
            leader.deliver(msg)


def test_a_replication_batch_alone_is_acknowledged_without_a_round(monkeypatch):
    leader, mirror, lhost, mhost = leader_and_mirror()
    leader.deliver(m.QPublish("q", OWNER, 1, [b"body"], None, False, 1, None))
    leader._round(0.1)
    batches = [msg for _, msg in lhost.sent if isinstance(msg, m.RRep)]
    assert len(batches) == 1
    asked = []
    mhost.may_deliver = lambda qp, now: asked.append(now) or True  # a full round asks this
    after_a_peer_batch(mirror, mhost, 0.2, *batches)
    assert asked == [] and not mirror.inbox
    assert [(n, type(msg)) for n, msg in mhost.sent] == [("n3", m.RRepOk)]
    assert mhost.sent[0][1].seq == batches[0].seq
    assert mirror.replica.q.stats()["messages"] == 1


def test_a_missing_replication_batch_still_restarts_the_mirror():
    """A gap in the batches (one lost with a link) is noticed as in a round: the mirror asks
    its leader for a restart and ignores the batches after the gap."""
    leader, mirror, lhost, mhost = leader_and_mirror()
    for pseq in (1, 2):
        leader.deliver(m.QPublish("q", OWNER, pseq, [b"body"], None, False, 1, None))
        leader._round(0.1 * pseq)
    first, second = [msg for _, msg in lhost.sent if isinstance(msg, m.RRep)]
    after_a_peer_batch(mirror, mhost, 0.3, second, first)
    assert [type(msg) for _, msg in mhost.sent] == [m.RMirrorReset]
    assert mirror.replica.state is State.WAITING


def test_a_waiting_mirror_gets_a_full_round():
    ha = HA(mode="all")
    host = Host()
    qp = QueueProcess(host, Replica("q", config("n2"), Assign("n3", 1, ["n2"], ["n2"], ha), 0.0))
    asked = []
    host.may_deliver = lambda qp, now: asked.append(now) or True
    after_a_peer_batch(qp, host, 0.2, m.RRep("q", 1, 1, [], 0.2))
    assert qp.replica.state is State.WAITING and asked == [0.2]
