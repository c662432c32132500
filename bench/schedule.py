"""When each message is meant to be sent: the open-loop schedule of a producer.

With a `producer_rate`, a producer's message i has an *intended* send time fixed before the run
starts, t0 + phase + i / rate, whatever the broker does. The producer sends every message whose
time has come (a burst, if it fell behind), and latency is measured from the intended time, not
from when the message could finally be sent: a broker that stalls the producer (full confirm
window, TCP back-pressure, a blocked connection) cannot hide the wait of the messages that
queued up behind the stall. This is the correction for coordinated omission (Gil Tene; wrk2
does the same).

A scenario of `duration` owes exactly the messages intended before its end: a producer that is
behind then keeps sending them (for at most GRACE seconds more), so the messages held up by a
stall near the end are counted too, not dropped from the statistics.

Producers of one scenario share its total rate: producer k of P sends at rate / P with a phase of
k / rate, so together they send at evenly spaced times. This module is pure arithmetic; the
generators (`bench.gen_amqp`, `bench.gen_warren`) call it on their hot path, so it is small.
"""

from __future__ import annotations

import math

GRACE = 30.0  # seconds past the end a late producer may take to send what it still owes


class OpenLoop:
    """Intended send times of one producer: message i at t0 + phase + i * interval."""

    __slots__ = ("rate", "t0", "phase", "interval", "start")

    def __init__(self, rate: float, t0: float, phase: float = 0.0):
        if not rate > 0:
            raise ValueError(f"an open-loop schedule needs a rate > 0, got {rate!r}")
        self.rate = float(rate)
        self.t0 = float(t0)
        self.phase = float(phase)
        self.interval = 1.0 / self.rate
        self.start = self.t0 + self.phase

    @classmethod
    def for_producer(cls, total_rate: float, producers: int, index: int, t0: float) -> "OpenLoop":
        """Producer `index` of `producers` sharing `total_rate` msgs/s, interleaved evenly."""
        if producers < 1 or not 0 <= index < producers:
            raise ValueError(f"producer index {index} of {producers}")
        return cls(total_rate / producers, t0, index / total_rate)

    def intended(self, i: int) -> float:
        """When message i (0, 1, 2, ...) is meant to be sent."""
        return self.start + i * self.interval

    def due(self, now: float) -> int:
        """How many messages are due at `now` (message i is due once now >= intended(i))."""
        if now < self.start:
            return 0
        # the small epsilon keeps a message whose time is exactly `now` from being lost to rounding
        return int(math.floor((now - self.start) * self.rate + 1e-9)) + 1

    def count_before(self, t: float) -> int:
        """How many messages are meant to be sent before `t`: what the schedule owes by then."""
        if math.isinf(t):
            return 1 << 62
        if t <= self.start:
            return 0
        return int(math.ceil((t - self.start) * self.rate - 1e-9))

    def wait(self, sent: int, now: float) -> float:
        """Seconds from `now` until message `sent` is due (0 if it already is)."""
        return max(0.0, self.intended(sent) - now)


def lag_stats(intended, actual) -> dict:
    """How late the generator itself sent messages (actual - intended), in ms: the part of any
    latency that the load generator added. p50/p99/max over the pairs given."""
    lags = sorted((a - i) * 1000.0 for i, a in zip(intended, actual) if a > 0 and i > 0)
    if not lags:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}

    def pct(q: float) -> float:
        k = (len(lags) - 1) * q
        lo = int(math.floor(k))
        hi = min(lo + 1, len(lags) - 1)
        return lags[lo] + (lags[hi] - lags[lo]) * (k - lo)

    return {"n": len(lags), "p50_ms": round(pct(0.5), 3), "p99_ms": round(pct(0.99), 3),
            "max_ms": round(lags[-1], 3)}
