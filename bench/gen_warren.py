"""The warren-native load: producers and consumers as trio tasks on warren's own async client.

This module owns how a worker process drives warren through `broker.client.aio` (target
`warren-native`): one connection and channel per producer or consumer, publishes pipelined under
the confirm window and, with a rate, on the open-loop schedule of `bench.schedule` (`t_int`
recorded); consumes through the client's delivery callback (no per-message task switch), acks
through the client's coalescing writer (`ack: multiple`: one multiple ack per MULTIPLE_EVERY
deliveries, and whatever is left every 5 ms). Per-message work is: build the body, one
`publish_nowait`, two or three array appends; on the consumer side, decode the 8-byte id, four
appends and one ack. A paced producer publishes what is due inside `conn.corked()` (written at
the block's end) and sleeps, and the client's reader sends a consumer's acks itself when it is
about to wait, both without waking the client's writer task. Short waits end to the microsecond
(`bench.fineloop.fine_trio_timers`, and a tight timer slack), as the AMQP generator's do, so
both generators send on time alike; a paced producer sleeps with `fineloop.trio_sleep`, which
spares the cancel scope of `trio.sleep`.
It also holds the warren-native side of the idle-connection, declare and rpc scenarios
(`run_idle`, `run_declare`, `run_rpc`).
"""

from __future__ import annotations

import contextlib
import math
import time

import trio
import trio.lowlevel

from bench import fineloop
from bench.declaring import Phases
from bench.records import (
    CONF_ACK,
    CONF_NACK,
    CONF_NONE,
    DeliverRecord,
    PublishRecord,
    make_id,
)
from bench.rpc_clients import Holders
from bench.schedule import GRACE, OpenLoop
from bench.shared import CONFIRMED, DELIVERED, FIRST, PUBLISHED, Shared, rotate
from broker.client.aio import open_connection
from broker.client.errors import AMQPConnectionError, AMQPError

BATCH = 200  # publishes between yields to the scheduler
_NOT_CORKED = contextlib.nullcontext()
MULTIPLE_EVERY = 100  # ack: multiple acks this many deliveries at once
NUDGE = 0.05  # seconds: how often producers waiting for room look again (see _nudge)


def declare(addresses: list[str], queues: list[str], durable: bool, delete: bool = False,
            qnodes: list[int] | None = None) -> None:
    """Declare (or delete) the scenario's queues from the runner process; queue i through node
    qnodes[i] (warren's default locator, client-local, puts its leader there)."""
    async def one(k: int, names: list[str]):
        async with open_connection(rotate(addresses, k), client_name="bench-setup") as conn:
            ch = await conn.channel()
            for q in names:
                if delete:
                    try:
                        await ch.queue_delete(q)
                    except AMQPError:  # already gone (deleted with its node, or never made)
                        ch = await conn.channel()
                else:
                    await ch.queue_declare(q, durable=durable)

    async def go():
        by_node: dict[int, list[str]] = {}
        for i, q in enumerate(queues):
            by_node.setdefault(qnodes[i] if qnodes else 0, []).append(q)
        async with trio.open_nursery() as n:
            for k, names in by_node.items():
                n.start_soon(one, k, names)
    trio.run(go)


def run_producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    return trio.run(_producers, spec, shared)


def run_consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    return trio.run(_consumers, spec, shared)


async def _wait_event(ev, poll: float = 0.02) -> None:
    """Wait for a multiprocessing Event, which can only be polled: once per process, never per
    worker task."""
    while not ev.is_set():
        await trio.sleep(poll)


async def _watch(shared: Shared, gate: "_Gate") -> None:
    """Read the runner's consume and stop flags for every worker of this process, and set the
    gate's events. A multiprocessing Event can only be polled; polled by each consumer task, a
    process of 500 consumers woke 10,000 times a second for it (py-spy on `scale-q1000-2k`)."""
    for flag, event, poll in ((shared.consume, gate.consume, 0.02), (shared.stop, gate.stop, 0.05)):
        await _wait_event(flag, poll)
        event.set()


async def _nudge(gate: "_Gate") -> None:
    """Every 50 ms, wake the producers waiting for room in their confirm window, to look again
    at the clock and the runner's stop (a broker that stalls sends no confirm to wake them). One
    timer for the process: a timeout on each wait cost a cancel scope per message in a closed
    loop of hundreds of connections."""
    while True:
        await trio.sleep(NUDGE)
        for room in gate.waiting:
            room.set()


async def _report(shared: Shared, totals: list[int], last: list[int], gate: "_Gate") -> None:
    """Every 0.25 s: add this process's new counts to the shared totals and read the runner's
    stop flag (a multiprocessing Event takes a lock: too dear to read per message)."""
    while True:
        await trio.sleep(0.25)
        deltas = [a - b for a, b in zip(totals, last)]
        last[:] = totals
        shared.add(deltas)
        gate.stopping = shared.stop_publish.is_set()


class _Gate:
    """Workers of one process get ready, then all wait for the runner's start signal together;
    producers that are through wait for one another before they close."""

    def __init__(self, shared: Shared, expected: int):
        self.shared = shared
        self.expected = expected
        self.count = 0
        self.all_ready = trio.Event()
        self.started = trio.Event()
        self.t0 = 0.0
        self.stopping = False  # the runner asked producers to stop (read by _report)
        self.consume = trio.Event()  # the runner's consume and stop flags (set by _watch)
        self.stop = trio.Event()
        self.done = 0  # producers that are through (published and confirmed, or gave up)
        self.waiting: set = set()  # the Events of producers waiting for room (see _nudge)
        self.all_finished = trio.Event()

    def ready(self) -> None:
        self.count += 1
        if self.count >= self.expected:
            self.all_ready.set()

    def finished(self) -> None:
        self.done += 1
        if self.done >= self.expected:
            self.all_finished.set()

    async def run(self) -> None:
        await self.all_ready.wait()
        self.t0 = await trio.to_thread.run_sync(self.shared.wait_start)
        self.started.set()


async def _run_role(spec: dict, shared: Shared, records: list, task) -> list:
    """Run `task` once per record behind one start gate, reporting per-second totals."""
    fineloop.fine_trio_timers()  # a paced producer's next send ends on time, not a millisecond late
    fineloop.tight_timer_slack()
    totals = [0, 0, 0, 0]
    last = [0, 0, 0, 0]
    gate = _Gate(shared, len(records))
    async with trio.open_nursery() as outer:
        outer.start_soon(_report, shared, totals, last, gate)
        outer.start_soon(_watch, shared, gate)
        outer.start_soon(_nudge, gate)
        async with trio.open_nursery() as n:
            n.start_soon(gate.run)
            for rec in records:
                n.start_soon(task, spec, shared, rec, gate, totals)
        shared.add([a - b for a, b in zip(totals, last)])
        outer.cancel_scope.cancel()
    return records


async def _producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    sc = spec["scenario"]
    records = [PublishRecord(p, spec["queues"], sc["message_size"], paced=spec["rate"] > 0)
               for p in spec["indices"]]
    return await _run_role(spec, shared, records, _producer)


def _node_of(spec: dict, key: str, index: int, default: int) -> int:
    table = spec.get(key) or {}
    return table.get(index, table.get(str(index), default))


async def _producer(spec, shared, rec: PublishRecord, gate: _Gate, totals) -> None:
    async with open_connection(rotate(spec["nodes"], _node_of(spec, "pnode", rec.producer, rec.producer)),
                               client_name=f"bench-producer-{rec.producer}") as conn:
        ch = await conn.channel()
        if spec["scenario"]["confirms"]:
            await ch.confirm_delivery()
        gate.ready()
        await gate.started.wait()
        await _publish(spec, gate, conn, ch, rec, gate.t0, totals)
        # close together once all are done, as the AMQP generator does: a connection closed
        # while the process's other producers still publish costs both ends a teardown in the
        # middle of their load (the last half second of `scale-q1000-2k`, where 500 producers
        # of a process finish one by one)
        gate.finished()
        await gate.all_finished.wait()


async def _publish(spec, gate: _Gate, conn, ch, rec: PublishRecord, t0: float, totals: list[int]) -> None:
    sc = spec["scenario"]
    queues = spec["queues"]
    p = rec.producer
    own = (spec.get("pqueues") or {}).get(p) or (spec.get("pqueues") or {}).get(str(p)) or list(range(len(queues)))
    nown = len(own)
    pad = b"\0" * (sc["message_size"] - 8)
    rate = spec["rate"]  # this producer's msgs/s, 0 = unlimited
    pacer = OpenLoop.for_producer(spec["rate_total"], spec["producers"], p, t0) if rate else None
    t_int = rec.t_int
    limit = spec["limits"][p] or math.inf
    t_end = t0 + sc["warmup"] + sc["duration"] if not sc["messages"] else math.inf
    if pacer is not None:  # a paced producer owes the messages intended before the end
        limit = min(limit, pacer.count_before(t_end))
        t_end += GRACE
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
    while not gate.stopping:
        now = now_f()
        if now >= t_end or sent >= limit:
            if pacer is not None and sent < limit:
                spec["errors"].append(f"producer {p}: {limit - sent} scheduled messages never sent: "
                                      f"still held back {GRACE:g} s after the end")
            break
        n = BATCH
        if sent + n > limit:
            n = int(limit - sent)
        if pacer is not None:
            n = min(n, pacer.due(now) - sent)
        if confirms:
            n = min(n, window - (sent - state["resolved"]))
        if n <= 0:
            if pacer is not None and pacer.due(now) <= sent:  # all that is due is out (corked)
                await fineloop.trio_sleep(pacer.wait(sent, now))
            else:
                room = state["room"] = trio.Event()
                gate.waiting.add(room)  # `_nudge` sets it within 50 ms if no confirm does
                try:
                    await room.wait()
                finally:
                    gate.waiting.discard(room)
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
        qi = own[sent % nown]
        with conn.corked() if pacer is not None else _NOT_CORKED:
            try:
                await ch.basic_publish("", queues[qi], make_id(p, sent).to_bytes(8, "big") + pad)
            except AMQPError:
                continue  # closed while waiting for room: the next turn reopens
            t_pub.append(now_f())
            rq.append(qi)
            if pacer is not None:
                t_int.append(pacer.intended(sent))
            sent += 1
            for _ in range(n - 1):
                qi = own[sent % nown]
                ch.publish_nowait(queues[qi], make_id(p, sent).to_bytes(8, "big") + pad)
                t_pub.append(now_f())
                rq.append(qi)
                if pacer is not None:
                    t_int.append(pacer.intended(sent))
                sent += 1
        totals[PUBLISHED] += n
        if pacer is None or pacer.due(now_f()) > sent:  # (else it sleeps next: a checkpoint)
            await trio.lowlevel.checkpoint()
    # wait for the outstanding confirms, woken by each confirm (polling every 10 ms, 500
    # finished producers of a process woke it 50,000 times a second while the others still
    # published: the last half second of `scale-q1000-2k` was its slowest by far)
    rec.grow_confirms()
    if confirms:
        with trio.move_on_after(spec["confirm_timeout"]):
            while state["resolved"] < sent:
                state["room"] = trio.Event()
                await state["room"].wait()


async def _consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    records = [DeliverRecord(c, spec["queues"]) for c in spec["indices"]]
    return await _run_role(spec, shared, records, _consumer)


async def _consumer(spec, shared, rec: DeliverRecord, gate: _Gate, totals) -> None:
    sc = spec["scenario"]
    queues = spec["queues"]
    c = rec.consumer
    async with open_connection(rotate(spec["nodes"], _node_of(spec, "cnode", c, c + 1)),
                               client_name=f"bench-consumer-{c}") as conn:
        ch = await conn.channel()
        if sc["prefetch"]:
            await ch.basic_qos(sc["prefetch"])
        gate.ready()
        await gate.started.wait()
        await gate.consume.wait()
        mode = sc["ack"]
        assign = spec["assign"].get(c, spec["assign"].get(str(c), []))
        last = {"tag": 0, "acked": 0}
        for qi in assign:
            await ch.basic_consume(queues[qi], on_message_callback=_on_message(conn, rec, qi, mode, totals, last),
                                   auto_ack=mode == "auto")
        if mode != "multiple":
            await gate.stop.wait()
            return
        while not gate.stop.is_set():  # the rest of a multiple ack's batch, within 5 ms
            await trio.sleep(0.005)
            if last["tag"] > last["acked"]:
                ch.basic_ack(last["tag"], multiple=True)
                last["acked"] = last["tag"]


def _on_message(conn, rec: DeliverRecord, qi: int, mode: str, totals: list[int], last: dict):
    ids, t_del, rq, red, node = rec.ids, rec.t_del, rec.q, rec.red, rec.node
    now_f = time.time
    cache = {"name": None, "index": 0}
    auto = mode == "auto"
    multiple = mode == "multiple"

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
        if multiple:
            tag = msg.delivery_tag
            last["tag"] = tag
            if tag - last["acked"] >= MULTIPLE_EVERY:
                ch.basic_ack(tag, multiple=True)
                last["acked"] = tag
        elif not auto:
            ch.basic_ack(msg.delivery_tag)

    return on_message


# --- idle connections ---------------------------------------------------------------------------

def run_idle(spec: dict, shared: Shared) -> dict:
    return trio.run(_idle, spec, shared)


async def _idle(spec: dict, shared: Shared) -> dict:
    """Open spec['connections'] connections of warren's client (one channel each) to one node,
    hold them until the runner says stop, close them."""
    address = spec["nodes"][spec["idle_node"]]
    opened: list = []
    errors: list[str] = []
    failed = [0]
    gate = trio.Semaphore(64)
    stop = trio.Event()
    t = time.time()

    async def hold(i: int, task_status=trio.TASK_STATUS_IGNORED):
        await gate.acquire()
        held = False
        try:
            async with open_connection([address], client_name=f"bench-idle-{spec['part']}-{i}") as conn:
                await conn.channel()
                gate.release()
                held = True
                opened.append(conn)
                task_status.started()
                await stop.wait()
        except Exception as exc:  # noqa: BLE001 - record and go on: the count says how many held
            failed[0] += 1
            if len(errors) < 20:
                errors.append(f"idle connection {i}: {exc!r}")
        finally:
            if not held:
                gate.release()
                task_status.started()

    async with trio.open_nursery() as n:
        for i in range(spec["connections"]):
            if i % 64 == 63:
                await n.start(hold, i)  # now and then, let the connections catch up
            else:
                n.start_soon(hold, i)
        while len(opened) + failed[0] < spec["connections"] and time.time() - t < 600:
            await trio.sleep(0.05)
        opened_s = time.time() - t
        with shared.ready.get_lock():
            shared.ready.value += 1
        await _wait_event(shared.stop, 0.1)
        alive = len(opened)
        stop.set()
    return {"opened": len(opened), "alive_at_end": alive, "open_s": round(opened_s, 2), "errors": errors}


# --- declaring and deleting queues ---------------------------------------------------------------

def run_declare(spec: dict, shared: Shared) -> dict:
    return trio.run(_declare, spec, shared)


async def _declare(spec: dict, shared: Shared) -> dict:
    """A declare scenario: in this one process, one task per node, each with its own connection
    (warren's client, no reconnecting) and channel to that node, declaring its share
    spec['shares'][k] one queue.declare at a time (the reply before the next), all starting at
    the runner's start time; once every task has declared its share, each deletes its queues the
    same way. The book-keeping is `bench.declaring.Phases`."""
    shares = spec["shares"]
    ph = Phases(len(shares), trio.Event)

    async def connection(k: int, names: list[str]) -> None:
        address = spec["nodes"][k]
        try:
            async with open_connection([address], client_name=f"bench-declare-{k}", reconnect=False) as conn:
                ch = await conn.channel()
                ph.arrived(k)
                await ph.calls(k, names, ch, conn.channel, trio.sleep, lambda exc: not isinstance(
                    exc, AMQPError) or isinstance(exc, AMQPConnectionError))
        except Exception as exc:  # noqa: BLE001 - the connection's queues count as not done; the others go on
            ph.gone(k, f"connection {k} to {address}: {exc!r}")
        else:
            ph.gone(k)

    async def gate() -> None:
        await ph.all_connected.wait()
        ph.t0 = await trio.to_thread.run_sync(shared.wait_start)
        ph.begin["declare"].set()

    async def report() -> None:
        while True:
            await trio.sleep(0.25)
            ph.progress(shared)

    async with trio.open_nursery() as outer:
        outer.start_soon(report)
        async with trio.open_nursery() as n:
            n.start_soon(gate)
            for k, names in enumerate(shares):
                n.start_soon(connection, k, names)
        ph.progress(shared)
        outer.cancel_scope.cancel()
    return ph.result()


# --- RPC clients: each holds an exclusive, server-named queue ----------------------------------------

def run_rpc(spec: dict, shared: Shared) -> dict:
    return trio.run(_rpc, spec, shared)


async def _rpc(spec: dict, shared: Shared) -> dict:
    """An rpc scenario's share in this process: spec['clients'] clients from number
    spec['first'] on, each its own connection of warren's client (no reconnecting) to node
    (first + j) % nodes, a channel and an exclusive queue the broker names, at most
    spec['at_once'] of them between connecting and their declare-ok at a time, all starting at
    the runner's start time. Held until the runner says stop, then every connection is closed.
    The book-keeping is `bench.rpc_clients.Holders`."""
    book = Holders(spec)
    gate = trio.Semaphore(spec["at_once"])
    stop = trio.Event()
    now = time.time

    async def client(j: int) -> None:
        await gate.acquire()
        waiting = True
        try:
            t = now()
            async with open_connection([book.address(j)], client_name=book.client_name(j),
                                       reconnect=False) as conn:
                ch = await conn.channel()
                ok = await ch.queue_declare("", exclusive=True)
                book.held(j, ok.queue, t, now())
                gate.release()
                waiting = False
                await stop.wait()
        except Exception as exc:  # noqa: BLE001 - the client counts as failed; the others go on
            book.fail(j, exc)
        finally:
            if waiting:
                gate.release()

    async def report() -> None:
        while True:
            await trio.sleep(0.25)
            book.progress(shared)

    t0 = await trio.to_thread.run_sync(shared.wait_start)
    if t0 > now():
        await trio.sleep(t0 - now())
    async with trio.open_nursery() as outer:
        outer.start_soon(report)
        async with trio.open_nursery() as n:
            for j in range(book.n):
                n.start_soon(client, j)
            while not book.done and not shared.stop.is_set():
                await trio.sleep(0.02)
            if book.done:
                book.announce(shared)
            await _wait_event(shared.stop, 0.02)
            book.t_stop = now()
            stop.set()
        book.t_closed = now()
        book.progress(shared)
        outer.cancel_scope.cancel()
    return book.result()
