"""Operator policies (RabbitMQ 3.10's keys and merge rule) and the managed HA's rewriting of
policies (Amazon MQ's system policy), as pure functions and as the planner commits them."""

from __future__ import annotations

import msgspec
import pytest

from mirroring import changes as c
from mirroring.metadata import Metadata, MetaError
from mirroring.planner import plan_change
from mirroring.policy import (MANAGED_HA_KEYS, OPERATOR_KEYS, SYSTEM_POLICY_NAME, PolicyError,
                              effective_definition, enforce_managed_ha, make_operator_policy,
                              make_policy, managed_ha_out_of_line, merge_operator_definition,
                              system_policy)
from mirroring.queue import check_arguments, limits_from
from mirroring.records import QueueDef
from wire.errors import NOT_FOUND, PRECONDITION_FAILED, ProtocolError


# --- operator policy definitions ------------------------------------------------------------

def test_operator_policies_take_rabbitmq_3_10s_keys():
    assert set(OPERATOR_KEYS) == {"expires", "message-ttl", "max-length", "max-length-bytes",
                                  "max-in-memory-length", "max-in-memory-bytes", "delivery-limit"}
    record = make_operator_policy("cap", "^a", '{"max-length": 10, "message-ttl": 0, '
                                  '"delivery-limit": 3}', 5, "queues")
    assert record.definition == {"max-length": 10, "message-ttl": 0, "delivery-limit": 3}
    assert (record.priority, record.apply_to, record.set_by) == (5, "queues", "user")


@pytest.mark.parametrize("definition, text", [
    ({"ha-mode": "all"}, "'ha-mode' are not recognised policy settings"),
    ({"ha-sync-mode": "automatic", "max-length": 1},
     "'ha-sync-mode' are not recognised policy settings"),
    ({"overflow": "reject-publish"}, "'overflow' are not recognised policy settings"),
    ({"queue-mode": "lazy"}, "'queue-mode' are not recognised policy settings"),
    ({"max-length": -1}, "'max-length' must be a non-negative integer, got -1"),
    ({"expires": 0}, "'expires' must be a positive integer, got 0"),
    ({"message-ttl": "60"}, "'message-ttl' must be a non-negative integer, got \"60\""),
    ({}, "'definition' must not be empty"),
    ("[1]", "'definition' must be a JSON object"),
])
def test_an_operator_policy_with_a_key_it_may_not_set_is_refused(definition, text):
    with pytest.raises(PolicyError) as ei:
        make_operator_policy("cap", ".*", definition)
    assert ei.value.code == PRECONDITION_FAILED
    assert text in ei.value.text and ei.value.text.startswith("Validation failed: ")


def test_an_operator_policy_gets_a_policys_checks_of_its_other_fields():
    with pytest.raises(PolicyError, match="'pattern' is not a valid regular expression"):
        make_operator_policy("cap", "(", {"max-length": 1})
    with pytest.raises(PolicyError, match="'apply-to' must be one of"):
        make_operator_policy("cap", ".*", {"max-length": 1}, apply_to="streams")


# --- merging --------------------------------------------------------------------------------

def test_merge_takes_the_lesser_value_of_a_key_both_set():
    user = {"max-length": 100, "message-ttl": 5000, "ha-mode": "all"}
    operator = {"max-length": 10, "message-ttl": 60000}
    assert merge_operator_definition(user, operator) == {
        "max-length": 10, "message-ttl": 5000, "ha-mode": "all"}


def test_merge_takes_a_key_only_one_side_sets_from_that_side():
    assert merge_operator_definition({"overflow": "reject-publish"}, {"expires": 1000}) == {
        "overflow": "reject-publish", "expires": 1000}
    assert merge_operator_definition(None, {"max-length-bytes": 7}) == {"max-length-bytes": 7}
    assert merge_operator_definition({"max-length": 3}, None) == {"max-length": 3}
    assert merge_operator_definition(None, None) == {}


def _policies(*records):
    return {r.name: r for r in records}


def test_the_operator_policy_in_effect_is_chosen_by_pattern_apply_to_and_priority():
    user = _policies(make_policy("lim", "^orders", {"max-length": 50}))
    operators = _policies(
        make_operator_policy("low", "^orders", {"max-length": 20}, 1),
        make_operator_policy("high", "^orders\\.eu", {"max-length": 30, "expires": 9000}, 2),
        make_operator_policy("exch", ".*", {"max-length": 1}, 9, "exchanges"),
    )
    # both match orders.eu: the higher priority wins, and its 30 is under the user's 50
    assert effective_definition(user, operators, "orders.eu") == {"max-length": 30,
                                                                  "expires": 9000}
    # only `low` matches orders.us (`exch` applies to exchanges only)
    assert effective_definition(user, operators, "orders.us") == {"max-length": 20}
    # no policy and no operator policy matches
    assert effective_definition(user, operators, "billing") == {}
    # equal priorities: the name that sorts first, as for policies
    tied = _policies(make_operator_policy("b", ".*", {"max-length": 1}),
                     make_operator_policy("a", ".*", {"max-length": 2}))
    assert effective_definition({}, tied, "q") == {"max-length": 2}


def test_the_merged_definition_sets_the_queues_limits():
    user = _policies(make_policy("lim", ".*", {"max-length": 50, "overflow": "reject-publish"}))
    operators = _policies(make_operator_policy("cap", ".*", {"max-length": 5,
                                                             "max-in-memory-length": 3}))
    limits = limits_from({"x-max-length": 8}, effective_definition(user, operators, "q"))
    assert limits.max_length == 5 and limits.reject_publish


# --- managed HA -----------------------------------------------------------------------------

def test_the_system_policy_is_amazon_mqs():
    record = system_policy()
    assert record.name == SYSTEM_POLICY_NAME == "ha-all-AWS-OWNED-DO-NOT-DELETE"
    assert record.definition == {"ha-mode": "all", "ha-sync-mode": "automatic"} == MANAGED_HA_KEYS
    assert (record.pattern, record.priority, record.apply_to, record.set_by) == (
        ".*", 0, "all", "managed-ha")


def test_a_policy_without_ha_keys_gets_them_added():
    record = make_policy("ttl", "^t", {"message-ttl": 1000}, 3, "queues")
    rewritten, note = enforce_managed_ha(record)
    assert rewritten.definition == {"message-ttl": 1000, "ha-mode": "all",
                                    "ha-sync-mode": "automatic"}
    assert (rewritten.name, rewritten.pattern, rewritten.priority, rewritten.apply_to) == (
        "ttl", "^t", 3, "queues")
    assert rewritten.set_by == "user+managed-ha" and note == "HA keys added"


def test_a_policy_with_other_ha_keys_gets_them_replaced():
    record = make_policy("two", ".*", {"ha-mode": "exactly", "ha-params": 2,
                                       "ha-sync-mode": "manual", "ha-promote-on-failure":
                                       "when-synced", "max-length": 9})
    rewritten, note = enforce_managed_ha(record)
    assert rewritten.definition == {"max-length": 9, "ha-mode": "all",
                                    "ha-sync-mode": "automatic"}
    assert note.startswith("HA keys replaced") and '"exactly"' in note
    assert rewritten.set_by == "user+managed-ha"


def test_a_policy_already_in_line_or_for_exchanges_is_left_alone():
    in_line = make_policy("ok", ".*", {"ha-mode": "all", "ha-sync-mode": "automatic"})
    assert enforce_managed_ha(in_line) == (in_line, "")
    exchanges = make_policy("x", ".*", {"max-length": 1}, apply_to="exchanges")
    assert enforce_managed_ha(exchanges) == (exchanges, "")


def test_a_users_policy_named_as_the_system_policy_is_the_system_policy():
    mine = make_policy(SYSTEM_POLICY_NAME, "^x", {"ha-mode": "exactly", "ha-params": 2})
    assert enforce_managed_ha(mine) == (system_policy(), "system policy restored")


def test_out_of_line_lists_the_system_policy_then_each_policy_to_rewrite():
    ok = make_policy("ok", ".*", {"ha-mode": "all", "ha-sync-mode": "automatic"})
    bare = make_policy("bare", ".*", {"max-length": 1})
    assert [p.name for p in managed_ha_out_of_line(_policies(ok, bare))] == [
        SYSTEM_POLICY_NAME, "bare"]
    assert managed_ha_out_of_line(_policies(ok, system_policy())) == []


# --- the planner ----------------------------------------------------------------------------

def _cluster(*names) -> Metadata:
    md = Metadata()
    for i, name in enumerate(names):
        md.apply(c.MemberAdd(name, ("h", 100 + i), ("h", 200 + i)))
        md.apply(c.NodeUp(name, 1))
    return md


def _kinds(planned):
    return [type(change).__name__ for change, _ in planned]


def test_enabling_managed_ha_commits_the_system_policy_and_rewrites_policies():
    md = _cluster("n1", "n2", "n3")
    md.apply(c.QueueDeclare(QueueDef("q", True, False, False, {}, "n1")))
    md.apply(c.PolicySet(make_policy("bare", "^zz", {"max-length": 1})))
    planned = plan_change(md, c.ManagedHAEnable(), {"n1", "n2", "n3"})
    assert _kinds(planned) == ["ManagedHAEnable", "PolicySet", "PolicySet"]
    assert md.managed_ha
    assert md.policies[SYSTEM_POLICY_NAME] == system_policy()
    assert md.policies["bare"].set_by == "user+managed-ha"
    assert md.policies["bare"].definition["ha-mode"] == "all"
    # the system policy's updates mirror the queue on every other node
    assert md.queues["q"].mirrors == ("n2", "n3")
    # enabling again has nothing left to do
    assert plan_change(md, c.ManagedHAEnable(), {"n1", "n2", "n3"}) == []


def test_under_managed_ha_a_users_policy_is_committed_with_the_ha_keys():
    md = _cluster("n1", "n2")
    plan_change(md, c.ManagedHAEnable(), {"n1", "n2"})
    plan_change(md, c.PolicySet(make_policy("two", "^a", {"ha-mode": "exactly",
                                                           "ha-params": 2})), {"n1", "n2"})
    assert md.policies["two"].definition == MANAGED_HA_KEYS
    assert md.policies["two"].set_by == "user+managed-ha"


def test_without_managed_ha_a_policy_is_committed_as_given():
    md = _cluster("n1", "n2")
    record = make_policy("two", "^a", {"ha-mode": "exactly", "ha-params": 2})
    plan_change(md, c.PolicySet(record), {"n1", "n2"})
    assert md.policies["two"] == record and md.policies["two"].set_by == "user"


def test_under_managed_ha_the_system_policy_comes_back_when_cleared():
    md = _cluster("n1", "n2")
    plan_change(md, c.ManagedHAEnable(), {"n1", "n2"})
    planned = plan_change(md, c.PolicyClear(SYSTEM_POLICY_NAME), {"n1", "n2"})
    assert _kinds(planned) == ["PolicyClear", "PolicySet"]
    assert md.policies[SYSTEM_POLICY_NAME] == system_policy()
    # another policy is cleared for good
    plan_change(md, c.PolicySet(make_policy("p", "^a", {"max-length": 1})), {"n1", "n2"})
    plan_change(md, c.PolicyClear("p"), {"n1", "n2"})
    assert "p" not in md.policies


def test_operator_policies_are_set_cleared_and_kept_in_snapshots():
    md = _cluster("n1")
    record = make_operator_policy("cap", ".*", {"max-length": 5})
    plan_change(md, c.OperatorPolicySet(record), {"n1"})
    md.apply(c.ManagedHAEnable())
    snap = msgspec.msgpack.decode(msgspec.msgpack.encode(md.snapshot()))
    again = Metadata.from_snapshot(snap)
    assert again.operator_policies == {"cap": record} and again.managed_ha
    assert again.digest() == md.digest() and md.copy().operator_policies == {"cap": record}
    plan_change(md, c.OperatorPolicyClear("cap"), {"n1"})
    assert md.operator_policies == {}
    with pytest.raises(MetaError) as ei:
        md.apply(c.OperatorPolicyClear("cap"))
    assert ei.value.code == NOT_FOUND and "operator policy 'cap' not found" in ei.value.text


def test_a_quorum_queue_is_refused_saying_why():
    with pytest.raises(ProtocolError) as ei:
        check_arguments("q", {"x-queue-type": "quorum"})
    assert ei.value.code == PRECONDITION_FAILED
    assert "Amazon MQ" in ei.value.text and "do not support quorum queues" in ei.value.text
    with pytest.raises(ProtocolError) as ei:
        check_arguments("q", {"x-queue-type": "stream"})
    assert "quorum" not in ei.value.text
