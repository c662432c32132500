"""The conformance cases warren fails today, each with what it lacks. Against warren (and only
there) conftest.py marks these cases xfail(strict=True): a case that starts to pass fails the run
until its line here is removed. A key is a test function's name (every parametrisation of it is
expected to fail) or one parametrised case's full name, e.g. `test_x[string]`."""

PRIORITIES = "queue priorities (x-max-priority is kept, not acted on)"
SAC = "single active consumer"
CONSUMER_PRIORITIES = "consumer priorities (x-priority on basic.consume)"
REPLY_TO = "direct reply-to (amq.rabbitmq.reply-to)"
ALTERNATE = "alternate exchanges (alternate-exchange is kept, not acted on)"
E2E = "exchange-to-exchange bindings (exchange.bind closes the connection with 540)"

GAPS: dict[str, str] = {
    # priorities
    "test_higher_priority_first_fifo_within_a_priority": PRIORITIES,
    "test_priority_above_the_maximum_counts_as_the_maximum": PRIORITIES,
    "test_priority_order_among_unacknowledged_and_requeued": PRIORITIES,
    "test_bad_max_priority_refused": "RabbitMQ's checks of x-max-priority",
    "test_mirrored_priority_queue_across_nodes": PRIORITIES,
    # consumers
    "test_single_active_consumer_only_the_first_receives": SAC,
    "test_single_active_consumer_takeover_on_connection_close_gets_unacked": SAC,
    "test_mirrored_single_active_consumer_takeover_across_nodes": SAC,
    "test_bad_single_active_consumer_argument": "RabbitMQ's check of x-single-active-consumer",
    "test_higher_priority_consumer_served_first_until_its_prefetch_is_full": CONSUMER_PRIORITIES,
    "test_higher_priority_consumer_takes_everything_it_can": CONSUMER_PRIORITIES,
    "test_bad_consumer_priority": "RabbitMQ's check of x-priority",
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
