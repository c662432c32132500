"""broker/backoff.py's pacing of retries, and the node's wait for its last client connection
to go (broker/node.py `Connections`), which a controlled stop waits on instead of polling."""

from __future__ import annotations

import trio
import trio.testing

from broker.backoff import Backoff
from broker.node import Connections


def test_the_delay_doubles_up_to_the_cap_and_starts_again_after_a_success():
    b = Backoff(0.05, 0.3)
    assert [b.next_delay() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    b.reset()
    assert b.next_delay() == 0.05


async def test_wait_sleeps_the_next_delay(autojump_clock):
    b = Backoff(0.5, 1.0)
    start = trio.current_time()
    await b.wait()
    await b.wait()
    assert trio.current_time() - start == 1.5


async def test_wait_empty_returns_when_the_last_connection_goes(autojump_clock):
    conns = Connections()
    await conns.wait_empty()  # none: at once
    conns[1] = "a"
    conns[2] = "b"
    done = trio.Event()

    async def waiter():
        await conns.wait_empty()
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        conns.pop(1)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()  # one is left
        del conns[2]
        with trio.fail_after(1):
            await done.wait()
