"""bench/queue_micro.py: the queue hot-path microbenchmark times every step and its mirror ends
equal to its leader."""

import pytest

from bench import queue_micro


@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize("ack_each", [False, True])
def test_every_step_is_timed_and_the_mirror_follows_its_leader(spill, ack_each):
    # raises if the mirror differs from its leader, or the channel settles other ids
    best = queue_micro.run(batch=20, rounds=50, repeat=1, spill=spill, ack_each=ack_each)
    assert set(best) == set(queue_micro.STEPS)
    assert all(ns > 0 for ns in best.values())
