"""Small pika helpers shared by the conformance cases: connections, fetching with a deadline,
draining, consumers on their own connections, and catching the channel or connection error a
broker closes with."""

from __future__ import annotations

import contextlib
import time

import pika
import pika.exceptions

# how long a message the broker should route, expire or dead-letter may take to show up
ARRIVAL_TIMEOUT = 1.0
# how long to watch for a message that should not show up
QUIET = 0.3


def connect(url: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(url))


@contextlib.contextmanager
def channel(url: str):
    """A blocking channel on a fresh connection, closed afterwards."""
    conn = connect(url)
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            conn.close()


def get(ch, queue: str, timeout: float = ARRIVAL_TIMEOUT, auto_ack: bool = True):
    """(method, properties, body) of the next message of `queue` by basic.get, waiting up to
    `timeout` seconds for one; None when none came."""
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is not None:
            return method, props, body
        if time.monotonic() >= deadline:
            return None
        ch.connection.sleep(0.02)


def bodies(ch, queue: str, quiet: float = QUIET) -> list[bytes]:
    """Every message `queue` holds now, by basic.get (acknowledged), until it has none for `quiet`
    seconds."""
    out = []
    while (got := get(ch, queue, quiet)) is not None:
        out.append(got[2])
    return out


def publish(ch, exchange: str, key: str, body: bytes | str, **props) -> None:
    if isinstance(body, str):
        body = body.encode()
    ch.basic_publish(exchange, key, body, pika.BasicProperties(**props) if props else None)


def message_count(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def wait_until(predicate, timeout: float = ARRIVAL_TIMEOUT, step: float = 0.02, conn=None) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        if conn is not None:
            conn.sleep(step)
        else:
            time.sleep(step)
    return True


@contextlib.contextmanager
def channel_closed(code: int, text: str | None = None):
    """Expects the broker to close the channel with `code` (and exactly `text` when given)."""
    with _closed(pika.exceptions.ChannelClosedByBroker, code, text):
        yield


@contextlib.contextmanager
def connection_closed(code: int, text: str | None = None):
    """Expects the broker to close the connection with `code` (and exactly `text` when given)."""
    with _closed(pika.exceptions.ConnectionClosedByBroker, code, text):
        yield


@contextlib.contextmanager
def _closed(kind, code, text):
    try:
        yield
    except kind as e:
        assert (e.reply_code, e.reply_text if text is not None else None) == (code, text), \
            f"closed with {e.reply_code} {e.reply_text!r}"
    else:
        raise AssertionError(f"expected the broker to close with {code} {text or ''}")


class Consumer:
    """A consumer on its own connection, recording (body, redelivered) of what it receives."""

    def __init__(self, url, queue, auto_ack=True, prefetch=0, arguments=None):
        self.conn = connect(url)
        self.ch = self.conn.channel()
        if prefetch:
            self.ch.basic_qos(prefetch_count=prefetch)
        self.got: list[tuple[bytes, bool]] = []
        self.tag = self.ch.basic_consume(queue, self._on_message, auto_ack=auto_ack, arguments=arguments)

    def _on_message(self, ch, method, props, body):
        self.got.append((body, method.redelivered))

    @property
    def bodies(self):
        return [b for b, _ in self.got]

    def pump(self, seconds=0.05):
        self.conn.process_data_events(seconds)

    def close(self):
        if self.conn.is_open:
            self.conn.close()


def pump_until(consumers, predicate, timeout=ARRIVAL_TIMEOUT):
    """Lets every consumer's connection take what the broker sends until `predicate()` holds;
    False after `timeout` seconds."""
    def step():
        for c in consumers:
            if c.conn.is_open:
                c.pump(0.01)
        return predicate()
    return wait_until(step, timeout, step=0)
