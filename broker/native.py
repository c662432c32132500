"""warren's own client protocol (msgpack frames, wire/messages.py) in front of a session.

`NativeProtocol` is the sans-IO state machine (a broker/frontend.py `ClientProtocol`): the
handshake (the server's hello, the client's credentials checked against the users and the
loopback rule, the welcome), client frames decoded into session commands (only the kinds a
client may send), session outputs encoded as frames (one `writev` of every frame queued), and
the error path (an error frame that says why, then the connection, not the node, is closed).
A publishing client held by a memory alarm is told so with `Blocked`/`Unblocked` frames; one
held by credit flow is not told (warren's client has no such frame). `NativeConnection` is the
connection driver (broker/connection.py) speaking it. What a session means is
broker/session/'s business.
"""

from __future__ import annotations

from wire import messages as m
from wire.errors import (ACCESS_REFUSED, CONNECTION_FORCED, NOT_ALLOWED, PRECONDITION_FAILED,
                         SYNTAX_ERROR, UNEXPECTED_FRAME, VERSION_MISMATCH, ProtocolError)
from wire.frames import FrameDecoder
from wire.props import NO_PROPS, REPLY_TO, dict_to_raw, expiration_ms, native_list
from wire.schema import decode_bytes

from .connection import ClientConnection, check_login, is_loopback
from .framed import frame_parts
from .frontend import ChannelFailed, Closed, ConnectionFailed, LoggedIn, vhost_not_found

CLIENT_KINDS = frozenset({
    "channel.open", "channel.close", "queue.declare", "queue.delete", "queue.purge", "basic.qos",
    "confirm.select", "publish", "basic.consume", "basic.cancel", "basic.get", "ack", "nack",
    "connection.close", "tx.select", "tx.commit", "tx.rollback",
    # exchanges and bindings, and publishing to an exchange (PublishTo, read by `_routed`)
    "exchange.declare", "exchange.delete", "queue.bind", "queue.unbind", "exchange.bind",
    "exchange.unbind", "publish.to",
})

HANDSHAKE, OPEN, CLOSED = "waiting for client.auth", "open", "closed"  # NativeProtocol.state

__all__ = ["CLIENT_KINDS", "NativeConnection", "NativeProtocol", "check_login", "is_loopback"]


def _routed(msg: m.PublishTo) -> list:
    """A client's publish to an exchange, as the session takes it from either front end: each
    message's properties in AMQP's form with the exchange and routing key it was published
    with (wire/props.py `[exchange, routing_key, raw]`: a consumer on either protocol reads them
    back, an AMQP one every property as encoded), and its TTL (`expiration`) and direct
    reply-to request read here, not taken from the client; runs of equal TTL and reply-to go
    as one batch each. A bad `expiration` fails the channel with RabbitMQ's text; properties
    that are not a map (or nil) are a protocol error, as a malformed AMQP header is."""
    props = msg.props
    n = len(msg.bodies)
    if props is not None and len(props) != n:
        return [msg]  # the session refuses it (props must be nil or parallel to bodies)
    ex, key = msg.exchange, msg.routing_key
    items, runs = [], []
    for i in range(n):
        d = props[i] if props is not None else None
        if d is not None and type(d) is not dict:
            raise ProtocolError(SYNTAX_ERROR, f"publish.to: the properties of a message must be a map "
                                              f"or nil on channel {msg.ch}")
        ttl = None
        if d is not None and d.get("expiration") is not None:
            ttl = expiration_ms(d["expiration"])
            if type(ttl) is str:
                return [ChannelFailed(msg.ch, PRECONDITION_FAILED, ttl)]
            if type(d["expiration"]) is not str:  # AMQP carries it as text: an AMQP reader sees it
                d = {**d, "expiration": str(ttl)}
        reply = d is not None and d.get("reply_to") == REPLY_TO
        items.append([ex, key, dict_to_raw(d) if d else NO_PROPS])
        if not runs or runs[-1][1:] != [ttl, reply]:
            runs.append([i, ttl, reply])
    out = []
    for j, (start, ttl, reply) in enumerate(runs):
        stop = runs[j + 1][0] if j + 1 < len(runs) else n
        out.append(m.PublishTo(msg.ch, ex, key, msg.mandatory, msg.bodies[start:stop],
                               items[start:stop], ttl, reply))
    return out


class NativeProtocol:
    """One native client connection's protocol state. `authenticate(user, password)` raises
    ProtocolError to refuse a login; `has_vhost(name)` says whether that vhost exists;
    `enter_vhost(user, vhost)` raises ProtocolError when the user has no permissions in it;
    `can_open()` returns why the node refuses connections now (a pause), or ""; `welcome()` is
    the Welcome to send once the client is in."""

    NAME = "client"
    SESSION_PROTOCOL = "warren"
    DEFAULT_CLIENT_NAME = ""

    def __init__(self, *, authenticate, can_open, welcome, hello: m.Hello, max_frame: int,
                 has_vhost=lambda name: name == "/", enter_vhost=lambda user, vhost: None):
        self.authenticate = authenticate
        self.enter_vhost = enter_vhost
        self.can_open = can_open
        self.has_vhost = has_vhost
        self.welcome = welcome
        self.max_frame = max_frame
        self.decoder = FrameDecoder(max_frame, decode_bytes)
        self.state = HANDSHAKE
        self.user = ""  # once logged in
        self._items: list = [hello]  # messages to send, encoded at the next write

    # --- state ------------------------------------------------------------------------------------
    @property
    def handshaking(self) -> bool:
        return self.state is HANDSHAKE

    @property
    def opened(self) -> bool:
        return self.state is OPEN

    @property
    def closed(self) -> bool:
        return self.state is CLOSED

    # --- bytes in -----------------------------------------------------------------------------------
    def receive_data(self, data: bytes, now: float) -> list:
        """Feed bytes from the client; returns the session commands (and the handshake's and
        errors' events) they make, in order. Nothing after a connection error is handled."""
        if self.state is CLOSED:
            return []
        try:
            msgs = self.decoder.feed(data)
            if not msgs:
                return msgs
            if self.state is HANDSHAKE:
                msgs[0] = self._login(msgs[0])  # the LoggedIn event in the auth's place
                rest = msgs[1:]
            else:
                rest = msgs
            checked = False
            for msg in rest:  # a frame a client may not send spoils the whole read
                if msg.KIND not in CLIENT_KINDS:
                    raise ProtocolError(UNEXPECTED_FRAME, f"message {msg.KIND!r} is not allowed here")
                t = type(msg)
                checked = checked or t is m.PublishTo or (t is m.Publish and msg.props is not None)
            if checked:  # publishes with properties: their user_id; those to an exchange: _routed
                msgs = [out for msg in msgs for out in self._publish_checked(msg)]
            return msgs
        except ProtocolError as exc:
            return self._fail(exc)

    def _publish_checked(self, msg):
        """A command as the session takes it: a publish whose user_id property is not the
        user's fails its channel (as RabbitMQ's); one to an exchange, or to a queue with
        messages that carry their own `expiration`, is `_routed` (the default exchange routes
        by the queue's name), so this is the one place a message's TTL is read from its
        properties, as AMQP's front end reads it from its header."""
        t = type(msg)
        if t is not m.Publish and t is not m.PublishTo:
            return (msg,)
        expiring = False
        for d in msg.props or ():
            if type(d) is dict:
                if d.get("user_id", self.user) != self.user:
                    return (ChannelFailed(msg.ch, PRECONDITION_FAILED, f"user_id property set to "
                                          f"'{d['user_id']}' but authenticated user was '{self.user}'"),)
                expiring = expiring or d.get("expiration") is not None
        if t is m.Publish:
            if not expiring:
                return (msg,)
            msg = m.PublishTo(msg.ch, "", msg.queue, False, msg.bodies, msg.props, None, False)
        return _routed(msg)

    def _login(self, msg) -> LoggedIn:
        if msg.KIND != "client.auth":
            if msg.KIND == "error":
                raise ProtocolError(msg.code, msg.text)
            raise ProtocolError(UNEXPECTED_FRAME, f"message {msg.KIND!r} is not allowed here")
        if msg.version != m.PROTOCOL_VERSION:
            raise ProtocolError(VERSION_MISMATCH, f"protocol version {msg.version} not supported "
                                                  f"(this node speaks {m.PROTOCOL_VERSION})")
        self.authenticate(msg.user, msg.password)
        if not self.has_vhost(msg.vhost):
            raise ProtocolError(NOT_ALLOWED, vhost_not_found(msg.vhost))
        self.enter_vhost(msg.user, msg.vhost)
        refusal = self.can_open()
        if refusal:
            raise ProtocolError(CONNECTION_FORCED, refusal)
        self._items.append(self.welcome())
        self.state = OPEN
        self.user = msg.user
        return LoggedIn(msg.user, {"connection_name": msg.client_name}, msg.vhost)

    def receive_eof(self, now: float) -> list:
        """The client went away: in the middle of a frame, or of the handshake, it is told
        why (if it still reads)."""
        if self.state is CLOSED:
            return []
        try:
            self.decoder.check_eof()
            if self.state is HANDSHAKE:
                raise ProtocolError(ACCESS_REFUSED, "connection closed during the handshake")
        except ProtocolError as exc:
            return self._fail(exc)
        self.state = CLOSED
        return []

    def _fail(self, exc: ProtocolError) -> list:
        self.close(exc.code, exc.text, 0.0)
        return [ConnectionFailed(exc.code, exc.text), Closed(exc.text)]

    # --- session output -> frames ----------------------------------------------------------------
    def send_output(self, msg) -> None:
        """One output of the session: messages published over AMQP get their properties as
        warren's client reads them; AMQP-only outputs (Returned) have no msgpack form."""
        if self.state is CLOSED:
            return
        t = type(msg)
        if t is m.Deliver:
            props = msg.props
            if props is not None:
                msg.props = native_list(props)
                if msg.props is not props:  # some were published over AMQP or to an exchange
                    msg.routes = [list(p[:2]) if isinstance(p, (list, tuple)) else None for p in props]
        elif t is m.Reply:
            v = msg.value
            if type(v) is list and len(v) == 5 and isinstance(v[3], (list, tuple)):
                # a basic.get answer [tag, body, redelivered, props, n], and where it was sent
                item = v[3]
                v[3] = native_list([item])[0]
                v.append(list(item[:2]))
        elif t is m.Returned:
            msg.props = native_list(msg.props)
        self._items.append(msg)

    def send_blocked(self, blocked: bool, reason: str = "", source: str = "credit") -> None:
        """A memory alarm holds this publishing client (or no longer does): it is told.
        Credit flow holds it untold."""
        if source == "memory" and self.state is OPEN:
            self._items.append(m.Blocked(reason) if blocked else m.Unblocked())

    def hold_reading(self, held: bool, now: float) -> None:
        """Nothing to do: warren's protocol has no heartbeats to stop checking."""

    def close(self, code: int, text: str, now: float) -> None:
        """Close from the server's side: an error frame that says why, then nothing more."""
        if self.state is CLOSED:
            return
        self._items.append(m.Error(code, text))
        self.state = CLOSED

    def client_closed(self, now: float) -> None:
        """The client said goodbye (its connection.close is answered): nothing more."""
        self.state = CLOSED

    # --- bytes out and time --------------------------------------------------------------------
    @property
    def has_output(self) -> bool:
        return bool(self._items)

    def take_output(self, now: float) -> list | None:
        """Every frame queued, as the parts of one write (None if nothing is)."""
        if not self._items:
            return None
        batch, self._items = self._items, []
        return frame_parts(batch, self.max_frame)

    def next_deadline(self) -> float | None:
        return None  # the driver keeps the handshake's time limit

    def tick(self, now: float) -> list:
        return []


class NativeConnection(ClientConnection):
    """A connection on the client port: the connection driver speaking warren's protocol."""

    def make_protocol(self, now: float) -> NativeProtocol:
        node = self.node
        max_frame = node.config.max_frame
        return NativeProtocol(
            authenticate=self._authenticate, can_open=self._can_open, has_vhost=self._has_vhost,
            enter_vhost=self._enter_vhost,
            welcome=lambda: m.Welcome(node.name, node.cluster.md.cluster_name, max_frame),
            hello=m.Hello(m.PROTOCOL_VERSION, node.name, node.new_nonce(), max_frame),
            max_frame=max_frame)

    def _can_open(self) -> str:
        self._check_connection_limit()
        node = self.node
        return node.paused_reason() if node.cluster.paused else ""
