"""bench/gen_warren.py: the warren-native generator's workers wait on events, never by polling
one by one: a process holds hundreds of them at 1,000 queues.

A multiprocessing Event can only be polled. When every consumer task polled the runner's stop
flag every 50 ms, a process of 500 consumers (`scale-q1000-2k`) woke 10,000 times a second for
it and spent three times the CPU per message of the AMQP generator; its deliveries' p99 was 137
ms. And a producer that had sent its last message polled for its outstanding confirms every 10
ms, so in the last half second of that scenario, as 500 producers of a process finished one by
one, the ones still publishing waited for a core (confirm p50 11 ms there, 0.5 ms before).
These tests run each role with a stand-in client and count the polls, or the producer's steps."""

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


class FakePublishChannel:
    def __init__(self, sent: list):
        self.sent = sent
        self.on_confirm = None
        self.is_open = True

    async def confirm_delivery(self):
        pass

    async def basic_publish(self, exchange, routing_key, body):
        self.sent.append(self)

    def publish_nowait(self, routing_key, body):
        self.sent.append(self)


@contextlib.asynccontextmanager
async def fake_publisher_connection(channels: list, closed: list):
    class Conn:
        node = "n1"
        connected = trio.Event()

        async def channel(self):
            ch = FakePublishChannel(channels)
            return ch

        def corked(self):
            return contextlib.nullcontext()

    conn = Conn()
    conn.connected.set()
    try:
        yield conn
    finally:
        closed.append(time.monotonic())


def test_a_finished_producer_waits_for_its_confirms_without_polling_then_for_the_others(monkeypatch):
    """...and the producers of a process close their connections together once all are through,
    as the AMQP generator does: closed one by one, the teardowns fell in the others' load."""
    sent: list = []
    closed: list = []
    monkeypatch.setattr(gen_warren, "open_connection",
                        lambda addresses, client_name: fake_publisher_connection(sent, closed))
    n, each = 50, 5
    spec = {"scenario": {"message_size": 64, "confirms": True, "confirm_window": 100, "warmup": 0,
                         "duration": 1, "messages": n * each},
            "queues": ["q"], "nodes": ["a", "b", "c"], "indices": list(range(n)), "rate": 0,
            "rate_total": 0, "producers": n, "limits": [each] * n, "confirm_timeout": 5.0}
    steps = {"producer": 0}
    last_confirm: list = []

    class CountSteps(trio.abc.Instrument):
        def after_task_step(self, task):
            if task.name.endswith("_producer"):
                steps["producer"] += 1

    async def main():
        async def confirm_later():  # the broker: every publish confirmed 0.4 s after the last
            while len(sent) < n * each:
                await trio.sleep(0.01)
            await trio.sleep(0.4)
            for ch in {id(c): c for c in sent}.values():  # one producer through every 2 ms
                confirmed_at = time.monotonic()  # (taken before the call: it may close them all)
                ch.on_confirm(1, each, True, None)
                await trio.sleep(0.002)
            last_confirm.append(confirmed_at)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(confirm_later)
            return await gen_warren._producers(spec, FakeShared())

    t = time.monotonic()
    records = trio.run(main, instruments=[CountSteps()])
    assert 0.35 < time.monotonic() - t < 4
    assert [len(r.t_pub) for r in records] == [each] * n
    assert all(len(r.t_conf) == each for r in records)
    # each producer: a few steps to connect, publish and be confirmed; polling every 10 ms for
    # the 0.4 s wait made it about 40 more each (2,000 here)
    assert steps["producer"] < 20 * n, steps
    assert len(closed) == n and min(closed) >= last_confirm[0], (min(closed), last_confirm)


def test_producers_with_a_full_window_and_no_confirms_still_stop_at_their_end(monkeypatch):
    """A broker that stalls sends no confirm to wake a producer waiting for room: the process's
    nudge (one timer, not a timeout per wait) makes it look at the clock again, so it stops
    publishing at its end time and gives up on its confirms after `confirm_timeout`."""
    sent: list = []
    closed: list = []
    monkeypatch.setattr(gen_warren, "open_connection",
                        lambda addresses, client_name: fake_publisher_connection(sent, closed))
    n, window = 20, 2
    spec = {"scenario": {"message_size": 64, "confirms": True, "confirm_window": window, "warmup": 0,
                         "duration": 0.3, "messages": 0},
            "queues": ["q"], "nodes": ["a", "b", "c"], "indices": list(range(n)), "rate": 0,
            "rate_total": 0, "producers": n, "limits": [0] * n, "confirm_timeout": 0.2}

    async def main():
        with trio.fail_after(5):
            return await gen_warren._producers(spec, FakeShared())

    t = time.monotonic()
    records = trio.run(main)
    assert time.monotonic() - t < 2
    assert [len(r.t_pub) for r in records] == [window] * n and len(closed) == n
