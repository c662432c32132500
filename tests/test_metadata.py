"""Unit tests of mirroring.metadata and the planner's concrete changes: declarations,
equivalence, nodes up and down by incarnation, mirror drops, forgetting a member, snapshots."""

from __future__ import annotations

import pytest

from mirroring import planner

from mirroring.metadata import Metadata, MetaError, client_delete, delete_asked_by
from mirroring.policy import make_policy
from wire.errors import NOT_FOUND, PRECONDITION_FAILED, RESOURCE_LOCKED


def qdef(name="q", durable=True, exclusive=False, auto_delete=False, arguments=None, leader="n1",
         owner=None):
    return {"name": name, "durable": durable, "exclusive": exclusive, "auto_delete": auto_delete,
            "arguments": arguments or {}, "leader": leader, "owner": owner}


def cluster(*names) -> Metadata:
    md = Metadata()
    for i, n in enumerate(names):
        md.apply(["member.add", n, [n, 25672], [n, 5672]])
    return md


def test_member_add_sets_cluster_name_and_order():
    md = cluster("n1", "n2", "n3")
    assert md.cluster_name == "warren@n1"
    assert list(md.members) == ["n1", "n2", "n3"]
    assert md.version == 3
    assert md.seniority("n1") == 0 and md.seniority("n3") == 2 and md.seniority("zz") == 4


def test_declare_and_equivalent_redeclare():
    md = cluster("n1")
    r = md.apply(["queue.declare", qdef()])
    assert r["created"] is True and md.queues["q"]["leader"] == "n1"
    v = md.version
    r = md.apply(["queue.declare", qdef(leader="n2")])  # leader of a redeclare does not matter
    assert r["created"] is False and r["queue"]["leader"] == "n1"
    assert md.version == v + 1


def test_declare_with_unknown_leader_refused():
    md = cluster("n1")
    with pytest.raises(MetaError) as ei:
        md.apply(["queue.declare", qdef(leader="n9")])
    assert ei.value.code == NOT_FOUND
    assert md.queues == {} and md.version == 1


def test_redeclare_with_different_durable():
    md = cluster("n1")
    md.apply(["queue.declare", qdef(durable=True)])
    v = md.version
    with pytest.raises(MetaError) as ei:
        md.apply(["queue.declare", qdef(durable=False)])
    assert ei.value.code == PRECONDITION_FAILED
    assert ei.value.text == ("inequivalent arg 'durable' for queue 'q' in vhost '/': "
                             "received 'false' but current is 'true'")
    assert md.version == v  # refused changes leave the state untouched
    assert md.queues["q"]["durable"] is True


def test_redeclare_with_different_arguments():
    md = cluster("n1")
    md.apply(["queue.declare", qdef(arguments={"x-max-length": 10})])
    with pytest.raises(MetaError) as ei:
        md.apply(["queue.declare", qdef(arguments={"x-max-length": 20})])
    assert ei.value.code == PRECONDITION_FAILED
    assert "inequivalent arg 'x-max-length' for queue 'q'" in ei.value.text


def test_exclusive_owned_by_another_owner_is_locked():
    md = cluster("n1")
    md.apply(["queue.declare", qdef(durable=False, exclusive=True, owner="conn-1")])
    with pytest.raises(MetaError) as ei:
        md.apply(["queue.declare", qdef(durable=False, exclusive=True, owner="conn-2")])
    assert ei.value.code == RESOURCE_LOCKED
    assert "cannot obtain exclusive access to locked queue 'q' in vhost '/'" in ei.value.text
    r = md.apply(["queue.declare", qdef(durable=False, exclusive=True, owner="conn-1")])
    assert r["created"] is False


def test_node_down_deletes_only_non_durable_queues_of_that_node():
    md = cluster("n1", "n2")
    md.apply(["queue.declare", qdef("d1", durable=True, leader="n1")])
    md.apply(["queue.declare", qdef("t1", durable=False, leader="n1")])
    md.apply(["queue.declare", qdef("t2", durable=False, leader="n2")])
    md.apply(["node.up", "n1", 7])
    updates = planner.plan(md, {"n2"}, down="n1")
    gone = md.apply(["node.down", "n1", 7, "failure", updates])
    assert gone == ["t1"]
    assert sorted(md.queues) == ["d1", "t2"]
    assert md.down == {"n1": "failure"} and "n1" not in md.up
    assert md.apply(["node.up", "n1", 8, planner.plan(md, {"n1", "n2"}, up="n1")]) == []
    assert md.down == {} and md.up["n1"] == 8
    assert md.queues["d1"]["epoch"] == 2  # its leader replica restarted


def test_member_remove_drops_its_queues():
    md = cluster("n1", "n2")
    md.apply(["queue.declare", qdef("a", leader="n1")])
    md.apply(["queue.declare", qdef("b", leader="n2")])
    md.apply(["member.remove", "n2"])
    assert list(md.members) == ["n1"] and list(md.queues) == ["a"]
    with pytest.raises(MetaError) as ei:
        md.apply(["member.remove", "n2"])
    assert ei.value.code == NOT_FOUND


def test_queue_delete_with_leader_guard():
    md = cluster("n1", "n2")
    md.apply(["queue.declare", qdef("a", leader="n1")])
    assert md.apply(["queue.delete", "a", "n2"]) is False
    assert md.apply(["queue.delete", "a"]) is True
    assert md.apply(["queue.delete", "a"]) is False


def test_a_clients_delete_names_its_asker_only_to_the_askers_node():
    md = cluster("n1", "n2")
    md.apply(["queue.declare", qdef("a")])
    change = client_delete("a", "n2", 7, 31, 5)
    assert md.apply(change) is True and "a" not in md.queues
    assert delete_asked_by(change, "n2") == (7, 31, 5)
    assert delete_asked_by(change, "n1") is None
    assert delete_asked_by(["queue.delete", "a"], "n2") is None
    assert delete_asked_by(["queue.delete", "a", "n2"], "n2") is None
    assert delete_asked_by(["node.down", "n2", 1, "failure"], "n2") is None


def test_unknown_change_refused():
    md = cluster("n1")
    with pytest.raises(MetaError) as ei:
        md.apply(["frobnicate"])
    assert ei.value.code == PRECONDITION_FAILED and "frobnicate" in ei.value.text
    assert md.version == 1


def test_snapshot_round_trip_and_digest():
    import msgpack

    md = cluster("n1", "n2", "n3")
    md.apply(["queue.declare", qdef("a", arguments={"k": [1, 2]})])
    md.apply(["queue.declare", qdef("b", durable=False, leader="n3")])
    snap = msgpack.unpackb(msgpack.packb(md.snapshot(), use_bin_type=True), raw=False,
                           strict_map_key=False)
    md2 = Metadata.from_snapshot(snap)
    assert md2.version == md.version and md2.cluster_name == md.cluster_name
    assert list(md2.members) == list(md.members) and md2.queues == md.queues
    assert md2.digest() == md.digest()
    # the snapshot is a copy: changing it does not change the source
    snap2 = md.snapshot()
    snap2["queues"]["a"]["durable"] = False
    assert md.queues["a"]["durable"] is True
    # the same changes applied to two copies give the same digest; a difference shows
    md.apply(["queue.delete", "b"])
    assert md2.digest() != md.digest()
    md2.apply(["queue.delete", "b"])
    assert md2.digest() == md.digest()


def up(md, *names):
    for i, n in enumerate(names, 1):
        md.apply(["node.up", n, i])


def mirrored(md, name="ha.q", leader="n1"):
    md.apply(["policy.set", make_policy("ha", r"^ha\.", {"ha-mode": "all"}), []])
    md.apply(["queue.declare", planner.plan_declare(md, qdef(name, leader=leader),
                                                      list(md.up), "client-local")])
    return md.queues[name]


def test_node_down_for_an_old_incarnation_is_stale():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    assert planner.plan_change(md, ["node.down", "n2", 99, "failure"], {"n1", "n3"}) == []
    assert md.up["n2"] == 2
    planned = planner.plan_change(md, ["node.down", "n2", 2, "failure"], {"n1", "n3"})
    assert [c[0] for c, _ in planned] == ["node.down"] and "n2" not in md.up


def test_a_restart_nobody_saw_is_a_down_then_an_up():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    q = mirrored(md, leader="n2")
    assert q["mirrors"] == ["n1", "n3"] and q["epoch"] == 1
    planned = planner.plan_change(md, ["node.up", "n2", 42], {"n1", "n2", "n3"})
    assert [c[0] for c, _ in planned] == ["node.down", "node.up"]
    # its queue was promoted away from the old incarnation, and it is a fresh mirror now
    q = md.queues["ha.q"]
    assert q["leader"] == "n1" and q["epoch"] == 2 and "n2" in q["mirrors"]
    assert q["synced"] == [] and md.up["n2"] == 42


def test_promotion_starts_the_new_epoch_with_no_synchronised_mirror():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    md.apply(["queues.update", [["ha.q", {"synced": ["n2", "n3"]}]]])
    planner.plan_change(md, ["node.down", "n1", 1, "failure"], {"n2", "n3"})
    q = md.queues["ha.q"]
    assert (q["leader"], q["mirrors"], q["synced"], q["epoch"]) == ("n2", ["n3"], [], 2)


def test_drop_mirror_removes_it_and_only_a_later_replan_places_it_again():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    md.apply(["queues.update", [["ha.q", {"synced": ["n2", "n3"]}]]])
    running = {"n1", "n2", "n3"}
    assert planner.plan_change(md, ["queue.drop_mirror", "ha.q", 9, "n2"], running) == []  # stale epoch
    planner.plan_change(md, ["queue.drop_mirror", "ha.q", 1, "n2"], running)
    assert md.queues["ha.q"]["mirrors"] == ["n3"] and md.queues["ha.q"]["synced"] == ["n3"]
    planner.plan_change(md, ["replan"], running)
    assert md.queues["ha.q"]["mirrors"] == ["n3", "n2"]  # back, as the youngest


def test_forgetting_a_leader_moves_its_queues_elsewhere():
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    mirrored(md)
    md.apply(["queue.declare", qdef("solo", leader="n1")])
    planner.plan_change(md, ["node.down", "n1", 1, "failure"], set())  # nobody to promote to
    planner.plan_change(md, ["member.remove", "n1"], {"n2", "n3"})
    assert "n1" not in md.members
    # a durable queue with no mirror lives on, empty, on the most senior running member
    assert md.queues["solo"]["leader"] == "n2" and md.queues["solo"]["epoch"] == 2
    q = md.queues["ha.q"]
    assert q["leader"] == "n2" and q["mirrors"] == ["n3"] and q["epoch"] == 2


def test_a_forget_is_refused_where_it_is_ordered_if_the_node_runs_by_then():
    """forget_cluster_node checks the node is stopped when asked, but the change may wait for
    a leader (up to 15 s); if the node is back by the time the log orders it, it is refused
    rather than removing a running member (dst seed 5531)."""
    md = cluster("n1", "n2", "n3")
    up(md, "n1", "n2", "n3")
    before = md.snapshot()
    with pytest.raises(MetaError, match="node n1 is running: stop its app first"):
        planner.plan_change(md, ["member.remove", "n1"], {"n1", "n2"})
    assert md.snapshot() == before


def test_refused_declare_leaves_the_copy_untouched():
    md = cluster("n1")
    up(md, "n1")
    md.apply(["queue.declare", qdef("a", durable=True)])
    before = md.snapshot()
    with pytest.raises(MetaError):
        planner.plan_change(md, ["queue.declare", qdef("a", durable=False)], {"n1"})
    assert md.snapshot() == before


def test_copy_is_equal_and_independent():
    from mirroring.metadata import Metadata, clone

    md = Metadata("c")
    md.members = {"n1": {"peer": ["127.0.0.1", 1]}}
    md.queues = {"q": {"leader": "n1", "mirrors": ["n2"], "args": {"x": [1, (2, 3)]}, "tags": {"a"}}}
    md.policies = {"ha": {"pattern": ".*", "definition": {"ha-mode": "all"}}}
    md.up = {"n1": 3}
    cp = md.copy()
    assert cp.snapshot() == md.snapshot()
    cp.queues["q"]["mirrors"].append("n3")
    cp.queues["q"]["args"]["x"].append(4)
    cp.queues["q"]["tags"].add("b")
    cp.policies["ha"]["definition"]["ha-mode"] = "exactly"
    cp.up["n2"] = 1
    assert md.queues["q"] == {"leader": "n1", "mirrors": ["n2"], "args": {"x": [1, (2, 3)]}, "tags": {"a"}}
    assert md.policies["ha"]["definition"]["ha-mode"] == "all" and md.up == {"n1": 3}
    assert clone({"t": (1, [2])})["t"] == (1, [2])
