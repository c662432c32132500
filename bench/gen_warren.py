"""The warren load: producers and consumers as trio tasks on warren's own async client.

This module owns how a worker process drives warren: one connection and channel per producer
or consumer, publishes pipelined under the confirm window and the rate, consumes through the
client's delivery callback (no per-message task switch), acks through the client's coalescing
writer. Per-message work is: build the body, one `publish_nowait`, two array appends; on the
consumer side, decode the 8-byte id, four appends and one ack.
"""

from __future__ import annotations

import math
import time

import trio
import trio.lowlevel

from bench.records import (
    CONF_ACK,
    CONF_NACK,
    CONF_NONE,
    DeliverRecord,
    PublishRecord,
    make_id,
)
from bench.worker import CONFIRMED, DELIVERED, FIRST, PUBLISHED, Shared, rotate
from broker.client.aio import open_connection
from broker.client.errors import AMQPError

BATCH = 200  # publishes between yields to the scheduler


def declare(addresses: list[str], queues: list[str], durable: bool, delete: bool = False) -> None:
    """Declare (or delete) the scenario's queues from the runner process."""
    async def go():
        async with open_connection(addresses, client_name="bench-setup") as conn:
            ch = await conn.channel()
            for q in queues:
                if delete:
                    try:
                        await ch.queue_delete(q)
                    except AMQPError:  # already gone (deleted with its node, or never made)
                        ch = await conn.channel()
                else:
                    await ch.queue_declare(q, durable=durable)
    trio.run(go)


def run_producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    return trio.run(_producers, spec, shared)


def run_consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    return trio.run(_consumers, spec, shared)


async def _wait_event(ev, poll: float = 0.02) -> None:
    while not ev.is_set():
        await trio.sleep(poll)


async def _report(shared: Shared, totals: list[int], last: list[int]) -> None:
    while True:
        await trio.sleep(0.25)
        deltas = [a - b for a, b in zip(totals, last)]
        last[:] = totals
        shared.add(deltas)


class _Gate:
    """Workers of one process get ready, then all wait for the runner's start signal together."""

    def __init__(self, shared: Shared, expected: int):
        self.shared = shared
        self.expected = expected
        self.count = 0
        self.all_ready = trio.Event()
        self.started = trio.Event()
        self.t0 = 0.0

    def ready(self) -> None:
        self.count += 1
        if self.count >= self.expected:
            self.all_ready.set()

    async def run(self) -> None:
        await self.all_ready.wait()
        self.t0 = await trio.to_thread.run_sync(self.shared.wait_start)
        self.started.set()


async def _run_role(spec: dict, shared: Shared, records: list, task) -> list:
    """Run `task` once per record behind one start gate, reporting per-second totals."""
    totals = [0, 0, 0, 0]
    last = [0, 0, 0, 0]
    gate = _Gate(shared, len(records))
    async with trio.open_nursery() as outer:
        outer.start_soon(_report, shared, totals, last)
        async with trio.open_nursery() as n:
            n.start_soon(gate.run)
            for rec in records:
                n.start_soon(task, spec, shared, rec, gate, totals)
        shared.add([a - b for a, b in zip(totals, last)])
        outer.cancel_scope.cancel()
    return records


async def _producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    sc = spec["scenario"]
    records = [PublishRecord(p, spec["queues"], sc["message_size"]) for p in spec["indices"]]
    return await _run_role(spec, shared, records, _producer)


async def _producer(spec, shared, rec: PublishRecord, gate: _Gate, totals) -> None:
    async with open_connection(rotate(spec["nodes"], rec.producer),
                               client_name=f"bench-producer-{rec.producer}") as conn:
        ch = await conn.channel()
        if spec["scenario"]["confirms"]:
            await ch.confirm_delivery()
        gate.ready()
        await gate.started.wait()
        await _publish(spec, shared, conn, ch, rec, gate.t0, totals)


async def _publish(spec, shared, conn, ch, rec: PublishRecord, t0: float, totals: list[int]) -> None:
    sc = spec["scenario"]
    queues = spec["queues"]
    nq = len(queues)
    p = rec.producer
    pad = b"\0" * (sc["message_size"] - 8)
    rate = spec["rate"]  # this producer's msgs/s, 0 = unlimited
    limit = spec["limits"][p] or math.inf
    t_end = t0 + sc["warmup"] + sc["duration"] if not sc["messages"] else math.inf
    confirms = sc["confirms"]
    window = sc["confirm_window"]
    state = {"resolved": 0, "room": trio.Event(), "low": 0}
    t_pub, rq = rec.t_pub, rec.q
    now_f = time.time

    def confirmer(base: int):
        # the channel's sequence 1 is our message `base`
        def on_confirm(first, last, ok, reason):
            code = CONF_ACK if ok else (CONF_NONE if reason == "connection lost" else CONF_NACK)
            newly = rec.confirm(first - 1 + base, last - 1 + base, code, now_f())
            state["resolved"] += newly
            if code == CONF_ACK:
                totals[CONFIRMED] += newly
            state["room"].set()
        return on_confirm

    async def reopen():
        """The broker closed the channel (e.g. the queue's node is down): give up on what it
        had not confirmed and publish on a new channel."""
        spec["errors"].append(f"producer {p}: channel closed: {ch.close_reason}")
        if sent:
            state["resolved"] += rec.confirm(0, sent - 1, CONF_NONE, now_f())
        await trio.sleep(0.5)
        new = await conn.channel()
        if confirms:
            await new.confirm_delivery()
        new.on_confirm = confirmer(sent)
        return new

    on_confirm = confirmer(0)
    ch.on_confirm = on_confirm
    sent = 0
    if t0 > now_f():
        await trio.sleep(t0 - now_f())
    while not shared.stop_publish.is_set():
        now = now_f()
        if now >= t_end or sent >= limit:
            break
        n = BATCH
        if sent + n > limit:
            n = int(limit - sent)
        if rate:
            n = min(n, int((now - t0) * rate) - sent)
        if confirms:
            n = min(n, window - (sent - state["resolved"]))
        if n <= 0:
            if rate and int((now - t0) * rate) <= sent:
                await trio.sleep(max(0.0005, (sent + 1) / rate - (now - t0)))
            else:
                state["room"] = trio.Event()
                with trio.move_on_after(0.05):
                    await state["room"].wait()
            continue
        if not conn.connected.is_set():
            await trio.sleep(0.01)
            continue
        if not ch.is_open:
            try:
                ch = await reopen()
            except Exception as exc:  # noqa: BLE001 - the node may refuse; try again shortly
                spec["errors"].append(f"producer {p}: {exc}")
            continue
        # the first of the batch waits if the client's send buffer is full; the rest do not
        qi = (p + sent) % nq
        try:
            await ch.basic_publish("", queues[qi], make_id(p, sent).to_bytes(8, "big") + pad)
        except AMQPError:
            continue  # closed while waiting for room: the next turn reopens
        t_pub.append(now_f())
        rq.append(qi)
        sent += 1
        for _ in range(n - 1):
            qi = (p + sent) % nq
            ch.publish_nowait(queues[qi], make_id(p, sent).to_bytes(8, "big") + pad)
            t_pub.append(now_f())
            rq.append(qi)
            sent += 1
        totals[PUBLISHED] += n
        await trio.lowlevel.checkpoint()
    # wait for the outstanding confirms
    rec.grow_confirms()
    if confirms:
        deadline = now_f() + spec["confirm_timeout"]
        while state["resolved"] < sent and now_f() < deadline:
            await trio.sleep(0.01)


async def _consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    records = [DeliverRecord(c, spec["queues"]) for c in spec["indices"]]
    return await _run_role(spec, shared, records, _consumer)


async def _consumer(spec, shared, rec: DeliverRecord, gate: _Gate, totals) -> None:
    sc = spec["scenario"]
    queues = spec["queues"]
    c = rec.consumer
    async with open_connection(rotate(spec["nodes"], c + 1), client_name=f"bench-consumer-{c}") as conn:
        ch = await conn.channel()
        if sc["prefetch"]:
            await ch.basic_qos(sc["prefetch"])
        gate.ready()
        await gate.started.wait()
        await _wait_event(shared.consume)
        auto = sc["ack"] == "auto"
        for qi in spec["assign"][c]:
            await ch.basic_consume(queues[qi], on_message_callback=_on_message(conn, rec, qi, auto, totals),
                                   auto_ack=auto)
        await _wait_event(shared.stop, 0.05)


def _on_message(conn, rec: DeliverRecord, qi: int, auto: bool, totals: list[int]):
    ids, t_del, rq, red, node = rec.ids, rec.t_del, rec.q, rec.red, rec.node
    now_f = time.time
    cache = {"name": None, "index": 0}

    def on_message(ch, msg):
        t_del.append(now_f())
        ids.append(int.from_bytes(msg.body[:8], "big"))
        rq.append(qi)
        r = msg.redelivered
        red.append(r)
        name = conn.node
        if name is not cache["name"]:
            cache["name"], cache["index"] = name, rec.node_index(name)
        node.append(cache["index"])
        totals[DELIVERED] += 1
        if not r:
            totals[FIRST] += 1
        if not auto:
            ch.basic_ack(msg.delivery_tag)

    return on_message
