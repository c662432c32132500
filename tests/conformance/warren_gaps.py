"""The conformance cases warren fails today, each with what it lacks. Against warren (and only
there) conftest.py marks these cases xfail(strict=True): a case that starts to pass fails the run
until its line here is removed. A key is a test function's name (every parametrisation of it is
expected to fail) or one parametrised case's full name, e.g. `test_x[string]`."""

DEAD_LETTERING = "dead-lettering (x-dead-letter-exchange is kept, not acted on)"
PER_MESSAGE_TTL = "per-message TTL (the expiration property is carried, not applied)"
PRIORITIES = "queue priorities (x-max-priority is kept, not acted on)"
SAC = "single active consumer"
CONSUMER_PRIORITIES = "consumer priorities (x-priority on basic.consume)"

GAPS: dict[str, str] = {
    # dead-lettering
    "test_rejected_message_is_dead_lettered_with_x_death": DEAD_LETTERING,
    "test_nack_multiple_without_requeue_dead_letters_each": DEAD_LETTERING,
    "test_queue_ttl_expiry_is_dead_lettered": DEAD_LETTERING,
    "test_per_message_expiry_is_dead_lettered_with_original_expiration": DEAD_LETTERING,
    "test_rejected_message_loses_its_expiration": DEAD_LETTERING,
    "test_max_length_drop_head_dead_letters_the_oldest": DEAD_LETTERING,
    "test_reject_publish_dlx_nacks_and_dead_letters_the_new_message":
        "x-overflow reject-publish-dlx (refused at declare)",
    "test_dead_letter_routing_key_replaces_the_key": DEAD_LETTERING,
    "test_default_exchange_as_dead_letter_exchange": DEAD_LETTERING,
    "test_retry_loop_counts_deaths_most_recent_first": DEAD_LETTERING,
    "test_dead_letter_policy_keys_apply_to_a_live_queue": "the dead-letter-exchange and dead-letter-routing-key policy keys",
    "test_retry_queue_set_by_policy_alone": "the dead-letter-* policy keys",
    "test_dead_letter_exchange_argument_beats_policy_but_policy_key_fills_in":
        "the dead-letter-* policy keys and their precedence",
    "test_bad_dead_letter_arguments": "RabbitMQ's checks of the x-dead-letter-* arguments",
    "test_mirrored_dead_lettering_across_nodes": DEAD_LETTERING,
    # TTLs
    "test_per_message_expiration_applies": PER_MESSAGE_TTL,
    "test_expiration_zero_expires_without_a_waiting_consumer": PER_MESSAGE_TTL,
    "test_bad_expiration_closes_the_channel": "RabbitMQ's check of the expiration property",
    "test_bad_queue_ttl_refused[string]":
        "RabbitMQ's text for a non-integer x-message-ttl (warren says {unacceptable_type,longstr})",
    "test_message_ttl_policy_set_later_spares_messages_already_queued":
        "RabbitMQ's deadline at enqueue (warren applies a new message-ttl policy to queued messages)",
    "test_mirrored_per_message_expiration": PER_MESSAGE_TTL,
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
    # policy keys
    "test_bad_overflow_argument":
        "RabbitMQ's text for a bad x-overflow (warren says {unacceptable_value,'nope'} and names its values)",
}
