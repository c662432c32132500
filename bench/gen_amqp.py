"""The AMQP 0-9-1 load: producers and consumers on the lean client of `bench.amqp` (asyncio).

This module owns how a worker process drives an AMQP broker (RabbitMQ, warren's AMQP port, the
null broker of `bench.nullbroker`): one connection per producer or consumer, one channel per
producer and one per queue a consumer reads. Per message the producer does: one bytes concat
(pre-marshalled frames + the 8-byte id), two or three array appends; a burst of messages is one
socket write. The consumer does: an int from the body's first 8 bytes, five array appends, and
an ack frame into the read's single write (`ack: manual`), or one `multiple` ack per read
(`ack: multiple`). Nothing is logged per message while the load runs (see `bench.records`).

Producers with a rate follow the open-loop schedule of `bench.schedule`: message i goes at its
intended time and `t_int` records that time, so latency is measured from it; the loop's timers
wake to the microsecond (`bench.fineloop`), not epoll's millisecond. A connection that
breaks is re-opened on the next node after 0.2 s (its unconfirmed publishes stay `conf: null`);
a channel the broker closes is re-opened after 0.5 s. The AMQP side of the idle-connection,
declare and rpc scenarios (`run_idle`, `run_declare`, `run_rpc`) is here too.
"""

from __future__ import annotations

import asyncio
import math
import time

from bench import fineloop
from bench.amqp import AMQPError, Connection, parse_address
from bench.declaring import Phases
from bench.records import CONF_ACK, CONF_NACK, CONF_NONE, ID_SHIFT, DeliverRecord, PublishRecord
from bench.rpc_clients import Holders
from bench.schedule import GRACE, OpenLoop
from bench.shared import CONFIRMED, DELIVERED, FIRST, PUBLISHED, Shared

BATCH = 250            # publishes per write in a closed loop
CONNECT_AT_ONCE = 64   # connections being opened at the same time


async def _open(address: str, name: str, heartbeat: int = 0) -> Connection:
    host, port = parse_address(address)
    return await Connection.connect(host, port, name=name, heartbeat=heartbeat)


def declare(addresses: list[str], queues: list[str], durable: bool, delete: bool = False,
            qnodes: list[int] | None = None) -> None:
    """Declare (or delete) the scenario's queues from the runner process; queue i through node
    qnodes[i] (its leader there, for brokers that place a queue on the node it is declared on)."""
    async def one(k: int, idx: list[int]) -> None:
        conn = await _open(addresses[k], "bench-setup")
        try:
            ch = await conn.channel()
            for i in idx:
                if delete:
                    try:
                        await ch.queue_delete(queues[i])
                    except AMQPError:
                        ch = await conn.channel()
                else:
                    await ch.queue_declare(queues[i], durable=durable)
        finally:
            await conn.close()

    async def go() -> None:
        by_node: dict[int, list[int]] = {}
        for i in range(len(queues)):
            by_node.setdefault(qnodes[i] if qnodes else 0, []).append(i)
        await asyncio.gather(*(one(k, idx) for k, idx in by_node.items()))

    asyncio.run(go())


class _Group:
    """What the producers or consumers of one worker process share: totals, the start and stop
    signals (polled, never waited on per message)."""

    def __init__(self, shared: Shared):
        self.shared = shared
        self.totals = [0, 0, 0, 0]
        self.last = [0, 0, 0, 0]
        self.stopping = False     # producers: stop publishing (the runner's interrupt)
        self.consume = False
        self.stop = False

    def flush(self) -> None:
        deltas = [a - b for a, b in zip(self.totals, self.last)]
        self.last[:] = self.totals
        self.shared.add(deltas)

    async def report(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.flush()
            self.stopping = self.shared.stop_publish.is_set()
            self.consume = self.shared.consume.is_set()
            self.stop = self.shared.stop.is_set()

    async def wait_start(self) -> float:
        return await asyncio.get_running_loop().run_in_executor(None, self.shared.wait_start)


async def _connect_all(members, spec) -> None:
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)

    async def one(m):
        async with gate:
            await m.connect()

    await asyncio.gather(*(one(m) for m in members))


# --- producers --------------------------------------------------------------------------------

class _Producer:
    def __init__(self, spec: dict, group: _Group, p: int):
        sc = spec["scenario"]
        self.spec, self.group, self.p = spec, group, p
        self.loop = asyncio.get_running_loop()
        self.size = sc["message_size"]
        self.paced = spec["rate"] > 0
        self.rec = PublishRecord(p, spec["queues"], self.size, paced=self.paced)
        self.own = spec["pqueues"][p]
        self.nodes = spec["nodes"]
        self.node_k = spec["pnode"][p]
        self.confirms = sc["confirms"]
        self.window = sc["confirm_window"]
        self.limit = spec["limits"][p] or math.inf
        self.base = p << ID_SHIFT
        self.sent = 0
        self.resolved = 0
        self.low = 0          # lowest sequence that may still be unresolved
        self.tag_base = 0     # our sequence of this channel's delivery tag 1, minus 1
        self.conn: Connection | None = None
        self.ch = None
        self.templates: list = []
        self.pacer: OpenLoop | None = None
        self.t_end = math.inf
        self.t_stop = math.inf  # past this a paced producer gives up what it still owes
        self.started = False
        self.done = asyncio.Event()
        self.publishing_done = False
        self._soon = False
        self._timer = None
        self._repairing = False
        self._blocked = False

    async def connect(self) -> None:
        address = self.nodes[self.node_k % len(self.nodes)]
        self.conn = await _open(address, f"bench-producer-{self.p}")
        self.conn.on_writable = self.kick
        self.conn.on_lost = self._lost
        await self._channel()

    async def _channel(self) -> None:
        ch = await self.conn.channel()
        if self.confirms:
            await ch.confirm_select()
        ch.on_confirm = self._on_confirm
        ch.on_close = self._closed
        queues = self.spec["queues"]
        self.templates = [ch.publish_template(queues[q], self.size) for q in self.own]
        self.tag_base = self.sent
        self.ch = ch

    def begin(self, t0: float) -> None:
        sc = self.spec["scenario"]
        if not sc["messages"]:
            self.t_end = t0 + sc["warmup"] + sc["duration"]
        self.t_stop = self.t_end
        if self.paced:
            self.pacer = OpenLoop.for_producer(self.spec["rate_total"], self.spec["producers"], self.p, t0)
            self.limit = min(self.limit, self.pacer.count_before(self.t_end))
            self.t_stop = self.t_end + GRACE
        self.started = True
        self._timer = self.loop.call_later(max(0.0, t0 - time.time()), self._pump)

    def kick(self) -> None:
        if not self._soon and self.started and not self.publishing_done:
            self._soon = True
            self.loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.publishing_done:
            return
        now = time.time()
        sent = self.sent
        if now >= self.t_stop or sent >= self.limit or self.group.stopping:
            if self.pacer is not None and sent < self.limit and not self.group.stopping:
                self.spec["errors"].append(f"producer {self.p}: {self.limit - sent} scheduled messages never "
                                           f"sent: still held back {GRACE:g} s after the end")
            self._end_publishing()
            return
        ch = self.ch
        if ch is None or not ch.is_open or self.conn.is_closed:
            return  # a repair is under way; it kicks when done
        if not self.conn.writable.is_set():
            return  # resume_writing kicks
        n = BATCH
        if self.limit - sent < n:
            n = int(self.limit - sent)
        pacer = self.pacer
        if pacer is not None:
            n = min(n, pacer.due(now) - sent)
        if self.confirms:
            n = min(n, self.window - (sent - self.resolved))
        if n <= 0:
            if pacer is not None and pacer.due(now) <= sent:
                self._timer = self.loop.call_later(pacer.wait(sent, now), self._pump)
            elif not self.confirms:
                self._timer = self.loop.call_later(0.001, self._pump)
            else:
                self._blocked = True  # the confirm window is full: the next confirm kicks
            return
        templates, own, base = self.templates, self.own, self.base
        nown = len(own)
        parts = []
        qs = self.rec.q
        for s in range(sent, sent + n):
            k = s % nown
            head, tail = templates[k]
            parts.append(head + (base | s).to_bytes(8, "big") + tail)
            qs.append(own[k])
        t = time.time()
        self.conn.send_many(parts)
        rec = self.rec
        rec.t_pub.extend([t] * n)
        if pacer is not None:
            start, iv = pacer.start, pacer.interval
            rec.t_int.extend([start + s * iv for s in range(sent, sent + n)])
        self.sent = sent + n
        self.group.totals[PUBLISHED] += n
        if pacer is None:
            self.kick()
        else:
            self._timer = self.loop.call_later(pacer.wait(self.sent, time.time()), self._pump)

    def _end_publishing(self) -> None:
        self.publishing_done = True
        self.rec.grow_confirms()
        if not self.confirms or self.resolved >= self.sent:
            self.done.set()
            return
        deadline = self.spec["confirm_timeout"]
        self.loop.call_later(deadline, self.done.set)

    def _on_confirm(self, tag: int, multiple: bool, ok: bool) -> None:
        seq = tag - 1 + self.tag_base
        first = self.low if multiple else seq
        newly = self.rec.confirm(first, seq, CONF_ACK if ok else CONF_NACK, time.time())
        self.resolved += newly
        if ok:
            self.group.totals[CONFIRMED] += newly
        if multiple and seq + 1 > self.low:
            self.low = seq + 1
        if self.publishing_done:
            if self.resolved >= self.sent:
                self.done.set()
        elif self._blocked or self.pacer is None:
            self._blocked = False
            self.kick()

    def _give_up_unconfirmed(self) -> None:
        """Publishes of a broken channel that got no confirm will never get one."""
        if self.sent > self.low:
            self.resolved += self.rec.confirm(self.low, self.sent - 1, CONF_NONE, time.time())
            self.low = self.sent
        if self.publishing_done and self.resolved >= self.sent:
            self.done.set()

    def _closed(self, reason: str) -> None:
        self._give_up_unconfirmed()
        if not self.conn.is_closed and not self._repairing:
            self.spec["errors"].append(f"producer {self.p}: channel closed: {reason}")
            self._repairing = True
            self.loop.create_task(self._reopen_channel())

    def _lost(self, reason: str) -> None:
        self._give_up_unconfirmed()
        if self.publishing_done or self._repairing:
            return
        self.spec["errors"].append(f"producer {self.p}: {reason}")
        self._repairing = True
        self.loop.create_task(self._reconnect())

    async def _reopen_channel(self) -> None:
        try:
            await asyncio.sleep(0.5)
            await self._channel()
        except (AMQPError, OSError) as exc:
            self.spec["errors"].append(f"producer {self.p}: {exc}")
        finally:
            self._repairing = False
        self.kick()

    async def _reconnect(self) -> None:
        while not self.publishing_done:
            await asyncio.sleep(0.2)
            self.node_k += 1
            try:
                await self.connect()
                break
            except (AMQPError, OSError, asyncio.TimeoutError) as exc:
                self.spec["errors"].append(f"producer {self.p}: reconnect: {exc}")
        self._repairing = False
        self.kick()


async def _producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    group = _Group(shared)
    members = [_Producer(spec, group, p) for p in spec["indices"]]
    await _connect_all(members, spec)
    reporter = asyncio.create_task(group.report())
    t0 = await group.wait_start()
    for m in members:
        m.begin(t0)
    await asyncio.gather(*(m.done.wait() for m in members))
    reporter.cancel()
    group.flush()
    await asyncio.gather(*(m.conn.close() for m in members if m.conn is not None), return_exceptions=True)
    return [m.rec for m in members]


def run_producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    return fineloop.run(_producers(spec, shared))


# --- consumers --------------------------------------------------------------------------------

class _Consumer:
    def __init__(self, spec: dict, group: _Group, c: int):
        self.spec, self.group, self.c = spec, group, c
        self.loop = asyncio.get_running_loop()
        sc = spec["scenario"]
        self.rec = DeliverRecord(c, spec["queues"])
        self.mode = sc["ack"]
        self.prefetch = sc["prefetch"]
        self.own = spec["assign"].get(c, spec["assign"].get(str(c), []))
        self.nodes = spec["nodes"]
        self.node_k = spec["cnode"][c]
        self.conn: Connection | None = None
        self.consuming = False
        self.closing = False

    async def connect(self) -> None:
        address = self.nodes[self.node_k % len(self.nodes)]
        self.conn = await _open(address, f"bench-consumer-{self.c}")
        self.conn.on_lost = self._lost
        self.node_index = self.rec.node_index(self.spec["node_names"].get(address, address))
        self.chans = []
        for qi in self.own:
            ch = await self.conn.channel()
            if self.prefetch:
                await ch.basic_qos(self.prefetch)
            ch.on_delivery = self._on_delivery(ch, qi)
            self.chans.append((ch, qi))

    async def start(self) -> None:
        self.consuming = True
        no_ack = self.mode == "auto"
        queues = self.spec["queues"]
        for ch, qi in self.chans:
            await ch.basic_consume(queues[qi], no_ack=no_ack)

    def _on_delivery(self, ch, qi: int):
        rec, totals = self.rec, self.group.totals
        ids, t_del, rq, red, node = rec.ids, rec.t_del, rec.q, rec.red, rec.node
        ni = self.node_index
        now_f = time.time
        mode = self.mode
        ack, ack_later = ch.ack, ch.ack_later

        def on_delivery(tag: int, redelivered: bool, body) -> None:
            t_del.append(now_f())
            ids.append(int.from_bytes(body[:8], "big"))
            rq.append(qi)
            red.append(redelivered)
            node.append(ni)
            totals[DELIVERED] += 1
            if not redelivered:
                totals[FIRST] += 1
            if mode == "manual":
                ack(tag)
            elif mode == "multiple":
                ack_later(tag)

        return on_delivery

    def _lost(self, reason: str) -> None:
        if self.closing:
            return
        self.spec["errors"].append(f"consumer {self.c}: {reason}")
        self.loop.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self.closing:
            await asyncio.sleep(0.2)
            self.node_k += 1
            try:
                await self.connect()
                if self.consuming:
                    await self.start()
                return
            except (AMQPError, OSError, asyncio.TimeoutError) as exc:
                self.spec["errors"].append(f"consumer {self.c}: reconnect: {exc}")


async def _consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    group = _Group(shared)
    members = [_Consumer(spec, group, c) for c in spec["indices"]]
    await _connect_all(members, spec)
    reporter = asyncio.create_task(group.report())
    await group.wait_start()
    while not shared.consume.is_set():
        await asyncio.sleep(0.02)
    await asyncio.gather(*(m.start() for m in members))
    while not shared.stop.is_set():
        await asyncio.sleep(0.05)
    reporter.cancel()
    group.flush()
    for m in members:
        m.closing = True
    await asyncio.gather(*(m.conn.close() for m in members if m.conn is not None), return_exceptions=True)
    return [m.rec for m in members]


def run_consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    return fineloop.run(_consumers(spec, shared))


# --- idle connections ---------------------------------------------------------------------------

async def _close_all(conns: list[Connection], at_once: int = 256) -> None:
    """Close every connection, at most `at_once` closes waiting for their close-ok at a time
    (each given 2 s before its socket is dropped)."""
    gate = asyncio.Semaphore(at_once)

    async def close(c: Connection) -> None:
        async with gate:
            await c.close(2.0)

    await asyncio.gather(*(close(c) for c in conns), return_exceptions=True)


async def _idle(spec: dict, shared: Shared) -> dict:
    """Open spec['connections'] connections (each with one channel) to spec['idle_node'], hold
    them until the runner says stop, close them. Returns what it managed."""
    count = spec["connections"]
    address = spec["nodes"][spec["idle_node"]]
    conns: list[Connection] = []
    errors: list[str] = []
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)
    t = time.time()

    async def one(i: int) -> None:
        async with gate:
            try:
                conn = await _open(address, f"bench-idle-{spec['part']}-{i}", heartbeat=spec.get("heartbeat", 0))
                await conn.channel()
                conns.append(conn)
            except (AMQPError, OSError, asyncio.TimeoutError) as exc:
                if len(errors) < 20:
                    errors.append(f"idle connection {i}: {exc!r}")

    await asyncio.gather(*(one(i) for i in range(count)))
    opened_s = time.time() - t
    with shared.ready.get_lock():
        shared.ready.value += 1
    while not shared.stop.is_set():
        await asyncio.sleep(0.1)
    alive = sum(1 for c in conns if not c.is_closed)
    await _close_all(conns)
    return {"opened": len(conns), "alive_at_end": alive, "open_s": round(opened_s, 2), "errors": errors}


def run_idle(spec: dict, shared: Shared) -> dict:
    return asyncio.run(_idle(spec, shared))


# --- declaring and deleting queues ---------------------------------------------------------------

async def _declare(spec: dict, shared: Shared) -> dict:
    """A declare scenario: in this one process, one asyncio task per node, each with its own
    connection and channel to that node, declaring its share spec['shares'][k] one queue.declare
    at a time (the reply before the next), all starting at the runner's start time; once every
    task has declared its share, each deletes its queues the same way. The book-keeping is
    `bench.declaring.Phases`."""
    shares = spec["shares"]
    ph = Phases(len(shares), asyncio.Event)
    loop = asyncio.get_running_loop()

    async def connection(k: int, names: list[str]) -> None:
        address = spec["nodes"][k]
        conn = None
        try:
            conn = await _open(address, f"bench-declare-{k}")
            ch = await conn.channel()
            ph.arrived(k)
            await ph.calls(k, names, ch, conn.channel, asyncio.sleep,
                           lambda exc: not isinstance(exc, AMQPError) or conn.is_closed)
        except (AMQPError, OSError, asyncio.TimeoutError) as exc:
            ph.gone(k, f"connection {k} to {address}: {exc!r}")
        else:
            ph.gone(k)
        finally:
            if conn is not None:
                await conn.close()

    async def gate() -> None:
        await ph.all_connected.wait()
        ph.t0 = await loop.run_in_executor(None, shared.wait_start)
        ph.begin["declare"].set()

    async def report() -> None:
        while True:
            await asyncio.sleep(0.25)
            ph.progress(shared)

    reporter = asyncio.create_task(report())
    await asyncio.gather(gate(), *(connection(k, names) for k, names in enumerate(shares)))
    reporter.cancel()
    ph.progress(shared)
    return ph.result()


def run_declare(spec: dict, shared: Shared) -> dict:
    return asyncio.run(_declare(spec, shared))


# --- RPC clients: each holds an exclusive, server-named queue ----------------------------------------

async def _rpc(spec: dict, shared: Shared) -> dict:
    """An rpc scenario's share in this process: spec['clients'] clients from number
    spec['first'] on, each its own connection to node (first + j) % nodes, a channel and an
    exclusive queue the broker names, at most spec['at_once'] of them between connecting and
    their declare-ok at a time, all starting at the runner's start time. Held until the runner
    says stop, then every connection is closed. The book-keeping is `bench.rpc_clients.Holders`."""
    book = Holders(spec)
    gate = asyncio.Semaphore(spec["at_once"])
    conns: list[Connection] = []
    loop = asyncio.get_running_loop()
    now = time.time

    async def client(j: int) -> None:
        async with gate:
            t = now()
            conn = None
            try:
                conn = await _open(book.address(j), book.client_name(j))
                ch = await conn.channel()
                ok = await ch.queue_declare("", exclusive=True)
                conns.append(conn)
                book.held(j, ok.queue, t, now())
            except (AMQPError, OSError, asyncio.TimeoutError) as exc:
                book.fail(j, exc)
                if conn is not None:
                    conn.abort()

    async def report() -> None:
        while True:
            await asyncio.sleep(0.25)
            book.progress(shared)

    t0 = await loop.run_in_executor(None, shared.wait_start)
    if t0 > now():
        await asyncio.sleep(t0 - now())
    reporter = asyncio.create_task(report())
    clients = asyncio.gather(*(client(j) for j in range(book.n)))
    while not clients.done() and not shared.stop.is_set():
        await asyncio.sleep(0.02)
    if clients.done():
        book.announce(shared)
    while not shared.stop.is_set():
        await asyncio.sleep(0.02)
    book.t_stop = now()
    clients.cancel()  # the runner gave up waiting: the clients still connecting stop
    await asyncio.gather(clients, return_exceptions=True)
    await _close_all(conns)
    book.t_closed = now()
    reporter.cancel()
    book.progress(shared)
    return book.result()


def run_rpc(spec: dict, shared: Shared) -> dict:
    return asyncio.run(_rpc(spec, shared))
