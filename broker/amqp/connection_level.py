"""The connection level (channel 0) of the AMQP 0-9-1 protocol (broker/amqp/protocol.py): the
protocol header, the handshake (start, tune, open), connection.close either way, the
connection.blocked notices, heartbeats and the close's time limit, and what the connection driver
(broker/connection.py) asks of a protocol. `ConnectionPart` is one part of `AmqpProtocol`; it
uses the protocol's state, output (`_send`, `_method`) and events.
"""

from __future__ import annotations

import enum
import platform

from pamqp import commands, decode

from wire.errors import (ACCESS_REFUSED, COMMAND_INVALID, CONNECTION_FORCED, NOT_ALLOWED,
                         NOT_IMPLEMENTED, UNEXPECTED_FRAME, CODE_NAMES, ProtocolError)

from ..frontend import Closed, ConnectionFailed, LoggedIn, vhost_not_found
from . import codec

SERVER_FRAME_MAX = 131072  # RabbitMQ's default
SERVER_CHANNEL_MAX = 2047
SERVER_HEARTBEAT = 60
CLOSE_TIMEOUT = 3.0  # seconds to wait for close-ok after a connection.close of ours
CAPABILITIES = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": False,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": False,
}


_START_FRAMES: dict[tuple, bytes] = {}  # (version, cluster, node) -> the connection.start frame


class State(enum.Enum):
    HEADER = "waiting for the protocol header"
    START_OK = "waiting for connection.start-ok"
    TUNE_OK = "waiting for connection.tune-ok"
    OPEN = "waiting for connection.open"
    OPENED = "open"
    CLOSING = "closing (connection.close sent)"
    CLOSED = "closed"


HANDSHAKING = frozenset({State.HEADER, State.START_OK, State.TUNE_OK, State.OPEN})


def _error_text(code: int, text: str) -> str:
    return f"{CODE_NAMES.get(code, str(code))} - {text}"


class ConnectionPart:
    """Channel 0 and the connection's lifetime (see the module docstring)."""

    def _check_header(self, head: bytes) -> bool:
        if head != codec.PROTOCOL_HEADER:
            # the spec: answer with the protocol version we speak, then close
            self._send(codec.PROTOCOL_HEADER)
            self.state = State.CLOSED
            self._events.append(Closed(f"bad protocol header {head!r}"))
            return False
        self.state = State.START_OK
        key = (self.version, self.cluster, self.node)
        start = _START_FRAMES.get(key)
        if start is None:  # the same for every connection to this node: encoded once
            props = {
                "product": "warren",
                "version": self.version,
                "platform": f"Python {platform.python_version()}",
                "information": "an in-memory broker implementing RabbitMQ's classic queue mirroring",
                "cluster_name": self.cluster,
                "node": self.node,
                "capabilities": dict(CAPABILITIES),
            }
            start = _START_FRAMES[key] = codec.method_frame(
                commands.Connection.Start(0, 9, props, "PLAIN AMQPLAIN", "en_US"), 0)
        self._send(start)
        return True

    # --- handshake -----------------------------------------------------------------------------
    def _handshake(self, kind: int, ch: int, payload: bytes, now: float) -> None:
        state = self.state
        if kind != codec.METHOD or ch != 0:
            raise ProtocolError(UNEXPECTED_FRAME, f"frame type {kind} on channel {ch} during "
                                                  f"the connection handshake ({state.value})")
        method = codec.decode_method(payload)
        if isinstance(method, commands.Connection.Close):
            self._method(0, commands.Connection.CloseOk())
            self._finish("the client closed the connection during the handshake")
            return
        want = {State.START_OK: commands.Connection.StartOk, State.TUNE_OK: commands.Connection.TuneOk,
                State.OPEN: commands.Connection.Open}[state]
        if not isinstance(method, want):
            raise ProtocolError(COMMAND_INVALID, f"expected '{codec.method_name(want.index)}', got "
                                                 f"'{codec.method_name(method.index)}'")
        if state is State.START_OK:
            self._start_ok(method)
        elif state is State.TUNE_OK:
            self._tune_ok(method, now)
        else:
            self._open(method)

    def _start_ok(self, method) -> None:
        self.client_properties = method.client_properties or {}
        caps = self.client_properties.get("capabilities")
        self.capabilities = caps if isinstance(caps, dict) else {}
        mech = method.mechanism
        response = method.response
        if isinstance(response, str):
            response = response.encode("utf-8", "surrogateescape")
        if mech == "PLAIN":
            parts = bytes(response or b"").split(b"\x00")
            if len(parts) != 3:
                raise ProtocolError(ACCESS_REFUSED, "malformed PLAIN response")
            user, password = parts[1], parts[2]
        elif mech == "AMQPLAIN":
            try:
                _, table = decode.field_table(len(response).to_bytes(4, "big") + response)
            except (ValueError, TypeError):
                raise ProtocolError(ACCESS_REFUSED, "malformed AMQPLAIN response") from None
            user, password = table.get("LOGIN", b""), table.get("PASSWORD", b"")
        else:
            raise ProtocolError(COMMAND_INVALID, f"unknown authentication mechanism '{mech}' "
                                                 "(warren offers PLAIN and AMQPLAIN)")
        user = user.decode(errors="replace") if isinstance(user, (bytes, bytearray)) else str(user)
        password = password.decode(errors="replace") if isinstance(password, (bytes, bytearray)) else str(password)
        try:
            self.authenticate(mech, user, password)
        except ProtocolError as exc:
            text = f"Login was refused using authentication mechanism {mech}: {exc.text}"
            if self.capabilities.get("authentication_failure_close"):
                self._connection_error(ACCESS_REFUSED, text)
            else:  # older clients: RabbitMQ just closes the socket
                self.state = State.CLOSED
                self._events.append(ConnectionFailed(ACCESS_REFUSED, text))
                self._events.append(Closed(text))
            return
        self.user = user
        self.mechanism = mech
        self.state = State.TUNE_OK
        self._method(0, commands.Connection.Tune(self.server_channel_max, self.server_frame_max,
                                                 self.server_heartbeat))

    def _tune_ok(self, method, now: float) -> None:
        frame_max = method.frame_max or self.server_frame_max
        if frame_max < codec.FRAME_MIN:
            raise ProtocolError(NOT_ALLOWED, f"frame_max={frame_max} < {codec.FRAME_MIN} min size")
        if frame_max > self.server_frame_max:
            raise ProtocolError(NOT_ALLOWED, f"frame_max={frame_max} > {self.server_frame_max} max size")
        channel_max = method.channel_max or self.server_channel_max
        if channel_max > self.server_channel_max:
            raise ProtocolError(NOT_ALLOWED, f"channel_max={channel_max} > "
                                             f"{self.server_channel_max} max channels")
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = max(0, method.heartbeat or 0)
        self.last_recv = now
        self.state = State.OPEN

    def _open(self, method) -> None:
        vhost = method.virtual_host
        if not self.has_vhost(vhost):
            raise ProtocolError(NOT_ALLOWED, vhost_not_found(vhost))
        self.enter_vhost(self.user, vhost)
        self.vhost = vhost
        refusal = self.can_open()
        if refusal:
            raise ProtocolError(CONNECTION_FORCED, refusal)
        self.state = State.OPENED
        self._method(0, commands.Connection.OpenOk())
        self._events.append(LoggedIn(self.user, self.client_properties, self.vhost))

    def _connection_method(self, method) -> None:
        if isinstance(method, commands.Connection.Close):
            self._flush_batch()
            self._method(0, commands.Connection.CloseOk())
            reason = f"the client closed the connection ({method.reply_code} {method.reply_text})"
            self._finish(reason)
        elif isinstance(method, (commands.Connection.Blocked, commands.Connection.Unblocked,
                                 commands.Connection.CloseOk)):
            return
        elif isinstance(method, commands.Connection.UpdateSecret):
            raise ProtocolError(NOT_IMPLEMENTED, "connection.update-secret")
        else:
            raise ProtocolError(COMMAND_INVALID, f"'{codec.method_name(method.index)}' is not "
                                                 "allowed on channel 0 of an open connection")

    # --- connection control -------------------------------------------------------------------
    def _method(self, ch: int, method) -> None:
        self._out.append(codec.method_frame(method, ch))

    def _send(self, data: bytes) -> None:
        self._out.append(data)

    def _connection_error(self, code: int, text: str) -> None:
        """Close the connection with `code` (a connection error)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._batch = None
        if self.state is State.HEADER:
            self.state = State.CLOSED
            self._events.append(Closed(text))
            return
        self._method(0, commands.Connection.Close(code, _error_text(code, text)[:255], 0, 0))
        self.state = State.CLOSING
        self.closing_since = self.last_recv
        self._events.append(ConnectionFailed(code, text))

    def close(self, code: int, text: str, now: float) -> None:
        """Close from the server's side (a session's connection error, stop_app, a pause):
        connection.close is sent, then only close-ok is read."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._batch = None
        if self.state is State.HEADER:
            self.state = State.CLOSED
            return
        self._method(0, commands.Connection.Close(code, _error_text(code, text)[:255], 0, 0))
        self.state = State.CLOSING
        self.closing_since = now

    def _finish(self, reason: str) -> None:
        self.state = State.CLOSED
        self._events.append(Closed(reason))

    def send_blocked(self, blocked: bool, reason: str = "", source: str = "credit") -> None:
        """The server holds this connection for `source` (credit flow, a memory alarm) or no
        longer does: connection.blocked when the first hold starts, connection.unblocked when
        the last ends, to clients that said they understand them."""
        before = bool(self.blocked)
        if blocked:
            self.blocked[source] = reason
        else:
            self.blocked.pop(source, None)
        after = bool(self.blocked)
        if before == after or self.state is not State.OPENED:
            return
        if not self.capabilities.get("connection.blocked"):
            return
        if after:
            self._method(0, commands.Connection.Blocked(reason[:255]))
        else:
            self._method(0, commands.Connection.Unblocked())

    def hold_reading(self, held: bool, now: float) -> None:
        """The driver stops (or starts again) reading from the client: a client that is not
        read cannot be heard, so its heartbeats are not checked meanwhile (as RabbitMQ does)."""
        self.reading = not held
        self.last_recv = now

    # --- time ----------------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        if self.state is State.CLOSING:
            return self.closing_since + CLOSE_TIMEOUT
        if self.state is not State.OPENED or not self.heartbeat:
            return None
        return min(self.last_sent + self.heartbeat / 2, self.last_recv + 2 * self.heartbeat)

    def tick(self, now: float) -> list:
        """Timers: heartbeats to send, a silent client, a close-ok that never came."""
        if self.state is State.CLOSING:
            if now >= self.closing_since + CLOSE_TIMEOUT:
                self._finish("no connection.close-ok from the client")
            return self._take_events()
        if self.state is not State.OPENED or not self.heartbeat:
            return []
        if self.reading and now - self.last_recv > 2 * self.heartbeat:
            self.state = State.CLOSED
            text = f"missed heartbeats from client, timeout: {self.heartbeat}s"
            self._events.append(ConnectionFailed(CONNECTION_FORCED, text))
            self._events.append(Closed(text))
            return self._take_events()
        if now - self.last_sent >= self.heartbeat / 2 and not self._out:
            self._out.append(codec.HEARTBEAT_FRAME)
        return []

    def data_to_send(self, now: float) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        self.last_sent = now
        return b"".join(out)

    @property
    def has_output(self) -> bool:
        return bool(self._out)

    def take_output(self, now: float) -> list | None:
        """The pending output as the parts of one write (None if there is none)."""
        data = self.data_to_send(now)
        return [data] if data else None

    # --- what else the connection driver asks (broker/frontend.py ClientProtocol) --------------
    @property
    def handshaking(self) -> bool:
        return self.state in HANDSHAKING

    @property
    def opened(self) -> bool:
        return self.state is State.OPENED

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    def receive_eof(self, now: float) -> list:
        """The client went away: nothing to tell it."""
        self.state = State.CLOSED
        return []

    def client_closed(self, now: float) -> None:
        """The session ended the connection on the client's word."""
        self.close(CONNECTION_FORCED, "closed", now)


