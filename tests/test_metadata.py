"""Unit tests of mirroring.metadata and the planner's concrete changes: declarations,
equivalence, nodes up and down by incarnation, mirror drops, forgetting a member, snapshots,
and the typed changes' dispatch and round trip through msgpack."""

from __future__ import annotations

import msgspec
import pytest

from mirroring import changes as c
from mirroring import planner
from mirroring.changes import (DropMirror, MemberAdd, MemberRemove, NodeDown, NodeUp, PolicySet,
                               QueueDeclare, QueueDelete, QueuesUpdate, Replan, client_delete,
                               delete_asked_by)
from mirroring.metadata import _APPLY, Metadata, MetaError
from mirroring.policy import make_operator_policy, make_policy
from mirroring.records import Placement, QueueDef, QueueUpdate
from wire.errors import NOT_FOUND, PRECONDITION_FAILED, RESOURCE_LOCKED, SYNTAX_ERROR, ProtocolError


def qdef(name="q", durable=True, exclusive=False, auto_delete=False, arguments=None, leader="n1",
         owner=None) -> QueueDef:
    return QueueDef(name, durable, exclusive, auto_delete, arguments or {}, leader, owner)


def declare(**kw) -> QueueDeclare:
    return QueueDeclare(qdef(**kw))


def cluster(*names) -> Metadata:
    md = Metadata()
    for i, n in enumerate(names):
        md.apply(MemberAdd(n, (n, 25672), (n, 5672)))
    return md


def set_synced(md, name, synced):
    """A queues.update that only says which mirrors are synchronised."""
    q = md.queues[name]
    md.apply(QueuesUpdate((QueueUpdate(name, Placement(q.leader, q.mirrors, tuple(synced),
                                                       q.epoch)),)))


def test_member_add_sets_cluster_name_and_order():
    md = cluster("n1", "n2", "n3")
    assert md.cluster_name == "warren@n1"
    assert list(md.members) == ["n1", "n2", "n3"]
    assert md.version == 3
    assert md.members["n2"].peer == ("n2", 25672)


def test_declare_and_equivalent_redeclare():
    md = cluster("n1")
    r = md.apply(declare())
    assert r == {"created": True, "leader": "n1"} and md.queues["q"].leader == "n1"
    v = md.version
    r = md.apply(declare(leader="n2"))  # leader of a redeclare does not matter
    assert r == {"created": False, "leader": "n1"}
    assert md.version == v + 1


def test_declare_with_unknown_leader_refused():
    md = cluster("n1")
    with pytest.raises(MetaError) as ei:
        md.apply(declare(leader="n9"))
    assert ei.value.code == NOT_FOUND
    assert md.queues == {} and md.version == 1


def test_redeclare_with_different_durable():
    md = cluster("n1")
    md.apply(declare(durable=True))
    v = md.version
    with pytest.raises(MetaError) as ei:
        md.apply(declare(durable=False))
    assert ei.value.code == PRECONDITION_FAILED
    assert ei.value.text == ("inequivalent arg 'durable' for queue 'q' in vhost '/': "
                             "received 'false' but current is 'true'")
    assert md.version == v  # refused changes leave the state untouched
    assert md.queues["q"].durable is True


def test_redeclare_with_different_arguments():
    md = cluster("n1")
    md.apply(declare(arguments={"x-max-length": 10}))
    with pytest.raises(MetaError) as ei:
        md.apply(declare(arguments={"x-max-length": 20}))
    assert ei.value.code == PRECONDITION_FAILED
    assert "inequivalent arg 'x-max-length' for queue 'q'" in ei.value.text


def test_exclusive_owned_by_another_owner_is_locked():
    md = cluster("n1")
    md.apply(declare(durable=False, exclusive=True, owner="conn-1"))
    with pytest.raises(MetaError) as ei:
        md.apply(declare(durable=False, exclusive=True, owner="conn-2"))
    assert ei.value.code == RESOURCE_LOCKED
    assert "cannot obtain exclusive access to locked queue 'q' in vhost '/'" in ei.value.text
    r = md.apply(declare(durable=False, exclusive=True, owner="conn-1"))
    assert r["created"] is False


def test_node_down_deletes_only_non_durable_queues_of_that_node():
    md = cluster("n1", "n2")
    md.apply(declare(name="d1", durable=True, leader="n1"))
    md.apply(declare(name="t1", durable=False, leader="n1"))
    md.apply(declare(name="t2", durable=False, leader="n2"))
    md.apply(NodeUp("n1", 7))
    updates = planner.plan(md, {"n2"}, down="n1")
    gone = md.apply(NodeDown("n1", 7, "failure", updates))
    assert gone == ["t1"]
    assert sorted(md.queues) == ["d1", "t2"]
    assert md.down == {"n1": "failure"} and "n1" not in md.up
    assert md.apply(NodeUp("n1", 8, planner.plan(md, {"n1", "n2"}, up="n1"))) == []
    assert md.down == {} and md.up["n1"] == 8
    assert md.queues["d1"].epoch == 2  # its leader replica restarted


def test_member_remove_drops_its_queues():
    md = cluster("n1", "n2")
    md.apply(declare(name="a", leader="n1"))
    md.apply(declare(name="b", leader="n2"))
    md.apply(MemberRemove("n2"))
    assert list(md.members) == ["n1"] and list(md.queues) == ["a"]
    with pytest.raises(MetaError) as ei:
        md.apply(MemberRemove("n2"))
    assert ei.value.code == NOT_FOUND


def test_queue_delete_with_leader_guard():
    md = cluster("n1", "n2")
    md.apply(declare(name="a", leader="n1"))
    assert md.apply(QueueDelete("a", "n2")) is False
    assert md.apply(QueueDelete("a")) is True
    assert md.apply(QueueDelete("a")) is False


def test_a_clients_delete_names_its_asker_only_to_the_askers_node():
    md = cluster("n1", "n2")
    md.apply(declare(name="a"))
    change = client_delete("a", "n2", 7, 31, 5)
    assert md.apply(change) is True and "a" not in md.queues
    asked = delete_asked_by(change, "n2")
    assert (asked.session, asked.rid, asked.count) == (7, 31, 5)
    assert delete_asked_by(change, "n1") is None
    assert delete_asked_by(QueueDelete("a"), "n2") is None
    assert delete_asked_by(QueueDelete("a", "n2"), "n2") is None
    assert delete_asked_by(NodeDown("n2", 1, "failure"), "n2") is None


def test_a_change_without_a_handler_is_refused():
    md = cluster("n1")
    with pytest.raises(MetaError) as ei:
        md.apply(Replan())  # a request only the planner takes
    assert ei.value.code == PRECONDITION_FAILED and "Replan" in ei.value.text
    assert md.version == 1


def test_every_kind_of_change_has_a_handler():
    """Each kind is applied (metadata) or turned into what is applied (planner)."""
    for kind in c.KINDS.values():
        assert kind in _APPLY or kind in planner._PLAN, kind


ALL_KINDS = [
    c.Noop(), MemberAdd("n1", ("h", 1), ("h", 2)), MemberRemove("n1"),
    QueueDeclare(qdef(arguments={"x-max-length": 3}, owner="n1/5"), "balanced"),
    QueueDelete("q", "n1", c.DeleteRequester("n2", 7, 31, 5)),
    QueuesUpdate((QueueUpdate("q", Placement("n1", ("n2",), ("n2",), 3)), QueueUpdate("r", None))),
    c.ExchangeDeclare(c.Exchange("x", "topic", True, False, False, {"alternate-exchange": "y"})),
    c.ExchangeDelete("x", True), c.BindingAdd("x", c.Binding("q", "a.#", {})),
    c.ExchangeBindingAdd("x", c.ExchangeBinding("y", "a.*", {})),
    c.ExchangeBindingRemove("x", c.ExchangeBinding("y", "a.*", {"x-match": "all"})),
    c.BindingRemove("x", c.Binding("q", "a.#", {"x-match": "any"})),
    NodeDown("n1", 7, "shutdown", (QueueUpdate("q", None),)), NodeUp("n1", 8),
    PolicySet(make_policy("ha", ".*", {"ha-mode": "exactly", "ha-params": 2})),
    c.PolicyClear("ha"), Replan(), c.QueueSynced("q", 2, ("n2", "n3")), DropMirror("q", 2, "n3"),
    c.OperatorPolicySet(make_operator_policy("cap", "^a", {"max-length": 5}, 1, "queues")),
    c.OperatorPolicyClear("cap"), c.ManagedHAEnable(),
    c.UserAdd(c.User("u", "aGFzaA==", ("administrator",))), c.UserUpdate(c.User("u", "aGFzaA==")),
    c.UserDelete("u"), c.PermissionSet(c.Permission("u", "/", "^a", ".*", "")),
    c.PermissionClear("u", "/"),
    c.VHostAdd(c.VHost("v", "a test vhost", True)), c.VHostDelete("v"),
]


def test_every_kind_round_trips_through_msgpack():
    """Changes cross the peer wire and the state file as msgpack arrays [kind, fields...]."""
    assert {type(change) for change in ALL_KINDS} == set(c.KINDS.values())
    for change in ALL_KINDS:
        plain = msgspec.msgpack.decode(msgspec.msgpack.encode(change))
        assert plain[0] == change.kind
        assert c.decode_change(plain) == change
    entries = [[1, change] for change in ALL_KINDS]
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(entries))
    assert c.decode_entries(plain) == [(1, change) for change in ALL_KINDS]


def test_a_malformed_change_is_refused_by_field_or_kind():
    with pytest.raises(ProtocolError) as ei:
        c.decode_change(["node.up", "n1", "seven"])
    assert ei.value.code == SYNTAX_ERROR and "int" in ei.value.text
    with pytest.raises(ProtocolError, match="unknown metadata change 'frobnicate'"):
        c.decode_change(["frobnicate"])
    with pytest.raises(ProtocolError):
        c.decode_entries([[1, ["queue.delete"]]])


def test_snapshot_round_trip_and_digest():
    md = cluster("n1", "n2", "n3")
    md.apply(declare(name="a", arguments={"k": [1, 2]}))
    md.apply(declare(name="b", durable=False, leader="n3"))
    md.apply(PolicySet(make_policy("ha", "^a$", {"ha-mode": "all"})))
    md.apply(c.BindingAdd("amq.topic", c.Binding("a", "k.#", {})))
    snap = msgspec.msgpack.decode(msgspec.msgpack.encode(md.snapshot()))
    md2 = Metadata.from_snapshot(snap)
    assert md2.version == md.version and md2.cluster_name == md.cluster_name
    assert list(md2.members) == list(md.members) and md2.queues == md.queues
    assert md2.policies == md.policies and md2.bindings == md.bindings
    assert md2.digest() == md.digest()
    # the snapshot is a copy: changing it does not change the source
    snap2 = md.snapshot()
    del snap2.queues["a"]
    snap2.bindings["amq.topic"].clear()
    assert "a" in md.queues and md.bindings["amq.topic"]
    # the same changes applied to two copies give the same digest; a difference shows
    md.apply(QueueDelete("b"))
    assert md2.digest() != md.digest()
    md2.apply(QueueDelete("b"))
    assert md2.digest() == md.digest()


def test_a_bad_snapshot_is_refused():
    with pytest.raises(MetaError, match="bad metadata snapshot"):
        Metadata.from_snapshot({"version": "one"})


def up(md, *names):
    for i, n in enumerate(names, 1):
        md.apply(NodeUp(n, i))


def mirrored(md, name="ha.q", leader="n1"):
    md.apply(PolicySet(make_policy("ha", r"^ha\.", {"ha-mode": "all"})))
    md.apply(QueueDeclare(planner.plan_declare(md, qdef(name, leader=leader), list(md.up),
                                               "client-local")))
    return md.queues[name]


def test_node_down_for_an_old_incarnation_is_stale():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    assert planner.plan_change(md, NodeDown("n2", 99, "failure"), {"n1", "n3"}) == []
    assert md.up["n2"] == 2
    planned = planner.plan_change(md, NodeDown("n2", 2, "failure"), {"n1", "n3"})
    assert [type(ch) for ch, _ in planned] == [NodeDown] and "n2" not in md.up


def test_a_restart_nobody_saw_is_a_down_then_an_up():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    q = mirrored(md, leader="n2")
    assert q.mirrors == ("n1", "n3") and q.epoch == 1
    planned = planner.plan_change(md, NodeUp("n2", 42), {"n1", "n2", "n3"})
    assert [type(ch) for ch, _ in planned] == [NodeDown, NodeUp]
    # its queue was promoted away from the old incarnation, and it is a fresh mirror now
    q = md.queues["ha.q"]
    assert q.leader == "n1" and q.epoch == 2 and "n2" in q.mirrors
    assert q.synced == () and md.up["n2"] == 42


def test_promotion_starts_the_new_epoch_with_no_synchronised_mirror():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    set_synced(md, "ha.q", ["n2", "n3"])
    planner.plan_change(md, NodeDown("n1", 1, "failure"), {"n2", "n3"})
    q = md.queues["ha.q"]
    assert (q.leader, q.mirrors, q.synced, q.epoch) == ("n2", ("n3",), (), 2)


def test_drop_mirror_removes_it_and_only_a_later_replan_places_it_again():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    set_synced(md, "ha.q", ["n2", "n3"])
    running = {"n1", "n2", "n3"}
    assert planner.plan_change(md, DropMirror("ha.q", 9, "n2"), running) == []  # stale epoch
    planner.plan_change(md, DropMirror("ha.q", 1, "n2"), running)
    assert md.queues["ha.q"].mirrors == ("n3",) and md.queues["ha.q"].synced == ("n3",)
    planner.plan_change(md, Replan(), running)
    assert md.queues["ha.q"].mirrors == ("n3", "n2")  # back, as the youngest


def test_forgetting_a_leader_moves_its_queues_elsewhere():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    md.apply(declare(name="solo", leader="n1"))
    planner.plan_change(md, NodeDown("n1", 1, "failure"), set())  # nobody to promote to
    planner.plan_change(md, MemberRemove("n1"), {"n2", "n3"})
    assert "n1" not in md.members
    # a durable queue with no mirror lives on, empty, on the most senior running member
    assert md.queues["solo"].leader == "n2" and md.queues["solo"].epoch == 2
    q = md.queues["ha.q"]
    assert q.leader == "n2" and q.mirrors == ("n3",) and q.epoch == 2


def test_a_forget_is_refused_where_it_is_ordered_if_the_node_runs_by_then():
    """forget_cluster_node checks the node is stopped when asked, but the change may wait for
    a leader (up to 15 s); if the node is back by the time the log orders it, it is refused
    rather than removing a running member (dst seed 5531)."""
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    before = md.snapshot()
    with pytest.raises(MetaError, match="node n1 is running: stop its app first"):
        planner.plan_change(md, MemberRemove("n1"), {"n1", "n2"})
    assert md.snapshot() == before


def test_refused_declare_leaves_the_copy_untouched():
    md = cluster("n1")
    up(md, "n1")
    md.apply(declare(name="a", durable=True))
    before = md.snapshot()
    with pytest.raises(MetaError):
        planner.plan_change(md, declare(name="a", durable=False), {"n1"})
    assert md.snapshot() == before


def test_copy_is_equal_and_independent():
    """A copy shares the immutable records and copies every container: changing the copy (as
    planning does) leaves the original as it was."""
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    md.apply(c.BindingAdd("amq.direct", c.Binding("ha.q", "k", {})))
    cp = md.copy()
    assert cp.snapshot() == md.snapshot() and cp.queues["ha.q"] is md.queues["ha.q"]
    before = md.snapshot()
    planner.plan_change(cp, NodeDown("n1", 1, "failure"), {"n2", "n3"})
    planner.plan_change(cp, MemberRemove("n1"), {"n2", "n3"})
    cp.apply(c.BindingAdd("amq.direct", c.Binding("ha.q", "k2", {})))
    cp.apply(c.PolicyClear("ha"))
    assert cp.queues["ha.q"].leader == "n2" and len(cp.bindings["amq.direct"]) == 2
    assert md.snapshot() == before and md.queues["ha.q"].leader == "n1"
    with pytest.raises(AttributeError):
        md.queues["ha.q"].leader = "n3"  # records are immutable
