"""The open-loop schedule of the load generator (bench/schedule.py): intended send times, what is
due when, what a run owes, and why latency is measured from the intended time (coordinated
omission): pure arithmetic and a simulated producer, no broker."""

import pytest

from bench.schedule import OpenLoop, lag_stats


def test_intended_times_are_fixed_by_rate_and_start():
    s = OpenLoop(1000, t0=100.0)
    assert [s.intended(i) for i in range(3)] == pytest.approx([100.0, 100.001, 100.002])
    assert s.intended(10_000) == pytest.approx(110.0)


def test_due_counts_messages_whose_time_has_come():
    s = OpenLoop(1000, t0=100.0)
    assert s.due(99.9999) == 0
    assert s.due(100.0) == 1            # message 0 is due at t0 exactly
    assert s.due(100.0005) == 1
    assert s.due(100.001) == 2          # exactly on time counts, despite float rounding
    assert s.due(100.0999999) == 100
    # due(intended(i)) always includes i, for any i (no message lost to rounding)
    for i in (0, 1, 7, 999, 123_456):
        assert s.due(s.intended(i)) == i + 1


def test_wait_until_the_next_message():
    s = OpenLoop(200, t0=10.0)
    assert s.wait(0, 9.0) == pytest.approx(1.0)
    assert s.wait(3, 10.0) == pytest.approx(0.015)
    assert s.wait(3, 11.0) == 0.0        # late: due now


def test_a_run_owes_the_messages_intended_before_its_end():
    s = OpenLoop(1000, t0=0.0)
    assert s.count_before(0.0) == 0
    assert s.count_before(1.0) == 1000   # 0 .. 999; message 1000 is intended at the end itself
    assert s.count_before(1.0005) == 1001
    assert s.count_before(float("inf")) > 10 ** 15
    with pytest.raises(ValueError):
        OpenLoop(0, t0=0.0)


def test_producers_share_the_rate_interleaved():
    total, producers = 3000, 3
    times = sorted(OpenLoop.for_producer(total, producers, k, 50.0).intended(i)
                   for k in range(producers) for i in range(100))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == pytest.approx([1 / total] * len(gaps))  # evenly spaced, as one producer at 3000/s
    with pytest.raises(ValueError):
        OpenLoop.for_producer(total, producers, 3, 0.0)


def _simulate(rate, seconds, stall, window, service=0.0005):
    """A producer on the open-loop schedule against a broker that confirms each message
    `service` s after it is sent, except that nothing is confirmed during `stall` = (a, b); at most
    `window` messages may be unconfirmed. The producer wakes every 1 ms, like an event loop's timer.
    Returns (t_int, t_pub, t_conf) per message."""
    s = OpenLoop(rate, t0=0.0)
    owed = s.count_before(seconds)
    t_int, t_pub, t_conf = [], [], []
    now = 0.0
    while len(t_pub) < owed:
        outstanding = sum(1 for c in t_conf if c > now)
        while len(t_pub) < min(s.due(now), owed) and outstanding < window:
            i = len(t_pub)
            t_int.append(s.intended(i))
            t_pub.append(now)
            done = now + service
            if stall[0] <= done < stall[1]:
                done = stall[1] + service  # held until the broker comes back
            t_conf.append(done)
            outstanding += 1
        now += 0.001
    return t_int, t_pub, t_conf


def _p(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_latency_from_the_intended_time_sees_the_stall_that_send_times_hide():
    # 1,000 msgs/s for 2 s; the broker stops confirming from 0.5 s to 0.8 s; window 50: after 50
    # messages the producer is held back, and 250 more messages queue up behind the stall
    t_int, t_pub, t_conf = _simulate(1000, 2.0, (0.5, 0.8), 50)
    assert len(t_int) == 2000                          # every message the schedule owed was sent
    from_pub = [(c - p) * 1000 for p, c in zip(t_pub, t_conf)]
    from_int = [(c - i) * 1000 for i, c in zip(t_int, t_conf)]
    # measured from the send time, only the 50 messages in flight saw the stall: p99 stays ~0.5 ms
    # (the coordinated omission: the held-back messages were "sent" after the stall and look fast)
    assert _p(from_pub, 0.90) < 1.0
    assert sum(1 for x in from_pub if x > 100) <= 50
    # measured from the intended time, every message meant for the stall shows its cost: those
    # intended in its first 200 ms waited more than 100 ms
    assert sum(1 for x in from_int if x > 100) >= 195
    assert _p(from_int, 0.99) > 200
    # held-back messages went late, and the send lag says how late
    lag = lag_stats(t_int, t_pub)
    assert lag["max_ms"] > 250 and lag["p50_ms"] < 1.5


def test_without_a_stall_both_measures_agree_within_the_timer_tick():
    t_int, t_pub, t_conf = _simulate(1000, 1.0, (5.0, 5.0), 1000)
    from_int = [(c - i) * 1000 for i, c in zip(t_int, t_conf)]
    assert max(from_int) < 1.6  # service 0.5 ms + at most one 1 ms timer tick
    assert lag_stats([], [])["n"] == 0
