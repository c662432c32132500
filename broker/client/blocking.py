"""A blocking client with pika's BlockingConnection / BlockingChannel surface.

It drives the trio client (`broker.client.aio`) on a background thread; calls from the
application's thread hop over with `trio.from_thread`. Message callbacks run in the thread that
calls `start_consuming()`, as in pika: `callback(channel, method, properties, body)`.

A refusal (a channel or connection closed by the broker, a nack, a connection that cannot be
made) is raised in the application's thread as the client's own exception (broker.client.errors),
its traceback beginning at the application's call: the thread hop and trio's internals are not
part of it.

Deliveries and returned messages of every channel of a connection wait in one queue, run by
`start_consuming()` (until the channel has no consumer left) or by the connection's
`process_data_events(time_limit)`, as pika runs its callbacks.
"""

from __future__ import annotations

import queue as _queue
import threading
import time
from enum import Enum
from types import SimpleNamespace

import trio

from . import aio
from .errors import AMQPConnectionError, AMQPError, NackError, UnroutableError


class ConnectionParameters:
    """Where to connect. `host` may also be a list of "host:port" strings for fail-over;
    `ssl_context`, a client-side `ssl.SSLContext`, connects over TLS; `virtual_host`: the vhost
    to work in, as pika's."""

    def __init__(self, host="localhost", port: int = 5672, credentials=None,
                 connection_attempts: int = 1, retry_delay: float = 2.0, client_name: str = "warren-blocking",
                 ssl_context=None, virtual_host: str = "/"):
        hosts = host if isinstance(host, (list, tuple)) else [host]
        self.nodes = [h if ":" in str(h) else f"{'127.0.0.1' if h == 'localhost' else h}:{port}" for h in hosts]
        self.credentials = credentials or PlainCredentials("guest", "guest")
        self.connection_attempts = connection_attempts
        self.retry_delay = retry_delay
        self.client_name = client_name
        self.ssl_context = ssl_context  # an ssl.SSLContext: TLS to the nodes' client ports
        self.virtual_host = virtual_host


class PlainCredentials:
    def __init__(self, username: str, password: str):
        self.username = username
        self.password = password


class BasicProperties(dict):
    """Message properties (content_type, headers, delivery_mode, message_id, ...): a dict."""

    def __init__(self, **kwargs):
        # pika's enums (DeliveryMode.Persistent) stand for their values
        super().__init__({k: v.value if isinstance(v, Enum) else v for k, v in kwargs.items()
                          if v is not None})

    def __getattr__(self, name):
        return self.get(name)


class BlockingConnection:
    def __init__(self, parameters: ConnectionParameters | None = None):
        params = parameters or ConnectionParameters()
        self._params = params
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._conn: aio.Connection | None = None
        self._token = None
        self._events: _queue.Queue = _queue.Queue()  # (channel, kind, item) for callbacks to run
        self._thread = threading.Thread(target=self._thread_main, name="warren-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if isinstance(self._error, AMQPError):
            raise self._error.with_traceback(None) from None
        if self._error is not None:
            raise self._error
        self.is_open = True

    def _thread_main(self):
        try:
            trio.run(self._main)
        except BaseException as exc:  # for the constructor if it still waits, else for later calls
            self._error = exc if isinstance(exc, Exception) else AMQPConnectionError(str(exc))
            self._ready.set()

    async def _main(self):
        p = self._params
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with aio.open_connection(p.nodes, user=p.credentials.username,
                                       password=p.credentials.password, client_name=p.client_name,
                                       connect_attempts=p.connection_attempts,
                                       max_retry_delay=p.retry_delay, ssl_context=p.ssl_context,
                                       vhost=p.virtual_host) as conn:
            self._conn = conn
            self._ready.set()
            await self._stop.wait()

    def _call(self, afn, *args):
        """`await afn(*args)` in the client's thread; its value, or its refusal raised here."""
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except (AMQPError, ValueError) as exc:
            error = exc
        except trio.RunFinishedError:
            error = self._closed_error()
        raise error.with_traceback(None) from None

    def _call_sync(self, fn, *args):
        """`fn(*args)` in the client's thread; its value, or its refusal raised here."""
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except (AMQPError, ValueError) as exc:
            error = exc
        except trio.RunFinishedError:
            error = self._closed_error()
        raise error.with_traceback(None) from None

    def _closed_error(self) -> AMQPConnectionError:
        why = f": {self._error}" if self._error is not None else ""
        return AMQPConnectionError(f"the connection is closed{why}")

    def channel(self) -> "BlockingChannel":
        return BlockingChannel(self, self._call(self._conn.channel))

    def process_data_events(self, time_limit: float | None = 0) -> None:
        """Run the callbacks of what has arrived (deliveries, returned messages), waiting up to
        `time_limit` seconds for something to arrive (0: not at all; None: as long as it
        takes), as pika's: it returns once what arrived has been run."""
        try:
            event = self._events.get(timeout=time_limit) if time_limit != 0 else self._events.get_nowait()
            while True:
                channel, kind, item = event
                if channel is None:  # the connection was closed
                    self._events.put(event)  # for whoever else waits
                    return
                channel._dispatch(kind, item)
                event = self._events.get_nowait()
        except _queue.Empty:
            return

    def sleep(self, duration: float) -> None:
        """Wait `duration` seconds while running callbacks, as pika's."""
        deadline = time.monotonic() + duration
        while (left := deadline - time.monotonic()) > 0 and self.is_open:
            self.process_data_events(left)

    def close(self) -> None:
        if not self.is_open:
            return
        self.is_open = False
        try:
            self._call_sync(self._stop.set)
        except AMQPConnectionError:
            pass  # its thread has ended already
        self._thread.join(10)
        self._events.put((None, "closed", None))  # start_consuming() in another thread returns

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BlockingChannel:
    def __init__(self, connection: BlockingConnection, channel: aio.Channel):
        self.connection = connection
        self._ch = channel
        self._callbacks: dict[str, object] = {}
        self._return_callbacks: list = []
        self._unroutable: list = []  # returned in confirm mode, for basic_publish to raise
        self._generator = None  # consume()'s (consumer tag, auto_ack) while it runs
        self._generator_pending: list = []  # what it has not yielded yet
        self._consuming = False
        self._stop_asked = False
        self.channel_number = channel.ch
        channel.on_return = self._on_return

    @property
    def is_open(self) -> bool:
        return self._ch.is_open

    def queue_declare(self, queue: str = "", passive: bool = False, durable: bool = False,
                      exclusive: bool = False, auto_delete: bool = False, arguments: dict | None = None):
        ok = self.connection._call(self._ch.queue_declare, queue, passive, durable, exclusive, auto_delete, arguments)
        return SimpleNamespace(method=SimpleNamespace(queue=ok.queue, message_count=ok.message_count,
                                                      consumer_count=ok.consumer_count))

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False):
        return self.connection._call(self._ch.queue_delete, queue, if_unused, if_empty)

    def queue_purge(self, queue: str):
        return self.connection._call(self._ch.queue_purge, queue)

    def exchange_declare(self, exchange: str, exchange_type="direct", passive: bool = False,
                         durable: bool = False, auto_delete: bool = False, internal: bool = False,
                         arguments: dict | None = None):
        kind = getattr(exchange_type, "value", exchange_type)  # pika's ExchangeType enum too
        self.connection._call(self._ch.exchange_declare, exchange, kind, passive, durable,
                              auto_delete, internal, arguments)

    def exchange_delete(self, exchange: str, if_unused: bool = False):
        self.connection._call(self._ch.exchange_delete, exchange, if_unused)

    def exchange_bind(self, destination: str, source: str, routing_key: str = "",
                      arguments: dict | None = None):
        self.connection._call(self._ch.exchange_bind, destination, source, routing_key, arguments)

    def exchange_unbind(self, destination: str, source: str, routing_key: str = "",
                        arguments: dict | None = None):
        self.connection._call(self._ch.exchange_unbind, destination, source, routing_key, arguments)

    def queue_bind(self, queue: str, exchange: str, routing_key: str | None = None,
                   arguments: dict | None = None):
        self.connection._call(self._ch.queue_bind, queue, exchange, routing_key, arguments)

    def queue_unbind(self, queue: str, exchange: str, routing_key: str | None = None,
                     arguments: dict | None = None):
        self.connection._call(self._ch.queue_unbind, queue, exchange, routing_key, arguments)

    def basic_qos(self, prefetch_size: int = 0, prefetch_count: int = 0, global_qos: bool = False):
        self.connection._call(self._ch.basic_qos, prefetch_count, global_qos)

    def confirm_delivery(self):
        self.connection._call(self._ch.confirm_delivery)

    def tx_select(self):
        self.connection._call(self._ch.tx_select)

    def tx_commit(self):
        """Returns once every mirror of the queues involved has the transaction's messages."""
        self.connection._call(self._ch.tx_commit)

    def tx_rollback(self):
        self.connection._call(self._ch.tx_rollback)

    def basic_publish(self, exchange: str, routing_key: str, body, properties=None, mandatory: bool = False):
        """Publish; in confirm mode wait for the confirm, and raise UnroutableError if the
        (mandatory) message came back, NackError if it was refused (as pika)."""
        if isinstance(body, str):
            body = body.encode()
        props = dict(properties) if properties else None
        self.connection._call(self._ch.basic_publish, exchange, routing_key, body, props, mandatory)
        if self._ch.confirming:
            ok = self.connection._call(self._ch.wait_for_confirms)
            # a returned message arrives before its confirm: it is in the list by now
            back, self._unroutable = self._unroutable, []
            if back:
                raise UnroutableError([_returned(r) for r in back])
            if not ok:
                raise NackError(f"message to {routing_key!r} was not confirmed")

    def add_on_return_callback(self, callback):
        """`callback(channel, method, properties, body)` for each mandatory message that came
        back (outside confirm mode: in confirm mode basic_publish raises UnroutableError)."""
        self._return_callbacks.append(callback)

    def _on_return(self, _channel, back) -> None:  # in the client's thread
        if self._ch.confirming:
            self._unroutable.append(back)
        else:
            self.connection._events.put((self, "return", back))

    def basic_consume(self, queue: str, on_message_callback, auto_ack: bool = False,
                      exclusive: bool = False, consumer_tag: str | None = None, arguments: dict | None = None):
        events = self.connection._events

        def hand_over(ch, msg):
            events.put((self, "msg", msg))

        consumer = self.connection._call(self._ch.basic_consume, queue, hand_over, auto_ack, exclusive,
                                         consumer_tag, arguments)
        consumer.on_cancel = lambda c, reason: events.put((self, "cancel", c.tag))
        self._callbacks[consumer.tag] = on_message_callback
        return consumer.tag

    def basic_cancel(self, consumer_tag: str):
        self.connection._call(self._ch.basic_cancel, consumer_tag)
        self._callbacks.pop(consumer_tag, None)

    def start_consuming(self):
        """Run the connection's callbacks until stop_consuming(), until this channel has no
        consumer left, or until the connection is closed."""
        self._consuming = True
        self._stop_asked = False
        events = self.connection._events
        while self._callbacks and not self._stop_asked:
            channel, kind, item = events.get()
            if channel is None:  # the connection was closed
                events.put((None, kind, item))
                break
            channel._dispatch(kind, item)
        self._consuming = False

    def _dispatch(self, kind: str, item) -> None:
        """Run one callback (in the application's thread)."""
        if kind == "stop":
            self._stop_asked = True
        elif kind == "cancel":
            self._callbacks.pop(item, None)
        elif kind == "return":
            method = SimpleNamespace(reply_code=item.reply_code, reply_text=item.reply_text,
                                     exchange=item.exchange, routing_key=item.routing_key)
            for cb in self._return_callbacks:
                cb(self, method, BasicProperties(**(item.properties or {})), item.body)
        else:
            cb = self._callbacks.get(item.consumer_tag)
            if cb is not None:
                method = SimpleNamespace(delivery_tag=item.delivery_tag, redelivered=item.redelivered,
                                         consumer_tag=item.consumer_tag, routing_key=item.routing_key,
                                         exchange=item.exchange)
                cb(self, method, BasicProperties(**(item.properties or {})), item.body)

    def stop_consuming(self, consumer_tag: str | None = None):
        for tag in [consumer_tag] if consumer_tag else list(self._callbacks):
            if tag in self._callbacks:
                self.basic_cancel(tag)
        if self._consuming:
            self.connection._events.put((self, "stop", None))

    def consume(self, queue: str, auto_ack: bool = False, exclusive: bool = False,
                arguments: dict | None = None, inactivity_timeout: float | None = None,
                consumer_tag: str | None = None):
        """pika's consumer generator: yields (method, properties, body) as messages come, and
        (None, None, None) after `inactivity_timeout` seconds without one; other callbacks of
        the connection run meanwhile. `cancel()` ends it."""
        if self._generator is None:
            pending = self._generator_pending = []
            tag = self.basic_consume(queue, lambda ch, method, props, body: pending.append(
                (method, props, body)), auto_ack, exclusive, consumer_tag, arguments)
            self._generator = (tag, auto_ack)
        tag = self._generator[0]
        pending = self._generator_pending
        while True:
            if pending:
                yield pending.pop(0)
                continue
            if self._generator is None or tag not in self._callbacks or not self.connection.is_open:
                return  # cancelled (by cancel(), or by the broker), or the connection closed
            deadline = None if inactivity_timeout is None else time.monotonic() + inactivity_timeout
            while not pending and tag in self._callbacks and self.connection.is_open:
                # another channel's events may come first: wait on until ours or the deadline
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.connection.process_data_events(left)
            if not pending and tag in self._callbacks:
                yield None, None, None

    def cancel(self) -> int:
        """End the `consume()` generator: its consumer is cancelled, and the messages it had not
        yielded yet are given back (requeued, unless they were taken with auto_ack). Returns
        how many."""
        if self._generator is None:
            return 0
        (tag, auto_ack), self._generator = self._generator, None
        if tag in self._callbacks:
            self.connection._call(self._ch.basic_cancel, tag)
            self.connection.process_data_events(0)  # what arrived before the cancel took effect
            self._callbacks.pop(tag, None)
        left, self._generator_pending = self._generator_pending, []
        if left and not auto_ack:
            for method, _, _ in left:
                self.basic_nack(method.delivery_tag, requeue=True)
        return len(left)

    def basic_get(self, queue: str, auto_ack: bool = False):
        msg = self.connection._call(self._ch.basic_get, queue, auto_ack)
        if msg is None:
            return None, None, None
        method = SimpleNamespace(delivery_tag=msg.delivery_tag, redelivered=msg.redelivered,
                                 routing_key=msg.routing_key, exchange=msg.exchange)
        return method, BasicProperties(**(msg.properties or {})), msg.body

    def basic_ack(self, delivery_tag: int = 0, multiple: bool = False):
        self.connection._call_sync(self._ch.basic_ack, delivery_tag, multiple)

    def basic_nack(self, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True):
        self.connection._call_sync(self._ch.basic_nack, delivery_tag, multiple, requeue)

    def basic_reject(self, delivery_tag: int, requeue: bool = True):
        self.connection._call_sync(self._ch.basic_reject, delivery_tag, requeue)

    def close(self):
        self.connection._call(self._ch.close)


def _returned(back) -> SimpleNamespace:
    """A returned message as pika's UnroutableError lists it (method, properties, body)."""
    method = SimpleNamespace(reply_code=back.reply_code, reply_text=back.reply_text,
                             exchange=back.exchange, routing_key=back.routing_key)
    return SimpleNamespace(method=method, properties=BasicProperties(**(back.properties or {})),
                           body=back.body)
