"""Message rates per queue (publish, deliver/get, ack), from the running totals each queue's
leader keeps (mirroring/queue.py), sampled whenever the API reads the leaders' stats: no
sampling happens while nobody asks, and nothing is counted per message.

A rate is the difference between the newest sample and the oldest one of the last
`WINDOW` seconds, over their time apart. A total that went down (a new leader after a
failover counts from what its mirror had applied) gives a rate of 0 for that window.
"""

from __future__ import annotations

from collections import deque

WINDOW = 5.0  # seconds a rate averages over
SPACING = 0.5  # at most one sample per queue in this long
KEPT = int(WINDOW / SPACING) + 2
TOTALS = ("published", "delivered", "acked")


class Rates:
    def __init__(self):
        self.samples: dict[str, deque] = {}

    def observe(self, leaders: dict, now: float) -> None:
        """`leaders`: {queue: its leader's stats} as `queue_stats` gives them."""
        samples = self.samples
        for name, st in leaders.items():
            d = samples.get(name)
            if d is None:
                d = samples[name] = deque(maxlen=KEPT)
            elif now - d[-1][0] < SPACING:
                continue
            d.append((now, st.get("published", 0), st.get("delivered", 0), st.get("acked", 0)))
        if len(samples) > 2 * len(leaders) + 64:  # forget queues gone long ago
            for name in [n for n, d in samples.items() if now - d[-1][0] > 10 * WINDOW]:
                del samples[name]

    def rates(self, name: str, now: float) -> dict:
        """{"published": per second, "delivered": ..., "acked": ...} for one queue."""
        d = self.samples.get(name)
        if not d or len(d) < 2:
            return dict.fromkeys(TOTALS, 0.0)
        newest = d[-1]
        oldest = next((s for s in d if newest[0] - s[0] <= WINDOW + SPACING), d[0])
        span = newest[0] - oldest[0]
        if span <= 0:
            return dict.fromkeys(TOTALS, 0.0)
        return {key: round(max(0, newest[i] - oldest[i]) / span, 1)
                for i, key in enumerate(TOTALS, 1)}
