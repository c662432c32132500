"""Exchange features as RabbitMQ 3.10 has them: alternate exchanges (argument and policy key, and
which counts), exchange-to-exchange bindings (`exchange.bind` / `exchange.unbind`) and internal
exchanges."""

from __future__ import annotations

import re

import pika.exceptions
import pytest

from amqp_helpers import QUIET, channel, channel_closed, get, publish


def with_alternate(ch, names, **main_args):
    """`main` (direct, key k -> queue main-q) whose unroutable messages an alternate exchange `ae`
    (fanout -> queue ae-q) may take."""
    ch.exchange_declare(names + "ae", "fanout")
    ch.queue_declare(names + "ae-q")
    ch.queue_bind(names + "ae-q", names + "ae")
    ch.exchange_declare(names + "main", "direct", arguments=main_args or None)
    ch.queue_declare(names + "main-q")
    ch.queue_bind(names + "main-q", names + "main", "k")


def test_alternate_exchange_argument_takes_unroutable_messages(broker, names):
    with channel(broker.url) as ch:
        with_alternate(ch, names, **{"alternate-exchange": names + "ae"})
        ch.confirm_delivery()
        ch.basic_publish(names + "main", "k", b"routed", mandatory=True)
        ch.basic_publish(names + "main", "other", b"unrouted", mandatory=True)  # not returned
        assert get(ch, names + "main-q")[2] == b"routed"
        method, _, body = get(ch, names + "ae-q")
        assert (body, method.exchange, method.routing_key) == (b"unrouted", names + "main", "other")
        assert get(ch, names + "ae-q", QUIET) is None


def test_alternate_exchange_policy_key(broker, names):
    with channel(broker.url) as ch:
        with_alternate(ch, names)
        broker.set_policy(names + "ae", "^" + re.escape(names + "main") + "$",
                     {"alternate-exchange": names + "ae"}, apply_to="exchanges")
        ch.connection.sleep(0.2)
        publish(ch, names + "main", "other", "unrouted")
        assert get(ch, names + "ae-q")[2] == b"unrouted"


def test_alternate_exchange_argument_beats_policy(broker, names):
    with channel(broker.url) as ch:
        with_alternate(ch, names, **{"alternate-exchange": names + "ae"})
        ch.exchange_declare(names + "ae2", "fanout")
        ch.queue_declare(names + "ae2-q")
        ch.queue_bind(names + "ae2-q", names + "ae2")
        broker.set_policy(names + "ae", "^" + re.escape(names + "main") + "$",
                     {"alternate-exchange": names + "ae2"}, apply_to="exchanges")
        ch.connection.sleep(0.2)
        publish(ch, names + "main", "other", "unrouted")
        assert get(ch, names + "ae-q")[2] == b"unrouted"
        assert get(ch, names + "ae2-q", QUIET) is None


def test_missing_alternate_exchange_leaves_the_message_unroutable(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "main", "direct", arguments={"alternate-exchange": names + "missing"})
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish(names + "main", "k", b"x", mandatory=True)


def test_exchange_to_exchange_binding_routes(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "up", "topic")
        ch.exchange_declare(names + "down", "direct")
        ch.queue_declare(names + "q")
        ch.queue_bind(names + "q", names + "down", "a.b")
        ch.exchange_bind(destination=names + "down", source=names + "up", routing_key="a.*")
        publish(ch, names + "up", "a.b", "through")   # matches a.* then a.b
        publish(ch, names + "up", "a.c", "stops")     # matches a.* but not a.b
        publish(ch, names + "up", "b.b", "never")
        assert get(ch, names + "q")[2] == b"through"
        assert get(ch, names + "q", QUIET) is None


def test_exchange_unbind_stops_routing(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "up", "fanout")
        ch.exchange_declare(names + "down", "fanout")
        ch.queue_declare(names + "q")
        ch.queue_bind(names + "q", names + "down")
        ch.exchange_bind(names + "down", names + "up")
        ch.exchange_unbind(names + "down", names + "up")
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish(names + "up", "", b"x", mandatory=True)


def test_exchange_binding_cycle_delivers_once(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "a", "fanout")
        ch.exchange_declare(names + "b", "fanout")
        ch.exchange_bind(names + "b", names + "a")
        ch.exchange_bind(names + "a", names + "b")
        ch.queue_declare(names + "q")
        ch.queue_bind(names + "q", names + "b")
        publish(ch, names + "a", "", "once")
        assert get(ch, names + "q")[2] == b"once"
        assert get(ch, names + "q", QUIET) is None


@pytest.mark.parametrize("missing", ["destination", "source"])
def test_exchange_bind_to_a_missing_exchange(broker, names, missing):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "there", "direct")
        ends = {"destination": names + "there", "source": names + "there", missing: names + "nope"}
        with channel_closed(404, f"NOT_FOUND - no exchange '{names}nope' in vhost '/'"):
            ch.exchange_bind(ends["destination"], ends["source"], "k")


def test_exchange_unbind_of_a_missing_binding_is_ok(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "a", "direct")
        ch.exchange_declare(names + "b", "direct")
        ch.exchange_unbind(names + "a", names + "b", "none")
        assert ch.is_open


def test_publishing_to_an_internal_exchange_is_refused(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "int", "direct", internal=True)
        with channel_closed(403, f"ACCESS_REFUSED - cannot publish to internal exchange '{names}int' "
                                 f"in vhost '/'"):
            publish(ch, names + "int", "k", "x")
            ch.exchange_declare(names + "int", passive=True)


def test_internal_exchange_routes_what_an_exchange_binding_gives_it(broker, names):
    with channel(broker.url) as ch:
        ch.exchange_declare(names + "front", "fanout")
        ch.exchange_declare(names + "int", "fanout", internal=True)
        ch.queue_declare(names + "q")
        ch.queue_bind(names + "q", names + "int")
        ch.exchange_bind(names + "int", names + "front")
        publish(ch, names + "front", "", "inside")
        assert get(ch, names + "q")[2] == b"inside"
