"""Unit and property tests of mirroring.policy: definitions, matching, placement, promotion."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.policy import (
    HA,
    KEYS,
    PolicyError,
    choose_promotion,
    effective_policy,
    ha_settings,
    initial_leader,
    leader_handover,
    make_policy,
    parse_definition,
    place_mirrors,
)
from mirroring.records import Policy
from wire.errors import PRECONDITION_FAILED, ProtocolError

# The spec's three example definitions, exactly as its rabbitmqctl lines spell them.
SPEC_EXACTLY = '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}'
SPEC_ALL = '{"ha-mode":"all"}'
SPEC_NODES = '{"ha-mode":"nodes","ha-params":["rabbit@nodeA", "rabbit@nodeB"]}'


def refused(definition, key: str) -> PolicyError:
    """parse_definition must refuse `definition` with an error that names `key`."""
    with pytest.raises(PolicyError) as info:
        parse_definition(definition)
    err = info.value
    assert err.code == PRECONDITION_FAILED
    assert f"'{key}'" in err.text, err.text
    return err


# --- definitions: the spec's examples ------------------------------------------------------

def test_spec_examples_parse_verbatim():
    assert parse_definition(SPEC_EXACTLY) == {
        "ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}
    assert parse_definition(SPEC_ALL) == {"ha-mode": "all"}
    assert parse_definition(SPEC_NODES) == {
        "ha-mode": "nodes", "ha-params": ["rabbit@nodeA", "rabbit@nodeB"]}


def test_dict_definition_is_copied_not_shared():
    d = {"ha-mode": "nodes", "ha-params": ["a", "b"]}
    out = parse_definition(d)
    assert out == d and out is not d and out["ha-params"] is not d["ha-params"]
    out["ha-params"].append("c")
    assert d["ha-params"] == ["a", "b"]


def test_every_key_accepted_together():
    d = {"ha-mode": "exactly", "ha-params": 3, "ha-sync-mode": "manual",
         "ha-sync-batch-size": 4096, "ha-promote-on-failure": "when-synced",
         "ha-promote-on-shutdown": "always", "queue-master-locator": "client-local",
         "max-length": 1000, "max-length-bytes": 1 << 20, "message-ttl": 60000, "expires": 1800000,
         "overflow": "reject-publish", "queue-mode": "lazy", "dead-letter-exchange": "dlx",
         "dead-letter-routing-key": "retry", "alternate-exchange": "ae"}
    assert parse_definition(d) == d
    assert set(d) == KEYS


def test_queue_limits_a_policy_may_set_and_their_bad_values():
    """RabbitMQ's policy keys for a classic queue's limits (the queue arguments' twins), alone
    or beside the ha keys; `queue-mode` is accepted and changes nothing in memory."""
    assert parse_definition('{"max-length":0,"message-ttl":0}') == {"max-length": 0, "message-ttl": 0}
    assert parse_definition({"queue-mode": "default"}) == {"queue-mode": "default"}
    for key, bad, kind in (("max-length", -1, "a non-negative integer"),
                           ("max-length-bytes", "10", "a non-negative integer"),
                           ("message-ttl", 1.5, "a non-negative integer"),
                           ("expires", 0, "a positive integer"),
                           ("max-length", True, "a non-negative integer")):
        err = refused({"ha-mode": "all", key: bad}, key)
        assert f"must be {kind}" in err.text, err.text
    assert "'drop-head', 'reject-publish', 'reject-publish-dlx'" in refused({"overflow": "nope"}, "overflow").text
    assert parse_definition({"dead-letter-exchange": "", "dead-letter-routing-key": "k"}) == {
        "dead-letter-exchange": "", "dead-letter-routing-key": "k"}
    assert "must be a string, got 5" in refused({"dead-letter-exchange": 5}, "dead-letter-exchange").text
    refused({"queue-mode": "paged"}, "queue-mode")


def test_policy_error_is_a_protocol_error():
    err = refused('{"ha-mode":"exactly","ha-params":0}', "ha-params")
    assert isinstance(err, ProtocolError)
    assert err.text == ("Validation failed: 'ha-params' must be a positive integer for ha-mode "
                        "'exactly', got 0")


# --- definitions: the whole definition -----------------------------------------------------

def test_bad_json_says_so_and_where():
    err = refused('{"ha-mode": "all",\n "ha-params" 2}', "definition")
    assert "not valid JSON" in err.text
    assert "line 2, column 14" in err.text  # where the ":" should have been


@pytest.mark.parametrize("definition", ['["ha-mode", "all"]', '"all"', "3", "null", ["ha-mode"], None])
def test_definition_must_be_an_object(definition):
    err = refused(definition, "definition")
    assert "object" in err.text


@pytest.mark.parametrize("definition", ["{}", " { } ", {}])
def test_empty_definition_refused(definition):
    err = refused(definition, "definition")
    assert "empty" in err.text


def test_unrecognised_keys_are_named():
    err = refused('{"ha-mode":"all","federation-upstream":"u","queue-version":2}',
                  "federation-upstream")
    assert "'queue-version'" in err.text and "not recognised policy settings" in err.text
    refused({"ha-mode": "all", "ha_mode": "all"}, "ha_mode")  # near-misses are not forgiven
    refused({"HA-MODE": "all"}, "HA-MODE")


def test_first_problem_in_the_documented_order_is_reported():
    bad_everything = {"ha-mode": "bogus", "ha-sync-mode": "bad", "queue-master-locator": "x"}
    refused(bad_everything, "ha-mode")
    refused({**bad_everything, "nope": 1}, "nope")
    refused({"ha-sync-mode": "bad", "ha-params": 2}, "ha-params")
    refused({"ha-mode": "all", "ha-sync-mode": "bad", "queue-master-locator": "x"}, "ha-sync-mode")


# --- definitions: ha-mode and ha-params ----------------------------------------------------

@pytest.mark.parametrize("mode", ["All", "exact", "", None, 1, ["all"]])
def test_bad_ha_mode(mode):
    refused({"ha-mode": mode}, "ha-mode")


@pytest.mark.parametrize("params", [0, -1, 1.0, 2.5, "2", True, False, None, [2]])
def test_exactly_needs_a_positive_int(params):
    err = refused({"ha-mode": "exactly", "ha-params": params}, "ha-params")
    assert "positive integer" in err.text


def test_exactly_without_params_refused():
    refused({"ha-mode": "exactly"}, "ha-params")


def test_exactly_one_is_fine():
    assert parse_definition({"ha-mode": "exactly", "ha-params": 1})["ha-params"] == 1


@pytest.mark.parametrize("params", [[], "rabbit@a", ["a", 1], [None], 2, {"a": 1}, [["a"]]])
def test_nodes_needs_a_non_empty_list_of_names(params):
    err = refused({"ha-mode": "nodes", "ha-params": params}, "ha-params")
    assert "list" in err.text


def test_nodes_without_params_refused():
    refused({"ha-mode": "nodes"}, "ha-params")


@pytest.mark.parametrize("params", [2, ["a"], None, []])
def test_all_takes_no_params(params):
    refused({"ha-mode": "all", "ha-params": params}, "ha-params")


@pytest.mark.parametrize("key,value", [
    ("ha-params", 2),
    ("ha-sync-mode", "automatic"),
    ("ha-sync-batch-size", 10),
    ("ha-promote-on-failure", "always"),
    ("ha-promote-on-shutdown", "always"),
])
def test_ha_keys_need_ha_mode(key, value):
    err = refused({key: value}, key)
    assert "'ha-mode'" in err.text
    # ...and the same key is fine once ha-mode is there
    base = {"ha-mode": "exactly", "ha-params": 2}
    assert parse_definition({**base, key: value})[key] == value


def test_locator_alone_needs_no_ha_mode():
    assert parse_definition({"queue-master-locator": "balanced"}) == {
        "queue-master-locator": "balanced"}


# --- definitions: the other keys -----------------------------------------------------------

ALL = {"ha-mode": "all"}


@pytest.mark.parametrize("value", ["manual", "automatic"])
def test_sync_mode_values(value):
    assert parse_definition({**ALL, "ha-sync-mode": value})["ha-sync-mode"] == value


@pytest.mark.parametrize("value", ["auto", "Automatic", "", None, 1, True])
def test_bad_sync_mode(value):
    refused({**ALL, "ha-sync-mode": value}, "ha-sync-mode")


@pytest.mark.parametrize("value", [0, -5, 1.5, "100", True, None])
def test_bad_sync_batch_size(value):
    err = refused({**ALL, "ha-sync-batch-size": value}, "ha-sync-batch-size")
    assert "positive integer" in err.text


def test_sync_batch_size_one_is_fine():
    assert parse_definition({**ALL, "ha-sync-batch-size": 1})["ha-sync-batch-size"] == 1


@pytest.mark.parametrize("key", ["ha-promote-on-failure", "ha-promote-on-shutdown"])
@pytest.mark.parametrize("value", ["always", "when-synced"])
def test_promote_values(key, value):
    assert parse_definition({**ALL, key: value})[key] == value


@pytest.mark.parametrize("key", ["ha-promote-on-failure", "ha-promote-on-shutdown"])
@pytest.mark.parametrize("value", ["never", "when_synced", "", None, False])
def test_bad_promote_values(key, value):
    refused({**ALL, key: value}, key)


@pytest.mark.parametrize("value,stored", [
    ("client-local", "client-local"), ("balanced", "balanced"), ("min-masters", "balanced")])
def test_locator_values_and_old_name(value, stored):
    assert parse_definition({"queue-master-locator": value}) == {"queue-master-locator": stored}


@pytest.mark.parametrize("value", ["random", "local", "", None, 3])
def test_bad_locator(value):
    refused({"queue-master-locator": value}, "queue-master-locator")


# --- make_policy ---------------------------------------------------------------------------

def test_make_policy_record():
    p = make_policy("ha-two", r"^two\.", SPEC_EXACTLY, priority=5, apply_to="queues")
    assert p == Policy("ha-two", r"^two\.",
                       {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}, 5, "queues")


def test_make_policy_defaults():
    p = make_policy("ha-all", r"^ha\.", SPEC_ALL)
    assert p.priority == 0 and p.apply_to == "all"


def make_refused(key: str, **kw) -> PolicyError:
    args = {"name": "p", "pattern": ".*", "definition": SPEC_ALL, **kw}
    with pytest.raises(PolicyError) as info:
        make_policy(**args)
    assert info.value.code == PRECONDITION_FAILED
    assert f"'{key}'" in info.value.text, info.value.text
    return info.value


@pytest.mark.parametrize("pattern", ["(", "[a-", "*x", None])
def test_make_policy_bad_pattern(pattern):
    make_refused("pattern", pattern=pattern)


@pytest.mark.parametrize("priority", ["1", 1.0, None, True])
def test_make_policy_bad_priority(priority):
    make_refused("priority", priority=priority)


def test_make_policy_negative_priority_is_an_int():
    assert make_policy("p", ".*", SPEC_ALL, priority=-3).priority == -3


@pytest.mark.parametrize("apply_to", ["queue", "Queues", "", None, "classic_queues"])
def test_make_policy_bad_apply_to(apply_to):
    make_refused("apply-to", apply_to=apply_to)


@pytest.mark.parametrize("apply_to", ["queues", "all", "exchanges"])
def test_make_policy_apply_to_values(apply_to):
    assert make_policy("p", ".*", SPEC_ALL, apply_to=apply_to).apply_to == apply_to


@pytest.mark.parametrize("name", ["", None, 3])
def test_make_policy_bad_name(name):
    make_refused("name", name=name)


def test_make_policy_checks_the_definition():
    make_refused("ha-params", definition='{"ha-mode":"exactly","ha-params":0}')


# --- effective_policy ----------------------------------------------------------------------

def pols(*records) -> dict:
    return {r.name: r for r in records}


def test_pattern_is_searched_not_matched():
    ps = pols(make_policy("mid", "two", SPEC_ALL))
    assert effective_policy(ps, "one.two.three").name == "mid"
    assert effective_policy(ps, "one.three") is None


def test_anchored_pattern():
    ps = pols(make_policy("ha-two", r"^two\.", SPEC_EXACTLY))
    assert effective_policy(ps, "two.replicas").name == "ha-two"
    assert effective_policy(ps, "x.two.replicas") is None
    assert effective_policy(ps, "twoXreplicas") is None


def test_no_policies():
    assert effective_policy({}, "q") is None


def test_highest_priority_wins_whatever_the_order():
    low = make_policy("a-low", ".*", SPEC_ALL, priority=1)
    high = make_policy("z-high", "^q", SPEC_EXACTLY, priority=7)
    assert effective_policy(pols(low, high), "q1").name == "z-high"
    assert effective_policy(pols(high, low), "q1").name == "z-high"
    assert effective_policy(pols(high, low), "other").name == "a-low"


def test_priority_tie_goes_to_the_name_that_sorts_first():
    b = make_policy("beta", ".*", SPEC_ALL, priority=3)
    a = make_policy("alpha", ".*", SPEC_EXACTLY, priority=3)
    assert effective_policy(pols(b, a), "q").name == "alpha"
    assert effective_policy(pols(a, b), "q").name == "alpha"


def test_exchange_policies_never_apply_to_queues():
    ex = make_policy("ex", ".*", SPEC_ALL, priority=100, apply_to="exchanges")
    q = make_policy("q", ".*", SPEC_EXACTLY, priority=0, apply_to="queues")
    assert effective_policy(pols(ex), "q1") is None
    assert effective_policy(pols(ex, q), "q1").name == "q"


def test_apply_to_queues_and_all_both_match():
    assert effective_policy(pols(make_policy("p", ".", SPEC_ALL, apply_to="queues")), "q")
    assert effective_policy(pols(make_policy("p", ".", SPEC_ALL, apply_to="all")), "q")


# --- ha_settings ---------------------------------------------------------------------------

def test_ha_defaults_without_policy():
    ha = ha_settings(None)
    assert ha == HA(mode=None, params=None, sync_mode="manual", sync_batch_size=None,
                    promote_on_failure="always", promote_on_shutdown="when-synced", locator=None)


def test_ha_from_spec_example():
    ha = ha_settings(make_policy("ha-two", r"^two\.", SPEC_EXACTLY))
    assert (ha.mode, ha.params, ha.sync_mode) == ("exactly", 2, "automatic")
    assert ha.promote_on_failure == "always" and ha.promote_on_shutdown == "when-synced"
    assert ha.sync_batch_size is None and ha.locator is None


def test_ha_every_key():
    ha = ha_settings(make_policy("p", ".*", {
        "ha-mode": "nodes", "ha-params": ["n1", "n2"], "ha-sync-batch-size": 50,
        "ha-promote-on-failure": "when-synced", "ha-promote-on-shutdown": "always",
        "queue-master-locator": "min-masters"}))
    assert ha.mode == "nodes" and list(ha.params) == ["n1", "n2"]
    assert ha.sync_batch_size == 50 and ha.locator == "balanced"
    assert ha.promote_on_failure == "when-synced" and ha.promote_on_shutdown == "always"


def test_ha_policy_without_ha_mode_is_not_mirrored():
    ha = ha_settings(make_policy("loc", ".*", {"queue-master-locator": "client-local"}))
    assert ha.mode is None and ha.locator == "client-local"


def test_exclusive_queues_are_never_mirrored():
    """Spec: "exclusive queues are never mirrored (even if they match a policy stating that
    they should be)"."""
    policy = make_policy("ha-all", ".*", SPEC_ALL)
    assert ha_settings(policy).mode == "all"
    ha = ha_settings(policy, exclusive=True)
    assert ha.mode is None
    assert place_mirrors(ha, "n1", [], ["n1", "n2", "n3"], {"n1", "n2", "n3"}) == []


def test_ha_is_frozen():
    with pytest.raises(AttributeError):
        HA().mode = "all"  # type: ignore[misc]


# --- place_mirrors -------------------------------------------------------------------------

N5 = ["n1", "n2", "n3", "n4", "n5"]
UP5 = set(N5)


def exactly(n: int) -> HA:
    return HA(mode="exactly", params=n)


def nodes(*names: str) -> HA:
    return HA(mode="nodes", params=tuple(names))


def test_no_mode_no_mirrors():
    assert place_mirrors(HA(), "n1", ["n2", "n3"], N5, UP5) == []


def test_all_mirrors_on_every_running_member_but_the_leader():
    assert place_mirrors(HA(mode="all"), "n2", [], N5, UP5) == ["n1", "n3", "n4", "n5"]
    assert place_mirrors(HA(mode="all"), "n2", [], N5, UP5 - {"n4"}) == ["n1", "n3", "n5"]


def test_all_adds_a_newly_running_node_at_the_end():
    """Spec: "When a new node is added to the cluster, the queue will be mirrored to that
    node."  The newcomer is the youngest mirror, even if it joined the cluster earlier."""
    placed = place_mirrors(HA(mode="all"), "n1", ["n3", "n2"], N5[:4], {"n1", "n2", "n3", "n4"})
    assert placed == ["n3", "n2", "n4"]
    # n4 was a member all along but down; it comes back up: it goes to the end too.
    placed = place_mirrors(HA(mode="all"), "n1", ["n5", "n2", "n3"], N5, UP5)
    assert placed == ["n5", "n2", "n3", "n4"]


def test_all_drops_mirrors_on_stopped_nodes():
    assert place_mirrors(HA(mode="all"), "n1", ["n2", "n3", "n4"], N5[:4],
                         {"n1", "n2", "n4"}) == ["n2", "n4"]


def test_exactly_counts_the_leader():
    """Spec: "A count value of 2 means 2 replicas: 1 queue leader and 1 queue mirror"."""
    assert place_mirrors(exactly(1), "n1", [], N5, UP5) == []
    assert place_mirrors(exactly(2), "n1", [], N5, UP5) == ["n2"]
    assert place_mirrors(exactly(3), "n3", [], N5, UP5) == ["n1", "n2"]


def test_exactly_with_fewer_nodes_mirrors_to_all():
    """Spec: "If there are fewer than count nodes in the cluster, the queue is mirrored to all
    nodes."."""
    assert place_mirrors(exactly(5), "n1", [], N5[:3], {"n1", "n2", "n3"}) == ["n2", "n3"]
    assert place_mirrors(exactly(5), "n1", [], N5, {"n1", "n4"}) == ["n4"]


def test_exactly_three_to_two_keeps_the_oldest():
    """Spec: "Whenever the HA policy for a queue changes it will endeavour to keep its existing
    mirrors as far as this fits with the new policy."."""
    assert place_mirrors(exactly(3), "n1", ["n4", "n2"], N5, UP5) == ["n4", "n2"]
    assert place_mirrors(exactly(2), "n1", ["n4", "n2"], N5, UP5) == ["n4"]


def test_exactly_growing_keeps_existing_and_appends():
    assert place_mirrors(exactly(4), "n1", ["n5"], N5, UP5) == ["n5", "n2", "n3"]


def test_exactly_replaces_a_mirror_whose_node_is_down():
    """Spec: "If there are more than count nodes in the cluster, and a node containing a mirror
    goes down, then a new mirror will be created on another node."."""
    assert place_mirrors(exactly(3), "n1", ["n2", "n3"], N5, UP5 - {"n2"}) == ["n3", "n4"]


def test_exactly_new_mirror_goes_to_the_least_loaded_node():
    load = {"n2": 5, "n3": 1, "n4": 1, "n5": 0}
    assert place_mirrors(exactly(2), "n1", [], N5, UP5, load) == ["n5"]
    assert place_mirrors(exactly(3), "n1", [], N5, UP5, load) == ["n5", "n3"]  # n3 before n4
    assert place_mirrors(exactly(3), "n1", [], N5, UP5 - {"n5"}, load) == ["n3", "n4"]
    # nodes missing from `load` count as hosting nothing
    assert place_mirrors(exactly(2), "n1", [], N5, UP5, {"n2": 1}) == ["n3"]


def test_exactly_load_does_not_move_existing_mirrors():
    load = {"n2": 100, "n3": 0}
    assert place_mirrors(exactly(2), "n1", ["n2"], N5, UP5, load) == ["n2"]


def test_the_leader_is_never_its_own_mirror():
    # a stale mirror entry on the leader's node (e.g. just after a promotion) is dropped
    assert place_mirrors(HA(mode="all"), "n2", ["n2", "n3"], N5[:3],
                         {"n1", "n2", "n3"}) == ["n3", "n1"]
    assert place_mirrors(exactly(2), "n2", ["n2"], N5, UP5) == ["n1"]
    assert place_mirrors(nodes("n1", "n2"), "n1", [], N5, UP5) == ["n2"]


def test_mirrors_on_nodes_no_longer_members_are_dropped():
    assert place_mirrors(exactly(3), "n1", ["gone", "n2"], ["n1", "n2", "n3"],
                         {"n1", "n2", "n3", "gone"}) == ["n2", "n3"]


def test_nodes_ignores_names_that_are_not_members():
    """Spec: "If any of those node names are not a part of the cluster, this does not
    constitute an error."."""
    assert place_mirrors(nodes("ghost", "n3", "n2"), "n1", [], N5, UP5) == ["n3", "n2"]
    assert place_mirrors(nodes("ghost"), "n1", [], N5, UP5) == []


def test_nodes_only_running_listed_nodes():
    assert place_mirrors(nodes("n2", "n3"), "n1", ["n2", "n3"], N5, UP5 - {"n2"}) == ["n3"]


def test_nodes_keeps_existing_listed_mirrors_in_their_order():
    assert place_mirrors(nodes("n2", "n3", "n4"), "n1", ["n4", "n5", "n2"], N5, UP5) == [
        "n4", "n2", "n3"]


def test_nodes_policy_moving_a_queue_from_a_b_to_c_d():
    """Spec: "if a queue is on [A B] (with A the leader), and you give it a nodes policy telling
    it to be on [C D], it will initially end up on [A C D]"."""
    members = ["A", "B", "C", "D"]
    assert place_mirrors(nodes("C", "D"), "A", ["B"], members, set(members)) == ["C", "D"]


# --- initial_leader ------------------------------------------------------------------------

def test_initial_leader_other_modes_follow_the_locator():
    for ha in (HA(), HA(mode="all"), exactly(2)):
        assert initial_leader(ha, "n3", "n1", ["n1", "n2", "n3"]) == "n3"


def test_initial_leader_nodes_locator_choice_listed_and_running():
    assert initial_leader(nodes("n2", "n3"), "n3", "n1", ["n1", "n2", "n3"]) == "n3"


def test_initial_leader_nodes_first_listed_running_node():
    # the locator picked an unlisted node: the first listed running node, in policy order
    assert initial_leader(nodes("n4", "n3", "n2"), "n1", "n1", ["n1", "n2", "n3"]) == "n3"
    # the locator picked a listed node that is not running
    assert initial_leader(nodes("n4", "n2"), "n4", "n1", ["n1", "n2", "n3"]) == "n2"


def test_initial_leader_nodes_none_running_uses_the_declaring_node():
    """Spec: "If none of the nodes in the list are online at the time when the queue is
    declared then the queue will be created on the node that the declaring client is
    connected to."."""
    assert initial_leader(nodes("n4", "n5"), "n2", "n1", ["n1", "n2", "n3"]) == "n1"


# --- leader_handover -----------------------------------------------------------------------

def test_handover_waits_for_a_synchronised_listed_mirror():
    """Spec: "RabbitMQ will keep the existing leader around until at least one other mirror has
    synchronised (even if this is a long time)" and "As soon as the queue synchronises on its
    new mirrors [C D], the leader on A will shut down."."""
    ha = nodes("C", "D")
    assert leader_handover(ha, "A", ["C", "D"], synced=set()) is None
    assert leader_handover(ha, "A", ["C", "D"], synced={"D"}) == "D"
    assert leader_handover(ha, "A", ["C", "D"], synced={"C", "D"}) == "C"  # the oldest


def test_handover_ignores_unlisted_synchronised_mirrors():
    assert leader_handover(nodes("C", "D"), "A", ["B", "C", "D"], synced={"B"}) is None
    assert leader_handover(nodes("C", "D"), "A", ["B", "C"], synced={"B", "C"}) == "C"


def test_no_handover_when_the_leader_is_listed_or_mode_is_not_nodes():
    assert leader_handover(nodes("A", "C"), "A", ["C"], synced={"C"}) is None
    assert leader_handover(HA(mode="all"), "A", ["C"], synced={"C"}) is None
    assert leader_handover(exactly(2), "A", ["C"], synced={"C"}) is None
    assert leader_handover(HA(), "A", [], synced=set()) is None


def test_handover_then_placement_settles_on_c_d():
    """After the handover the queue lives on [C D] only, with the old leader gone."""
    ha = nodes("C", "D")
    members = ["A", "B", "C", "D"]
    new_leader = leader_handover(ha, "A", ["C", "D"], synced={"C", "D"})
    rest = [m for m in ["C", "D"] if m != new_leader]
    assert new_leader == "C"
    assert place_mirrors(ha, new_leader, rest, members, set(members)) == ["D"]


# --- choose_promotion ----------------------------------------------------------------------

def promo(failure="always", shutdown="when-synced") -> HA:
    return HA(mode="all", promote_on_failure=failure, promote_on_shutdown=shutdown)


MIRRORS = ["old", "young"]
RUNNING = {"old", "young"}


def test_failure_default_promotes_the_oldest_even_unsynchronised():
    """Spec: "By default if a queue's leader node fails, loses connection to its peers or is
    removed from the cluster, the oldest mirror will be promoted to be the new leader." and
    "An uncontrolled leader shutdown (i.e. server or node crash, or network outage) will still
    trigger a promotion of an unsynchronised mirror."."""
    assert choose_promotion(promo(), MIRRORS, set(), RUNNING, shutdown=False) == "old"
    assert choose_promotion(promo(), MIRRORS, {"young"}, RUNNING, shutdown=False) == "old"
    assert choose_promotion(promo(), MIRRORS, {"old", "young"}, RUNNING, shutdown=False) == "old"


def test_failure_when_synced_never_promotes_unsynchronised():
    """Spec: "the ha-promote-on-failure policy key controls whether unsynchronised mirror
    promotion is allowed. When set to when-synced, it will make sure that unsynchronised
    mirrors are not promoted."."""
    ha = promo(failure="when-synced")
    assert choose_promotion(ha, MIRRORS, set(), RUNNING, shutdown=False) is None
    assert choose_promotion(ha, MIRRORS, {"young"}, RUNNING, shutdown=False) == "young"
    assert choose_promotion(ha, MIRRORS, {"old"}, RUNNING, shutdown=False) == "old"


def test_shutdown_default_refuses_unsynchronised():
    """Spec: "By default, RabbitMQ will refuse to promote an unsynchronised mirror on controlled
    leader shutdown (i.e. explicit stop of the RabbitMQ service or shutdown of the OS) in order
    to avoid message loss"."""
    assert choose_promotion(promo(), MIRRORS, set(), RUNNING, shutdown=True) is None
    assert choose_promotion(promo(), MIRRORS, {"young"}, RUNNING, shutdown=True) == "young"
    assert choose_promotion(promo(), MIRRORS, {"old", "young"}, RUNNING, shutdown=True) == "old"


def test_shutdown_always_promotes_unsynchronised():
    """Spec: "If you would prefer to have queue leader move to an unsynchronised mirror in all
    circumstances (...) then set the ha-promote-on-shutdown policy key to always rather than its
    default value of when-synced."."""
    ha = promo(shutdown="always")
    assert choose_promotion(ha, MIRRORS, set(), RUNNING, shutdown=True) == "old"
    assert choose_promotion(ha, MIRRORS, {"young"}, RUNNING, shutdown=True) == "old"


def test_failure_when_synced_overrides_shutdown_always():
    """Spec: "If the ha-promote-on-failure policy key is set to when-synced, unsynchronised
    mirrors will not be promoted even if the ha-promote-on-shutdown key is set to always."."""
    ha = promo(failure="when-synced", shutdown="always")
    assert choose_promotion(ha, MIRRORS, set(), RUNNING, shutdown=True) is None
    assert choose_promotion(ha, MIRRORS, set(), RUNNING, shutdown=False) is None
    assert choose_promotion(ha, MIRRORS, {"young"}, RUNNING, shutdown=True) == "young"
    assert choose_promotion(ha, MIRRORS, {"young"}, RUNNING, shutdown=False) == "young"


def _unsynced_allowed(failure: str, shutdown_key: str, shutdown: bool) -> bool:
    # Written as the spec's sentences, not as the module's expression.
    if failure == "when-synced":
        return False  # "unsynchronised mirrors will not be promoted even if ... always"
    if not shutdown:
        return True  # "will still trigger a promotion of an unsynchronised mirror"
    return shutdown_key == "always"  # "refuse ... on controlled leader shutdown" by default


@pytest.mark.parametrize("failure,shutdown_key,shutdown,synced", [
    combo for combo in itertools.product(
        ["always", "when-synced"], ["always", "when-synced"], [False, True],
        [frozenset(), frozenset({"young"}), frozenset({"old"}), frozenset({"old", "young"})])
])
def test_promotion_table(failure, shutdown_key, shutdown, synced):
    """Spec: "Note that ha-promote-on-shutdown and ha-promote-on-failure have different default
    behaviours. ha-promote-on-shutdown is set to when-synced by default, while
    ha-promote-on-failure is set to always by default."  Every combination of the two keys,
    failure or controlled shutdown, and which mirrors are synchronised."""
    ha = promo(failure, shutdown_key)
    got = choose_promotion(ha, MIRRORS, set(synced), RUNNING, shutdown=shutdown)
    if _unsynced_allowed(failure, shutdown_key, shutdown) or "old" in synced:
        assert got == "old"
    elif "young" in synced:
        assert got == "young"
    else:
        assert got is None


def test_promotion_defaults_match_the_spec():
    """Spec: "ha-promote-on-shutdown is set to when-synced by default, while
    ha-promote-on-failure is set to always by default."."""
    assert HA().promote_on_shutdown == "when-synced" and HA().promote_on_failure == "always"
    assert ha_settings(make_policy("p", ".*", SPEC_ALL)).promote_on_failure == "always"
    assert ha_settings(make_policy("p", ".*", SPEC_ALL)).promote_on_shutdown == "when-synced"


def test_promotion_skips_mirrors_that_are_not_running():
    """Spec: "the oldest mirror will be promoted" - of those still there to promote."""
    assert choose_promotion(promo(), ["a", "b", "c"], set(), {"b", "c"}, shutdown=False) == "b"
    assert choose_promotion(promo(), ["a", "b"], {"a", "b"}, {"b"}, shutdown=True) == "b"
    assert choose_promotion(promo(), ["a", "b"], {"a", "b"}, set(), shutdown=False) is None
    assert choose_promotion(promo(), [], set(), {"a"}, shutdown=False) is None


# --- properties of place_mirrors -----------------------------------------------------------

NAMES = ["n1", "n2", "n3", "n4", "n5", "n6", "ghost"]


@st.composite
def placements(draw):
    members = draw(st.lists(st.sampled_from(NAMES[:6]), unique=True, min_size=1))
    running = draw(st.sets(st.sampled_from(NAMES)))
    leader = draw(st.sampled_from(members))
    mirrors = draw(st.lists(st.sampled_from(NAMES), max_size=8))  # may hold junk
    kind = draw(st.sampled_from([None, "all", "exactly", "nodes"]))
    if kind == "exactly":
        ha = HA(mode="exactly", params=draw(st.integers(1, 8)))
    elif kind == "nodes":
        ha = HA(mode="nodes", params=tuple(draw(st.lists(st.sampled_from(NAMES), min_size=1))))
    else:
        ha = HA(mode=kind)
    load = draw(st.none() | st.dictionaries(st.sampled_from(NAMES), st.integers(0, 5)))
    return ha, leader, mirrors, members, running, load


@settings(max_examples=500, deadline=None)
@given(placements())
def test_placement_properties(case):
    ha, leader, mirrors, members, running, load = case
    placed = place_mirrors(ha, leader, mirrors, members, running, load)
    assert leader not in placed
    assert len(placed) == len(set(placed))
    assert all(n in members and n in running for n in placed)
    # existing mirrors that survive keep their relative order, and come before new ones
    survivors = [m for m in placed if m in mirrors]
    assert placed[:len(survivors)] == survivors
    firsts = list(dict.fromkeys(mirrors))
    assert survivors == [m for m in firsts if m in survivors]
    if ha.mode is None:
        assert placed == []
    elif ha.mode == "all":
        assert set(placed) == {n for n in members if n in running} - {leader}
    elif ha.mode == "exactly":
        usable = {n for n in members if n in running} - {leader}
        assert len(placed) == min(ha.params - 1, len(usable))
    else:
        assert set(placed) == {n for n in ha.params if n in members and n in running} - {leader}


@settings(max_examples=500, deadline=None)
@given(placements())
def test_placement_is_idempotent(case):
    ha, leader, mirrors, members, running, load = case
    placed = place_mirrors(ha, leader, mirrors, members, running, load)
    assert place_mirrors(ha, leader, placed, members, running, load) == placed


@settings(max_examples=300, deadline=None)
@given(placements())
def test_placement_does_not_touch_its_inputs(case):
    ha, leader, mirrors, members, running, load = case
    before = (list(mirrors), list(members), set(running), dict(load) if load else load)
    place_mirrors(ha, leader, mirrors, members, running, load)
    assert (mirrors, members, running, load) == before


def test_alternate_exchange_key_is_an_exchange_name():
    with pytest.raises(PolicyError, match="'alternate-exchange' must be an exchange name, got 5"):
        parse_definition({"alternate-exchange": 5})
