"""The node's only way to reach peers and clients: the ``Network`` interface.

This module owns

* ``Network``: the protocol the rest of the broker codes against (``serve`` to
  listen, ``connect`` to dial out; both deal in plain ``trio.abc.Stream``\\ s);
* ``TcpNetwork``: the production implementation over real TCP sockets, with TLS (trio's
  ``SSLStream``) on the listeners given a server context and on every dial when it is given a
  client context;
* ``SimNetwork``: an in-memory, deterministic simulated world of named hosts
  with fault injection (partitions, dropped connections, latency, killed
  hosts).  Whole-cluster tests run on it under
  ``trio.testing.MockClock(autojump_threshold=0)``, so timer-heavy scenarios
  (heartbeats, timeouts) take milliseconds of wall time.

It owns nothing above the byte stream: framing, msgpack and the AMQP-ish
protocol live elsewhere.

Simulation model, in brief.  A connection is two one-way pipes.  ``send_all``
never blocks (buffers are unbounded); it stamps the bytes with a delivery
time (now + configured delay, never earlier than the previous chunk on that
pipe, so order is kept) and queues them *in transit*.  The receiving side moves
in-transit bytes into its readable buffer lazily, when it reads and the
delivery time has come and the two hosts are not partitioned; a reader with
nothing to read sleeps until the next delivery time or until some fault event
(heal, close, drop, kill) wakes it.  Waiting uses trio deadlines, so
``MockClock`` autojump makes latency free.  Nothing in the simulation is
random; the seed is kept (``SimNetwork.rng``) for callers that want seeded
jitter of their own.

Handler exceptions: ``serve`` (both implementations) runs each handler inside
``async with stream`` and swallows ``trio.BrokenResourceError`` and
``trio.ClosedResourceError`` escaping from it, because a peer going away is
normal life for a server (and what ``SimNetwork.drop``/``kill`` produce).  Any
other exception propagates and brings ``serve`` down, as with
``trio.serve_listeners``.
"""

from __future__ import annotations

import errno
import math
import os
import random
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import trio

HANDSHAKE_TIMEOUT = 10.0  # seconds an accepted connection has to finish its TLS handshake

__all__ = ["Network", "Handler", "TcpNetwork", "SimNetwork"]

Handler = Callable[[trio.abc.Stream, str], Awaitable[None]]


@runtime_checkable
class Network(Protocol):
    async def serve(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        tls: ssl.SSLContext | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on host:port forever (speaking TLS with `tls`, a server context, if given); for each accepted connection run
        `await handler(stream, peer_description)` in a task of a nursery owned by serve()
        (so cancelling serve() cancels all handlers). task_status.started(bound_port) once
        listening (port 0 = pick a free one). The handler's stream is closed when the handler returns."""
        ...

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Open a stream; raises OSError if nobody listens / unreachable."""
        ...


async def _run_handler(handler: Handler, stream: trio.abc.Stream, peer: str) -> None:
    """Run one connection handler; close its stream afterwards; a broken or
    closed connection ends the handler quietly."""
    try:
        async with stream:
            await handler(stream, peer)
    except* (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


# ---------------------------------------------------------------------------
# Real TCP
# ---------------------------------------------------------------------------


def _set_nodelay(stream: trio.SocketStream) -> None:
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except OSError:  # pragma: no cover - not a TCP socket
        pass


def _describe(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        ip, port = addr[0], addr[1]
        return f"[{ip}]:{port}" if ":" in str(ip) else f"{ip}:{port}"
    return str(addr)


def connect_reason(exc: OSError) -> str:
    """Why a connect failed, in the system's words: trio's connect raises "all attempts to
    connect ... failed" with each attempt's own error (e.g. "Connection refused") in its cause;
    a name that does not resolve is a socket.gaierror ("Name or service not known"), whose
    negative error numbers os.strerror does not know."""
    cause = exc.__cause__
    if not exc.errno and isinstance(cause, BaseExceptionGroup) and isinstance(cause.exceptions[0], OSError):
        exc = cause.exceptions[0]
    if exc.errno and exc.errno > 0:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


class TcpNetwork:
    """``Network`` over real TCP sockets (TCP_NODELAY on every stream).

    `dial_tls`, a client context, makes every ``connect`` a TLS one (its peer's name checked
    against the host dialed when the context checks host names); ``serve(..., tls=ctx)`` makes
    a listener whose every connection starts with a TLS handshake (HANDSHAKE_TIMEOUT seconds at
    most) before the handler sees it. A TLS stream has no ``socket`` attribute, so framed.py's
    readers and writers take it through its own methods; a plain one keeps the direct path."""

    def __init__(self, dial_tls: ssl.SSLContext | None = None, log: Any = None) -> None:
        self.dial_tls = dial_tls
        self.log = log  # where refused TLS handshakes are told, once per reason (None: nowhere)
        self._refusals: set[str] = set()

    def _note_refused(self, port: int, peer: str, exc: BaseException) -> None:
        """A refused TLS handshake, logged once per port and reason (bounded, whatever strangers
        send): who was refused on the peer port, and why, without a line per retry."""
        if self.log is None:
            return
        cause = exc.__cause__
        reason = ("no TLS handshake within %g s" % HANDSHAKE_TIMEOUT if isinstance(exc, trio.TooSlowError)
                  else getattr(cause, "verify_message", None) or getattr(cause, "reason", None)
                  or str(cause or exc) or "the connection was closed")
        key = f"{port} {reason}"
        if key in self._refusals:
            return
        if len(self._refusals) >= 256:
            self._refusals.clear()
        self._refusals.add(key)
        self.log.warning("TLS handshake refused", port=port, peer=peer, reason=reason)

    async def serve(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        tls: ssl.SSLContext | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]

        async def accepted(stream: trio.SocketStream) -> None:
            _set_nodelay(stream)
            try:
                peer = _describe(stream.socket.getpeername())
            except OSError:
                peer = "?"
            if tls is None:
                await _run_handler(handler, stream, peer)
                return
            secured = trio.SSLStream(stream, tls, server_side=True)
            try:
                with trio.fail_after(HANDSHAKE_TIMEOUT):
                    await secured.do_handshake()
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
                # refused (no certificate, one of another CA, an expired one, not TLS at all)
                self._note_refused(bound, peer, exc)
                await _send_alert(secured, stream)
                await trio.aclose_forcefully(stream)
                return
            await _run_handler(handler, secured, peer)

        task_status.started(bound)
        # serve_listeners closes the listeners when it is cancelled, and runs
        # the handlers in a nursery of its own, i.e. inside this call.
        await trio.serve_listeners(accepted, listeners)

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream(host, port)
        _set_nodelay(stream)
        if self.dial_tls is None:
            return stream
        return await tls_handshake(stream, self.dial_tls, host, port)


async def _send_alert(secured: trio.SSLStream, stream: trio.SocketStream) -> None:
    """Send the alert a refused handshake left unsent (trio's SSLStream keeps it in its outgoing
    buffer when the handshake fails), so the client reads why ("certificate required", "unknown
    ca", "certificate expired") rather than a bare end of stream. Best effort: one second."""
    outgoing = getattr(secured, "_outgoing", None)
    alert = outgoing.read() if outgoing is not None else b""
    if alert:
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(alert)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


async def tls_handshake(stream: trio.abc.Stream, context: ssl.SSLContext, host: str,
                        port: int) -> trio.SSLStream:
    """`stream` as the client end of a TLS connection to host:port; a refused handshake is an
    OSError saying why (what callers of ``connect`` expect of a peer they cannot reach)."""
    secured = trio.SSLStream(stream, context, server_hostname=host if context.check_hostname else None)
    try:
        await secured.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        await trio.aclose_forcefully(stream)
        cause = exc.__cause__
        reason = (getattr(cause, "verify_message", None) or getattr(cause, "reason", None)
                  or str(cause or exc) or "the connection was closed")
        raise OSError(f"TLS handshake with {host}:{port} failed: {reason}") from exc
    return secured


# ---------------------------------------------------------------------------
# Simulated network
# ---------------------------------------------------------------------------

_EOF = None  # marker queued in a pipe after the sender closed


def _now_or_none() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # called outside trio.run: nothing can be in flight
        return None


class _Guard:
    """Raise BusyResourceError when two tasks use one direction at once."""

    __slots__ = ("_busy", "_msg")

    def __init__(self, msg: str) -> None:
        self._busy = False
        self._msg = msg

    def __enter__(self) -> None:
        if self._busy:
            raise trio.BusyResourceError(self._msg)
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False


class _Pipe:
    """One direction of a simulated connection, from host ``src`` to ``dst``."""

    def __init__(self, src: str, dst: str) -> None:
        self.src = src
        self.dst = dst
        self.in_transit: deque[tuple[float, bytes | None]] = deque()
        self.readable = bytearray()
        self.eof = False  # EOF reached the reader (after all data)
        self.reader_gone = False  # receiving end closed / died / dropped
        self.last_at = -math.inf
        self.wakeup = trio.Event()

    def wake(self) -> None:
        self.wakeup.set()
        self.wakeup = trio.Event()

    def discard(self) -> None:
        self.in_transit.clear()
        self.readable.clear()


@dataclass
class _Conn:
    client: str
    server: str
    open: bool = True
    ends: list[_SimStream] = field(default_factory=list)


class _SimStream(trio.abc.Stream):
    """One end of a simulated connection, living on host ``host``."""

    def __init__(
        self, net: SimNetwork, conn: _Conn, host: str, peer: str, inbound: _Pipe, outbound: _Pipe
    ) -> None:
        self._net = net
        self._conn = conn
        self.host = host
        self.peer = peer
        self._in = inbound
        self._out = outbound
        self._closed = False  # we called aclose()
        self._broken = False  # dropped, or our own host was killed
        self._finished = False  # the network has done its close/kill/drop work
        self._send_guard = _Guard("another task is already sending on this stream")
        self._recv_guard = _Guard("another task is already receiving on this stream")

    def __repr__(self) -> str:
        return f"<SimStream {self.host}->{self.peer}>"

    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream was closed")
        if self._broken or self._out.reader_gone:
            raise trio.BrokenResourceError("connection is broken")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_guard:
            await trio.lowlevel.checkpoint()
            self._check_send()
            chunk = bytes(data)
            if chunk:
                self._net._transmit(self._out, chunk)

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_guard:
            await trio.lowlevel.checkpoint()
            self._check_send()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        with self._recv_guard:
            await trio.lowlevel.checkpoint()
            pipe = self._in
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("stream was closed")
                if self._broken:
                    raise trio.BrokenResourceError("connection is broken")
                self._net._deliver(pipe)
                if pipe.readable:
                    n = len(pipe.readable) if max_bytes is None else max_bytes
                    out = bytes(pipe.readable[:n])
                    del pipe.readable[:n]
                    return out
                if pipe.eof:
                    return b""
                event = pipe.wakeup
                with trio.move_on_at(self._net._next_delivery(pipe)):
                    await event.wait()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._finished:
                self._net._end_closed(self)
        await trio.lowlevel.checkpoint()


@dataclass
class _Listener:
    host: str
    port: int
    handler: Handler
    nursery: trio.Nursery


class _SimHost:
    """The ``Network`` as seen from one simulated host."""

    def __init__(self, net: SimNetwork, name: str) -> None:
        self._net = net
        self.name = name

    def __repr__(self) -> str:
        return f"<SimNetwork host {self.name!r}>"

    async def serve(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        tls: ssl.SSLContext | None = None,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        net = self._net
        if tls is not None:
            raise ValueError("the simulated network has no TLS")
        if host != self.name:
            raise ValueError(
                f"host {self.name!r} can only listen on its own name, not {host!r}"
            )
        await trio.lowlevel.checkpoint()
        if self.name in net._dead:
            raise OSError(errno.ENETDOWN, f"host {self.name} is down")
        if port == 0:
            port = net._free_port(self.name)
        key = (self.name, port)
        if key in net._listeners:
            raise OSError(errno.EADDRINUSE, f"{self.name}:{port} already in use")
        async with trio.open_nursery() as nursery:
            listener = _Listener(self.name, port, handler, nursery)
            net._listeners[key] = listener
            try:
                task_status.started(port)
                await trio.sleep_forever()
            finally:
                if net._listeners.get(key) is listener:
                    del net._listeners[key]

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        net = self._net
        me = self.name
        await trio.lowlevel.checkpoint()
        net._check_connect(me, host, port)
        rtt = 2 * net._delay_between(me, host)
        if rtt:
            await trio.sleep(rtt)  # the handshake costs one round trip
            net._check_connect(me, host, port)
        listener = net._listeners[(host, port)]
        client_port = net._ephemeral_port(me)
        conn = _Conn(me, host)
        up, down = _Pipe(me, host), _Pipe(host, me)
        client_end = _SimStream(net, conn, me, f"{host}:{port}", inbound=down, outbound=up)
        server_end = _SimStream(net, conn, host, f"{me}:{client_port}", inbound=up, outbound=down)
        conn.ends = [client_end, server_end]
        net._conns.append(conn)
        net._stat(me, host)["connections"] += 1
        listener.nursery.start_soon(_run_handler, listener.handler, server_end, server_end.peer)
        return client_end


class SimNetwork:
    """The simulated world. Hosts are names (strings, e.g. "n1"); a host's view is a Network.

    Faults (all take effect immediately, may be called from sync code):

    * ``partition(*groups)``: hosts in different groups cannot talk; bytes in
      transit or sent later between them are held (not lost) until ``heal()``;
      ``connect`` across the cut raises OSError.  Calls accumulate: two hosts
      can talk only if no partition call separates them.  Hosts not named in a
      call are not affected by it.
    * ``heal()``: remove every partition; held bytes are delivered in order.
    * ``drop(a, b)``: every open connection between a and b breaks, at both
      ends (unread data is discarded, like a reset).
    * ``delay(a, b, s)``: extra one-way latency for new bytes between a and b
      (both directions); ``connect`` also waits one round trip.
    * ``kill(host)`` / ``revive(host)``: see the methods.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)  # not used by the sim itself
        self._hosts: dict[str, _SimHost] = {}
        self._listeners: dict[tuple[str, int], _Listener] = {}
        self._conns: list[_Conn] = []
        self._cuts: list[dict[str, int]] = []  # each: host -> group index
        self._delays: dict[frozenset[str], float] = {}
        self._dead: set[str] = set()
        self._paused: set[str] = set()
        self._next_listen_port: dict[str, int] = {}
        self._next_client_port: dict[str, int] = {}
        self._stats: dict[tuple[str, str], dict[str, int]] = {}

    # -- hosts -------------------------------------------------------------

    def host(self, name: str) -> Network:
        if name not in self._hosts:
            self._hosts[name] = _SimHost(self, name)
        return self._hosts[name]

    # -- faults ------------------------------------------------------------

    def partition(self, *groups: Iterable[str]) -> None:
        self._deliver_all_due()
        cut: dict[str, int] = {}
        for index, group in enumerate(groups):
            if isinstance(group, str):
                raise TypeError("each group must be an iterable of host names, not a str")
            for h in group:
                if h in cut and cut[h] != index:
                    raise ValueError(f"host {h!r} is in two groups")
                cut[h] = index
        self._cuts.append(cut)

    def heal(self) -> None:
        self._cuts.clear()
        self._wake_all()

    def pause(self, host: str) -> None:
        """The host falls silent, as a SIGSTOPped process does to the others: bytes to and
        from it are held (nothing breaks) until ``resume``; new connections to it fail."""
        self._deliver_all_due()
        self._paused.add(host)

    def resume(self, host: str) -> None:
        self._paused.discard(host)
        self._wake_all()

    def drop(self, a: str, b: str) -> None:
        # Every connection still known, including half-closed ones whose
        # surviving end has not read its EOF yet.
        for conn in [c for c in self._conns if {c.client, c.server} == {a, b}]:
            conn.open = False
            for end in conn.ends:
                end._broken = True
                end._finished = True
                end._in.reader_gone = True
                end._in.discard()
                end._in.wake()
        self._prune()

    def delay(self, a: str, b: str, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        key = frozenset((a, b))
        if seconds:
            self._delays[key] = float(seconds)
        else:
            self._delays.pop(key, None)

    def kill(self, host: str) -> None:
        """The host's process died: its listeners vanish, its own ends of every
        connection raise BrokenResourceError, and each remote end reads
        whatever the dead host had already sent (its kernel flushes it, subject
        to delay/partition), then EOF; sending to it raises
        BrokenResourceError.  The host's tasks keep running: cancel them.

        A paused host that is killed is no longer paused: SIGKILL ends a SIGSTOPped
        process, and the process that `revive` later stands for starts running (dst seed
        20130 from the chaos schedules: a full restart during a pause brought the node back
        silent for good)."""
        self._paused.discard(host)
        self._deliver_all_due()
        self._dead.add(host)
        for key in [k for k in self._listeners if k[0] == host]:
            del self._listeners[key]
        for conn in list(self._conns):
            for end in conn.ends:
                if end.host == host and not end._finished:
                    end._broken = True
                    self._end_closed(end)

    def revive(self, host: str) -> None:
        self._dead.discard(host)

    # -- introspection -------------------------------------------------------

    def stats(self) -> dict:
        """``{(src, dst): {"bytes": sent src->dst, "connections": opened by
        src to dst, "open": currently open between them (either direction)}}``."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for (src, dst), counters in self._stats.items():
            out[(src, dst)] = dict(counters, open=self.connections(src, dst))
        return out

    def connections(self, a: str, b: str) -> int:
        """Open connections between a and b (either direction): ones that
        neither end has closed and that were not dropped or killed."""
        return sum(1 for _ in self._conns_between(a, b))

    def is_partitioned(self, a: str, b: str) -> bool:
        if a != b and (a in self._paused or b in self._paused):
            return True
        for cut in self._cuts:
            if a in cut and b in cut and cut[a] != cut[b]:
                return True
        return False

    # -- internals ---------------------------------------------------------

    def _stat(self, src: str, dst: str) -> dict[str, int]:
        return self._stats.setdefault((src, dst), {"bytes": 0, "connections": 0})

    def _conns_between(self, a: str, b: str) -> list[_Conn]:
        return [
            c for c in self._conns
            if c.open and {c.client, c.server} == {a, b}
        ]

    def _prune(self) -> None:
        # A connection is forgotten once neither end can be read any more (and lets go of its
        # ends, which refer back to it, so both are freed without waiting for a collection).
        kept = []
        for c in self._conns:
            if all(e._finished for e in c.ends):
                c.ends = []
            else:
                kept.append(c)
        self._conns = kept

    def _delay_between(self, a: str, b: str) -> float:
        return self._delays.get(frozenset((a, b)), 0.0)

    def _free_port(self, host: str) -> int:
        port = self._next_listen_port.get(host, 10000)
        while (host, port) in self._listeners:
            port += 1
        self._next_listen_port[host] = port + 1
        return port

    def _ephemeral_port(self, host: str) -> int:
        port = self._next_client_port.get(host, 40000)
        self._next_client_port[host] = port + 1
        return port

    def _check_connect(self, me: str, host: str, port: int) -> None:
        if me in self._dead:
            raise OSError(errno.ENETDOWN, f"host {me} is down")
        if self.is_partitioned(me, host):
            raise OSError(errno.EHOSTUNREACH, f"{host} unreachable from {me}")
        if host in self._dead or (host, port) not in self._listeners:
            raise OSError(errno.ECONNREFUSED, f"connection refused by {host}:{port}")

    def _transmit(self, pipe: _Pipe, item: bytes | None) -> None:
        now = trio.current_time()
        at = max(now + self._delay_between(pipe.src, pipe.dst), pipe.last_at)
        pipe.last_at = at
        pipe.in_transit.append((at, item))
        if item:
            self._stat(pipe.src, pipe.dst)["bytes"] += len(item)
        pipe.wake()

    def _deliver(self, pipe: _Pipe, now: float | None = None) -> None:
        """Move due, reachable in-transit items to the reader's buffer."""
        if not pipe.in_transit or self.is_partitioned(pipe.src, pipe.dst):
            return
        if now is None:
            now = trio.current_time()
        while pipe.in_transit and pipe.in_transit[0][0] <= now:
            _, item = pipe.in_transit.popleft()
            if item is _EOF:
                pipe.eof = True
            else:
                pipe.readable += item

    def _next_delivery(self, pipe: _Pipe) -> float:
        if not pipe.in_transit or self.is_partitioned(pipe.src, pipe.dst):
            return math.inf
        return pipe.in_transit[0][0]

    def _all_pipes(self) -> Iterable[_Pipe]:
        for conn in self._conns:
            for end in conn.ends:
                yield end._in

    def _deliver_all_due(self) -> None:
        # Before the topology changes, bytes whose time has come count as
        # delivered even if their reader has not looked yet.
        now = _now_or_none()
        if now is None:
            return
        for pipe in self._all_pipes():
            self._deliver(pipe, now)

    def _wake_all(self) -> None:
        for pipe in self._all_pipes():
            pipe.wake()

    def _end_closed(self, end: _SimStream) -> None:
        """``end`` stops taking part (closed, or its host died): the peer gets
        EOF after the bytes already sent, the peer's later sends fail, and
        whatever was on its way to ``end`` is thrown away.  Runs once per end."""
        end._finished = True
        if not end._out.reader_gone:
            self._transmit(end._out, _EOF)
        end._in.reader_gone = True
        end._in.discard()
        end._in.wake()
        end._conn.open = False
        self._prune()
