"""The RabbitMQ load: the same producers and consumers over AMQP 0-9-1 with pika.

This module owns how a worker process drives RabbitMQ. pika (pure Python, no C parts, the client
the RabbitMQ tutorials use) is run in its asynchronous `SelectConnection` style: one I/O loop per
worker process, one connection and channel per producer or consumer, publisher confirms
pipelined under the window (a blocking pika channel would wait for each confirm in turn, which
would measure the client, not the broker). Consumers ack every message (multiple=False), as
PerfTest does by default. When a node dies the connection moves to the next node; publishes
without a confirm then stay `conf: null`.
"""

from __future__ import annotations

import logging
import math
import time

import pika
from pika.adapters.select_connection import IOLoop

from bench.records import (
    CONF_ACK,
    CONF_NACK,
    CONF_NONE,
    DeliverRecord,
    PublishRecord,
    make_id,
)
from bench.worker import CONFIRMED, DELIVERED, FIRST, PUBLISHED, Shared, rotate

BATCH = 200
logging.getLogger("pika").setLevel(logging.CRITICAL)


def _params(address: str, name: str) -> pika.ConnectionParameters:
    host, _, port = address.rpartition(":")
    return pika.ConnectionParameters(host=host, port=int(port), heartbeat=30, connection_attempts=1,
                                     blocked_connection_timeout=None,
                                     client_properties={"connection_name": name})


def declare(addresses: list[str], queues: list[str], durable: bool, delete: bool = False) -> None:
    """Declare (or delete) the scenario's queues from the runner process."""
    conn = pika.BlockingConnection(_params(addresses[0], "bench-setup"))
    try:
        ch = conn.channel()
        for q in queues:
            if delete:
                ch.queue_delete(q)
            else:
                ch.queue_declare(q, durable=durable)
    finally:
        conn.close()


class _Loop:
    """The worker's I/O loop plus its periodic tick (progress report, start and stop signals)."""

    def __init__(self, shared: Shared, members: list):
        self.ioloop = IOLoop()
        self.shared = shared
        self.members = members
        self.totals = [0, 0, 0, 0]
        self.last = [0, 0, 0, 0]
        self.marked_ready = False
        self.t0 = None

    def run(self) -> None:
        for m in self.members:
            m.connect()
        self.ioloop.call_later(0.05, self.tick)
        self.ioloop.start()
        self.flush()

    def flush(self) -> None:
        deltas = [a - b for a, b in zip(self.totals, self.last)]
        self.last[:] = self.totals
        self.shared.add(deltas)

    def tick(self) -> None:
        self.flush()
        if not self.marked_ready and all(m.ready for m in self.members):
            with self.shared.ready.get_lock():
                self.shared.ready.value += 1
            self.marked_ready = True
        if self.marked_ready and self.t0 is None and self.shared.start.is_set():
            self.t0 = self.shared.start_at.value
            for m in self.members:
                m.begin(self.t0)
        for m in self.members:
            m.poll()
        if all(m.finished for m in self.members):
            self.ioloop.stop()
            return
        self.ioloop.call_later(0.05, self.tick)


class _Member:
    """One connection (a producer or a consumer) that re-opens on the next node when it breaks."""

    def __init__(self, loop: _Loop, spec: dict, index: int, name: str):
        self.loop = loop
        self.spec = spec
        self.nodes = rotate(spec["nodes"], index)
        self.name = name
        self.attempt = 0
        self.conn = None
        self.ch = None
        self.ready = False
        self.finished = False
        self.closing = False
        self.node = self.nodes[0]

    def connect(self) -> None:
        self.node = self.nodes[self.attempt % len(self.nodes)]
        self.conn = pika.SelectConnection(_params(self.node, self.name), on_open_callback=self._opened,
                                          on_open_error_callback=self._failed,
                                          on_close_callback=self._closed, custom_ioloop=self.loop.ioloop)

    def _opened(self, conn) -> None:
        conn.channel(on_open_callback=self._channel)

    def _failed(self, conn, exc) -> None:
        self._retry()

    def _closed(self, conn, reason) -> None:
        self.ch = None
        self.lost()
        if self.closing:
            self.finished = True
        else:
            self._retry()

    def _retry(self) -> None:
        if self.closing:
            self.finished = True
            return
        self.attempt += 1
        self.loop.ioloop.call_later(0.2, self.connect)

    def close(self) -> None:
        self.closing = True
        if self.conn is not None and self.conn.is_open:
            self.conn.close()
        elif self.conn is None or self.conn.is_closed:
            self.finished = True

    def lost(self) -> None: ...
    def begin(self, t0: float) -> None: ...
    def poll(self) -> None: ...


class _Producer(_Member):
    def __init__(self, loop, spec, p: int):
        super().__init__(loop, spec, p, f"bench-producer-{p}")
        sc = spec["scenario"]
        self.rec = PublishRecord(p, spec["queues"], sc["message_size"])
        self.p = p
        self.pad = b"\0" * (sc["message_size"] - 8)
        self.rate = spec["rate"]
        self.limit = spec["limits"][p] or math.inf
        self.confirms = sc["confirms"]
        self.window = sc["confirm_window"]
        self.sent = 0
        self.resolved = 0
        self.low = 0         # lowest sequence that may still be unresolved
        self.tag_base = 0    # sequence of this channel's delivery tag 1, minus 1
        self.t0 = None
        self.t_end = math.inf
        self.done_publishing = False
        self.confirm_deadline = math.inf
        self.pumping = False

    def _channel(self, ch) -> None:
        self.ch = ch
        self.tag_base = self.sent
        if self.confirms:
            ch.confirm_delivery(ack_nack_callback=self._on_confirm, callback=lambda _f: self._usable())
        else:
            self._usable()

    def _usable(self) -> None:
        self.ready = True
        self._kick()

    def begin(self, t0: float) -> None:
        self.t0 = t0
        sc = self.spec["scenario"]
        if not sc["messages"]:
            self.t_end = t0 + sc["warmup"] + sc["duration"]
        self.loop.ioloop.call_later(max(0.0, t0 - time.time()), self._kick)

    def _kick(self) -> None:
        if not self.pumping and self.t0 is not None:
            self.pumping = True
            self.loop.ioloop.add_callback(self._pump)

    def _pump(self) -> None:
        self.pumping = False
        if self.done_publishing or self.ch is None or not self.ch.is_open:
            return
        now = time.time()
        if now >= self.t_end or self.sent >= self.limit or self.loop.shared.stop_publish.is_set():
            self._end_publishing()
            return
        n = min(BATCH, self.limit - self.sent)
        if self.rate:
            n = min(n, int((now - self.t0) * self.rate) - self.sent)
        if self.confirms:
            n = min(n, self.window - (self.sent - self.resolved))
        if n <= 0:
            if self.rate and int((now - self.t0) * self.rate) <= self.sent:
                self.loop.ioloop.call_later(max(0.0005, (self.sent + 1) / self.rate - (now - self.t0)), self._kick)
            elif not self.confirms:
                self.loop.ioloop.call_later(0.001, self._kick)
            # else: the next confirm kicks the pump
            return
        queues, nq, p, pad = self.spec["queues"], len(self.spec["queues"]), self.p, self.pad
        t_pub, rq, publish = self.rec.t_pub, self.rec.q, self.ch.basic_publish
        sent = self.sent
        for _ in range(int(n)):
            qi = (p + sent) % nq
            publish("", queues[qi], make_id(p, sent).to_bytes(8, "big") + pad)
            t_pub.append(time.time())
            rq.append(qi)
            sent += 1
        self.loop.totals[PUBLISHED] += sent - self.sent
        self.sent = sent
        self._kick()

    def _end_publishing(self) -> None:
        self.done_publishing = True
        self.rec.grow_confirms()
        self.confirm_deadline = time.time() + self.spec["confirm_timeout"]

    def _on_confirm(self, frame) -> None:
        method = frame.method
        seq = method.delivery_tag - 1 + self.tag_base
        code = CONF_ACK if isinstance(method, pika.spec.Basic.Ack) else CONF_NACK
        first = self.low if method.multiple else seq
        newly = self.rec.confirm(first, seq, code, time.time())
        self.resolved += newly
        if code == CONF_ACK:
            self.loop.totals[CONFIRMED] += newly
        conf, t_conf = self.rec.conf, self.rec.t_conf
        while self.low < len(t_conf) and (conf[self.low] or not math.isnan(t_conf[self.low])):
            self.low += 1
        self._kick()

    def lost(self) -> None:
        # publishes of the broken channel that got no confirm will never get one
        if self.sent > self.low:
            self.resolved += self.rec.confirm(self.low, self.sent - 1, CONF_NONE, time.time())
            self.low = self.sent

    def poll(self) -> None:
        if self.t0 is None or self.closing:
            return
        if not self.done_publishing:
            self._kick()
            return
        if not self.confirms or self.resolved >= self.sent or time.time() > self.confirm_deadline:
            self.close()


class _Consumer(_Member):
    def __init__(self, loop, spec, c: int):
        super().__init__(loop, spec, c + 1, f"bench-consumer-{c}")
        self.rec = DeliverRecord(c, spec["queues"])
        self.c = c
        self.consuming = False
        self.started = False

    def _channel(self, ch) -> None:
        self.ch = ch
        prefetch = self.spec["scenario"]["prefetch"]
        ch.basic_qos(prefetch_count=prefetch, callback=lambda _f: self._usable())

    def _usable(self) -> None:
        self.ready = True
        self.consuming = False
        if self.started:
            self._consume()

    def begin(self, t0: float) -> None:
        pass

    def poll(self) -> None:
        shared = self.loop.shared
        if shared.stop.is_set() and not self.closing:
            self.close()
            return
        if not self.started and shared.consume.is_set():
            self.started = True
            self._consume()

    def _consume(self) -> None:
        if self.consuming or self.ch is None or not self.ch.is_open:
            return
        self.consuming = True
        auto = self.spec["scenario"]["ack"] == "auto"
        queues = self.spec["queues"]
        rec, totals = self.rec, self.loop.totals
        node_index = rec.node_index(self.spec["node_names"].get(self.node, self.node))
        for qi in self.spec["assign"][self.c]:
            self.ch.basic_consume(queues[qi], self._on_message(qi, auto, rec, totals, node_index), auto_ack=auto)

    @staticmethod
    def _on_message(qi, auto, rec, totals, node_index):
        ids, t_del, rq, red, node = rec.ids, rec.t_del, rec.q, rec.red, rec.node
        now_f = time.time

        def on_message(ch, method, _props, body):
            t_del.append(now_f())
            ids.append(int.from_bytes(body[:8], "big"))
            rq.append(qi)
            r = method.redelivered
            red.append(r)
            node.append(node_index)
            totals[DELIVERED] += 1
            if not r:
                totals[FIRST] += 1
            if not auto:
                ch.basic_ack(method.delivery_tag)

        return on_message


def run_producers(spec: dict, shared: Shared) -> list[PublishRecord]:
    loop = _Loop(shared, [])
    loop.members = [_Producer(loop, spec, p) for p in spec["indices"]]
    loop.run()
    return [m.rec for m in loop.members]


def run_consumers(spec: dict, shared: Shared) -> list[DeliverRecord]:
    loop = _Loop(shared, [])
    loop.members = [_Consumer(loop, spec, c) for c in spec["indices"]]
    loop.run()
    return [m.rec for m in loop.members]
