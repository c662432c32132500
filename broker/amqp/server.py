"""The trio side of an AMQP 0-9-1 connection: the socket, the tasks and the timers around the
sans-IO protocol (broker/amqp/protocol.py) and the session (broker/session.py).

One reader (bytes -> protocol -> session commands, awaited in order), one writer (whatever the
protocol has to send: sent at once, and what comes while a send is in flight goes out together
in the next one), one timer (heartbeats, the handshake deadline, a close-ok that never comes).
While the session has no credit (its window of unconfirmed publishes is full: a mirror is
behind), and while a memory alarm is on anywhere in the cluster and the connection publishes
(broker/memory.py's PublisherGate), the reader stops reading and the client is told
`connection.blocked` until it is released (`connection.unblocked`); its heartbeats are not
checked meanwhile. Errors close this connection only; the node carries on.
"""

from __future__ import annotations

import math

import trio

from wire.errors import CONNECTION_FORCED, INTERNAL_ERROR, ProtocolError

from ..framed import CORK, DirectWrites, Reader, direct_socket
from ..memory import PublisherGate
from ..native import check_login
from ..session import INLINE, Session
from . import protocol as proto

READ_SIZE = 256 * 1024
HANDSHAKE_TIMEOUT = 10.0
HANDSHAKING = frozenset({proto.State.HEADER, proto.State.START_OK, proto.State.TUNE_OK,
                         proto.State.OPEN})  # the handshake's time limit runs


class AmqpConnection:
    def __init__(self, node, stream, peer: str):
        self.node = node
        self.stream = stream
        self.peer = peer
        self.log = node.log
        now = trio.current_time()
        self.started = now
        cfg = node.config
        self.proto = proto.AmqpProtocol(
            authenticate=self._authenticate, can_open=self._can_open, node=node.name,
            cluster=node.cluster.md.cluster_name, max_message=max(4096, cfg.max_frame - 65536),
            now=now)
        self.session: Session | None = None
        self.gate: PublisherGate | None = None
        self.scope = trio.CancelScope()
        self._wake = trio.Event()
        self._stop = trio.Event()
        self._done = False
        self._held = False  # noted by the Cork, to be flushed at the end of the stretch
        self._direct = DirectWrites(direct_socket(stream))
        self._timer_scope: trio.CancelScope | None = None  # the timer's sleep (`_timer`)
        self._timer_state = None  # the protocol's state when the timer went to sleep

    # --- callbacks of the protocol ---------------------------------------------------------------
    def _authenticate(self, mechanism: str, user: str, password: str) -> None:
        check_login(self.node.config, user, password, self.peer)

    def _can_open(self) -> str:
        node = self.node
        if not node.app_running:
            return f"node {node.name} is not running (its app is stopped)"
        if node.cluster.paused:
            return node.paused_reason()
        return ""

    # --- lifetime -------------------------------------------------------------------------------
    async def serve(self) -> None:
        node = self.node
        stop = self._stop = trio.Event()
        writer_done = trio.Event()
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, writer_done)
                    nursery.start_soon(self._timer)
                    nursery.start_soon(self._reader)
                    await stop.wait()
                    self._done = True  # the writer sends what is left, then ends
                    self._kick()
                    with trio.move_on_after(2):
                        await writer_done.wait()
                    nursery.cancel_scope.cancel()
        finally:
            if self.gate is not None:
                self.gate.close()
            session = self.session
            if session is not None:
                node.sessions.pop(session.sid, None)
                node.connections.pop(session.sid, None)
                session.close()
                if session.exclusive_queues:
                    node.spawn(session.delete_exclusive)
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                try:
                    await self.stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass

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
        parts = self._take_output()
        if parts and direct.write(parts):
            self._wake.set()

    def _take_output(self) -> list | None:
        """The protocol's pending output as one write (None if there is none)."""
        data = self.proto.data_to_send(trio.current_time())
        return [data] if data else None

    async def _reader(self) -> None:
        p = self.proto
        stream = Reader(self.stream)
        memory = self.node.memory
        try:
            while p.state is not proto.State.CLOSED:
                session = self.session
                if session is not None and not session.has_credit:
                    p.send_blocked(True, "warren credit flow: too many unconfirmed publishes on "
                                         "this connection (a mirror is behind)")
                    p.hold_reading(True, trio.current_time())
                    self._kick()
                    await session.wait_credit()
                    p.send_blocked(False)
                    p.hold_reading(False, trio.current_time())
                    self._kick()
                gate = self.gate
                publisher = gate is not None and session.publisher
                if publisher and memory.blocked:
                    await self._hold(gate)
                data = await stream.receive_some(READ_SIZE)
                if not data:
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
                    self.log.exception("AMQP connection failed", peer=self.peer)
                    p.close(INTERNAL_ERROR, f"internal error: {exc!r}"[:200], trio.current_time())
                    events = []
                i, n = 0, len(events)
                while i < n:
                    ev = events[i]
                    if type(ev) in INLINE and self.session is not None \
                            and p.state is proto.State.OPENED:
                        i = self._run_inline(events, i)
                        if self.session.full_links:
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

    async def _hold(self, gate) -> None:
        """Read nothing from this publishing client while publishers are blocked (its
        heartbeats are not checked meanwhile: Protocol.hold_reading)."""
        p = self.proto
        p.hold_reading(True, trio.current_time())
        await gate.hold()
        p.hold_reading(False, trio.current_time())

    def _run_inline(self, events: list, i: int) -> int:
        """A run of publishes and acks as one batch of input (Session.handle_run); a protocol
        error closes the connection."""
        session = self.session
        try:
            return session.handle_run(events, i)
        except ProtocolError as exc:
            self.log.warning("closing AMQP connection", conn=session.conn_id, code=exc.code,
                             reason=exc.text)
            self.proto.close(exc.code, exc.text, trio.current_time())
            return len(events)  # the rest of the read is not handled: the connection closes

    async def _event(self, ev) -> None:
        session = self.session
        t = type(ev)
        if t is proto.LoggedIn:
            self._open_session(ev)
        elif t is proto.ChannelFailed:
            if session is not None:
                session.fail_channel(ev.ch, ev.code, ev.text)
        elif t is proto.ConnectionFailed:
            self.log.warning("closing AMQP connection", peer=self.peer, code=ev.code, reason=ev.text,
                             conn=session.conn_id if session else None)
        elif t is proto.Closed:
            self.log.debug("AMQP connection closed", peer=self.peer, reason=ev.reason)
        elif session is not None and self.proto.state is proto.State.OPENED:
            try:
                if await session.handle(ev):
                    self.proto.close(CONNECTION_FORCED, "closed", trio.current_time())
            except ProtocolError as exc:
                self.log.warning("closing AMQP connection", conn=session.conn_id, code=exc.code,
                                 reason=exc.text)
                self.proto.close(exc.code, exc.text, trio.current_time())

    def _open_session(self, ev: proto.LoggedIn) -> None:
        node = self.node
        props = ev.client_properties or {}
        name = props.get("connection_name") or props.get("product") or "AMQP client"
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        sid = node.new_session_id()
        session = self.session = Session(node, sid, self.peer, ev.user, str(name), self._out)
        session.protocol = "AMQP 0-9-1"
        node.sessions[sid] = session
        node.connections[sid] = self
        self.gate = PublisherGate(node.memory, session, self._tell_memory)

    def _tell_memory(self, blocked: bool, reason: str) -> None:
        """The memory alarm holds (or releases) this publishing connection."""
        self.proto.send_blocked(blocked, reason, source="memory")
        self._kick()

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

    async def _timer(self) -> None:
        """Heartbeats, the handshake's time limit and a close that is never answered. The task
        sleeps until the protocol's next deadline (before the connection is open, the end of
        the time the handshake has), and is woken sooner only when the connection's state
        changes (`_state_changed`), the one thing that brings a deadline forward: traffic only
        moves the heartbeat deadlines later, and a wake at a passed one finds nothing due. It
        used to wake every second whatever the deadline: one wake-up a second per connection,
        10,000 a second for nothing on a node holding 10,000 idle ones."""
        p = self.proto
        while True:
            now = trio.current_time()
            self._timer_state = p.state
            deadline = p.next_deadline()
            if p.state in HANDSHAKING:
                limit = self.started + HANDSHAKE_TIMEOUT
                deadline = limit if deadline is None else min(deadline, limit)
            elif deadline is None:
                deadline = math.inf
            with trio.CancelScope(deadline=max(deadline, now + 0.01)) as self._timer_scope:
                await trio.sleep_forever()
            self._timer_scope = None
            now = trio.current_time()
            if p.state in HANDSHAKING and now - self.started >= HANDSHAKE_TIMEOUT:
                self.log.info("AMQP handshake timed out", peer=self.peer, state=p.state.value)
                self._stop.set()
                return
            for ev in p.tick(now):
                if type(ev) is proto.ConnectionFailed:
                    self.log.warning("closing AMQP connection", peer=self.peer, reason=ev.text)
                elif type(ev) is proto.Closed:
                    self._stop.set()
                    return
            if p.has_output:
                self._kick()

    def _state_changed(self) -> None:
        """Wake the timer if the connection's state moved since it went to sleep, other than
        from one step of the handshake to the next (its time limit stays the same)."""
        scope = self._timer_scope
        state = self.proto.state
        if scope is not None and state is not self._timer_state \
                and not (state in HANDSHAKING and self._timer_state in HANDSHAKING):
            scope.cancel()

    def force_close(self, code: int, text: str) -> None:
        """Close this connection from the server's side (pause_minority, stop_app)."""
        self.proto.close(code, text, trio.current_time())
        self._state_changed()
        self._kick()
