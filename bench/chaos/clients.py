"""Publishers and consumers that record a checker history while they run (trio, warren's
async client), used by the chaos driver (bench/chaos/real.py) and by the process tests.

This module owns how a chaos client behaves, which is how a user's client behaves:

- A `Publisher` connects through a list of nodes (its own first) and reconnects, publishes
  message ids (publisher index << 40 | number) at a fixed rate with confirms and at most
  `window` unanswered, and publishes only while connected (from the moment the client is
  connected again, as most applications do: the client holds what is published while it re-opens
  its channels). A `careful` publisher waits until the client says it has recovered its channels
  (`on_reconnect`), which keeps the client's recovery out of a test of the broker. With
  `priorities` N (a priority queue's workload) each message carries a priority 0..N drawn from
  its number (`priority_of_number`), recorded with it. It records a
  `Publish` per message, its outcome from the confirm (a nack from the broker, or the client's own "connection lost"),
  and a `Disconnect` whenever its connection breaks or the broker closes its channel (then it
  opens a new channel: publishes of the closed one get no answer, and that is not "stuck").
- A `Consumer` connects the same way, consumes with manual acks (one ack per delivery) and a
  prefetch, records a `Delivery` per message and a `Subscription` per span of being subscribed;
  when the broker cancels it (or the client cannot re-create it after reconnecting) it
  subscribes again, as a robust application does. With `retries` it is the worker of a retry
  loop: a message that has died in its queue (rejected: its `x-death`) fewer times than that is
  rejected without requeue, for the queue's dead-letter exchange to bring it back later; only the
  delivery it acknowledges is recorded (`rejections` keeps the others, with their flag).

The hot path appends one record per message and logs nothing.
"""

from __future__ import annotations

import time

import trio

from broker.client.aio import open_connection
from broker.client.errors import AMQPError

from .checker import Delivery, Disconnect, History, Publish, Subscription

ID_SHIFT = 40


def priority_of_number(num: int, priorities: int) -> int:
    """The priority a publisher gives its message number `num` (0..priorities, well mixed)."""
    return (num * 2654435761 >> 13) % (priorities + 1)


def rotate(nodes: list[str], first: str) -> list[str]:
    """The node list starting at `first` (kept in order after it)."""
    if first not in nodes:
        return list(nodes)
    k = nodes.index(first)
    return nodes[k:] + nodes[:k]


def rejected_here(properties: dict | None, queue: str) -> int:
    """How many times a message was rejected from `queue` (its x-death header's count)."""
    headers = (properties or {}).get("headers") or {}
    for d in headers.get("x-death") or ():
        if isinstance(d, dict) and d.get("queue") == queue and d.get("reason") == "rejected":
            return int(d.get("count", 0))
    return 0


class Publisher:
    def __init__(self, history: History, index: int, addresses: list[str], queue: str, *,
                 rate: float, window: int, size: int = 256, careful: bool = False,
                 user: str = "guest", password: str = "guest", clock=time.time, network=None,
                 tick: float = 0.005, priorities: int = 0):
        self.h = history
        self.priorities = priorities
        self.tick = tick  # how often it publishes what is due (the simulation takes bigger steps)
        self.index = index
        self.addresses = addresses
        self.queue = queue
        self.rate = rate
        self.window = window
        self.pad = b"\0" * max(0, size - 8)
        self.user, self.password = user, password
        self.clock = clock
        self.network = network  # None: real TCP; a SimNetwork host in the simulation
        self.careful = careful
        self.recovering = False  # disconnected, and the client has not said it recovered yet
        self.pubs: list[Publish] = []  # by number (the low bits of the id)
        self.resolved = 0
        self.stop = trio.Event()  # stop publishing (the connection stays open for late confirms)
        self.release = trio.Event()  # close the connection
        self.stopped = trio.Event()
        self.conn = None
        self.ch = None
        self.errors: list[str] = []
        self._room = trio.Event()

    @property
    def published(self) -> int:
        return len(self.pubs)

    @property
    def unanswered(self) -> int:
        return len(self.pubs) - self.resolved

    def _confirmer(self, base: int):
        """Confirms of a channel whose sequence 1 is our message number `base`."""
        pubs, clock = self.pubs, self.clock

        def on_confirm(first: int, last: int, ok: bool, reason: str) -> None:
            now = clock()
            newly = 0
            for s in range(first - 1 + base, min(last + base, len(pubs))):
                p = pubs[s]
                if p.outcome is None:
                    p.outcome = "ack" if ok else "nack"
                    p.t_conf = now
                    if not ok:
                        p.reason = reason
                    newly += 1
            self.resolved += newly
            self._room.set()
        return on_confirm

    def _on_disconnect(self, error) -> None:
        self.recovering = True
        self.h.disconnects.append(Disconnect(self.clock(), "publisher", self.index,
                                             self.conn.node if self.conn else None, str(error)[:200]))

    def _on_reconnect(self, node) -> None:
        self.recovering = False

    async def _open_channel(self):
        ch = await self.conn.channel()
        await ch.confirm_delivery()
        ch.on_confirm = self._confirmer(len(self.pubs))
        return ch

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with open_connection(self.addresses, user=self.user, password=self.password, network=self.network,
                                       client_name=f"chaos-publisher-{self.index}",
                                       connect_attempts=20, on_reconnect=self._on_reconnect) as conn:
                self.conn = conn
                conn.on_disconnect = self._on_disconnect
                self.ch = await self._open_channel()
                task_status.started()
                await self._loop()
                await self.release.wait()
        finally:
            self.stopped.set()

    async def _loop(self) -> None:
        conn = self.conn
        base_id = self.index << ID_SHIFT
        pubs, clock, queue, pad = self.pubs, self.clock, self.queue, self.pad
        t0 = clock()
        while not self.stop.is_set():
            now = clock()
            due = int((now - t0) * self.rate) - len(pubs)
            room = self.window - (len(pubs) - self.resolved)
            n = min(due, room, 500)
            if n <= 0:
                self._room = trio.Event()
                with trio.move_on_after(self.tick if room > 0 else 0.05):
                    await self._room.wait()
                continue
            if not conn.connected.is_set() or (self.careful and self.recovering):
                with trio.move_on_after(0.05):
                    await conn.connected.wait()
                await trio.sleep(self.tick)
                continue
            ch = self.ch
            if not ch.is_open:
                self.h.disconnects.append(Disconnect(now, "publisher", self.index, conn.node,
                                                     f"channel closed: {ch.close_reason}"[:200]))
                try:
                    self.ch = await self._open_channel()
                except (AMQPError, trio.TooSlowError) as exc:
                    self.errors.append(f"reopen: {exc}")
                    await trio.sleep(0.2)
                continue
            node = conn.node
            try:
                if self.priorities:
                    self._publish_prioritised(ch, n, base_id, node)
                else:
                    for _ in range(n):
                        num = len(pubs)
                        ch.publish_nowait(queue, (base_id | num).to_bytes(8, "big") + pad)
                        pubs.append(Publish(base_id | num, self.index, node, clock(), queue=queue))
            except AMQPError as exc:
                self.errors.append(f"publish: {exc}")
            await trio.sleep(self.tick)

    def _publish_prioritised(self, ch, n: int, base_id: int, node) -> None:
        pubs, clock, queue, pad, top = self.pubs, self.clock, self.queue, self.pad, self.priorities
        for _ in range(n):
            num = len(pubs)
            p = priority_of_number(num, top)
            ch.publish_nowait(queue, (base_id | num).to_bytes(8, "big") + pad, {"priority": p})
            pubs.append(Publish(base_id | num, self.index, node, clock(), queue=queue, priority=p))

    def records(self) -> list[Publish]:
        return self.pubs


class Consumer:
    def __init__(self, history: History, index: int, addresses: list[str], queue: str, *,
                 prefetch: int, user: str = "guest", password: str = "guest", clock=time.time,
                 network=None, retries: int = 0):
        self.h = history
        self.retries = retries
        self.rejections: list[tuple[int, int, bool]] = []  # (id, deaths so far, redelivered)
        self.index = index
        self.addresses = addresses
        self.queue = queue
        self.prefetch = prefetch
        self.user, self.password = user, password
        self.clock = clock
        self.network = network  # None: real TCP; a SimNetwork host in the simulation
        self.count = 0
        self.last_delivery = 0.0
        self.ids: set[int] = set()
        self.stop = trio.Event()
        self.conn = None
        self.sub: Subscription | None = None
        self.errors: list[str] = []
        self._resubscribe = trio.Event()

    def _on_disconnect(self, error) -> None:
        self.h.disconnects.append(Disconnect(self.clock(), "consumer", self.index,
                                             self.conn.node if self.conn else None, str(error)[:200]))

    def _callback(self):
        deliveries, clock, ids = self.h.deliveries, self.clock, self.ids
        index, queue = self.index, self.queue

        def on_message(ch, msg) -> None:
            now = clock()
            mid = int.from_bytes(msg.body[:8], "big")
            if self.retries:
                died = rejected_here(msg.properties, queue)
                if died < self.retries:
                    self.rejections.append((mid, died, msg.redelivered))
                    try:
                        ch.basic_reject(msg.delivery_tag, requeue=False)
                    except AMQPError:
                        pass
                    return
            deliveries.append(Delivery(mid, index, self.conn.node, now, msg.redelivered, queue))
            ids.add(mid)
            self.count += 1
            self.last_delivery = now
            try:
                ch.basic_ack(msg.delivery_tag)
            except AMQPError:
                pass  # the channel closed under us: the broker requeues it
        return on_message

    def _on_cancel(self, consumer, reason: str) -> None:
        if self.sub is not None and self.sub.t_end is None:
            self.sub.t_end = self.clock()
        self.sub = None
        if not self.stop.is_set():
            self.errors.append(f"cancelled: {reason}"[:200])
            self._resubscribe.set()

    async def _subscribe(self) -> None:
        ch = await self.conn.channel()
        if self.prefetch:
            await ch.basic_qos(self.prefetch)
        c = await ch.basic_consume(self.queue, on_message_callback=self._callback())
        c.on_cancel = self._on_cancel
        self.channel, self.consumer = ch, c
        self.sub = Subscription(self.index, self.queue, self.clock())
        self.h.subscriptions.append(self.sub)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_connection(self.addresses, user=self.user, password=self.password, network=self.network,
                                   client_name=f"chaos-consumer-{self.index}",
                                   connect_attempts=20) as conn:
            self.conn = conn
            conn.on_disconnect = self._on_disconnect
            await self._subscribe()
            task_status.started()
            while not self.stop.is_set():
                with trio.move_on_after(0.2):
                    await self._resubscribe.wait()
                if self._resubscribe.is_set() and not self.stop.is_set():
                    self._resubscribe = trio.Event()
                    await trio.sleep(0.3)
                    try:
                        with trio.fail_after(10):
                            await self._subscribe()
                    except (AMQPError, trio.TooSlowError) as exc:
                        self.errors.append(f"resubscribe: {exc}"[:200])
                        self._resubscribe.set()
            if self.sub is not None and self.sub.t_end is None:
                self.sub.t_end = self.clock()
            with trio.move_on_after(3):
                try:
                    await self.channel.basic_cancel(self.consumer.tag)
                except AMQPError:
                    pass
