"""The fault explorer's regression seeds: schedules on the deterministic simulation that once
found a bug stay fixed (apart from tests/test_dst.py so that `make test`'s workers can run the
two CPU-bound halves side by side)."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(600)  # CPU-bound: about 1 minute on one core
def test_regression_seeds():
    """Schedules that once found a bug (bench/chaos/sim.py REGRESSIONS) stay fixed."""
    from bench.chaos.sim import REGRESSIONS, regression_run
    runs = {name: regression_run(value) for name, value in REGRESSIONS.items()}
    bad = {name: r.line() for name, r in runs.items() if not r.verdict.ok}
    assert not bad, bad


@pytest.mark.parametrize("seed", [654, 1432])
def test_a_confirm_stall_that_began_in_a_partition_is_excused_past_the_heal(seed):
    """Seeds whose publisher's confirms waited, from within a partition, until the queue's
    leader gave up on the mirror that missed batches (net_ticktime after its last word, which
    came just after the heal): the checker excused the partition but judged the seconds after
    it as a stall in a healthy cluster. Whether a seed still draws that stall depends on the
    code it runs (a change anywhere moves a simulated run); the rule itself is
    tests/test_checker.py's `test_a_confirm_stall_just_after_a_fault_is_excused...`."""
    from bench.chaos.sim import SIM_STALL_LIMIT, run_seed
    r = run_seed(seed)
    assert r.verdict.ok, r.line()
    stall = r.verdict.confirm_stall_s
    assert stall is None or stall < SIM_STALL_LIMIT, r.line()
