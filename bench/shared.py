"""What the runner and its load-generator processes share (one multiprocessing context): the
progress counters and the start/stop signals.

Each worker adds its progress into `Shared.counters` a few times a second (never per message):
[published, confirmed (ack), delivered, first deliveries (not redelivered)]; the workers of a
declare or rpc scenario use the first two slots for their own counts (bench/declaring.py,
bench/rpc_clients.py).
"""

from __future__ import annotations

PUBLISHED, CONFIRMED, DELIVERED, FIRST = range(4)


class Shared:
    """State shared by the runner and its workers (built from one multiprocessing context)."""

    def __init__(self, ctx):
        self.counters = ctx.Array("q", 4)
        self.ready = ctx.Value("i", 0)
        self.finished = ctx.Value("i", 0)  # producer processes that stopped publishing
        self.held = ctx.Value("i", 0)      # rpc processes whose clients all hold their queue
        self.start_at = ctx.Value("d", 0.0)
        self.start = ctx.Event()
        self.consume = ctx.Event()       # consumers may start consuming
        self.stop_publish = ctx.Event()  # producers stop early (interrupt)
        self.stop = ctx.Event()          # consumers stop

    def add(self, deltas: list[int]) -> None:
        with self.counters.get_lock():
            for i, d in enumerate(deltas):
                if d:
                    self.counters[i] += d

    def snapshot(self) -> list[int]:
        with self.counters.get_lock():
            return list(self.counters)

    def wait_start(self) -> float:
        with self.ready.get_lock():
            self.ready.value += 1
        self.start.wait()
        return self.start_at.value


def rotate(nodes: list, k: int) -> list:
    k %= len(nodes)
    return nodes[k:] + nodes[:k]
