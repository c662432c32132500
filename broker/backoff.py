"""Retry pacing shared by every retry loop of the node and its client library: dialing a peer
(broker/cluster.py), joining through a cluster seed (broker/node.py), a client's connecting and
reconnecting (broker/client/aio.py).

The delay before the next attempt starts at `first` and doubles after each failed attempt, up to
`cap`; an attempt that worked starts the sequence again from `first`. Doubling keeps a node that
is down for long from being hammered, and the cap bounds how long a node that has come back waits
to be noticed.
"""

from __future__ import annotations

import trio


class Backoff:
    def __init__(self, first: float, cap: float):
        self.first = first
        self.cap = cap
        self.delay = first  # the wait before the next attempt

    def reset(self) -> None:
        """An attempt worked: the next failure waits `first` again."""
        self.delay = self.first

    def next_delay(self) -> float:
        """The wait before the next attempt; the one after it is twice as long (at most `cap`)."""
        delay = self.delay
        self.delay = min(delay * 2, self.cap)
        return delay

    async def wait(self) -> None:
        """Sleep before the next attempt."""
        await trio.sleep(self.next_delay())
