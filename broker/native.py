"""warren's own client protocol (msgpack frames, wire/messages.py) in front of a Session.

It owns the socket: the handshake (user, password, the loopback rule), the reader (client
frames -> Session.handle, holding the client while the session has no credit, and holding a
publishing client while a memory alarm is on, which it is told with `Blocked`/`Unblocked`
frames), the writer (one Outbox, batching), and the error path (a protocol error gets an Error
frame and the connection, not the node, is closed). What a session means is broker/session.py's
business.
"""

from __future__ import annotations

import ipaddress

import trio

from wire import messages as m
from wire.props import native_list
from wire.errors import ACCESS_REFUSED, CONNECTION_FORCED, VERSION_MISMATCH, ProtocolError

from .framed import FramedStream, Outbox
from .memory import PublisherGate
from .session import INLINE, SessionDriver

HANDSHAKE_TIMEOUT = 10.0
CLIENT_KINDS = frozenset({
    "channel.open", "channel.close", "queue.declare", "queue.delete", "queue.purge", "basic.qos",
    "confirm.select", "publish", "basic.consume", "basic.cancel", "basic.get", "ack", "nack",
    "connection.close", "tx.select", "tx.commit", "tx.rollback",
})


def is_loopback(peer: str, own_host: str) -> bool:
    host = peer.rsplit(":", 1)[0].strip("[]") if ":" in peer else peer
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == own_host  # simulated network: a client on the node's own host


def check_login(config, user: str, password: str, peer: str) -> None:
    """The users and the loopback rule (shared by every front end)."""
    if config.users.get(user) != password:
        raise ProtocolError(ACCESS_REFUSED, f"login refused for user '{user}': wrong user name or password")
    if user in config.loopback_users and not is_loopback(peer, config.advertise_host):
        raise ProtocolError(ACCESS_REFUSED,
                            f"user '{user}' can only connect via localhost (loopback_users)")


class NativeConnection:
    def __init__(self, node, stream, peer: str):
        self.node = node
        self.framed = FramedStream(stream, node.config.max_frame)
        self.peer = peer
        self.outbox = Outbox(self.framed)
        self.session: SessionDriver | None = None
        self.gate: PublisherGate | None = None
        self.scope = trio.CancelScope()
        self.log = node.log

    async def serve(self) -> None:
        node = self.node
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                user, client_name = await self._handshake()
        except ProtocolError as exc:
            self.log.warning("client connection refused", peer=self.peer, reason=exc.text)
            with trio.move_on_after(2):  # no writer runs yet: say why straight away
                try:
                    await self.framed.send_now(m.Error(exc.code, exc.text))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            return
        except trio.TooSlowError:
            return
        session = self.session = SessionDriver.open(node, self.peer, user, client_name, self._out)
        core = session.core
        sid = core.sid
        node.connections[sid] = self
        self.gate = PublisherGate(node.memory, core, self._tell_blocked)
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    written = trio.Event()
                    nursery.start_soon(self._write, written)
                    error = await self._read(session)
                    if error is not None:
                        self._tell_error(error)
                    # the writer sends what is queued (the close reply, the error), then stops;
                    # nothing else writes meanwhile (two senders on one stream collide)
                    self.outbox.close()
                    with trio.move_on_after(2):
                        await written.wait()
                    nursery.cancel_scope.cancel()
        finally:
            self.gate.close()
            node.sessions.pop(sid, None)
            node.connections.pop(sid, None)
            core.close()
            self.outbox.close()
            if core.exclusive_queues:
                node.spawn(session.delete_exclusive)

    def _out(self, msg) -> None:
        """Session output to the client: messages published over AMQP get their properties as
        warren's client reads them; AMQP-only outputs have no msgpack form."""
        t = type(msg)
        if t is m.Deliver:
            if msg.props is not None:
                msg.props = native_list(msg.props)
        elif t is m.Reply:
            v = msg.value
            if type(v) is list and len(v) == 5 and isinstance(v[3], (list, tuple)):
                v[3] = native_list([v[3]])[0]  # a basic.get answer [tag, body, redelivered, props, n]
        elif t is m.Returned:
            return
        self.outbox.put(msg)

    async def _handshake(self) -> tuple[str, str]:
        node = self.node
        await self.framed.send_now(m.Hello(m.PROTOCOL_VERSION, node.name, node.new_nonce(), self.framed.max_frame))
        auth = await self.framed.receive(frozenset({"client.auth"}))
        if auth is None:
            raise ProtocolError(ACCESS_REFUSED, "connection closed during the handshake")
        if auth.version != m.PROTOCOL_VERSION:
            raise ProtocolError(VERSION_MISMATCH,
                                f"protocol version {auth.version} not supported (this node speaks {m.PROTOCOL_VERSION})")
        check_login(node.config, auth.user, auth.password, self.peer)
        if node.cluster.paused:
            raise ProtocolError(CONNECTION_FORCED, node.paused_reason())
        await self.framed.send_now(m.Welcome(node.name, node.cluster.md.cluster_name, self.framed.max_frame))
        return auth.user, auth.client_name

    async def _read(self, session: SessionDriver) -> ProtocolError | None:
        """Client frames until the client leaves; returns the error to report, if any."""
        memory = self.node.memory
        gate = self.gate
        core = session.core
        while True:
            if not core.has_credit:
                await session.wait_credit()
            if memory.blocked and core.publisher:
                await gate.hold()
            try:
                batch = await self.framed.receive_batch(CLIENT_KINDS)
            except ProtocolError as exc:
                return exc
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not batch:
                return None
            if core.publisher:
                memory.took(self.framed.last_read)
                if memory.blocked:
                    # the alarm went on while this read waited: what it brought is held, not
                    # handled, until the alarm is over (one read of this client's at most)
                    await gate.hold()
            i, n = 0, len(batch)
            while i < n:
                msg = batch[i]
                try:
                    if type(msg) in INLINE:  # a run of publishes and acks: one batch of input
                        i = core.handle_run(batch, i)
                        if core.full_links:
                            await session.wait_link_room()
                        continue
                    i += 1
                    if await session.handle(msg):
                        return None
                except ProtocolError as exc:
                    return exc

    def _tell_blocked(self, blocked: bool, reason: str) -> None:
        self.outbox.put(m.Blocked(reason) if blocked else m.Unblocked())

    async def _write(self, done: trio.Event) -> None:
        try:
            await self.outbox.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.scope.cancel()
        finally:
            done.set()

    def _tell_error(self, exc: ProtocolError) -> None:
        """Tell the client why, after what is queued for it; the connection then closes (the
        node and other connections carry on)."""
        if self.session is not None:
            self.log.warning("closing client connection", conn=self.session.core.conn_id, code=exc.code,
                             reason=exc.text)
        self.outbox.put(m.Error(exc.code, exc.text))

    def force_close(self, code: int, text: str) -> None:
        """Close this connection from the server's side (pause, stop_app)."""
        self.outbox.put(m.Error(code, text))
        self.outbox.close()
        self.node.spawn(self._cancel_soon)

    async def _cancel_soon(self) -> None:
        with trio.move_on_after(1.0):
            while not self.outbox.closed or self.outbox._queued:
                await trio.sleep(0.01)
        self.scope.cancel()
