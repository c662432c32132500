"""bench/fineloop.py: the load generator's short waits are not rounded up to a millisecond, and
the selector still reports ready descriptors."""

import selectors
import socket
import time

import pytest

from bench import fineloop


def _shortest_wait(selector, timeout: float, tries: int = 20) -> float:
    best = 1.0
    for _ in range(tries):
        t = time.perf_counter()
        assert selector.select(timeout) == []
        best = min(best, time.perf_counter() - t)
    return best


def test_a_short_wait_is_not_rounded_up_to_a_millisecond():
    # epoll_wait's whole milliseconds make every 0.3 ms wait last at least 1 ms; the shortest
    # of twenty fine waits is well under that even on a busy machine
    with selectors.EpollSelector() as plain:
        assert _shortest_wait(plain, 0.0003) >= 0.001
    with fineloop.FineEpollSelector() as fine:
        assert _shortest_wait(fine, 0.0003) < 0.0009


def test_ready_descriptors_are_reported_in_short_and_long_waits():
    a, b = socket.socketpair()
    with a, b, fineloop.FineEpollSelector() as sel:
        sel.register(a, selectors.EVENT_READ, "a")
        b.send(b"x")
        for timeout in (0.0005, 0.5, None):
            ready = sel.select(timeout)
            assert [(key.data, ev) for key, ev in ready] == [("a", selectors.EVENT_READ)]


def test_the_loop_runs_coroutines():
    import asyncio

    async def main():
        await asyncio.sleep(0.0002)
        return 7

    assert fineloop.run(main()) == 7


async def _shortest_sleep(sleep, tries: int = 20) -> float:
    """The shortest of `tries` sleeps of 0.3 ms with `sleep`, in seconds."""
    best = 1.0
    for _ in range(tries):
        t = time.perf_counter()
        await sleep(0.0003)
        best = min(best, time.perf_counter() - t)
    return best


def test_trio_short_sleeps_end_on_time_with_fine_timers():
    """The warren-native generator's loop: trio's 0.3 ms sleeps last a whole millisecond on
    plain epoll, and well under it once `fine_trio_timers` is in place; I/O still wakes it."""
    import trio

    async def main():
        plain = await _shortest_sleep(trio.sleep)
        assert fineloop.fine_trio_timers()
        fine = await _shortest_sleep(trio.sleep)
        a, b = trio.socket.socketpair()
        with a, b:
            await b.send(b"x")
            with trio.fail_after(1):
                assert await a.recv(1) == b"x"
        return plain, fine

    plain, fine = trio.run(main)
    assert plain >= 0.001 and fine < 0.0009, (plain, fine)


def test_trio_sleep_is_on_time_in_order_and_cancellable(monkeypatch):
    """`trio_sleep`, the generator's cheap short sleep: on time like a fine trio.sleep, sleepers
    woken in deadline order, a cancelled sleep ends at once and leaves no wake-up behind, and
    without the wrapper it is trio's own sleep.

    "In deadline order" is the order of the wrapper's `reschedule` calls: sleepers that a stall
    of the machine leaves due in one pass are run in the order trio picks for a batch, which
    need not be the order they were woken in."""
    import trio
    import trio.testing

    woken: list = []
    reschedule = trio.lowlevel.reschedule

    def recording(task, *args):
        woken.append(task)
        return reschedule(task, *args)

    monkeypatch.setattr(trio.lowlevel, "reschedule", recording)

    async def main():
        assert fineloop._fine_epoll() is None
        t = time.perf_counter()
        await fineloop.trio_sleep(0.0003)  # no wrapper yet: trio's sleep, a millisecond
        assert time.perf_counter() - t >= 0.001
        assert fineloop.fine_trio_timers()
        fine = fineloop._fine_epoll()
        assert await _shortest_sleep(fineloop.trio_sleep) < 0.0009
        slept: dict = {}  # task -> (its sleep, how long it slept)

        async def sleeper(d):
            t = time.perf_counter()
            await fineloop.trio_sleep(d)
            slept[trio.lowlevel.current_task()] = (d, time.perf_counter() - t)

        woken.clear()
        async with trio.open_nursery() as n:
            for d in (0.006, 0.002, 0.004):
                n.start_soon(sleeper, d)
        assert [slept[t][0] for t in woken if t in slept] == [0.002, 0.004, 0.006]
        assert all(took >= d for d, took in slept.values()), slept  # none woken early
        with trio.move_on_after(0.001) as scope:
            await fineloop.trio_sleep(0.015)
        assert scope.cancelled_caught
        assert [e[2] for e in fine.timers] == [None]  # dropped when its time comes
        await trio.sleep(0.02)
        assert fine.timers == []
        # a long sleep is kept in the same heap (no cancel scope), wakes EARLY in epoll (whose
        # whole milliseconds would make it late by up to one) and waits out the rest exactly:
        # never early, and the best of five well inside 1 ms
        inner, handed = fine._epoll, []

        class Recording:
            def poll(self, timeout=-1, maxevents=-1):
                handed.append(timeout)
                return inner.poll(timeout, maxevents)

        fine._epoll = Recording()
        try:  # (put back whatever happens: trio closes the epoll when the run ends)
            lateness = []
            slept.clear()
            for _ in range(5):
                async with trio.open_nursery() as n:
                    n.start_soon(sleeper, 3 * fineloop.LONG_WAIT)
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(fine.timers) == 1
                (d, took), = slept.values()
                assert took >= d
                lateness.append(took - d)
                slept.clear()
        finally:
            fine._epoll = inner
        assert min(lateness) < 0.0009, lateness
        longest = max(t for t in handed if t is not None)
        assert 0 < longest <= 3 * fineloop.LONG_WAIT - fineloop.EARLY, handed

    trio.run(main)


@pytest.mark.process  # in a process of its own: the slack would stay with the test's
def test_tight_timer_slack_asks_linux_for_waits_that_end_on_time():
    import subprocess
    import sys

    code = ("from bench import fineloop; print(fineloop.tight_timer_slack()); "
            "print(open('/proc/self/timerslack_ns').read().strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "1"]
