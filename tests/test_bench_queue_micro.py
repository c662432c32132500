"""bench/queue_micro.py: the queue hot-path microbenchmark times every step and its mirror ends
equal to its leader."""

from bench import queue_micro


import pytest


@pytest.mark.parametrize("spill", [False, True])
def test_every_step_is_timed_and_the_mirror_follows_its_leader(spill):
    best = queue_micro.run(batch=20, rounds=50, repeat=1, spill=spill)  # raises if the mirror differs
    assert set(best) == set(queue_micro.STEPS)
    assert all(ns > 0 for ns in best.values())
