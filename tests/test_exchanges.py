"""Exchanges and bindings (mirroring/exchanges.py, mirroring/metadata.py): RabbitMQ's topic
matching (property-tested against an independent regular-expression formulation), headers
matching, routing, and the metadata changes (idempotent, with RabbitMQ's errors)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import msgspec

from mirroring import exchanges as xmod
from mirroring.changes import (BindingAdd, BindingRemove, ExchangeDeclare, ExchangeDelete, MemberAdd,
                               QueueDeclare, QueueDelete)
from mirroring.metadata import Metadata, MetaError
from mirroring.records import Binding, QueueDef
from wire.errors import ACCESS_REFUSED, COMMAND_INVALID, NOT_FOUND, PRECONDITION_FAILED, ProtocolError


def reference_match(binding_key: str, routing_key: str) -> bool:
    """RabbitMQ's rule restated as a regular expression over the words, each written as
    NUL + word: '*' is exactly one word, '#' any number of words (zero too); the empty key is
    no word at all."""
    def words(key):
        return key.split(".") if key else []
    parts = []
    for w in words(binding_key):
        if w == "*":
            parts.append("\x00[^\x00]*")
        elif w == "#":
            parts.append("(?:\x00[^\x00]*)*")
        else:
            parts.append("\x00" + re.escape(w))
    subject = "".join("\x00" + w for w in words(routing_key))
    return re.fullmatch("".join(parts), subject) is not None


WORD = st.sampled_from(["a", "b", "c", "", "ab"])
PATTERN_WORD = st.sampled_from(["a", "b", "c", "", "*", "#"])
ROUTING_KEY = st.lists(WORD, max_size=5).map(".".join)
BINDING_KEY = st.lists(PATTERN_WORD, max_size=5).map(".".join)


@settings(max_examples=600, deadline=None)
@given(st.lists(BINDING_KEY, min_size=1, max_size=8), st.lists(ROUTING_KEY, min_size=1, max_size=6))
def test_topic_trie_matches_like_rabbitmq(bindings, keys):
    trie = xmod.TopicTrie()
    for i, b in enumerate(bindings):
        trie.add(b, i)
    for key in keys:
        got = sorted(trie.match(key))
        want = [i for i, b in enumerate(bindings) if reference_match(b, key)]
        assert got == want, (bindings, key)


@pytest.mark.parametrize("binding, key, matches", [
    # RabbitMQ's tutorial 5
    ("*.orange.*", "quick.orange.rabbit", True),
    ("*.*.rabbit", "quick.orange.rabbit", True),
    ("lazy.#", "lazy.orange.elephant", True),
    ("*.orange.*", "quick.brown.fox", False),
    ("lazy.#", "lazy.brown.fox", True),
    ("*.orange.*", "orange", False),
    ("*.orange.*", "quick.orange.male.rabbit", False),
    ("lazy.#", "lazy.orange.male.rabbit", True),
    # edges of the word split
    ("#", "", True),
    ("#", "a.b.c", True),
    ("a.#", "a", True),
    ("#.a", "a", True),
    ("#.a.#", "a", True),
    ("*", "", False),
    ("*", "a", True),
    ("", "", True),
    ("", "a", False),
    ("a", "a.", False),
    ("a.*", "a.", True),  # "a." is the words "a" and ""
    ("*.*", ".", True),
    ("a.*.b", "a..b", True),
    ("a.#.b", "a.b", True),
    ("#.#", "", True),
    ("a.*.#", "a", False),
    ("a.*.#", "a.b", True),
    ("a.*.#", "a.b.c.d", True),
    ("#.b.#.d", "a.b.c.d", True),
    ("#.b.#.d", "a.b.c", False),
])
def test_topic_examples(binding, key, matches):
    trie = xmod.TopicTrie()
    trie.add(binding, "q")
    assert (trie.match(key) == ["q"]) is matches


def test_headers_matching():
    m = xmod.headers_match
    assert m({"x-match": "all", "a": 1, "b": "x"}, {"a": 1, "b": "x", "c": 3})
    assert not m({"x-match": "all", "a": 1, "b": "x"}, {"a": 1})
    assert m({"x-match": "any", "a": 1, "b": "x"}, {"a": 2, "b": "x"})
    assert not m({"x-match": "any", "a": 1}, {"a": 2})
    assert m({"a": 1}, {"a": 1})  # all is the default
    assert m({"x-match": "all"}, None)  # nothing to require
    assert not m({"x-match": "any"}, {"a": 1})
    assert m({"x-match": "all", "a": None}, {"a": "anything"})  # void: presence only
    assert not m({"x-match": "all", "a": 1}, {"a": 1.0})  # type classes differ
    assert not m({"x-match": "all", "a": 1}, {"a": True})
    assert m({"x-match": "all", "a": "x"}, {"a": b"x"})  # both binary
    assert m({"x-match": "all", "x-key": 1}, {})  # x- keys are not compared
    assert not m({"x-match": "all-with-x", "x-key": 1}, {})
    assert m({"x-match": "any-with-x", "x-key": 1}, {"x-key": 1})


def _md() -> Metadata:
    md = Metadata()
    md.apply(MemberAdd("n1", ("n1", 1), ("n1", 2)))
    for q in ("q1", "q2", "q3"):
        md.apply(QueueDeclare(QueueDef(q, False, False, False, {}, "n1")))
    return md


def test_builtin_exchanges_and_default_routing():
    md = _md()
    assert set(xmod.BUILTIN) <= set(md.exchanges)
    assert md.routes.route("", "q1") == ["q1"]
    assert md.routes.route("", "nope") == []
    with pytest.raises(ProtocolError) as e:
        md.routes.route("missing", "k")
    assert e.value.code == NOT_FOUND and e.value.text == "no exchange 'missing' in vhost '/'"


def test_routing_through_each_type():
    md = _md()
    md.apply(BindingAdd("amq.direct", Binding("q1", "k", {})))
    md.apply(BindingAdd("amq.direct", Binding("q2", "k", {})))
    md.apply(BindingAdd("amq.direct", Binding("q3", "other", {})))
    assert md.routes.route("amq.direct", "k") == ["q1", "q2"]
    md.apply(BindingAdd("amq.fanout", Binding("q1", "", {})))
    md.apply(BindingAdd("amq.fanout", Binding("q3", "ignored", {})))
    assert md.routes.route("amq.fanout", "whatever") == ["q1", "q3"]
    md.apply(BindingAdd("amq.topic", Binding("q1", "a.*", {})))
    md.apply(BindingAdd("amq.topic", Binding("q1", "#", {})))  # two bindings, one queue: routed once
    md.apply(BindingAdd("amq.topic", Binding("q2", "a.#", {})))
    assert sorted(md.routes.route("amq.topic", "a.b")) == ["q1", "q2"]
    assert md.routes.route("amq.topic", "b") == ["q1"]
    md.apply(BindingAdd("amq.headers", Binding("q2", "", {"x-match": "any", "h": 1})))
    calls = []

    def headers():
        calls.append(1)
        return {"h": 1}
    assert md.routes.route("amq.headers", "", headers) == ["q2"]
    assert calls == [1]
    assert md.routes.route("amq.direct", "k", headers) == ["q1", "q2"]
    assert calls == [1]  # decoded only for a headers exchange


def test_exchange_declare_is_idempotent_and_checks_equivalence():
    md = _md()
    x = xmod.make_exchange("logs", "fanout")
    assert md.apply(ExchangeDeclare(x)) == {"created": True}
    assert md.apply(ExchangeDeclare(xmod.make_exchange("logs", "fanout"))) == {"created": False}
    for change, text in (
        ({"type": "direct"}, "inequivalent arg 'type' for exchange 'logs' in vhost '/': "
                             "received 'direct' but current is 'fanout'"),
        ({"durable": True}, "inequivalent arg 'durable' for exchange 'logs' in vhost '/': "
                            "received 'true' but current is 'false'"),
        ({"auto_delete": True}, "inequivalent arg 'auto_delete'"),
        ({"internal": True}, "inequivalent arg 'internal'"),
        ({"arguments": {"alternate-exchange": "ae"}}, "inequivalent arg 'alternate-exchange'"),
    ):
        with pytest.raises(ProtocolError) as e:
            md.apply(ExchangeDeclare(msgspec.structs.replace(x, **change)))
        assert e.value.code == PRECONDITION_FAILED and text in e.value.text
    with pytest.raises(ProtocolError) as e:
        xmod.check_declare("x", "nonsense", False)
    assert e.value.code == COMMAND_INVALID
    with pytest.raises(ProtocolError) as e:
        xmod.check_declare("amq.custom", "direct", False)
    assert e.value.code == ACCESS_REFUSED
    with pytest.raises(ProtocolError) as e:
        xmod.check_declare("", "direct", False)
    assert e.value.code == ACCESS_REFUSED


def test_bindings_are_idempotent_and_go_with_their_queue_or_exchange():
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("x", "direct")))
    assert md.apply(BindingAdd("x", Binding("q1", "k", {}))) is True
    assert md.apply(BindingAdd("x", Binding("q1", "k", {}))) is False  # a retried proposal
    assert md.apply(BindingRemove("x", Binding("q1", "k", {}))) is True
    assert md.apply(BindingRemove("x", Binding("q1", "k", {}))) is False
    md.apply(BindingAdd("x", Binding("q1", "k", {})))
    md.apply(BindingAdd("x", Binding("q2", "k", {})))
    md.apply(QueueDelete("q1"))
    assert md.bindings["x"] == [Binding("q2", "k", {})]
    assert md.routes.route("x", "k") == ["q2"]
    with pytest.raises(MetaError) as e:
        md.apply(BindingAdd("x", Binding("q1", "k", {})))
    assert e.value.code == NOT_FOUND and e.value.text == "no queue 'q1' in vhost '/'"
    with pytest.raises(ProtocolError) as e:
        md.apply(ExchangeDelete("x", True))  # if-unused, but bound
    assert e.value.code == PRECONDITION_FAILED
    assert md.apply(ExchangeDelete("x", False)) is True
    assert md.apply(ExchangeDelete("x", False)) is False
    assert "x" not in md.bindings
    with pytest.raises(ProtocolError) as e:
        md.apply(ExchangeDelete("amq.direct", False))
    assert e.value.code == ACCESS_REFUSED
    with pytest.raises(ProtocolError) as e:
        md.apply(BindingAdd("", Binding("q2", "k", {})))
    assert e.value.code == ACCESS_REFUSED


def test_auto_delete_exchange_goes_with_its_last_binding():
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("ad", "fanout", auto_delete=True)))
    md.apply(BindingAdd("ad", Binding("q1", "", {})))
    md.apply(BindingAdd("ad", Binding("q2", "", {})))
    md.apply(BindingRemove("ad", Binding("q1", "", {})))
    assert "ad" in md.exchanges
    md.apply(QueueDelete("q2"))
    assert "ad" not in md.exchanges


def test_snapshots_carry_exchanges_and_bindings():
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("t", "topic", durable=True)))
    md.apply(BindingAdd("t", Binding("q1", "a.#", {})))
    copy = Metadata.from_snapshot(md.snapshot())
    assert copy.exchanges == md.exchanges and copy.bindings == md.bindings
    assert copy.digest() == md.digest()
    assert copy.routes.route("t", "a.b") == ["q1"]


def test_plain_argument_values():
    import datetime
    import decimal
    assert xmod.plain({"a": decimal.Decimal("1.50"), "b": bytearray(b"x"),
                       "c": [datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)]}) == \
        {"a": "1.50", "b": b"x", "c": [1577836800]}


# --- exchange-to-exchange bindings and alternate exchanges -------------------------------------

def _graph_md():
    from mirroring.changes import ExchangeBindingAdd
    from mirroring.records import ExchangeBinding
    md = _md()
    for name, kind in (("up", "topic"), ("down", "direct"), ("a", "fanout"), ("b", "fanout")):
        md.apply(ExchangeDeclare(xmod.make_exchange(name, kind)))
    md.apply(BindingAdd("down", Binding("q1", "a.b", {})))
    md.apply(ExchangeBindingAdd("up", ExchangeBinding("down", "a.*", {})))
    md.apply(ExchangeBindingAdd("a", ExchangeBinding("b", "", {})))
    md.apply(ExchangeBindingAdd("b", ExchangeBinding("a", "", {})))  # a cycle
    md.apply(BindingAdd("b", Binding("q2", "", {})))
    md.apply(BindingAdd("a", Binding("q2", "", {})))
    return md


def test_exchange_bindings_route_through_chains_and_cycles_once():
    md = _graph_md()
    assert md.routes.route("up", "a.b") == ["q1"]  # a.* then a.b
    assert md.routes.route("up", "a.c") == []  # a.* but not a.b
    assert md.routes.route("up", "b.b") == []
    assert md.routes.route("a", "") == ["q2"]  # bound to both ends of the cycle: once
    assert md.routes.route("down", "a.b") == ["q1"]  # a plain exchange routes as before
    assert md.routes.graph == {"up", "a", "b"}


def test_exchange_bindings_are_idempotent_and_go_with_either_exchange():
    from mirroring.changes import ExchangeBindingAdd, ExchangeBindingRemove
    from mirroring.records import ExchangeBinding
    md = _graph_md()
    b = ExchangeBinding("down", "a.*", {})
    assert md.apply(ExchangeBindingAdd("up", b)) is False
    assert md.apply(ExchangeBindingRemove("up", b)) is True
    assert md.apply(ExchangeBindingRemove("up", b)) is False
    assert md.routes.route("up", "a.b") == []
    for missing in ("nope", "up"):
        ends = {"source": "up", "destination": "down"}
        ends["source" if missing == "nope" else "destination"] = "nope"
        with pytest.raises(ProtocolError) as e:
            md.apply(ExchangeBindingAdd(ends["source"], ExchangeBinding(ends["destination"], "", {})))
        assert e.value.code == NOT_FOUND and e.value.text == "no exchange 'nope' in vhost '/'"
    with pytest.raises(ProtocolError) as e:
        md.apply(ExchangeDelete("a", True))  # if-unused: it is the source of an exchange binding
    assert e.value.code == PRECONDITION_FAILED
    md.apply(ExchangeDelete("b", False))  # its bindings both ways go with it
    assert md.exchange_bindings == {} and md.routes.route("a", "") == ["q2"]


def test_an_auto_delete_exchange_goes_with_its_last_exchange_binding():
    from mirroring.changes import ExchangeBindingAdd, ExchangeBindingRemove
    from mirroring.records import ExchangeBinding
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("ad", "fanout", auto_delete=True)))
    md.apply(ExchangeBindingAdd("ad", ExchangeBinding("amq.fanout", "", {})))
    md.apply(ExchangeBindingRemove("ad", ExchangeBinding("amq.fanout", "", {})))
    assert "ad" not in md.exchanges


def test_snapshots_carry_exchange_bindings():
    md = _graph_md()
    copy = Metadata.from_snapshot(msgspec.msgpack.decode(msgspec.msgpack.encode(md.snapshot())))
    assert copy.exchange_bindings == md.exchange_bindings and copy.digest() == md.digest()
    assert copy.routes.route("up", "a.b") == ["q1"]
    assert md.copy().exchange_bindings == md.exchange_bindings


def test_alternate_exchange_takes_what_matches_nothing_argument_before_policy():
    from mirroring.changes import PolicySet
    from mirroring.policy import make_policy
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("ae", "fanout")))
    md.apply(ExchangeDeclare(xmod.make_exchange("ae2", "fanout")))
    md.apply(ExchangeDeclare(xmod.make_exchange("main", "direct", arguments={"alternate-exchange": "ae"})))
    md.apply(ExchangeDeclare(xmod.make_exchange("other", "direct")))
    md.apply(BindingAdd("main", Binding("q1", "k", {})))
    md.apply(BindingAdd("ae", Binding("q2", "", {})))
    md.apply(BindingAdd("ae2", Binding("q3", "", {})))
    assert md.routes.route("main", "k") == ["q1"]
    assert md.routes.route("main", "x") == ["q2"]
    assert md.routes.route("other", "x") == []
    md.apply(PolicySet(make_policy("p", "^(main|other)$", {"alternate-exchange": "ae2"},
                                   apply_to="exchanges")))
    assert md.routes.route("main", "x") == ["q2"]  # the argument wins
    assert md.routes.route("other", "x") == ["q3"]  # the policy's key fills in
    md.apply(PolicySet(make_policy("p", "^(main|other)$", {"alternate-exchange": "ae2"},
                                   apply_to="queues")))
    assert md.routes.route("other", "x") == []  # a policy for queues only says nothing of it


def test_alternate_exchanges_chain_stop_at_a_cycle_and_a_missing_one():
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("x1", "direct", arguments={"alternate-exchange": "x2"})))
    md.apply(ExchangeDeclare(xmod.make_exchange("x2", "direct", arguments={"alternate-exchange": "x1"})))
    md.apply(ExchangeDeclare(xmod.make_exchange("x3", "direct", arguments={"alternate-exchange": "gone"})))
    assert md.routes.route("x1", "k") == []  # round the cycle once, then unroutable
    md.apply(BindingAdd("x2", Binding("q1", "k", {})))
    assert md.routes.route("x1", "k") == ["q1"] and md.routes.route("x1", "z") == []
    assert md.routes.route("x3", "k") == []


def test_a_graph_reaching_a_headers_exchange_routes_message_by_message():
    from mirroring.changes import ExchangeBindingAdd
    from mirroring.records import ExchangeBinding
    md = _md()
    md.apply(ExchangeDeclare(xmod.make_exchange("front", "fanout")))
    md.apply(ExchangeBindingAdd("front", ExchangeBinding("amq.headers", "", {})))
    md.apply(BindingAdd("amq.headers", Binding("q1", "", {"h": 1})))
    assert md.routes.by_headers == {"front"}
    assert md.routes.route("front", "", lambda: {"h": 1}) == ["q1"]
    assert md.routes.route("front", "", lambda: {"h": 2}) == []


def test_binding_rows_list_exchange_bindings_after_a_sources_queue_bindings():
    md = _graph_md()
    rows = xmod.binding_rows(md.queues, md.bindings, md.exchange_bindings)
    assert rows[:3] == [("", q, "queue", q, {}) for q in ("q1", "q2", "q3")]
    assert rows[3:] == [("a", "q2", "queue", "", {}), ("a", "b", "exchange", "", {}),
                        ("b", "q2", "queue", "", {}), ("b", "a", "exchange", "", {}),
                        ("down", "q1", "queue", "a.b", {}), ("up", "down", "exchange", "a.*", {})]
