"""One client connection on a socket, whatever protocol it speaks: the tasks, timers, holds and
lifecycle around a sans-IO client protocol (broker/frontend.py `ClientProtocol`: warren's own,
broker/native.py, or AMQP 0-9-1, broker/amqp/protocol.py) and its session
(broker/session/driver.py).

One reader (bytes -> protocol -> session commands, awaited in order; a read's run of publishes
and acks is one batch of input, `Session.handle_run`), one writer (whatever the protocol has to
send: sent at once, and what comes while a send is in flight goes out together in the next
one), one timer (the handshake's time limit, heartbeats, a close that is never answered). The
writer is corked (broker/framed.py `Cork`): output given during a queue's round is written at
the round's end from that task, straight to the socket when the writer task is idle.

While the session has no credit (its window of unconfirmed publishes is full: a mirror is
behind), and while a memory alarm is on anywhere in the cluster and the connection publishes
(broker/memory.py `PublisherGate`), the reader stops reading; the protocol tells the client if
it can (`send_blocked`) and stops checking its heartbeats meanwhile (`hold_reading`). Errors
close this connection only, after the client is told why; the node carries on.
"""

from __future__ import annotations

import ipaddress
import math

import trio

from mirroring.access import SALT_BYTES, check_password, hash_password
from wire.errors import ACCESS_REFUSED, INTERNAL_ERROR, NOT_ALLOWED, ProtocolError

from .framed import CORK, DirectWrites, Reader, direct_socket
from .log import clip
from .frontend import ENDED, ChannelFailed, ClientProtocol, Closed, ConnectionFailed, LoggedIn
from .memory import PublisherGate
from .session import INLINE, SessionDriver

READ_SIZE = 256 * 1024
CREDIT_HELD = ("warren credit flow: too many unconfirmed publishes on this connection (a mirror "
               "is behind)")


def is_loopback(peer: str, own_host: str) -> bool:
    host = peer.rsplit(":", 1)[0].strip("[]") if ":" in peer else peer
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == own_host  # simulated network: a client on the node's own host


_NO_USER = hash_password("", bytes(SALT_BYTES))  # an unknown user's password is checked against it


def check_login(md, config, user: str, password: str, peer: str) -> None:
    """The users of the metadata `md` (salted hashes, mirroring/access.py) and the loopback rule
    (shared by every front end)."""
    record = md.users.get(user)
    # an unknown user costs a hash too: the answer's time does not tell which users exist
    if not check_password(record.password_hash if record is not None else _NO_USER, password) \
            or record is None:
        raise ProtocolError(ACCESS_REFUSED,
                            f"login refused for user '{clip(user)}': wrong user name or password")
    if user in config.loopback_users and not is_loopback(peer, config.advertise_host):
        raise ProtocolError(ACCESS_REFUSED,
                            f"user '{clip(user)}' can only connect via localhost (loopback_users)")


def check_vhost_access(md, user: str, vhost: str) -> None:
    """A user with no permissions in the vhost is refused at connection.open (RabbitMQ's text)."""
    if md.access(user, vhost) is None:
        raise ProtocolError(NOT_ALLOWED, f"access to vhost '{vhost}' refused for user '{user}'")


class ClientConnection:
    """The driver of one client connection; a front end's subclass makes its protocol
    (`make_protocol`)."""

    def __init__(self, node, stream, peer: str):
        self.node = node
        self.stream = stream
        self.peer = peer
        self.log = node.log
        config = node.config
        self.handshake_timeout = config.handshake_timeout
        self.login_refused = ""  # the refusal of this connection's login, once it is refused
        self._answer_late = False  # a refused login's answer waits for login_failure_delay
        now = trio.current_time()
        self.started = now
        self.proto: ClientProtocol = self.make_protocol(now)
        self.session: SessionDriver | None = None
        self.gate: PublisherGate | None = None
        self.scope = trio.CancelScope()
        self._wake = trio.Event()
        self._stop = trio.Event()
        self._done = False
        self._held = False  # noted by the Cork, to be flushed at the end of the stretch
        self._direct = DirectWrites(direct_socket(stream))
        self._timer_scope: trio.CancelScope | None = None  # the timer's sleep (`_timer`)
        self._timer_state = None  # the protocol's state when the timer went to sleep
        self._timer_handshaking = False  # and whether it was handshaking then

    def make_protocol(self, now: float) -> ClientProtocol:
        raise NotImplementedError

    def _authenticate(self, user: str, password: str) -> None:
        """The login check; a refusal is logged (at most a line a second per node) and
        answered only after `login_failure_delay` (the reader waits it out: `_refused_login`)."""
        try:
            check_login(self.node.md, self.node.config, user, password, self.peer)
        except ProtocolError as exc:
            self.login_refused = exc.text
            self._answer_late = True
            self.node.stranger_log.warning(f"{self.proto.NAME} login failed", peer=self.peer,
                                           user=clip(user), reason=exc.text)
            raise

    def _enter_vhost(self, user: str, vhost: str) -> None:
        check_vhost_access(self.node.md, user, vhost)

    def _has_vhost(self, name: str) -> bool:
        return name in self.node.md.vhosts

    def _check_connection_limit(self) -> None:
        """max_connections: a connection past it is refused when it asks to open (RabbitMQ's
        connection_max)."""
        limit = self.node.config.max_connections
        if limit and self.node.client_sockets > limit:
            raise ProtocolError(NOT_ALLOWED, f"connection refused: node connection limit ({limit}) is reached")

    async def _refused_login(self) -> None:
        """A refused login is answered after login_failure_delay, in this connection's task
        only (guessing passwords is slow; other connections carry on). The handshake's time
        limit still holds meanwhile."""
        delay = self.node.config.login_failure_delay
        if delay > 0:
            await trio.sleep(delay)

    # --- lifetime -------------------------------------------------------------------------------
    async def serve(self) -> None:
        node = self.node
        stop = self._stop
        writer_done = trio.Event()
        node.client_sockets += 1
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, writer_done)
                    nursery.start_soon(self._timer)
                    nursery.start_soon(self._reader)
                    self._kick()  # a protocol that speaks first (warren's hello)
                    await stop.wait()
                    self._done = True  # the writer sends what is left, then ends
                    self._kick()
                    with trio.move_on_after(2):
                        await writer_done.wait()
                    nursery.cancel_scope.cancel()
        finally:
            node.client_sockets -= 1
            if self.gate is not None:
                self.gate.close()
            session = self.session
            if session is not None:
                core = session.core
                node.sessions.pop(core.sid, None)
                node.connections.pop(core.sid, None)
                core.close()
                if core.exclusive_queues:
                    node.spawn(session.delete_exclusive)
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                try:
                    await self.stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            # the protocol holds methods of this driver (its callbacks) and the driver holds
            # the protocol: left whole, every ended connection's objects and buffers would wait
            # for the interpreter's rare full collection (tens of MB under a flood of them)
            self.proto = ENDED
            self.session = self.gate = None  # (they hold methods of this driver too)

    def force_close(self, code: int, text: str) -> None:
        """Close this connection from the server's side (pause_minority, stop_app): the client
        is told why, then the connection ends (at once, or when the protocol's close is
        answered or times out)."""
        self.proto.close(code, text, trio.current_time())
        self._state_changed()
        self._kick()
        if self.proto.closed:
            self._stop.set()

    def _open_session(self, ev: LoggedIn) -> None:
        node = self.node
        props = ev.client_properties or {}
        name = props.get("connection_name") or props.get("product") or self.proto.DEFAULT_CLIENT_NAME
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        session = self.session = SessionDriver.open(node, self.peer, ev.user, str(name), self._out,
                                                    ev.vhost)
        core = session.core
        core.protocol = self.proto.SESSION_PROTOCOL
        node.connections[core.sid] = self
        self.gate = PublisherGate(node.memory, core, self._tell_memory)

    # --- output -----------------------------------------------------------------------------------
    def _kick(self) -> None:
        if not CORK.hold(self):
            self._wake.set()

    def _out(self, msg) -> None:
        """The session's output: frames for the writer."""
        self.proto.send_output(msg)
        self._kick()

    def flush(self) -> None:
        """End of a corked stretch (broker/framed.py Cork): write the output now if the writer
        task is idle, else leave it to the writer."""
        self._held = False
        direct = self._direct
        if self._done or not direct.can_write():
            self._wake.set()
            return
        parts = self.proto.take_output(trio.current_time())
        if parts and direct.write(parts):
            self._wake.set()

    def _take_output(self) -> list | None:
        return self.proto.take_output(trio.current_time())

    async def _writer(self, done: trio.Event) -> None:
        p = self.proto
        stream = self.stream
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                # no waiting for more: what the other tasks produce while this send is in
                # flight (send_all yields) forms the next write
                await self._direct.send(stream, self._take_output)
                if self._done and not p.has_output:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._stop.set()
        finally:
            done.set()

    # --- input ------------------------------------------------------------------------------------
    async def _reader(self) -> None:
        p = self.proto
        stream = Reader(self.stream)
        memory = self.node.memory
        try:
            while not p.closed:
                session = self.session
                if session is not None and not session.core.has_credit:
                    await self._wait_credit(session)
                gate = self.gate
                publisher = gate is not None and session.core.publisher
                if publisher and memory.blocked:
                    await self._hold(gate)
                data = await stream.receive_some(READ_SIZE)
                if not data:
                    self._handle_events(p.receive_eof(trio.current_time()))
                    self._kick()
                    return  # the client went away
                if publisher:
                    memory.took(len(data))
                    if memory.blocked:
                        # the alarm went on while this read waited: what it brought is held,
                        # not handled, until the alarm is over (one read of this client's at most)
                        await self._hold(gate)
                try:
                    events = p.receive_data(data, trio.current_time())
                except Exception as exc:  # a bug must cost this connection only, with a reason
                    self.log.exception(f"{p.NAME} connection failed", peer=self.peer)
                    p.close(INTERNAL_ERROR, f"internal error: {exc!r}"[:200], trio.current_time())
                    events = []
                if self._answer_late:
                    self._answer_late = False
                    await self._refused_login()
                i, n = 0, len(events)
                while i < n:  # in order; a run of publishes and acks as one batch of input
                    ev = events[i]
                    if type(ev) in INLINE and self.session is not None and p.opened:
                        i = self._run_inline(events, i)
                        if self.session.core.full_links:
                            await self.session.wait_link_room()
                    else:
                        await self._event(ev)
                        i += 1
                if p.state is not self._timer_state:
                    self._state_changed()
                self._kick()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._stop.set()

    async def _wait_credit(self, session: SessionDriver) -> None:
        """Read nothing while the session's window is full (the client is told if it can be)."""
        p = self.proto
        p.send_blocked(True, CREDIT_HELD)
        p.hold_reading(True, trio.current_time())
        self._kick()
        await session.wait_credit()
        p.send_blocked(False)
        p.hold_reading(False, trio.current_time())
        self._kick()

    async def _hold(self, gate: PublisherGate) -> None:
        """Read nothing from this publishing client while publishers are blocked (its
        heartbeats are not checked meanwhile: hold_reading)."""
        p = self.proto
        p.hold_reading(True, trio.current_time())
        await gate.hold()
        p.hold_reading(False, trio.current_time())

    def _tell_memory(self, blocked: bool, reason: str) -> None:
        """The memory alarm holds (or releases) this publishing connection."""
        self.proto.send_blocked(blocked, reason, source="memory")
        self._kick()

    def _run_inline(self, events: list, i: int) -> int:
        """A run of publishes and acks as one batch of input (Session.handle_run); a protocol
        error closes the connection."""
        core = self.session.core
        try:
            return core.handle_run(events, i)
        except ProtocolError as exc:
            self._close_for(exc)
            return len(events)  # the rest of the read is not handled: the connection closes

    def _close_for(self, exc: ProtocolError) -> None:
        self.log.warning(f"closing {self.proto.NAME} connection", conn=self.session.core.conn_id,
                         code=exc.code, reason=exc.text)
        self.proto.close(exc.code, exc.text, trio.current_time())

    def _handle_events(self, events: list) -> None:
        """Events of the protocol itself (no session command among them)."""
        for ev in events:
            self._protocol_event(ev)

    def _protocol_event(self, ev) -> None:
        session = self.session
        t = type(ev)
        if t is LoggedIn:
            self._open_session(ev)
        elif t is ChannelFailed:
            if session is not None:
                session.core.fail_channel(ev.ch, ev.code, ev.text)
        elif t is ConnectionFailed:
            if session is not None:
                self.log.warning(f"closing {self.proto.NAME} connection", peer=self.peer, code=ev.code,
                                 reason=clip(ev.text, 255), conn=session.core.conn_id)
            elif not self.login_refused:  # before the login: a stranger's, throttled (a refused login was logged)
                self.node.stranger_log.warning(f"{self.proto.NAME} handshake failed", peer=self.peer,
                                               code=ev.code, reason=clip(ev.text, 255))
        elif t is Closed:
            self.log.debug(f"{self.proto.NAME} connection closed", peer=self.peer, reason=clip(ev.reason, 255))

    async def _event(self, ev) -> None:
        session = self.session
        if type(ev) in (LoggedIn, ChannelFailed, ConnectionFailed, Closed):
            self._protocol_event(ev)
        elif session is not None and self.proto.opened:
            try:
                if await session.handle(ev):
                    self.proto.client_closed(trio.current_time())
            except ProtocolError as exc:
                self._close_for(exc)

    # --- time -------------------------------------------------------------------------------------
    async def _timer(self) -> None:
        """Heartbeats, the handshake's time limit and a close that is never answered. The task
        sleeps until the protocol's next deadline (before the connection is open, the end of
        the time the handshake has), and is woken sooner only when the connection's state
        changes (`_state_changed`), the one thing that brings a deadline forward: traffic only
        moves the heartbeat deadlines later, and a wake at a passed one finds nothing due (one
        wake-up a second per connection would be 10,000 a second for nothing on a node holding
        10,000 idle ones)."""
        p = self.proto
        while True:
            now = trio.current_time()
            self._timer_state = p.state
            self._timer_handshaking = p.handshaking
            deadline = p.next_deadline()
            if p.handshaking:
                limit = self.started + self.handshake_timeout
                deadline = limit if deadline is None else min(deadline, limit)
            elif deadline is None:
                deadline = math.inf
            with trio.CancelScope(deadline=max(deadline, now + 0.01)) as self._timer_scope:
                await trio.sleep_forever()
            self._timer_scope = None
            now = trio.current_time()
            if p.handshaking and now - self.started >= self.handshake_timeout:
                self.node.stranger_log.warning(f"{p.NAME} handshake timed out", peer=self.peer,
                                               seconds=self.handshake_timeout)
                self._stop.set()
                return
            for ev in p.tick(now):
                if type(ev) is ConnectionFailed:
                    self.log.warning(f"closing {p.NAME} connection", peer=self.peer, reason=ev.text)
                elif type(ev) is Closed:
                    self._stop.set()
                    return
            if p.has_output:
                self._kick()

    def _state_changed(self) -> None:
        """Wake the timer if the connection's state moved since it went to sleep, other than
        from one step of the handshake to the next (its time limit stays the same)."""
        scope = self._timer_scope
        p = self.proto
        if scope is not None and p.state is not self._timer_state \
                and not (p.handshaking and self._timer_handshaking):
            scope.cancel()
