"""A blocking client with pika's BlockingConnection / BlockingChannel surface.

It drives the trio client (`broker.client.aio`) on a background thread; calls from the
application's thread hop over with `trio.from_thread`. Message callbacks run in the thread that
calls `start_consuming()`, as in pika: `callback(channel, method, properties, body)`.

A refusal (a channel or connection closed by the broker, a nack, a connection that cannot be
made) is raised in the application's thread as the client's own exception (broker.client.errors),
its traceback beginning at the application's call: the thread hop and trio's internals are not
part of it.
"""

from __future__ import annotations

import queue as _queue
import threading
from types import SimpleNamespace

import trio

from . import aio
from .errors import AMQPConnectionError, AMQPError, NackError


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
        super().__init__({k: v for k, v in kwargs.items() if v is not None})

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

    def close(self) -> None:
        if not self.is_open:
            return
        self.is_open = False
        try:
            self._call_sync(self._stop.set)
        except AMQPConnectionError:
            pass  # its thread has ended already
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BlockingChannel:
    def __init__(self, connection: BlockingConnection, channel: aio.Channel):
        self.connection = connection
        self._ch = channel
        self._deliveries: _queue.Queue = _queue.Queue()
        self._callbacks: dict[str, object] = {}
        self._consuming = False
        self.channel_number = channel.ch

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
        """Publish; in confirm mode wait for the confirm and raise NackError if refused (as pika)."""
        if isinstance(body, str):
            body = body.encode()
        props = dict(properties) if properties else None
        self.connection._call(self._ch.basic_publish, exchange, routing_key, body, props)
        if self._ch.confirming:
            ok = self.connection._call(self._ch.wait_for_confirms)
            if not ok:
                raise NackError(f"message to {routing_key!r} was not confirmed")

    def basic_consume(self, queue: str, on_message_callback, auto_ack: bool = False,
                      exclusive: bool = False, consumer_tag: str | None = None, arguments: dict | None = None):
        def hand_over(ch, msg):
            self._deliveries.put(("msg", msg))

        consumer = self.connection._call(self._ch.basic_consume, queue, hand_over, auto_ack, exclusive,
                                         consumer_tag, arguments)
        consumer.on_cancel = lambda c, reason: self._deliveries.put(("cancel", c.tag))
        self._callbacks[consumer.tag] = on_message_callback
        return consumer.tag

    def basic_cancel(self, consumer_tag: str):
        self.connection._call(self._ch.basic_cancel, consumer_tag)
        self._callbacks.pop(consumer_tag, None)

    def start_consuming(self):
        """Run message callbacks until stop_consuming() or until no consumer is left."""
        self._consuming = True
        while self._consuming and self._callbacks:
            kind, item = self._deliveries.get()
            if kind == "cancel":
                self._callbacks.pop(item, None)
                continue
            if kind == "stop":
                break
            cb = self._callbacks.get(item.consumer_tag)
            if cb is None:
                continue
            method = SimpleNamespace(delivery_tag=item.delivery_tag, redelivered=item.redelivered,
                                     consumer_tag=item.consumer_tag, routing_key=item.queue, exchange="")
            cb(self, method, BasicProperties(**(item.properties or {})), item.body)
        self._consuming = False

    def stop_consuming(self, consumer_tag: str | None = None):
        for tag in [consumer_tag] if consumer_tag else list(self._callbacks):
            if tag in self._callbacks:
                self.basic_cancel(tag)
        self._consuming = False
        self._deliveries.put(("stop", None))

    def basic_get(self, queue: str, auto_ack: bool = False):
        msg = self.connection._call(self._ch.basic_get, queue, auto_ack)
        if msg is None:
            return None, None, None
        method = SimpleNamespace(delivery_tag=msg.delivery_tag, redelivered=msg.redelivered,
                                 routing_key=queue, exchange="")
        return method, BasicProperties(**(msg.properties or {})), msg.body

    def basic_ack(self, delivery_tag: int = 0, multiple: bool = False):
        self.connection._call_sync(self._ch.basic_ack, delivery_tag, multiple)

    def basic_nack(self, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True):
        self.connection._call_sync(self._ch.basic_nack, delivery_tag, multiple, requeue)

    def basic_reject(self, delivery_tag: int, requeue: bool = True):
        self.connection._call_sync(self._ch.basic_reject, delivery_tag, requeue)

    def close(self):
        self.connection._call(self._ch.close)
