"""bench/gen_warren.py: the warren-native generator's workers wait for the runner's signals
through one watcher per process, not one poll per worker.

A multiprocessing Event can only be polled. When every consumer task polled the runner's stop
flag every 50 ms, a process of 500 consumers (`scale-q1000-2k`) woke 10,000 times a second for
it and spent three times the CPU per message of the AMQP generator; its deliveries' p99 was 137
ms. This test runs the consumers' role with 200 workers against a stand-in client and counts
the polls."""

import contextlib
import time

import trio

from bench import gen_warren


class CountingFlag:
    """A stand-in for a multiprocessing Event that counts how often it is polled."""

    def __init__(self, set_after: float):
        self.at = time.monotonic() + set_after
        self.polls = 0

    def is_set(self) -> bool:
        self.polls += 1
        return time.monotonic() >= self.at


class FakeShared:
    def __init__(self):
        self.start_at = time.time()
        self.consume = CountingFlag(0.05)
        self.stop = CountingFlag(0.6)
        self.stop_publish = CountingFlag(1e9)

    def wait_start(self) -> float:
        return self.start_at

    def add(self, deltas) -> None:
        pass


class FakeChannel:
    def __init__(self, consumed: list):
        self.consumed = consumed

    async def basic_qos(self, prefetch):
        pass

    async def basic_consume(self, queue, on_message_callback, auto_ack):
        self.consumed.append(queue)


@contextlib.asynccontextmanager
async def fake_connection(addresses, client_name, consumed):
    class Conn:
        node = "n1"

        async def channel(self):
            return FakeChannel(consumed)

    yield Conn()


def test_consumers_wait_for_the_runners_signals_through_one_watcher(monkeypatch):
    consumed: list = []
    monkeypatch.setattr(gen_warren, "open_connection",
                        lambda addresses, client_name: fake_connection(addresses, client_name, consumed))
    n = 200
    queues = [f"q{i}" for i in range(n)]
    spec = {"scenario": {"prefetch": 10, "ack": "manual"}, "queues": queues, "nodes": ["a", "b", "c"],
            "indices": list(range(n)), "assign": {c: [c] for c in range(n)}}
    shared = FakeShared()
    t = time.monotonic()
    records = trio.run(gen_warren._consumers, spec, shared)
    took = time.monotonic() - t
    assert sorted(consumed) == sorted(queues) and len(records) == n
    assert 0.55 < took < 5
    # one watcher polls each flag every 20 or 50 ms: a dozen or two polls in 0.6 s, not one per
    # consumer per poll (about 2,400 here when each consumer polled)
    assert shared.stop.polls < 40, shared.stop.polls
    assert shared.consume.polls < 20, shared.consume.polls
