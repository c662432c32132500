"""A client connection on a node: handshake, channels, and routing to queue leaders.

The session is where a client's channel lives (like RabbitMQ's channel process): it assigns
delivery tags and publish sequence numbers, turns acks into per-queue id lists, and sends each
operation to the queue's leader, local or on another node.

Publishes stay *in flight* here, bodies and all, until the queue's leader says every mirror has
them ("accepted"); then confirm-mode channels get their confirms. That set is the credit window:
past WINDOW_MSGS messages or WINDOW_BYTES bytes the session stops reading from the client (a
held publisher), so a stalled mirror holds publishers and memory stays bounded. When the queue's
leader changes (a promotion), everything in flight, and every request not yet answered, is sent
again to the new leader, which ignores publish batches it already has: publishes in flight during
a failover are not lost. Two tasks: the reader handles client
frames; the pump turns queue events (from the unbounded inbox, so a queue never blocks on a
session) into client frames. One writer (Outbox) batches all output.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
from collections import deque
from itertools import repeat

import trio

from wire import messages as m
from wire.errors import (
    ACCESS_REFUSED,
    COMMAND_INVALID,
    NOT_FOUND,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    VERSION_MISMATCH,
    ProtocolError,
)
from wire.handshake import new_nonce

from .framed import FramedStream, Outbox

HANDSHAKE_TIMEOUT = 10.0
WINDOW_MSGS = 20_000
WINDOW_BYTES = 32 << 20
CLIENT_KINDS = frozenset({
    "channel.open", "channel.close", "queue.declare", "queue.delete", "queue.purge", "basic.qos",
    "confirm.select", "publish", "basic.consume", "basic.cancel", "basic.get", "ack", "nack",
    "connection.close", "tx.select", "tx.commit", "tx.rollback",
})


class ChannelError(ProtocolError):
    """Closes the channel, not the connection (an AMQP channel exception)."""


def is_loopback(peer: str, own_host: str) -> bool:
    host = peer.rsplit(":", 1)[0].strip("[]") if ":" in peer else peer
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == own_host  # simulated network: a client on the node's own host


class Channel:
    __slots__ = ("id", "prefetch", "confirm", "next_seq", "next_tag", "tags", "consumers",
                 "touched", "tx", "tx_pending", "inflight", "commit_rid", "tx_failed")

    def __init__(self, ch: int):
        self.id = ch
        self.prefetch = 0
        self.confirm = False
        self.next_seq = 1
        self.next_tag = 1
        self.tags: dict[int, tuple] = {}  # delivery tag -> (queue, message id)
        self.consumers: dict[str, tuple] = {}  # consumer tag -> (queue, no_ack)
        self.touched: set[str] = set()  # queues holding consumers or deliveries of this channel
        self.tx = False  # transaction mode: publishes and acks wait in tx_pending for tx.commit
        self.tx_pending: list = []
        self.inflight = 0  # messages of this channel not yet accepted by every mirror
        self.commit_rid = 0  # a tx.commit waiting for them
        self.tx_failed = ""


class Session:
    _ids = itertools.count(1)

    def __init__(self, node, framed: FramedStream, peer: str):
        self.node = node
        self.framed = framed
        self.peer = peer
        self.sid = next(Session._ids)
        self.conn_id = f"{node.name}/{self.sid}"
        self.user = ""
        self.client_name = ""
        self.outbox = Outbox(framed)
        self.inbox, self._events = trio.open_memory_channel(math.inf)
        self.channels: dict[int, Channel] = {}
        self.closed_channels: set[int] = set()
        self.exclusive_queues: set[str] = set()
        self._ctags = itertools.count(1)
        self._noack_gets: set[int] = set()
        self.pseq = 0
        # queue -> deque of [pseq, ch, first confirm seq (0: none), count, bytes, bodies, props]
        self.inflight: dict[str, deque] = {}
        self.inflight_msgs = 0
        self.inflight_bytes = 0
        self._room = trio.Event()
        self.routes: dict[str, int] = {}  # queue -> the leader epoch our operations went to
        self.rpcs: dict[int, tuple[str, list]] = {}  # rid -> (queue, op): unanswered requests
        self._resend: set[str] = set()
        self._resend_wake = trio.Event()
        self._send_lock = trio.Lock()  # resends and new operations reach a leader in order
        self.done = trio.Event()
        self._written = trio.Event()
        self.log = node.log.bind(conn=self.conn_id)

    # --- lifecycle -------------------------------------------------------------------------
    async def handshake(self) -> None:
        node = self.node
        await self.framed.send_now(m.Hello(m.PROTOCOL_VERSION, node.name, new_nonce(), self.framed.max_frame))
        auth = await self.framed.receive(frozenset({"client.auth"}))
        if auth is None:
            raise ProtocolError(ACCESS_REFUSED, "connection closed during the handshake")
        if auth.version != m.PROTOCOL_VERSION:
            raise ProtocolError(VERSION_MISMATCH,
                                f"protocol version {auth.version} not supported (this node speaks {m.PROTOCOL_VERSION})")
        users = node.config.users
        if users.get(auth.user) != auth.password:
            raise ProtocolError(ACCESS_REFUSED, f"login refused for user '{auth.user}': wrong user name or password")
        if auth.user in node.config.loopback_users and not is_loopback(self.peer, node.config.advertise_host):
            raise ProtocolError(ACCESS_REFUSED,
                                f"user '{auth.user}' can only connect via localhost (loopback_users)")
        self.user, self.client_name = auth.user, auth.client_name
        await self.framed.send_now(m.Welcome(node.name, node.md.cluster_name, self.framed.max_frame))

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write)
                nursery.start_soon(self._pump)
                nursery.start_soon(self._resender)
                await self._read()
                self.outbox.close()  # send what is queued (e.g. the close reply), then stop
                with trio.move_on_after(2):
                    await self._written.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.done.set()
            self.outbox.close()
            with trio.CancelScope(shield=True):
                await self._cleanup()

    async def _write(self):
        try:
            await self.outbox.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._written.set()

    def send(self, msg) -> None:
        self.outbox.put(msg)

    async def close_with_error(self, exc: ProtocolError) -> None:
        """Tell the client why, then close (the node and other connections carry on)."""
        self.log.warning("closing client connection", code=exc.code, reason=exc.text)
        self.outbox.close()
        with trio.move_on_after(2):
            try:
                await self.framed.send_now(m.Error(exc.code, exc.text))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass

    async def _cleanup(self) -> None:
        node = self.node
        for ch in self.channels.values():
            self._release_channel(ch)
        for qname in list(self.exclusive_queues):
            with trio.move_on_after(5):
                try:
                    await node.propose(["queue.delete", qname])
                except ProtocolError:
                    pass

    def _release_channel(self, ch: Channel) -> None:
        owner = [self.node.name, self.sid, ch.id]
        for qname in ch.touched:
            self.node.queue_op_nowait(qname, ["owner_gone", owner])

    # --- client frames ---------------------------------------------------------------------
    async def _read(self) -> None:
        handlers = self._handlers()
        while True:
            try:
                batch = await self.framed.receive_batch(CLIENT_KINDS)
            except ProtocolError as exc:
                await self.close_with_error(exc)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not batch:
                return
            for msg in batch:
                ch_id = getattr(msg, "ch", 0)
                if ch_id in self.closed_channels and type(msg) is not m.ChannelOpen:
                    continue  # frames in flight for a channel the server closed
                try:
                    done = await handlers[type(msg)](msg)
                except ChannelError as exc:
                    self._close_channel(ch_id, getattr(msg, "rid", 0), exc)
                    continue
                except ProtocolError as exc:
                    await self.close_with_error(exc)
                    return
                if done:
                    return

    def _handlers(self):
        return {
            m.Publish: self.on_publish, m.Ack: self.on_ack, m.Nack: self.on_nack,
            m.ChannelOpen: self.on_channel_open, m.ChannelClose: self.on_channel_close,
            m.QueueDeclare: self.on_queue_declare, m.QueueDelete: self.on_queue_delete,
            m.QueuePurge: self.on_queue_purge, m.BasicQos: self.on_qos,
            m.ConfirmSelect: self.on_confirm_select, m.BasicConsume: self.on_consume,
            m.BasicCancel: self.on_cancel, m.BasicGet: self.on_get,
            m.ConnectionClose: self.on_connection_close,
            m.TxSelect: self.on_tx_select, m.TxCommit: self.on_tx_commit,
            m.TxRollback: self.on_tx_rollback,
        }

    def _ch(self, ch_id: int) -> Channel:
        ch = self.channels.get(ch_id)
        if ch is None:
            raise ProtocolError(COMMAND_INVALID, f"channel {ch_id} is not open")
        return ch

    def _close_channel(self, ch_id: int, rid: int, exc: ProtocolError) -> None:
        ch = self.channels.pop(ch_id, None)
        if ch is not None:
            self._release_channel(ch)
        self.closed_channels.add(ch_id)
        self.send(m.Fail(rid, ch_id, exc.code, exc.text))

    def _owner(self, ch: Channel) -> list:
        return [self.node.name, self.sid, ch.id]

    def _queue(self, name: str) -> dict:
        """The queue's definition, or the channel errors RabbitMQ gives."""
        qdef = self.node.md.queues.get(name)
        if qdef is None:
            raise ChannelError(NOT_FOUND, f"no queue '{name}' in vhost '/'")
        if qdef["exclusive"] and qdef.get("owner") != self.conn_id:
            raise ChannelError(RESOURCE_LOCKED,
                               f"cannot obtain exclusive access to locked queue '{name}' in vhost '/'. "
                               "It could be originally declared on another connection or the exclusive "
                               "property value does not match that of the original declaration.")
        self.node.check_queue_available(qdef, ChannelError)
        return qdef

    async def on_channel_open(self, msg):
        if msg.ch in self.channels or msg.ch <= 0:
            raise ProtocolError(COMMAND_INVALID, f"channel {msg.ch} is already open or invalid")
        self.closed_channels.discard(msg.ch)
        self.channels[msg.ch] = Channel(msg.ch)
        self.send(m.Reply(msg.rid, None))

    async def on_channel_close(self, msg):
        ch = self.channels.pop(msg.ch, None)
        if ch is not None:
            self._release_channel(ch)
        self.send(m.Reply(msg.rid, None))

    async def on_connection_close(self, msg):
        self.send(m.Reply(msg.rid, None))
        self.outbox.close()
        return True

    async def on_qos(self, msg):
        ch = self._ch(msg.ch)
        if msg.prefetch_count < 0 or msg.prefetch_count > 65535:
            raise ChannelError(PRECONDITION_FAILED, "prefetch_count must be between 0 and 65535")
        ch.prefetch = msg.prefetch_count
        self.send(m.Reply(msg.rid, None))

    async def on_confirm_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode")
        ch.confirm = True
        self.send(m.Reply(msg.rid, None))

    # --- transactions: commit-ok only once every mirror has the publishes (spec) ----------
    async def on_tx_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.confirm:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode")
        ch.tx = True
        self.send(m.Reply(msg.rid, None))

    async def on_tx_commit(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        pending, ch.tx_pending = ch.tx_pending, []
        ch.tx = False
        try:
            for op in pending:
                await self._handlers()[type(op)](op)
        finally:
            ch.tx = True
        if ch.inflight:
            ch.commit_rid = msg.rid
        else:
            self._commit_done(ch, msg.rid)

    def _commit_done(self, ch: Channel, rid: int) -> None:
        ch.commit_rid = 0
        if ch.tx_failed:
            reason, ch.tx_failed = ch.tx_failed, ""
            self.send(m.Fail(rid, ch.id, NOT_FOUND, f"tx.commit failed: {reason}"))
        else:
            self.send(m.Reply(rid, None))

    async def on_tx_rollback(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        ch.tx_pending.clear()
        self.send(m.Reply(msg.rid, None))

    async def on_queue_declare(self, msg):
        self._ch(msg.ch)
        value = await self.node.declare_queue(self, msg)
        if value is not None:  # else the queue's leader answers the client itself
            self.send(m.Reply(msg.rid, value))

    async def on_queue_delete(self, msg):
        ch = self._ch(msg.ch)
        qdef = self.node.md.queues.get(msg.queue)
        if qdef is None:
            self.send(m.Reply(msg.rid, 0))  # deleting a missing queue is fine in AMQP
            return
        self._queue(msg.queue)
        # not tracked as a request: the queue's deletion itself would fail it
        await self._send(msg.queue, ["delete", self._owner(ch), msg.rid, msg.if_unused, msg.if_empty])

    async def on_queue_purge(self, msg):
        ch = self._ch(msg.ch)
        self._queue(msg.queue)
        await self._request(msg.queue, msg.rid, ["purge", self._owner(ch), msg.rid])

    async def on_publish(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        n = len(msg.bodies)
        if not n:
            return
        if msg.props is not None and len(msg.props) != n:
            raise ProtocolError(COMMAND_INVALID, "publish: props must be nil or parallel to bodies")
        if ch.confirm:
            first = ch.next_seq
            ch.next_seq = first + n
        else:
            first = 0
        node = self.node
        qdef = node.md.queues.get(msg.queue)
        if qdef is None:
            # like AMQP's default exchange: an unroutable message is dropped (and confirmed)
            if first:
                self.send(m.Confirm(ch.id, [[first, first + n - 1]], [], ""))
            return
        if qdef["exclusive"] and qdef.get("owner") != self.conn_id:
            raise ChannelError(RESOURCE_LOCKED, f"cannot obtain exclusive access to locked queue '{msg.queue}' in vhost '/'")
        down = node.queue_down_reason(qdef)
        if down:
            if first:
                self.send(m.Confirm(ch.id, [], [[first, first + n - 1]], down))
            return
        qname = msg.queue
        self.pseq = pseq = self.pseq + 1
        size = sum(map(len, msg.bodies))
        dq = self.inflight.get(qname)
        if dq is None:
            dq = self.inflight[qname] = deque()
        dq.append([pseq, ch.id, first, n, size, msg.bodies, msg.props])
        ch.inflight += n
        self.inflight_msgs += n
        self.inflight_bytes += size
        await self._send(qname, ["publish", self._owner(ch), pseq, msg.bodies, msg.props])
        if self.inflight_msgs > WINDOW_MSGS or self.inflight_bytes > WINDOW_BYTES:
            await self._flow_wait()

    # --- routing to the queue's leader, and failover -------------------------------------
    async def _send(self, qname: str, op: list) -> None:
        async with self._send_lock:
            if self._resend:
                await self._do_resends()
            qdef = self.node.md.queues.get(qname)
            if qdef is None:
                return
            if qname not in self.routes:
                self.routes[qname] = qdef.get("epoch", 1)
            await self.node.queue_op(qdef, op)

    async def _resender(self) -> None:
        """Resend to a new leader even when the client sends nothing more (it may be waiting
        for the very confirms the resend will bring)."""
        while True:
            await self._resend_wake.wait()
            self._resend_wake = trio.Event()
            async with self._send_lock:
                await self._do_resends()

    async def _request(self, qname: str, rid: int, op: list) -> None:
        """An operation the queue answers: remembered until answered, resent on failover."""
        self.rpcs[rid] = (qname, op)
        await self._send(qname, op)

    async def _flow_wait(self) -> None:
        """Hold this publisher until the queues' mirrors have caught up (credit flow)."""
        while self.inflight_msgs > WINDOW_MSGS or self.inflight_bytes > WINDOW_BYTES:
            self._room = trio.Event()
            await self._room.wait()

    def meta_changed(self) -> None:
        """The cluster metadata changed: find queues whose leader moved (resend to it) or that
        are gone for good (tell the client)."""
        md = self.node.md
        for qname, epoch in list(self.routes.items()):
            qdef = md.queues.get(qname)
            if qdef is None:
                self.queue_lost(qname, f"queue '{qname}' in vhost '/' was deleted")
            elif qdef.get("epoch", 1) != epoch:
                self._resend.add(qname)
                self._resend_wake.set()
            elif down := self.node.queue_down_reason(qdef):
                self.queue_lost(qname, down)

    async def _do_resends(self) -> None:
        while self._resend:
            qname = self._resend.pop()
            qdef = self.node.md.queues.get(qname)
            if qdef is None or qname not in self.routes:
                continue
            self.routes[qname] = qdef.get("epoch", 1)
            me, sid = self.node.name, self.sid
            ops = [["publish", [me, sid, e[1]], e[0], e[5], e[6]] for e in self.inflight.get(qname, ())]
            ops += [op for q, op in list(self.rpcs.values()) if q == qname]
            if ops:
                self.log.info("resending to the queue's new leader", queue=qname,
                              leader=qdef["leader"], operations=len(ops))
            for op in ops:
                if qname in self._resend:
                    break  # it moved again: start over
                await self.node.queue_op(qdef, op)

    def _settle(self, ch: Channel, tags, upto: int) -> dict[str, list]:
        """Delivery tags -> {queue: [message ids]}; unknown tags are a channel error."""
        out: dict[str, list] = {}
        table = ch.tags
        for t in tags:
            entry = table.pop(t, None)
            if entry is None:
                raise ChannelError(PRECONDITION_FAILED, f"unknown delivery tag {t}")
            lst = out.get(entry[0])
            if lst is None:
                out[entry[0]] = [entry[1]]
            else:
                lst.append(entry[1])
        if upto:
            if upto >= ch.next_tag:
                raise ChannelError(PRECONDITION_FAILED, f"unknown delivery tag {upto}")
            done = []
            for t, entry in table.items():
                if t > upto:
                    break
                done.append(t)
                lst = out.get(entry[0])
                if lst is None:
                    out[entry[0]] = [entry[1]]
                else:
                    lst.append(entry[1])
            for t in done:
                del table[t]
        return out

    async def on_ack(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        owner = self._owner(ch)
        for qname, ids in self._settle(ch, msg.tags, msg.multiple_upto).items():
            self.node.queue_op_nowait(qname, ["ack", owner, ids])

    async def on_nack(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        owner = self._owner(ch)
        kind = "requeue" if msg.requeue else "discard"
        for qname, ids in self._settle(ch, msg.tags, msg.multiple_upto).items():
            self.node.queue_op_nowait(qname, [kind, owner, ids])

    async def on_consume(self, msg):
        ch = self._ch(msg.ch)
        self._queue(msg.queue)  # the channel errors for a missing, locked or unavailable queue
        tag = msg.consumer_tag or f"amq.ctag-{self.conn_id}-{next(self._ctags)}"
        if tag in ch.consumers:
            raise ChannelError(PRECONDITION_FAILED, f"consumer tag '{tag}' is already in use on this channel")
        ch.touched.add(msg.queue)
        await self._request(msg.queue, msg.rid, ["consume", self._owner(ch), msg.rid, tag, msg.no_ack,
                                                 ch.prefetch, msg.exclusive, msg.arguments])

    async def on_cancel(self, msg):
        ch = self._ch(msg.ch)
        entry = ch.consumers.pop(msg.consumer_tag, None)
        if entry is None:
            self.send(m.Reply(msg.rid, msg.consumer_tag))
            return
        qdef = self.node.md.queues.get(entry[0])
        if qdef is None or self.node.queue_down_reason(qdef):
            self.send(m.Reply(msg.rid, msg.consumer_tag))
            return
        await self._request(entry[0], msg.rid, ["cancel", self._owner(ch), msg.rid, msg.consumer_tag])

    async def on_get(self, msg):
        ch = self._ch(msg.ch)
        self._queue(msg.queue)
        if msg.no_ack:
            self._noack_gets.add(msg.rid)
        else:
            ch.touched.add(msg.queue)
        await self._request(msg.queue, msg.rid, ["get", self._owner(ch), msg.rid, msg.no_ack])

    # --- queue events ----------------------------------------------------------------------
    async def _pump(self) -> None:
        recv = self._events
        while True:
            events = await recv.receive()
            self.handle_events(events)
            while True:
                try:
                    events = recv.receive_nowait()
                except trio.WouldBlock:
                    break
                self.handle_events(events)

    def handle_events(self, events: list) -> None:
        send = self.send
        channels = self.channels
        for ev in events:
            kind = ev[0]
            if kind == "deliver":
                _, ch_id, ctag, qname, ids, bodies, red, props = ev
                ch = channels.get(ch_id)
                if ch is None:
                    continue  # channel closed meanwhile; the queue requeues on owner_gone
                first = ch.next_tag
                n = len(ids)
                ch.next_tag = first + n
                entry = ch.consumers.get(ctag)
                if entry is None or not entry[1]:
                    ch.tags.update(zip(range(first, first + n), zip(repeat(qname), ids)))
                send(m.Deliver(ch_id, ctag, first, bodies, red, props))
            elif kind == "accepted":
                self._accepted(ev[1], ev[2])
            elif kind == "reply":
                self.rpcs.pop(ev[1], None)
                send(m.Reply(ev[1], ev[2]))
            elif kind == "fail":
                _, rid, ch_id, code, text = ev
                self.rpcs.pop(rid, None)
                if ch_id in channels:
                    self._close_channel(ch_id, rid, ChannelError(code, text))
            elif kind == "consume_ok":
                _, ch_id, rid, tag, qname, no_ack = ev
                if self.rpcs.pop(rid, None) is None:
                    continue  # a resent consume answered twice
                ch = channels.get(ch_id)
                if ch is not None:
                    ch.consumers[tag] = (qname, no_ack)
                send(m.Reply(rid, tag))
            elif kind == "get_ok":
                _, ch_id, rid, qname, msg, remaining = ev
                if self.rpcs.pop(rid, None) is None:
                    continue
                ch = channels.get(ch_id)
                if msg is None or ch is None:
                    self._noack_gets.discard(rid)
                    send(m.Reply(rid, None))
                    continue
                tag = ch.next_tag
                ch.next_tag += 1
                if rid in self._noack_gets:
                    self._noack_gets.discard(rid)
                else:
                    ch.tags[tag] = (qname, msg[0])
                send(m.Reply(rid, [tag, msg[1], msg[3], msg[2], remaining]))
            elif kind == "cancelled":
                _, ch_id, tag, qname, reason = ev
                ch = channels.get(ch_id)
                if ch is not None and ch.consumers.pop(tag, None) is not None:
                    send(m.Cancelled(ch_id, tag, reason))

    def _accepted(self, qname: str, upto: int) -> None:
        """Publishes up to `upto` are on every mirror: release them, confirm them."""
        dq = self.inflight.get(qname)
        if not dq:
            return
        ranges: dict[int, list] = {}
        n = size = 0
        channels = self.channels
        while dq and dq[0][0] <= upto:
            e = dq.popleft()
            n += e[3]
            size += e[4]
            ch = channels.get(e[1])
            if ch is not None:
                ch.inflight -= e[3]
                if ch.commit_rid and not ch.inflight:
                    self._commit_done(ch, ch.commit_rid)
            if e[2]:
                lst = ranges.get(e[1])
                last = e[2] + e[3] - 1
                if lst is None:
                    ranges[e[1]] = [[e[2], last]]
                elif lst[-1][1] + 1 == e[2]:
                    lst[-1][1] = last
                else:
                    lst.append([e[2], last])
        self.inflight_msgs -= n
        self.inflight_bytes -= size
        for ch_id, acks in ranges.items():
            if ch_id in self.channels:
                self.send(m.Confirm(ch_id, acks, [], ""))
        if self.inflight_msgs <= WINDOW_MSGS and self.inflight_bytes <= WINDOW_BYTES:
            self._room.set()

    def queue_lost(self, qname: str, reason: str) -> None:
        """The queue is gone or unavailable: cancel our consumers, nack what is in flight, fail
        unanswered requests."""
        self.routes.pop(qname, None)
        self._resend.discard(qname)
        for ch in self.channels.values():
            for tag, (q, _) in list(ch.consumers.items()):
                if q == qname:
                    del ch.consumers[tag]
                    self.send(m.Cancelled(ch.id, tag, reason))
            stale = [t for t, (q, _) in ch.tags.items() if q == qname]
            for t in stale:
                del ch.tags[t]
        nacks: dict[int, list] = {}
        for e in self.inflight.pop(qname, ()):
            self.inflight_msgs -= e[3]
            self.inflight_bytes -= e[4]
            ch = self.channels.get(e[1])
            if ch is not None:
                ch.inflight -= e[3]
                if ch.tx or ch.commit_rid:
                    ch.tx_failed = reason
                if ch.commit_rid and not ch.inflight:
                    self._commit_done(ch, ch.commit_rid)
            if e[2]:
                nacks.setdefault(e[1], []).append([e[2], e[2] + e[3] - 1])
        for ch_id, ranges in nacks.items():
            if ch_id in self.channels:
                self.send(m.Confirm(ch_id, [], ranges, reason))
        for rid, (q, op) in list(self.rpcs.items()):
            if q == qname:
                del self.rpcs[rid]
                ch_id = op[1][2]
                if ch_id in self.channels:
                    self._close_channel(ch_id, rid, ChannelError(NOT_FOUND, reason))
        self._room.set()
