"""What a client session means, whatever protocol speaks it: channels, delivery tags, publish
sequence numbers, confirms, transactions, credit, and resends to a queue's new leader.

A front end (broker/native.py for warren's msgpack protocol) owns the socket: it decodes client
frames into the command messages of wire/messages.py (ChannelOpen, Publish, Ack, ...), hands
them to `handle`, and turns what the session emits (`out`: Reply, Fail, Deliver, Confirm,
Cancelled) into frames. The session never touches a socket, so it is tested without one.

Theory of operation:
* Like RabbitMQ's channel process, the session assigns delivery tags and publish sequence
  numbers, turns acks into per-queue id lists, and sends every operation to the queue's leader,
  local or on another node (broker/router.py).
* Publishes stay *in flight* here, bodies and all, until the queue's leader says every mirror
  has them (`EvAccepted`); then confirm-mode channels get their confirms and transactions their
  commit-ok. That set is the credit window: past WINDOW_MSGS messages or WINDOW_BYTES bytes the
  front end stops reading from the client (a held publisher), so a stalled mirror holds
  publishers and memory stays bounded.
* A session that has published is a *publisher*: while a memory alarm is on anywhere in the
  cluster, front ends stop reading from it (broker/memory.py); sessions that only consume and
  ack keep being read, so consumers drain the queues that hold the memory.
* Whenever the route to a queue's leader changes (the metadata names a new leader epoch, or the
  link to the leader's node comes back), the session resends what is in flight there: publishes
  (the leader ignores batches it already has), unanswered requests, and the registration of
  every consumer (the new leader may not know a consumer registered just before a failover).
  Consumers that asked for `x-cancel-on-ha-failover` are not re-registered: they are cancelled.
* Queue events arrive through `queue_events` from the router and are handled at once.
"""

from __future__ import annotations

import itertools
from collections import deque
from itertools import repeat

import trio

from wire import messages as m
from wire.errors import (
    COMMAND_INVALID,
    NOT_FOUND,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    ProtocolError,
)

WINDOW_MSGS = 20_000
WINDOW_BYTES = 32 << 20


class ChannelError(ProtocolError):
    """Closes the channel, not the connection (an AMQP channel exception)."""


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
        self.consumers: dict[str, m.QConsume] = {}  # consumer tag -> its registration
        self.touched: set[str] = set()  # queues holding consumers or deliveries of this channel
        self.tx = False  # transaction mode: publishes and acks wait in tx_pending for tx.commit
        self.tx_pending: list = []
        self.inflight = 0  # messages of this channel not yet accepted by every mirror
        self.commit_rid = 0  # a tx.commit waiting for them
        self.tx_failed = ""


class Session:
    def __init__(self, node, sid: int, peer: str, user: str, client_name: str, out):
        self.node = node
        self.router = node.router
        self.sid = sid
        self.me = node.name
        self.conn_id = f"{node.name}/{sid}"
        self.peer = peer
        self.user = user
        self.client_name = client_name
        self.out = out  # callable(message): the front end sends it to the client
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
        self._room.set()
        self.routes: dict[str, tuple] = {}  # queue -> (leader, epoch) our operations went to
        self.rpcs: dict[int, tuple[str, object]] = {}  # rid -> (queue, op): unanswered requests
        self.closed = False
        # a publishing connection (it has published): held by the front end during a memory
        # alarm (broker/memory.py PublisherGate); one that only consumes is never held
        self.publisher = False
        self.log = node.log.bind(conn=self.conn_id)
        self._handlers = {
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

    # --- commands from the client ----------------------------------------------------------
    async def handle(self, msg) -> bool:
        """One client command; True when the client closed the connection. A ChannelError
        closes the channel; any other ProtocolError is the front end's to answer."""
        ch_id = getattr(msg, "ch", 0)
        if ch_id in self.closed_channels and type(msg) is not m.ChannelOpen:
            return False  # frames in flight for a channel the server closed
        try:
            return bool(await self._handlers[type(msg)](msg))
        except ChannelError as exc:
            self._close_channel(ch_id, getattr(msg, "rid", 0), exc)
            return False

    @property
    def has_credit(self) -> bool:
        return self.inflight_msgs <= WINDOW_MSGS and self.inflight_bytes <= WINDOW_BYTES

    async def wait_credit(self) -> None:
        """Hold the client while too much is in flight (credit flow)."""
        while not self.has_credit:
            self._room = trio.Event()
            await self._room.wait()

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
        self.out(m.Fail(rid, ch_id, exc.code, exc.text))

    def _owner(self, ch: Channel) -> tuple:
        return (self.me, self.sid, ch.id)

    def _queue(self, name: str) -> dict:
        """The queue's definition, or the channel errors RabbitMQ gives."""
        qdef = self.node.cluster.md.queues.get(name)
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
        self.out(m.Reply(msg.rid, None))

    async def on_channel_close(self, msg):
        ch = self.channels.pop(msg.ch, None)
        if ch is not None:
            self._release_channel(ch)
        self.out(m.Reply(msg.rid, None))

    async def on_connection_close(self, msg):
        self.out(m.Reply(msg.rid, None))
        return True

    async def on_qos(self, msg):
        ch = self._ch(msg.ch)
        if msg.prefetch_count < 0 or msg.prefetch_count > 65535:
            raise ChannelError(PRECONDITION_FAILED, "prefetch_count must be between 0 and 65535")
        ch.prefetch = msg.prefetch_count
        self.out(m.Reply(msg.rid, None))

    async def on_confirm_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode")
        ch.confirm = True
        self.out(m.Reply(msg.rid, None))

    # --- transactions: commit-ok only once every mirror has the publishes (spec) ----------
    async def on_tx_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.confirm:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode")
        ch.tx = True
        self.out(m.Reply(msg.rid, None))

    async def on_tx_commit(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        pending, ch.tx_pending = ch.tx_pending, []
        ch.tx = False
        try:
            for op in pending:
                await self._handlers[type(op)](op)
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
            self.out(m.Fail(rid, ch.id, NOT_FOUND, f"tx.commit failed: {reason}"))
        else:
            self.out(m.Reply(rid, None))

    async def on_tx_rollback(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        ch.tx_pending.clear()
        self.out(m.Reply(msg.rid, None))

    # --- queues ----------------------------------------------------------------------------
    async def on_queue_declare(self, msg):
        ch = self._ch(msg.ch)
        value = await self.node.declare_queue(self, msg)
        if value is not None:  # created: answer now
            self.out(m.Reply(msg.rid, value))
            return
        # it existed: its leader answers with the counts
        self._request(msg.queue, msg.rid, m.QDeclareOk(msg.queue, self._owner(ch), msg.rid))

    async def on_queue_delete(self, msg):
        ch = self._ch(msg.ch)
        qdef = self.node.cluster.md.queues.get(msg.queue)
        if qdef is None:
            self.out(m.Reply(msg.rid, 0))  # deleting a missing queue is fine in AMQP
            return
        self._queue(msg.queue)
        # not tracked as a request: the queue's deletion itself would fail it
        self._send(msg.queue, m.QDelete(msg.queue, self._owner(ch), msg.rid, msg.if_unused, msg.if_empty))

    async def on_queue_purge(self, msg):
        ch = self._ch(msg.ch)
        self._queue(msg.queue)
        self._request(msg.queue, msg.rid, m.QPurge(msg.queue, self._owner(ch), msg.rid))

    # --- publishing ------------------------------------------------------------------------
    async def on_publish(self, msg):
        self.publisher = True
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
        qname = msg.queue
        qdef = node.cluster.md.queues.get(qname)
        if qdef is None:
            # like AMQP's default exchange: an unroutable message is dropped (and confirmed)
            if first:
                self.out(m.Confirm(ch.id, [[first, first + n - 1]], [], ""))
            return
        if qdef["exclusive"] and qdef.get("owner") != self.conn_id:
            raise ChannelError(RESOURCE_LOCKED, f"cannot obtain exclusive access to locked queue '{qname}' in vhost '/'")
        down = node.queue_down_reason(qdef)
        if down:
            if first:
                self.out(m.Confirm(ch.id, [], [[first, first + n - 1]], down))
            return
        self.pseq = pseq = self.pseq + 1
        size = sum(map(len, msg.bodies))
        dq = self.inflight.get(qname)
        if dq is None:
            dq = self.inflight[qname] = deque()
        dq.append([pseq, ch.id, first, n, size, msg.bodies, msg.props])
        ch.inflight += n
        self.inflight_msgs += n
        self.inflight_bytes += size
        await self.router.wait_link_room(qname)
        self._send(qname, m.QPublish(qname, self._owner(ch), pseq, msg.bodies, msg.props, False))

    # --- routing to the queue's leader, and resends ------------------------------------------
    def _send(self, qname: str, op) -> None:
        """Send to the queue's leader now (or leave it for the resend when the route is back)."""
        qdef = self.node.cluster.md.queues.get(qname)
        if qdef is None:
            return
        if qname not in self.routes:
            self.routes[qname] = (qdef["leader"], qdef.get("epoch", 1))
        self.router.to_leader(qname, op)

    def _request(self, qname: str, rid: int, op) -> None:
        """An operation the queue answers: remembered until answered, resent on a route change."""
        self.rpcs[rid] = (qname, op)
        self._send(qname, op)

    def meta_changed(self) -> None:
        """The metadata changed: resend to queues whose leader moved, tell the client about
        queues that are gone for good."""
        md = self.node.cluster.md
        for qname, route in list(self.routes.items()):
            qdef = md.queues.get(qname)
            if qdef is None:
                self.queue_lost(qname, f"queue '{qname}' in vhost '/' was deleted")
            elif (qdef["leader"], qdef.get("epoch", 1)) != route:
                self.routes[qname] = (qdef["leader"], qdef.get("epoch", 1))
                self._resend(qname, qdef)
            elif down := self.node.queue_down_reason(qdef):
                self.queue_lost(qname, down)

    def route_changed(self, node: str) -> None:
        """The link to `node` went down or came back: resend to the queues it leads (operations
        sent while it was down were dropped; the leader dropped our consumers)."""
        md = self.node.cluster.md
        if node not in self.node.cluster.links:
            return  # down: nothing can be sent; the resend comes with the link
        for qname in list(self.routes):
            qdef = md.queues.get(qname)
            if qdef is not None and qdef["leader"] == node:
                self._resend(qname, qdef)

    def _resend(self, qname: str, qdef: dict) -> None:
        me, sid = self.me, self.sid
        ops = [m.QPublish(qname, (me, sid, e[1]), e[0], e[5], e[6], True)
               for e in self.inflight.get(qname, ())]
        ops += [op for q, op in self.rpcs.values() if q == qname]
        ops += [c for ch in self.channels.values() for c in ch.consumers.values()
                if c.queue == qname and c.arguments.get("x-cancel-on-ha-failover") is not True]
        if not ops:
            return
        self.log.info("resending to the queue's leader", queue=qname, leader=qdef["leader"],
                      epoch=qdef.get("epoch", 1), operations=len(ops))
        router = self.router
        for op in ops:
            router.to_leader(qname, op)

    # --- acknowledgements ------------------------------------------------------------------
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
            self.router.to_leader(qname, m.QSettle(qname, owner, m.ACK, ids))

    async def on_nack(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        owner = self._owner(ch)
        how = m.REQUEUE if msg.requeue else m.DISCARD
        for qname, ids in self._settle(ch, msg.tags, msg.multiple_upto).items():
            self.router.to_leader(qname, m.QSettle(qname, owner, how, ids))

    # --- consumers -------------------------------------------------------------------------
    async def on_consume(self, msg):
        ch = self._ch(msg.ch)
        self._queue(msg.queue)  # the channel errors for a missing, locked or unavailable queue
        tag = msg.consumer_tag or f"amq.ctag-{self.conn_id}-{next(self._ctags)}"
        if tag in ch.consumers:
            raise ChannelError(PRECONDITION_FAILED, f"consumer tag '{tag}' is already in use on this channel")
        ch.touched.add(msg.queue)
        op = m.QConsume(msg.queue, self._owner(ch), msg.rid, tag, msg.no_ack, ch.prefetch,
                        msg.exclusive, msg.arguments)
        self._request(msg.queue, msg.rid, op)

    async def on_cancel(self, msg):
        ch = self._ch(msg.ch)
        reg = ch.consumers.pop(msg.consumer_tag, None)
        if reg is None:
            self.out(m.Reply(msg.rid, msg.consumer_tag))
            return
        qdef = self.node.cluster.md.queues.get(reg.queue)
        if qdef is None or self.node.queue_down_reason(qdef):
            self.out(m.Reply(msg.rid, msg.consumer_tag))
            return
        self._request(reg.queue, msg.rid, m.QCancel(reg.queue, self._owner(ch), msg.rid, msg.consumer_tag))

    async def on_get(self, msg):
        ch = self._ch(msg.ch)
        self._queue(msg.queue)
        if msg.no_ack:
            self._noack_gets.add(msg.rid)
        else:
            ch.touched.add(msg.queue)
        self._request(msg.queue, msg.rid, m.QGet(msg.queue, self._owner(ch), msg.rid, msg.no_ack))

    # --- queue events ----------------------------------------------------------------------
    def queue_events(self, events: list) -> None:
        """Events from queues (deliveries, acceptances, answers), handled at once."""
        if self.closed:
            return
        out = self.out
        channels = self.channels
        for ev in events:
            t = type(ev)
            if t is m.EvDeliver:
                ch = channels.get(ev.ch)
                if ch is None:
                    continue  # channel closed meanwhile; the queue requeues on owner_gone
                reg = ch.consumers.get(ev.tag)
                if reg is None:
                    self._unknown_consumer(ch, ev)
                    continue
                first = ch.next_tag
                n = len(ev.ids)
                ch.next_tag = first + n
                if not reg.no_ack:
                    ch.tags.update(zip(range(first, first + n), zip(repeat(ev.queue), ev.ids)))
                out(m.Deliver(ev.ch, ev.tag, first, ev.bodies, ev.redelivered, ev.props))
            elif t is m.EvAccepted:
                self._accepted(ev.queue, ev.pseq)
            elif t is m.EvReply:
                if ev.rid:  # rid 0: an answer nobody waits for (a cancel of our own)
                    self.rpcs.pop(ev.rid, None)
                    out(m.Reply(ev.rid, ev.value))
            elif t is m.EvFail:
                if self.rpcs.pop(ev.rid, None) is None and ev.rid:
                    continue
                if ev.ch in channels:
                    self._close_channel(ev.ch, ev.rid, ChannelError(ev.code, ev.text))
            elif t is m.EvConsumeOk:
                req = self.rpcs.pop(ev.rid, None) if ev.rid else None
                if req is None:
                    continue  # a re-registration (or a resent consume) answered again
                ch = channels.get(ev.ch)
                if ch is not None:
                    ch.consumers[ev.tag] = req[1]
                out(m.Reply(ev.rid, ev.tag))
            elif t is m.EvGetOk:
                if self.rpcs.pop(ev.rid, None) is None:
                    continue
                ch = channels.get(ev.ch)
                if ev.msg is None or ch is None:
                    self._noack_gets.discard(ev.rid)
                    out(m.Reply(ev.rid, None))
                    continue
                tag = ch.next_tag
                ch.next_tag += 1
                if ev.rid in self._noack_gets:
                    self._noack_gets.discard(ev.rid)
                else:
                    ch.tags[tag] = (ev.queue, ev.msg[0])
                out(m.Reply(ev.rid, [tag, ev.msg[1], ev.msg[3], ev.msg[2], ev.remaining]))
            elif t is m.EvCancelled:
                ch = channels.get(ev.ch)
                if ch is not None and ch.consumers.pop(ev.tag, None) is not None:
                    out(m.Cancelled(ev.ch, ev.tag, ev.reason))

    def _unknown_consumer(self, ch: Channel, ev: m.EvDeliver) -> None:
        """Deliveries for a consumer this channel does not have (cancelled meanwhile, or
        re-registered by a resend that crossed its cancellation): give them back and cancel it
        at the queue, so nothing sits unacknowledged for a consumer nobody reads."""
        owner = self._owner(ch)
        router = self.router
        router.to_leader(ev.queue, m.QSettle(ev.queue, owner, m.REQUEUE, ev.ids))
        router.to_leader(ev.queue, m.QCancel(ev.queue, owner, 0, ev.tag))

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
            if ch_id in channels:
                self.out(m.Confirm(ch_id, acks, [], ""))
        if self.has_credit:
            self._room.set()

    def queue_lost(self, qname: str, reason: str) -> None:
        """The queue is gone or unavailable: cancel our consumers, nack what is in flight, fail
        unanswered requests."""
        self.routes.pop(qname, None)
        for ch in self.channels.values():
            for tag, reg in list(ch.consumers.items()):
                if reg.queue == qname:
                    del ch.consumers[tag]
                    self.out(m.Cancelled(ch.id, tag, reason))
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
                self.out(m.Confirm(ch_id, [], ranges, reason))
        for rid, (q, op) in list(self.rpcs.items()):
            if q == qname:
                del self.rpcs[rid]
                ch_id = op.owner[2]
                if ch_id in self.channels:
                    self._close_channel(ch_id, rid, ChannelError(NOT_FOUND, reason))
        self._room.set()

    # --- the end ---------------------------------------------------------------------------
    def _release_channel(self, ch: Channel) -> None:
        owner = self._owner(ch)
        for qname in ch.touched:
            self.router.to_leader(qname, m.QOwnerGone(qname, owner))

    def close(self) -> None:
        """The connection is gone: its channels and consumers go, unacked messages are
        requeued by their queues; returns at once (exclusive queues: `delete_exclusive`)."""
        if self.closed:
            return
        self.closed = True
        touched = {q for ch in self.channels.values() for q in ch.touched}
        for qname in touched:
            self.router.to_leader(qname, m.QSessionGone(qname, self.me, self.sid))
        self._room.set()

    async def delete_exclusive(self) -> None:
        for qname in list(self.exclusive_queues):
            with trio.move_on_after(5):
                try:
                    await self.node.cluster.propose(["queue.delete", qname])
                except ProtocolError:
                    pass
