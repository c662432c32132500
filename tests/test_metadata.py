"""Unit tests of mirroring.metadata: declarations, equivalence, node down, snapshots, authority."""

from __future__ import annotations

import pytest

from mirroring import planner

from mirroring.metadata import Metadata, MetaError, authority_key
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
    assert md.coordinator({"n2", "n3"}) == "n2"
    assert md.coordinator(set()) is None


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
    updates = planner.plan(md, {"n2"}, down="n1")
    gone = md.apply(["node.down", "n1", "failure", updates])
    assert gone == ["t1"]
    assert sorted(md.queues) == ["d1", "t2"]
    assert md.down == {"n1": "failure"}
    assert md.apply(["node.up", "n1", planner.plan(md, {"n1", "n2"}, up="n1")]) == []
    assert md.down == {} and md.queues["d1"]["epoch"] == 2  # its leader replica restarted


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


def test_authority_key_booting_node_loses():
    md = cluster("n1", "n2", "n3")
    booting = authority_key(md, True, ["n1", "n2", "n3"])
    running = authority_key(md, False, ["n3"])
    assert running > booting


def test_authority_key_larger_running_set_wins():
    md = cluster("n1", "n2", "n3")
    big = authority_key(md, False, ["n2", "n3"])
    small = authority_key(md, False, ["n1"])
    assert big > small


def test_authority_key_senior_wins_ties():
    md = cluster("n1", "n2", "n3", "n4")
    a = authority_key(md, False, ["n1", "n4"])
    b = authority_key(md, False, ["n2", "n3"])
    assert a > b
    # on equal seniority the higher version wins
    md2 = Metadata.from_snapshot(md.snapshot())
    md2.apply(["queue.declare", qdef("x")])
    assert authority_key(md2, False, ["n1", "n4"]) > a
