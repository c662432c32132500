"""broker/queue_process.py: the pump around one replica. Here, how it hands the replica the
metadata's news: a replica acts only on the newest Assign its inbox holds, and not on any
Assign a Stop follows."""

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
        self.leaving = False  # the node is not stopping

    def may_deliver(self, qp, now) -> bool:
        return True  # the node is in step with the metadata log

    def encode_once(self, msg):
        return None

    def to_node(self, node, msg, encoded=None):
        pass  # replication to the mirror: these tests look at the confirms only

    def to_session(self, node, sid, evs):
        self.events.extend(evs)

    def propose(self, change):
        pass


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
    qp.deliver(m.QPublish("q", OWNER, 1, [b"only the leader has this"], None, False, 1))
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
