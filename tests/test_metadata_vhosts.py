"""Virtual hosts in the cluster metadata: the same name in two vhosts is two things, policies
apply within their vhost, and deleting a vhost drops everything it holds."""

from __future__ import annotations

import msgspec
import pytest

from mirroring import changes as c
from mirroring import planner
from mirroring.exchanges import make_exchange
from mirroring.metadata import Metadata, MetaError
from mirroring.policy import make_operator_policy, make_policy
from mirroring.records import QueueDef, VHost, in_vhost, qualify, shown, split_key
from wire.errors import NOT_FOUND, PRECONDITION_FAILED, ProtocolError


def cluster(*names) -> Metadata:
    md = Metadata()
    for n in names:
        md.apply(c.MemberAdd(n, (n, 25672), (n, 5672)))
    return md


def qdef(name: str, vhost: str = "/", leader: str = "n1") -> QueueDef:
    return QueueDef(name, True, False, False, {}, leader, vhost=vhost)


def commit(md: Metadata, change: c.Change) -> None:
    """As the log's leader does: plan, then apply the concrete changes to md."""
    for concrete, _ in planner.plan_change(md.copy(), change, set(md.members)):
        md.apply(concrete)


def test_keys_of_the_default_vhost_are_plain_names():
    assert qualify("/", "q") == "q"
    assert qualify("v", "q") != "q" and qualify("v", "q") != qualify("w", "q")
    assert split_key(qualify("v", "a/b")) == ("v", "a/b")
    assert split_key("q") == ("/", "q")
    assert in_vhost("queue", qualify("v", "q")) == "queue 'q' in vhost 'v'"
    assert (shown("q"), shown(qualify("v", "q"))) == ("q", "q (vhost v)")


def test_the_default_vhost_always_exists_and_cannot_be_deleted():
    md = Metadata()
    assert md.vhosts == {"/": VHost("/", "Default virtual host")}
    with pytest.raises(MetaError) as ei:
        md.apply(c.VHostDelete("/"))
    assert ei.value.code == PRECONDITION_FAILED
    restored = Metadata.from_snapshot(msgspec.msgpack.decode(msgspec.msgpack.encode(md.snapshot())))
    assert restored.vhosts == {"/": VHost("/", "Default virtual host")}


def test_a_new_vhost_has_its_own_builtin_exchanges_and_round_trips():
    md = cluster("n1")
    assert md.apply(c.VHostAdd(VHost("v", "tenant", True))) is True
    assert md.apply(c.VHostAdd(VHost("v", "renamed"))) is False
    assert md.vhosts["v"] == VHost("v", "renamed")
    for name in ("", "amq.direct", "amq.topic", "amq.fanout", "amq.headers", "amq.match"):
        x = md.exchanges[qualify("v", name)]
        assert (x.name, x.vhost) == (name, "v")
    restored = Metadata.from_snapshot(msgspec.msgpack.decode(msgspec.msgpack.encode(md.snapshot())))
    assert restored.vhosts == md.vhosts and restored.digest() == md.digest()


@pytest.mark.parametrize("bad", ["", "a\x00b"])
def test_a_vhost_name_is_checked(bad):
    with pytest.raises(MetaError, match="invalid vhost name"):
        Metadata().apply(c.VHostAdd(VHost(bad)))


def test_the_same_name_in_two_vhosts_is_two_queues():
    md = cluster("n1", "n2")
    md.apply(c.VHostAdd(VHost("v")))
    md.apply(c.QueueDeclare(qdef("q")))
    md.apply(c.QueueDeclare(qdef("q", "v", leader="n2")))
    assert md.queues["q"].vhost == "/" and md.queues[qualify("v", "q")].leader == "n2"
    md.apply(c.QueueDelete(qualify("v", "q")))
    assert list(md.queues) == ["q"]


def test_declares_into_a_missing_vhost_are_refused():
    md = cluster("n1")
    for change in (c.QueueDeclare(qdef("q", "nope")),
                   c.ExchangeDeclare(make_exchange("x", "direct", vhost="nope")),
                   c.PolicySet(make_policy("p", ".*", {"ha-mode": "all"}, vhost="nope"))):
        with pytest.raises(MetaError) as ei:
            md.apply(change)
        assert (ei.value.code, ei.value.text) == (NOT_FOUND, "vhost 'nope' does not exist")


def test_errors_name_the_queues_vhost():
    md = cluster("n1")
    md.apply(c.VHostAdd(VHost("v")))
    md.apply(c.QueueDeclare(qdef("q", "v")))
    with pytest.raises(MetaError, match="inequivalent arg 'durable' for queue 'q' in vhost 'v'"):
        md.apply(c.QueueDeclare(QueueDef("q", False, False, False, {}, "n1", vhost="v")))
    with pytest.raises(MetaError, match="no queue 'r' in vhost 'v'"):
        md.apply(c.BindingAdd(qualify("v", "amq.direct"), c.Binding(qualify("v", "r"), "k", {})))
    with pytest.raises(ProtocolError, match="no exchange 'x' in vhost 'v'"):
        md.apply(c.BindingAdd(qualify("v", "x"), c.Binding(qualify("v", "q"), "k", {})))
    with pytest.raises(MetaError, match="policy 'p' not found in vhost 'v'"):
        md.apply(c.PolicyClear(qualify("v", "p")))


def test_a_policy_mirrors_only_the_queues_of_its_vhost():
    md = cluster("n1", "n2", "n3")
    md.apply(c.VHostAdd(VHost("v")))
    commit(md, c.QueueDeclare(qdef("q")))
    commit(md, c.QueueDeclare(qdef("q", "v")))
    commit(md, c.PolicySet(make_policy("ha", ".*", {"ha-mode": "all"}, vhost="v")))
    assert md.queues["q"].mirrors == ()
    assert set(md.queues[qualify("v", "q")].mirrors) == {"n2", "n3"}
    # a policy of the same name in "/" is another policy
    commit(md, c.PolicySet(make_policy("ha", ".*", {"ha-mode": "exactly", "ha-params": 2})))
    assert len(md.queues["q"].mirrors) == 1 and set(md.policies) == {"ha", qualify("v", "ha")}
    commit(md, c.PolicyClear(qualify("v", "ha")))
    assert md.queues[qualify("v", "q")].mirrors == () and len(md.queues["q"].mirrors) == 1


def test_routing_stays_within_a_vhost():
    md = cluster("n1")
    md.apply(c.VHostAdd(VHost("v")))
    md.apply(c.QueueDeclare(qdef("q")))
    md.apply(c.QueueDeclare(qdef("q", "v")))
    md.apply(c.BindingAdd(qualify("v", "amq.direct"), c.Binding(qualify("v", "q"), "k", {})))
    assert md.routes.route(qualify("v", "amq.direct"), "k") == [qualify("v", "q")]
    assert md.routes.route("amq.direct", "k") == []
    assert md.routes.route(qualify("v", ""), "q") == [qualify("v", "q")]
    assert md.routes.route("", "q") == ["q"]


def test_deleting_a_vhost_drops_everything_it_holds_and_nothing_else():
    md = cluster("n1")
    md.apply(c.VHostAdd(VHost("v")))
    md.apply(c.UserAdd(c.User("u", "aGFzaA==")))
    for vhost in ("/", "v"):
        md.apply(c.QueueDeclare(qdef("q", vhost)))
        md.apply(c.ExchangeDeclare(make_exchange("x", "topic", vhost=vhost)))
        md.apply(c.BindingAdd(qualify(vhost, "x"), c.Binding(qualify(vhost, "q"), "#", {})))
        md.apply(c.PolicySet(make_policy("p", ".*", {"max-length": 1}, vhost=vhost)))
        md.apply(c.OperatorPolicySet(make_operator_policy("o", ".*", {"max-length": 1}, vhost=vhost)))
        md.apply(c.PermissionSet(c.Permission("u", vhost, ".*", ".*", ".*")))
    access_version = md.access_version
    assert md.apply(c.VHostDelete("v")) == [qualify("v", "q")]
    assert list(md.permissions) == [("/", "u")] and md.access_version > access_version
    assert md.touched == {qualify("v", "q")}
    assert "v" not in md.vhosts
    assert list(md.queues) == ["q"] and list(md.policies) == ["p"]
    assert list(md.operator_policies) == ["o"] and list(md.bindings) == ["x"]
    assert all(x.vhost == "/" for x in md.exchanges.values())
    with pytest.raises(MetaError, match="vhost 'v' does not exist"):
        md.apply(c.VHostDelete("v"))


def test_under_managed_ha_every_vhost_has_its_system_policy():
    from mirroring.policy import SYSTEM_POLICY_NAME, system_policy
    md = cluster("n1", "n2", "n3")
    md.apply(c.VHostAdd(VHost("old")))
    commit(md, c.ManagedHAEnable())
    assert md.policies[qualify("old", SYSTEM_POLICY_NAME)] == system_policy("old")
    commit(md, c.VHostAdd(VHost("v")))
    assert md.policies[qualify("v", SYSTEM_POLICY_NAME)] == system_policy("v")
    commit(md, c.QueueDeclare(qdef("q", "v")))
    assert set(md.queues[qualify("v", "q")].mirrors) == {"n2", "n3"}
    # cleared, it comes back in its own vhost
    commit(md, c.PolicyClear(qualify("v", SYSTEM_POLICY_NAME)))
    assert md.policies[qualify("v", SYSTEM_POLICY_NAME)] == system_policy("v")
    assert md.policies[SYSTEM_POLICY_NAME] == system_policy()
