"""The session core: what a client session means, whatever protocol speaks it, as a synchronous
state machine. Commands from the client and events from the queues go in; what the client is to
see goes out through `out` (Reply, Fail, Deliver, Confirm, Cancelled, Returned), what the
queues' leaders are to get goes out through the host (`SessionHost.to_leader`), and what has to
wait for the cluster's log comes back from `handle` as an action (`Propose`, `DeclareQueue`)
for the driver (broker/session/driver.py) to carry out and answer. Nothing here awaits, sleeps
or touches a socket, so it is tested against a stand-in host, without a cluster.

The parts, by responsibility: channels and their delivery tags (channels.py), publishes in
flight and their confirms (publishing.py), consumers and deliveries (consumers.py). This module
joins them and owns what they share: the commands' dispatch, the user's permission checks
(`check_access`: RabbitMQ's configure/write/read, over the session's compiled patterns), the
queue commands, exchanges and bindings, requests to queues, and the route to each queue's leader
with its resends.

Theory of operation:
* Like RabbitMQ's channel process, the session assigns delivery tags and publish sequence
  numbers, turns acks into per-queue id lists, and sends every operation to the queue's leader,
  local or on another node (broker/router.py).
* Whenever the route to a queue's leader changes (the metadata names a new leader epoch, or the
  link to the leader's node comes back), the session resends what is in flight there: publishes
  (the leader ignores batches it already has), unanswered requests, and the registration of
  every consumer (the new leader may not know a consumer registered just before a failover).
* Queue events arrive through `queue_events` from the router and are handled at once.
"""

from __future__ import annotations

import itertools
from collections import deque
from functools import partial

from mirroring import exchanges as xmod
from mirroring.access import CONFIGURE, READ, WRITE, refused
from mirroring.changes import (BindingAdd, BindingRemove, Change, ExchangeBindingAdd,
                               ExchangeBindingRemove, ExchangeDeclare, ExchangeDelete)
from mirroring.records import (DEFAULT_VHOST, VHOST_SEP, Binding, ExchangeBinding, in_vhost,
                               named, qualify, split_key)
from wire import messages as m
from wire.errors import NOT_FOUND, PRECONDITION_FAILED, RESOURCE_LOCKED, ProtocolError

from .channels import Channel, ChannelError, ChannelsPart, as_channel_error
from .consumers import ConsumersPart
from .host import SessionHost
from .publishing import Batch, PublishingPart
from .replyto import ReplyToPart

# client commands handled without awaiting anything (Session.handle_now): a front end runs a
# read's run of them as one batch of input (Router.begin_input)
INLINE = frozenset({m.Publish, m.PublishTo, m.Ack, m.Nack})


class Propose:
    """An action for the driver: have the cluster's log record `change`, then call
    `then(result)` (which may return the next action). A refusal closes channel `ch`."""
    __slots__ = ("change", "ch", "rid", "then")

    def __init__(self, change: Change, ch: int, rid: int, then):
        self.change = change
        self.ch = ch
        self.rid = rid
        self.then = then


class DeclareQueue:
    """An action for the driver: declare `msg`'s queue through the log (Node.declare_queue),
    then call `then(value)`: [name, 0, 0] when it was created, None when it existed."""
    __slots__ = ("msg", "ch", "rid", "then")

    def __init__(self, msg: m.QueueDeclare, ch: int, rid: int, then):
        self.msg = msg
        self.ch = ch
        self.rid = rid
        self.then = then


KEY_CACHE = 4096  # names a session outside the default vhost remembers the keys of


class Session(ChannelsPart, PublishingPart, ConsumersPart, ReplyToPart):
    """One client connection's session core (see the module docstring)."""

    listed = True  # among the node's connections (not its dead-letter publisher's session)
    channel_max = 2047  # channels open at once (the node's config, set by the driver)
    max_tx_bytes = 64 << 20  # uncommitted publish bytes per transaction (likewise)
    _NOW: dict  # command type -> its handler, for `INLINE` commands (filled below the class)
    _HANDLERS: dict  # command type -> its handler, for the others (likewise)

    def __init__(self, host: SessionHost, sid: int, peer: str, user: str, client_name: str, out,
                 vhost: str = DEFAULT_VHOST):
        self.host = host
        # the vhost every name the client gives is in: `key` turns a name into its key in the
        # metadata and the queues' messages (the name itself in the default vhost)
        self.vhost = vhost
        self._prefix = "" if vhost == DEFAULT_VHOST else qualify(vhost, "")
        self._keys: dict[str, str] = {}
        self.sid = sid
        self.me = host.name
        self.conn_id = f"{host.name}/{sid}"
        self.peer = peer
        self.user = user
        self.vhost = vhost
        # the user's permissions in the vhost, compiled, while the metadata's access_version
        # stays what it was built at (`check_access`)
        self._access = host.access(user, vhost)
        self.client_name = client_name
        self.protocol = "warren"  # the front end speaking for the session (list_connections)
        self.out = out  # callable(message): the front end sends it to the client
        self.channels: dict[int, Channel] = {}
        self.closed_channels: set[int] = set()
        self.exclusive_queues: set[str] = set()
        self._ctags = itertools.count(1)
        self._noack_gets: set[int] = set()
        # queue.delete rid -> its QDelete (queue, owner with the channel): answered by the log
        self._deletes: dict[int, m.QDelete] = {}
        self.pseq = 0
        self.inflight: dict[str, deque[Batch]] = {}  # queue -> its batches in flight, in order
        self.inflight_msgs = 0
        self.inflight_bytes = 0
        # called once when credit may be back (the driver sets it while it waits for credit)
        self.when_room = None
        self.routes: dict[str, tuple] = {}  # queue -> (leader, epoch) our operations went to
        # queue -> the newest leader epoch that delivered to us, while it is newer than our
        # route's (the delivery beat the metadata change here), and the settles held meanwhile
        # (`_settle_to_leader`)
        self._ahead: dict[str, int] = {}
        self._held_settles: dict[str, list] = {}
        self.rpcs: dict[int, tuple[str, object]] = {}  # rid -> (queue, op): unanswered requests
        # direct replies sent to another node whose outcome is awaited (session/replyto.py)
        self._replies_out: dict[int, tuple] = {}
        self._reply_rids = 0
        self.closed = False
        # a publishing connection (it has published): held by the front end during a memory
        # alarm (broker/memory.py PublisherGate); one that only consumes is never held
        self.publisher = False
        self.full_links: list[str] = []  # queues a publish went to whose leader's link is full
        self.log = host.log.bind(conn=self.conn_id)

    # --- commands from the client ----------------------------------------------------------
    def handle(self, msg):
        """One client command. Returns None when it is done, CLOSE when the client closed the
        connection, or an action (`Propose`, `DeclareQueue`) for the driver to carry out. A
        ChannelError closes the channel; any other ProtocolError is the front end's to answer.
        A publish, ack or nack may leave `full_links` for the driver to wait on."""
        if type(msg) in INLINE:
            self.handle_now(msg)
            return None
        ch_id = getattr(msg, "ch", 0)
        if ch_id in self.closed_channels and type(msg) is not m.ChannelOpen:
            return None  # frames in flight for a channel the server closed
        rid = getattr(msg, "rid", 0)
        if rid and ch_id:
            ch = self.channels.get(ch_id)
            if ch is not None:
                ch.order.append(rid)  # its reply leaves after the replies to earlier requests
        try:
            return self._HANDLERS[type(msg)](self, msg)
        except ChannelError as exc:
            self._close_channel(ch_id, rid, exc)
            return None

    def action_failed(self, action, exc: ChannelError) -> None:
        """What an action waited for refused it: the channel closes, with its request's rid."""
        self._close_channel(action.ch, action.rid, exc)

    def handle_now(self, msg) -> None:
        """A publish, ack or nack (`INLINE`), handled without awaiting anything. A ChannelError
        closes the channel; any other ProtocolError is the front end's to answer."""
        ch_id = msg.ch
        if ch_id in self.closed_channels:
            return  # frames in flight for a channel the server closed
        try:
            self._NOW[type(msg)](self, msg)
        except ChannelError as exc:
            self._close_channel(ch_id, 0, exc)

    def handle_run(self, msgs: list, i: int) -> int:
        """The run of `INLINE` commands in `msgs` from index i on, as one batch of input
        (Router.begin_input: the rounds of the replicas it feeds run at its end, in this task);
        returns the index after the run. A ProtocolError (not a channel's) ends the run and is
        the front end's to answer. Call `wait_link_room` after it when `full_links`."""
        host = self.host
        n = len(msgs)
        host.begin_input()
        try:
            while i < n and type(msgs[i]) in INLINE:
                msg = msgs[i]
                i += 1
                self.handle_now(msg)
        finally:
            host.end_input()
        return i

    def check_access(self, what: str, kind: str, name: str) -> None:
        """RabbitMQ's permission check (mirroring/access.py): a ChannelError ACCESS_REFUSED
        when the user may not `what` (configure, write, read) the queue or exchange `name` (a
        name of this session's vhost, or its key)."""
        if self._prefix and name.startswith(self._prefix):
            name = name[len(self._prefix):]
        acc = self._access
        if acc.version != self.host.access_version:
            acc = self._access = self.host.access(self.user, self.vhost)
        if not acc.allowed(what, kind, name):
            raise as_channel_error(refused(kind, name, self.vhost, self.user))

    def key(self, name: str) -> str:
        """A name of this session's vhost -> its key (made once per name, then cached: the
        publish path asks for one per publish outside the default vhost)."""
        if not self._prefix:
            return name
        keys = self._keys
        key = keys.get(name)
        if key is None:
            if len(keys) >= KEY_CACHE:
                keys.clear()
            key = keys[name] = self._prefix + name
        return key

    def _queue(self, key: str):
        """The queue's definition, or the channel errors RabbitMQ gives."""
        host = self.host
        qdef = host.queue(key)
        if qdef is None:
            raise ChannelError(NOT_FOUND, f"no {in_vhost('queue', key)}")
        if host.queue_locked(qdef, self.conn_id):
            raise ChannelError(RESOURCE_LOCKED,
                               f"cannot obtain exclusive access to locked {in_vhost('queue', key)}. "
                               "It could be originally declared on another connection or the exclusive "
                               "property value does not match that of the original declaration.")
        reason = host.queue_down_reason(qdef)
        if reason:
            raise ChannelError(NOT_FOUND, reason)
        return qdef

    # --- queues ----------------------------------------------------------------------------
    def _queue_name(self, ch: Channel, name: str) -> str:
        """The key of a queue the client names; AMQP: an empty name means the last queue
        declared on the channel."""
        if name:
            return self.key(name)
        if ch.last_queue is None:
            raise ChannelError(NOT_FOUND, "no previously declared queue")
        return ch.last_queue

    def on_queue_declare(self, msg):
        ch = self._ch(msg.ch)
        return DeclareQueue(msg, ch.id, msg.rid, partial(self._declared, ch, msg, True))

    def _declared(self, ch: Channel, msg: m.QueueDeclare, first: bool, value):
        key = self.key(msg.queue)  # the server-chosen name too (declare_queue sets it)
        if value is None and first and self.host.queue(key) is None:
            # it existed when the log took the declare, and was deleted since: declare it again
            return DeclareQueue(msg, ch.id, msg.rid, partial(self._declared, ch, msg, False))
        ch.last_queue = key
        if value is not None:  # created: answer now
            self._reply(ch.id, msg.rid, value)
            return None
        # it existed: its leader answers with the counts
        self._request(key, msg.rid, m.QDeclareOk(key, self._owner(ch), msg.rid))
        return None

    def on_queue_delete(self, msg):
        ch = self._ch(msg.ch)
        name = self._queue_name(ch, msg.queue)
        self.check_access(CONFIGURE, "queue", name)
        if self.host.queue(name) is None:
            self._reply(ch.id, msg.rid, 0)  # deleting a missing queue is fine in AMQP
            return
        self._queue(name)
        # not tracked as a request: the log's change answers it (`answer_delete`)
        op = m.QDelete(name, self._owner(ch), msg.rid, msg.if_unused, msg.if_empty)
        self._deletes[msg.rid] = op
        self._send(name, op)

    def on_queue_purge(self, msg):
        ch = self._ch(msg.ch)
        name = self._queue_name(ch, msg.queue)
        self.check_access(READ, "queue", name)
        self._queue(name)
        self._request(name, msg.rid, m.QPurge(name, self._owner(ch), msg.rid))

    # --- exchanges and bindings (cluster metadata, through the log: the driver proposes) -------
    def _then_reply(self, ch_id: int, rid: int, result) -> None:
        self._reply(ch_id, rid, None)

    def _change(self, ch: Channel, rid: int, change: Change) -> Propose:
        return Propose(change, ch.id, rid, partial(self._then_reply, ch.id, rid))

    def on_exchange_declare(self, msg):
        ch = self._ch(msg.ch)
        name = msg.exchange
        if VHOST_SEP in name:
            raise ChannelError(PRECONDITION_FAILED, "exchange name contains a NUL character")
        key = self.key(name)
        try:
            xmod.check_declare(key, msg.kind, msg.passive)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        existing = self.host.exchange(key)
        if msg.passive:
            if existing is None:
                raise ChannelError(NOT_FOUND, f"no {xmod.describe(key)}")
        else:
            self.check_access(CONFIGURE, "exchange", name)
            xdef = xmod.make_exchange(name, msg.kind, msg.durable, msg.auto_delete, msg.internal,
                                      xmod.plain(msg.arguments), self.vhost)
            if existing is None or existing != xdef:
                return self._change(ch, msg.rid, ExchangeDeclare(xdef))
        self._reply(ch.id, msg.rid, None)
        return None

    def on_exchange_delete(self, msg):
        ch = self._ch(msg.ch)
        key = self.key(msg.exchange)
        try:
            xmod.check_deletable(key)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        self.check_access(CONFIGURE, "exchange", msg.exchange)
        if self.host.exchange(key) is not None:
            return self._change(ch, msg.rid, ExchangeDelete(key, bool(msg.if_unused)))
        self._reply(ch.id, msg.rid, None)
        return None

    def _binding(self, msg, kind: type[BindingAdd | BindingRemove]):
        ch = self._ch(msg.ch)
        qname = self._queue_name(ch, msg.queue)
        key = msg.routing_key
        if not msg.queue and not key:
            key = split_key(qname)[1]  # AMQP: both empty binds the last queue by its name
        host = self.host
        exchange = self.key(msg.exchange)
        try:
            xmod.check_bindable(exchange)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        self.check_access(WRITE, "queue", qname)
        self.check_access(READ, "exchange", msg.exchange)
        xdef = host.exchange(exchange)
        if xdef is None:
            raise ChannelError(NOT_FOUND, f"no {xmod.describe(exchange)}")
        self._queue(qname)  # 404 / 405 / the queue's node down
        args = xmod.plain(msg.arguments)
        try:
            xmod.check_binding_arguments(host.exchange_kind(xdef)[0], args)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        binding = Binding(qname, key, args)
        if (kind is BindingAdd) != host.bound(exchange, binding):
            return self._change(ch, msg.rid, kind(exchange, binding))
        self._reply(ch.id, msg.rid, None)
        return None

    def on_queue_bind(self, msg):
        return self._binding(msg, BindingAdd)

    def on_queue_unbind(self, msg):
        return self._binding(msg, BindingRemove)

    def _exchange_binding(self, msg, kind: type[ExchangeBindingAdd | ExchangeBindingRemove]):
        ch = self._ch(msg.ch)
        host = self.host
        for name in (msg.destination, msg.source):
            try:
                xmod.check_bindable(name)
            except ProtocolError as exc:
                raise as_channel_error(exc) from None
            if host.exchange(name) is None:
                raise ChannelError(NOT_FOUND, f"no {xmod.describe(name)}")
        args = xmod.plain(msg.arguments)
        try:
            xmod.check_binding_arguments(host.exchange_kind(host.exchange(msg.source))[0], args)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        binding = ExchangeBinding(msg.destination, msg.routing_key, args)
        if (kind is ExchangeBindingAdd) != host.exchange_bound(msg.source, binding):
            return self._change(ch, msg.rid, kind(msg.source, binding))
        self._reply(ch.id, msg.rid, None)
        return None

    def on_exchange_bind(self, msg):
        return self._exchange_binding(msg, ExchangeBindingAdd)

    def on_exchange_unbind(self, msg):
        return self._exchange_binding(msg, ExchangeBindingRemove)

    # --- routing to the queue's leader, and resends ------------------------------------------
    def _send(self, qname: str, op) -> None:
        """Send to the queue's leader now (or leave it for the resend when the route is back)."""
        qdef = self.host.queue(qname)
        if qdef is not None:
            self._send_to(qname, qdef, op)

    def _send_to(self, qname: str, qdef, op) -> None:
        """`_send` with the queue's definition looked up already."""
        if qname not in self.routes:
            self.routes[qname] = self.host.queue_route(qdef)
            if not self.closed:
                self.host.track_route(qname, self)
        self.host.to_leader(qname, op)

    def _drop_route(self, qname: str) -> None:
        self._ahead.pop(qname, None)
        self._held_settles.pop(qname, None)
        if self.routes.pop(qname, None) is not None:
            self.host.untrack_route(qname, self.sid)

    def _request(self, qname: str, rid: int, op) -> None:
        """An operation the queue answers: remembered until answered, resent on a route change.
        A queue already gone or unavailable fails it at once: `meta_changed` fails requests
        when the metadata changes, but one made after the change would wait for the next. A
        re-declare goes through the log between its check and its request, and the queue's
        node can be recorded down meanwhile (tests/test_sim_cluster.py holds that open)."""
        self.rpcs[rid] = (qname, op)
        qdef = self.host.queue(qname)
        reason = _deleted(qname) if qdef is None else self.host.queue_down_reason(qdef)
        if reason:
            self.queue_lost(qname, reason)
            return
        self._send_to(qname, qdef, op)

    def meta_changed(self, touched: set[str] | None = None) -> None:
        """The metadata changed: resend to queues whose leader moved, tell the client about
        queues that are gone for good. `touched`: the only queues the change named (the node
        shows it only to sessions routing to one of them); None: any queue may have changed.

        A pending delete always has its queue in `routes`: it is sent with `_send`, and
        `queue_lost` fails it when it drops the route of a queue that still exists, so a
        change that names the queue reaches this session."""
        host = self.host
        for rid, op in list(self._deletes.items()):
            if host.queue(op.queue) is None:  # deleted, by another request (ours is answered already)
                self.answer_delete(rid, 0)
        names = list(self.routes) if touched is None else [q for q in sorted(touched) if q in self.routes]
        for qname in names:
            route = self.routes.get(qname)
            if route is None:
                continue  # dropped while an earlier name was handled: nothing left to do
            qdef = host.queue(qname)
            if qdef is None:
                self.queue_lost(qname, _deleted(qname))
            elif (now := host.queue_route(qdef)) != route:
                self.routes[qname] = now
                self._resend(qname, now)
            elif down := host.queue_down_reason(qdef):
                self.queue_lost(qname, down)

    def answer_delete(self, rid: int, count: int) -> None:
        """The log applied the deletion of the queue of our queue.delete `rid` (which it names,
        with the message count its leader saw), or another deletion of it: delete-ok."""
        pending = self._deletes.pop(rid, None)
        if pending is not None:
            self._put(pending.owner[2], rid, m.Reply(rid, count))

    def resend_all(self) -> None:
        """Every route changed at once (this node was counted down and is back)."""
        host = self.host
        for qname in list(self.routes):
            qdef = host.queue(qname)
            if qdef is not None:
                self._resend(qname, host.queue_route(qdef))

    def route_changed(self, node: str) -> None:
        """The link to `node` went down or came back: resend to the queues it leads (operations
        sent while it was down were dropped; the leader dropped our consumers)."""
        host = self.host
        if not host.linked(node):
            if self._replies_out:
                self._replies_lost(node)
            # down: nothing can be sent; the resend comes with the link. A queue the log
            # already counts unavailable (its node recorded down before this link broke) fails
            # now: no change of the metadata will come to say so.
            for qname in list(self.routes):
                qdef = host.queue(qname)
                if qdef is not None and host.queue_route(qdef)[0] == node and (
                        down := host.queue_down_reason(qdef)):
                    self.queue_lost(qname, down)
            return
        for qname in list(self.routes):
            qdef = host.queue(qname)
            if qdef is not None and (route := host.queue_route(qdef))[0] == node:
                self._resend(qname, route)

    def _resend(self, qname: str, route: tuple[str, int]) -> None:
        """Send again everything the queue's leader `route` (leader, epoch) may lack."""
        me, sid = self.me, self.sid
        epoch = route[1]
        ops = [m.QPublish(qname, (me, sid, b.ch), b.pseq, b.bodies, b.props, True, epoch, b.ttl)
               for b in self.inflight.get(qname, ())]
        ops += [op for q, op in self.rpcs.values() if q == qname]
        ops += [op for op in self._deletes.values() if op.queue == qname]
        ops += [c for ch in self.channels.values() for c in ch.consumers.values()
                if c.queue == qname and c.arguments.get("x-cancel-on-ha-failover") is not True]
        ahead = self._ahead.get(qname)
        if ahead is not None and epoch >= ahead:  # caught up: the held settles go to this leader
            del self._ahead[qname]
            ops += self._held_settles.pop(qname, ())
        if not ops:
            return
        self.log.info("resending to the queue's leader", **named(qname), leader=route[0],
                      epoch=epoch, operations=len(ops))
        to_leader = self.host.to_leader
        for op in ops:
            to_leader(qname, op)

    def _settle_to_leader(self, qname: str, msg: m.QSettle) -> None:
        """A client's ack, nack or recover for the queue's leader. If a newer leader than our
        route's has delivered to us (its deliveries beat the metadata change to this node), the
        settle may be for its deliveries, which only it holds as ours: it waits until the route
        catches up, then goes there (`_resend`). Sent to the old leader, it was lost, and the
        new one counted those deliveries in flight for good: its consumer got nothing more
        (dst seed 116560: a consumer's node woke from a freeze to the deposed leader's late
        batch and the promoted one's redelivery of it, 1,000 deliveries at prefetch 500, and
        the acks of both went to the deposed leader).

        While `_ahead` names the queue, its route is behind: a route only changes in
        `meta_changed`, whose `_resend` releases the held settles (and forgets the mark) once
        the route reaches that epoch, and `_drop_route` forgets both."""
        if qname in self._ahead:
            self._held_settles.setdefault(qname, []).append(msg)
            return
        self.host.to_leader(qname, msg)

    # --- queue events ----------------------------------------------------------------------
    def queue_events(self, events: list) -> None:
        """Events from queues (deliveries, acceptances, answers), handled at once."""
        if self.closed:
            return
        channels = self.channels
        leaving = self.host.leaving  # our node's shutdown record is on its way (Node.leaving)
        for ev in events:
            t = type(ev)
            if t is m.EvDeliver:
                if leaving:
                    continue  # our node's shutdown record is on its way (Node.leaving)
                ch = channels.get(ev.ch)
                if ch is None:
                    self._closed_channel_delivery(ev)
                    continue
                route = self.routes.get(ev.queue)
                if route is not None and ev.epoch != route[1]:
                    if ev.epoch < route[1]:
                        self._stale_delivery(ch, ev)
                        continue
                    if ev.epoch > self._ahead.get(ev.queue, 0):
                        self._ahead[ev.queue] = ev.epoch
                reg = ch.consumers.get(ev.tag)
                if reg is None:
                    self._unknown_consumer(ch, ev)
                    continue
                if not ev.bodies and ev.ids:
                    ev = self._bodies_from_mirror(ch, ev)
                    if ev is None:
                        continue
                first = ch.next_tag
                n = len(ev.ids)
                ch.next_tag = first + n
                if not reg.no_ack:
                    ch.record_delivery(first, ev.queue, ev.ids)
                self._deliver_out(ch, m.Deliver(ev.ch, ev.tag, first, ev.bodies, ev.redelivered, ev.props, None))
            elif t is m.EvAccepted:
                self._accepted(ev.queue, ev.pseq)
            elif t is m.EvReply:
                if ev.rid:  # rid 0: an answer nobody waits for (a cancel of our own)
                    req = self.rpcs.pop(ev.rid, None)
                    if req is not None:
                        self._put(req[1].owner[2], ev.rid, m.Reply(ev.rid, ev.value))
            elif t is m.EvFail:
                if self.rpcs.pop(ev.rid, None) is None and self._deletes.pop(ev.rid, None) is None \
                        and ev.rid:
                    continue
                if ev.ch in channels:
                    self._close_channel(ev.ch, ev.rid, ChannelError(ev.code, ev.text))
            elif t is m.EvConsumeOk:
                self._consume_ok(ev)
            elif t is m.EvGetOk:
                self._get_ok(ev)
            elif t is m.EvCancelled:
                self._cancelled(ev)
            elif t is m.EvRejected:
                self._rejected(ev)
            elif t is m.EvDirectReply:
                self._reply_in(ev)
            elif t is m.EvReplyTaken:
                self._reply_outcome(ev.rid, ev.taken)

    def queue_lost(self, qname: str, reason: str) -> None:
        """The queue is gone or unavailable: cancel our consumers, nack what is in flight, fail
        unanswered requests."""
        self._drop_route(qname)
        for ch in list(self.channels.values()):
            for tag, reg in list(ch.consumers.items()):
                if reg.queue == qname:
                    del ch.consumers[tag]
                    self._put(ch.id, 0, m.Cancelled(ch.id, tag, reason))
            stale = [t for t, (q, _) in ch.tags.items() if q == qname]
            for t in stale:
                del ch.tags[t]
        self._lost_in_flight(qname, reason)
        failed = [(rid, op) for rid, (q, op) in self.rpcs.items() if q == qname]
        if self.host.queue(qname) is not None:
            # unavailable rather than deleted: no one can delete it now (a deletion goes
            # through its leader), so a delete in flight fails as one made now would
            failed += [(rid, op) for rid, op in self._deletes.items() if op.queue == qname]
        for rid, op in failed:
            self.rpcs.pop(rid, None)
            self._deletes.pop(rid, None)
            ch_id = op.owner[2]
            if type(op) is m.QCancel:  # its consumer is gone with the queue: done
                self._put(ch_id, rid, m.Reply(rid, op.tag))
            elif ch_id in self.channels:
                self._close_channel(ch_id, rid, ChannelError(NOT_FOUND, reason))
        self._credit_may_be_back()

    # --- the end ---------------------------------------------------------------------------
    def close(self) -> None:
        """The connection is gone: its channels and consumers go, unacked messages are
        requeued by their queues; returns at once (exclusive queues: the driver's
        `delete_exclusive`)."""
        if self.closed:
            return
        self.closed = True
        # every queue it published to too: a queue remembers each publishing session's last
        # batch (to drop a resend after a failover) until it hears the session is gone
        touched = {q for ch in self.channels.values() for q in ch.touched}
        touched.update(self.routes)
        for qname in list(self.routes):
            self._drop_route(qname)
        for qname in sorted(touched):
            self.host.to_leader(qname, m.QSessionGone(qname, self.me, self.sid))
        self._credit_may_be_back()


# The commands' handlers by type, as functions of the class taking the session: bound methods
# kept by each session would make it a reference cycle of its own, left for the interpreter's
# rare full collection when its connection ends.
# The hot path, handled without awaiting anything: a front end may run these inside a batch of
# input (Router.begin_input), whose replicas' rounds run at its end.
Session._NOW = {
    m.Publish: Session.on_publish, m.PublishTo: Session.on_publish_to,
    m.Ack: Session.on_ack, m.Nack: Session.on_nack,
}
Session._HANDLERS = {
    m.ChannelOpen: Session.on_channel_open, m.ChannelClose: Session.on_channel_close,
    m.QueueDeclare: Session.on_queue_declare, m.QueueDelete: Session.on_queue_delete,
    m.QueuePurge: Session.on_queue_purge, m.BasicQos: Session.on_qos,
    m.ConfirmSelect: Session.on_confirm_select, m.BasicConsume: Session.on_consume,
    m.BasicCancel: Session.on_cancel, m.BasicGet: Session.on_get,
    m.ConnectionClose: Session.on_connection_close,
    m.TxSelect: Session.on_tx_select, m.TxCommit: Session.on_tx_commit,
    m.TxRollback: Session.on_tx_rollback,
    m.ExchangeDeclare: Session.on_exchange_declare,
    m.ExchangeDelete: Session.on_exchange_delete, m.QueueBind: Session.on_queue_bind,
    m.QueueUnbind: Session.on_queue_unbind, m.BasicRecover: Session.on_recover,
    m.ExchangeBind: Session.on_exchange_bind, m.ExchangeUnbind: Session.on_exchange_unbind,
    m.ChannelFlow: Session.on_flow,
}


def _deleted(qname: str) -> str:
    return f"{in_vhost('queue', qname)} was deleted"

