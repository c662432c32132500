"""What a client protocol tells the connection driver, and what the driver asks of it.

A client protocol (broker/native.py `NativeProtocol`, broker/amqp/protocol.py `AmqpProtocol`)
is a sans-IO state machine: bytes in, session commands and the events below out; session
outputs in, bytes out; time comes in as `now`. broker/connection.py drives either over a
socket: the same reader, writer, timer, credit and memory-alarm holds, and lifecycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


def vhost_not_found(vhost: str) -> str:
    """RabbitMQ's text for a login into a vhost that does not exist (530 NOT_ALLOWED)."""
    return f"vhost {vhost} not found"


@dataclass(slots=True)
class LoggedIn:
    """The client is who it says: the driver opens its session, in `vhost`."""
    user: str
    client_properties: dict
    vhost: str = "/"


@dataclass(slots=True)
class ChannelFailed:
    """A channel error found by the protocol (the session closes the channel: `fail_channel`)."""
    ch: int
    code: int
    text: str


@dataclass(slots=True)
class ConnectionFailed:
    """A connection error: the client was told why (or the connection is just gone)."""
    code: int
    text: str


@dataclass(slots=True)
class Closed:
    """The connection is over: close the socket once the output is written."""
    reason: str


class ClientProtocol(Protocol):
    """One client connection's protocol state, as broker/connection.py drives it."""

    NAME: str  # in log lines: "closing {NAME} connection"
    SESSION_PROTOCOL: str  # what list_connections shows
    DEFAULT_CLIENT_NAME: str  # a client that gives no name

    @property
    def handshaking(self) -> bool: ...  # the handshake's time limit runs

    @property
    def opened(self) -> bool: ...  # commands may go to the session

    @property
    def closed(self) -> bool: ...  # nothing more is read; the driver ends once output is written

    @property
    def has_output(self) -> bool: ...

    @property
    def state(self): ...  # compared by identity: a change wakes the driver's timer

    def receive_data(self, data: bytes, now: float) -> list: ...  # commands and events
    def receive_eof(self, now: float) -> list: ...  # the client went away
    def send_output(self, msg) -> None: ...  # one of the session's outputs
    def take_output(self, now: float) -> list | None: ...  # the parts of one write, if any
    def send_blocked(self, blocked: bool, reason: str = "", source: str = "credit") -> None: ...
    def hold_reading(self, held: bool, now: float) -> None: ...
    def next_deadline(self) -> float | None: ...
    def tick(self, now: float) -> list: ...  # events: ConnectionFailed, Closed
    def close(self, code: int, text: str, now: float) -> None: ...  # from the server's side
    def client_closed(self, now: float) -> None: ...  # the session ended on the client's close


class EndedProtocol:
    """What a driver holds in place of its protocol once the connection has ended and its
    socket is closed (broker/connection.py `serve`): closed, with nothing more to say. Dropping
    the real protocol breaks the cycle it makes with its driver (it holds the driver's methods
    as callbacks), so the protocol, its buffers and decoders are freed at once rather than at
    the interpreter's next full collection (tests/test_amqp_sim.py checks that an ended
    connection leaves nothing of warren's for it)."""

    NAME = SESSION_PROTOCOL = DEFAULT_CLIENT_NAME = "ended"
    handshaking = opened = has_output = False
    closed = True
    state = None

    def receive_data(self, data: bytes, now: float) -> list:
        return []

    def receive_eof(self, now: float) -> list:
        return []

    def take_output(self, now: float) -> list | None:
        return None

    def next_deadline(self) -> float | None:
        return None

    def tick(self, now: float) -> list:
        return []

    def send_output(self, msg) -> None:
        pass

    def send_blocked(self, blocked: bool, reason: str = "", source: str = "credit") -> None:
        pass

    def hold_reading(self, held: bool, now: float) -> None:
        pass

    def close(self, code: int, text: str, now: float) -> None:
        pass

    def client_closed(self, now: float) -> None:
        pass


ENDED = EndedProtocol()

__all__ = ["ENDED", "ChannelFailed", "ClientProtocol", "Closed", "ConnectionFailed", "EndedProtocol", "LoggedIn"]
