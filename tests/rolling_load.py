"""Clients that keep working through a rolling restart, for the tests of `warrenctl
rolling_restart`: a pika publisher with confirms and a pika consumer with acks, each in a thread
that reconnects (to the next address of its list) whenever its connection goes, and an aio-pika
consumer on `connect_robust`. Messages carry their id as the body; every consumer writes a
delivery log (`TIME ID` a line, TIME the Unix time it arrived: what `--client-log` reads).

The publisher counts an id as confirmed only when the broker confirmed it; an id whose publish
failed is published again after the reconnect (so a consumer may see an id twice, never miss a
confirmed one).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pika
import pika.exceptions

LOST = (pika.exceptions.AMQPError, OSError)


def _parameters(host: str, port: int, user: str, password: str):
    return pika.ConnectionParameters(host, port, credentials=pika.PlainCredentials(user, password),
                                     connection_attempts=1, socket_timeout=3,
                                     blocked_connection_timeout=30)


class _Client(threading.Thread):
    def __init__(self, addresses, queue: str, user="guest", password="guest"):
        super().__init__(daemon=True)
        self.addresses, self.queue, self.user, self.password = list(addresses), queue, user, password
        self.stopping = threading.Event()
        self.reconnects = 0
        self.errors: list[str] = []
        self._next = 0

    def connect(self):
        """A connection to the next address that accepts one (the same one after a failure
        only when it is the only address)."""
        while not self.stopping.is_set():
            host, port = self.addresses[self._next % len(self.addresses)]
            self._next += 1
            try:
                return pika.BlockingConnection(_parameters(host, port, self.user, self.password))
            except LOST:
                time.sleep(0.2)
        return None

    def lost(self, conn, exc) -> None:
        """The connection (or its channel) failed: closed for good, counted, noted."""
        self.reconnects += 1
        self.errors.append(f"{type(exc).__name__}: {exc}")
        try:
            conn.close()
        except Exception:
            pass
        time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping.set()
        self.join(timeout)


class Publisher(_Client):
    """Publishes ids 0, 1, 2, ... with confirms, `rate` per second at most."""

    def __init__(self, addresses, queue, rate: float = 200.0, **kw):
        super().__init__(addresses, queue, **kw)
        self.confirmed = 0  # ids below this one are confirmed
        self.rate = rate

    def run(self) -> None:
        while not self.stopping.is_set():
            conn = self.connect()
            if conn is None:
                return
            try:
                ch = conn.channel()
                ch.queue_declare(self.queue, durable=True)
                ch.confirm_delivery()
                while not self.stopping.is_set():
                    ch.basic_publish("", self.queue, str(self.confirmed).encode(),
                                     pika.BasicProperties(delivery_mode=2), mandatory=True)
                    self.confirmed += 1
                    time.sleep(1.0 / self.rate)
                conn.close()
            except LOST as exc:
                self.lost(conn, exc)


class Consumer(_Client):
    """Consumes with manual acks, logging every delivery to `log_path`."""

    def __init__(self, addresses, queue, log_path, prefetch: int = 100, **kw):
        super().__init__(addresses, queue, **kw)
        self.delay = 0.0  # seconds spent on each message (a slow consumer keeps a backlog)
        self.ids: set[int] = set()
        self.deliveries = 0
        self.log = open(log_path, "a", buffering=1)

    def _on_message(self, ch, method, _properties, body) -> None:
        self.log.write(f"{time.time():.6f} {body.split()[0].decode()}\n")
        self.ids.add(int(body.split()[0]))
        self.deliveries += 1
        if self.delay:
            time.sleep(self.delay)
        ch.basic_ack(method.delivery_tag)

    def run(self) -> None:
        while not self.stopping.is_set():
            conn = self.connect()
            if conn is None:
                break
            try:
                ch = conn.channel()
                ch.queue_declare(self.queue, durable=True)
                ch.basic_qos(prefetch_count=100)
                ch.basic_consume(self.queue, self._on_message)
                while not self.stopping.is_set():
                    conn.process_data_events(time_limit=0.2)
                conn.close()
            except LOST as exc:
                self.lost(conn, exc)
        self.log.close()


def wait_for_ids(consumers, count: int, timeout: float = 60.0) -> set[int]:
    """Until the consumers together have every id below `count`; the ids missing then."""
    deadline = time.monotonic() + timeout
    while True:
        missing = set(range(count)).difference(*(c.ids for c in consumers))
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


class RobustConsumer(threading.Thread):
    """aio-pika's connect_robust consumer (acks), in its own event loop in a thread: the robust
    connection reconnects to the same URL (the load balancer) and consumes again by itself."""

    def __init__(self, url: str, queue: str, log_path):
        super().__init__(daemon=True)
        self.url, self.queue = url, queue
        self.delay = 0.0
        self.ids: set[int] = set()
        self.deliveries = 0
        self.log = open(log_path, "a", buffering=1)
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.log.close()

    async def _main(self) -> None:
        import aio_pika

        conn = await aio_pika.connect_robust(self.url, reconnect_interval=0.5)
        async with conn:
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=100)
            queue = await ch.declare_queue(self.queue, durable=True)

            async def on_message(message):
                self.log.write(f"{time.time():.6f} {message.body.split()[0].decode()}\n")
                self.ids.add(int(message.body.split()[0]))
                self.deliveries += 1
                if self.delay:
                    await asyncio.sleep(self.delay)
                await message.ack()

            await queue.consume(on_message)
            while not self._halt.is_set():
                await asyncio.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        self._halt.set()
        self.join(timeout)


class WarrenConsumer(threading.Thread):
    """warren's own client (broker/client/aio.py), in trio in a thread: it reconnects to its
    address list by itself and re-creates its consumer."""

    def __init__(self, addresses: list[str], queue: str, log_path, user="guest", password="guest"):
        super().__init__(daemon=True)
        self.addresses, self.queue, self.user, self.password = addresses, queue, user, password
        self.delay = 0.0
        self.ids: set[int] = set()
        self.deliveries = 0
        self.reconnects = 0
        self.log = open(log_path, "a", buffering=1)
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.log.close()

    async def _main(self) -> None:
        import trio

        from broker.client.aio import open_connection

        async with open_connection(self.addresses, user=self.user, password=self.password) as conn:
            ch = await conn.channel()
            await ch.basic_qos(prefetch_count=100)
            await ch.queue_declare(self.queue, durable=True)
            consumer = await ch.basic_consume(self.queue)
            while not self._halt.is_set():
                with trio.move_on_after(0.2):
                    async for msg in consumer:
                        self.log.write(f"{time.time():.6f} {msg.body.split()[0].decode()}\n")
                        self.ids.add(int(msg.body.split()[0]))
                        self.deliveries += 1
                        ch.basic_ack(msg.delivery_tag)  # before a wait that may be cancelled
                        if self.delay:
                            await trio.sleep(self.delay)
                        if self._halt.is_set():
                            break
            self.reconnects = conn.reconnects

    def stop(self, timeout: float = 30.0) -> None:
        self._halt.set()
        self.join(timeout)
