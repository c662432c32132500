"""The conformance cases warren fails today, each with what it lacks. Against warren (and only
there) conftest.py marks these cases xfail(strict=True): a case that starts to pass fails the run
until its line here is removed. A key is a test function's name (every parametrisation of it is
expected to fail) or one parametrised case's full name, e.g. `test_x[string]`."""

REPLY_TO = "direct reply-to (amq.rabbitmq.reply-to)"
ALTERNATE = "alternate exchanges (alternate-exchange is kept, not acted on)"
E2E = "exchange-to-exchange bindings (exchange.bind closes the connection with 540)"

GAPS: dict[str, str] = {
    # direct reply-to
    "test_rpc_round_trip_through_direct_reply_to": REPLY_TO,
    "test_reply_consumer_must_be_no_ack": REPLY_TO,
    "test_request_with_reply_to_needs_a_reply_consumer": REPLY_TO,
    "test_reply_to_a_gone_client_is_unroutable": REPLY_TO,
    "test_aio_pika_rpc_client_with_direct_reply_to": REPLY_TO,
    # exchanges
    "test_alternate_exchange_argument_takes_unroutable_messages": ALTERNATE,
    "test_alternate_exchange_policy_key": ALTERNATE,
    "test_alternate_exchange_argument_beats_policy": ALTERNATE,
    "test_exchange_to_exchange_binding_routes": E2E,
    "test_exchange_unbind_stops_routing": E2E,
    "test_exchange_binding_cycle_delivers_once": E2E,
    "test_exchange_bind_to_a_missing_exchange": E2E,
    "test_exchange_unbind_of_a_missing_binding_is_ok": E2E,
    "test_internal_exchange_routes_what_an_exchange_binding_gives_it": E2E,
    # clustering
    "test_queue_declared_through_one_node_is_routable_through_another_at_once":
        "a queue declared through one node is briefly unknown to the others: a publish through "
        "another node right after declare-ok can be unroutable (returned, or dropped without mandatory)",
}
