"""What a client session means, whatever protocol speaks it: channels, delivery tags, publish
sequence numbers, routing through exchanges, confirms, returns, transactions, credit, and
resends to a queue's new leader.

A front end (broker/native.py for warren's msgpack protocol, broker/amqp/ for AMQP 0-9-1) owns
the socket: it decodes client frames into the command messages of wire/messages.py
(ChannelOpen, Publish, PublishTo, Ack, QueueBind, ...), hands them to `handle`, and turns what
the session emits (`out`: Reply, Fail, Deliver, Confirm, Cancelled, Returned) into frames. The
session never touches a socket, so it is tested without one.

Theory of operation:
* Like RabbitMQ's channel process, the session assigns delivery tags and publish sequence
  numbers, turns acks into per-queue id lists, and sends every operation to the queue's leader,
  local or on another node (broker/router.py). A channel keeps each delivery as one run (first
  tag, queue, ids), and an ack of the oldest runs' tags in order (what consumers send) becomes
  id lists by slicing them; anything else reads `tags`, the tag -> (queue, id) table the runs
  spill into first (the same two forms as a queue's unacknowledged messages, mirroring/queue.py).
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
* Routing happens here, on the node that received the publish (mirroring/exchanges.py over the
  metadata). A message routed to several queues is sent to each leader with one publish batch
  number and confirmed once *every* queue, with all its mirrors, has it; it is nacked if any
  refuses it (its node is down, it is lost, or x-overflow reject-publish). A `mandatory`
  message no queue takes comes back (`Returned`) before its confirm, as RabbitMQ does.
* Per channel, replies leave in the order of the requests (AMQP needs it: a queue on another
  node may answer a declare after a local exchange.bind answered at once), and nothing else
  for that channel overtakes a held reply (a consumer's first delivery never precedes its
  consume-ok). `channel.flow` pauses a channel's deliveries (held here) until it resumes.
* Queue events arrive through `queue_events` from the router and are handled at once.
  Deliveries from a leader epoch older than the route's are dropped (and given back): a
  deposed leader's last words must not reach the client after the new leader's.
"""

from __future__ import annotations

import itertools
from collections import deque
from itertools import repeat
from operator import itemgetter

import trio

from mirroring import changes as c
from mirroring import exchanges as xmod
from mirroring.records import Binding, QueueDef
from wire import messages as m
from wire import props as propsmod
from wire.errors import (
    ACCESS_REFUSED,
    COMMAND_INVALID,
    INTERNAL_ERROR,
    NO_ROUTE,
    NOT_ALLOWED,
    NOT_FOUND,
    NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    ProtocolError,
)

_entry_queue, _entry_id = itemgetter(0), itemgetter(1)  # a channel's tag table entry: (queue, message id)
WINDOW_MSGS = 20_000
WINDOW_BYTES = 32 << 20


# client commands handled without awaiting anything (Session.handle_now): a front end runs a
# read's run of them as one batch of input (Router.begin_input)
INLINE = frozenset({m.Publish, m.PublishTo, m.Ack, m.Nack})


class ChannelError(ProtocolError):
    """Closes the channel, not the connection (an AMQP channel exception)."""


def as_channel_error(exc: ProtocolError) -> ProtocolError:
    """A refusal from the metadata or routing: codes below 500 close the channel only."""
    if isinstance(exc, ChannelError) or exc.code >= 500:
        return exc
    return ChannelError(exc.code, exc.text)


class Fanout:
    """One publish batch routed to several queues: confirmed when the last queue accepts it,
    nacked if any refused it (`reason`), with the indexes some queue refused (`rejected`)."""
    __slots__ = ("left", "reason", "rejected")

    def __init__(self, left: int):
        self.left = left
        self.reason = ""
        self.rejected: set[int] = set()


class Batch:
    """A publish batch in flight to one queue: released (and confirmed) when the queue's
    leader says every mirror has it."""
    __slots__ = ("pseq", "ch", "first", "n", "size", "bodies", "props", "rejected", "fanout")

    def __init__(self, pseq, ch, first, n, size, bodies, props, fanout):
        self.pseq = pseq
        self.ch = ch
        self.first = first  # its first confirm sequence number (0: the channel does not confirm)
        self.n = n
        self.size = size
        self.bodies = bodies
        self.props = props
        self.rejected: list | None = None  # indexes the queue refused (reject-publish)
        self.fanout: Fanout | None = fanout


class Channel:
    __slots__ = ("id", "prefetch", "confirm", "next_seq", "next_tag", "_tags", "tag_runs", "consumers",
                 "touched", "tx", "tx_pending", "inflight", "commit_rid", "tx_failed",
                 "order", "held", "active", "paused", "last_queue")

    def __init__(self, ch: int):
        self.id = ch
        self.prefetch = 0
        self.confirm = False
        self.next_seq = 1
        self.next_tag = 1
        self._tags: dict[int, tuple] = {}  # delivery tag -> (queue, message id)
        # [first tag, queue, ids, settled]: deliveries not in _tags yet, the first `settled` acked
        self.tag_runs: deque[list] = deque()
        self.consumers: dict[str, m.QConsume] = {}  # consumer tag -> its registration
        self.touched: set[str] = set()  # queues holding consumers or deliveries of this channel
        self.tx = False  # transaction mode: publishes and acks wait in tx_pending for tx.commit
        self.tx_pending: list = []
        self.inflight = 0  # messages of this channel not yet accepted by every mirror
        self.commit_rid = 0  # a tx.commit waiting for them
        self.tx_failed = ""
        self.order: deque[int] = deque()  # request ids awaiting their reply, in request order
        self.held: deque[tuple] = deque()  # (rid or 0, output) waiting for an earlier reply
        self.active = True  # channel.flow
        self.paused: list = []  # deliveries held while the flow is off
        self.last_queue: str | None = None  # the queue an empty name stands for (AMQP)

    @property
    def tags(self) -> dict[int, tuple]:
        """Every unacknowledged delivery tag: tag -> (queue, message id)."""
        if self.tag_runs:
            table = self._tags
            for first, qname, ids, settled in self.tag_runs:
                table.update(zip(range(first + settled, first + len(ids)),
                                 zip(repeat(qname), ids[settled:])))
            self.tag_runs.clear()
        return self._tags

    @tags.setter
    def tags(self, table: dict[int, tuple]) -> None:
        self.tag_runs.clear()
        self._tags = table

    def unacked(self) -> int:
        """How many deliveries wait for an ack (counted without building the tag table)."""
        return len(self._tags) + sum(len(ids) - settled for _, _, ids, settled in self.tag_runs)

    def record_delivery(self, first: int, qname: str, ids: list) -> None:
        """Tags first.. were given to the messages `ids` of `qname`, to be acknowledged."""
        self.tag_runs.append([first, qname, ids, 0])

    def take_runs(self, tags: list, out: dict) -> int:
        """Settle the prefix of `tags` that continues the oldest delivery runs, in order, into
        `out` ({queue: [ids]}); returns how many tags that was (the rest are for `tags`). Time
        in proportion to the ack, not to the runs (a run's mark moves; nothing is cut)."""
        runs = self.tag_runs
        n = len(tags)
        done = 0
        while runs and done < n:
            run = runs[0]
            first, qname, ids, settled = run
            left = len(ids) - settled
            k = left if left <= n - done else n - done
            start = first + settled
            if (tags if k == n else tags[done:done + k]) != list(range(start, start + k)):
                break
            part = ids[settled:settled + k]
            lst = out.get(qname)
            if lst is None:
                out[qname] = part
            else:
                lst.extend(part)
            if k == left:
                runs.popleft()
            else:
                run[3] = settled + k
            done += k
        return done


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
        self._room = trio.Event()
        self._room.set()
        self.routes: dict[str, tuple] = {}  # queue -> (leader, epoch) our operations went to
        # queue -> the newest leader epoch that delivered to us, while it is newer than our
        # route's (the delivery beat the metadata change here), and the settles held meanwhile
        # (`_settle_to_leader`)
        self._ahead: dict[str, int] = {}
        self._held_settles: dict[str, list] = {}
        self.rpcs: dict[int, tuple[str, object]] = {}  # rid -> (queue, op): unanswered requests
        self.closed = False
        # a publishing connection (it has published): held by the front end during a memory
        # alarm (broker/memory.py PublisherGate); one that only consumes is never held
        self.publisher = False
        self.full_links: list[str] = []  # queues a publish went to whose leader's link is full
        self.log = node.log.bind(conn=self.conn_id)
        # the hot path, handled without awaiting anything: a front end may run these inside a
        # batch of input (Router.begin_input), whose replicas' rounds run at its end
        self._now = {
            m.Publish: self.on_publish, m.PublishTo: self.on_publish_to,
            m.Ack: self.on_ack, m.Nack: self.on_nack,
        }
        self._handlers = {
            m.ChannelOpen: self.on_channel_open, m.ChannelClose: self.on_channel_close,
            m.QueueDeclare: self.on_queue_declare, m.QueueDelete: self.on_queue_delete,
            m.QueuePurge: self.on_queue_purge, m.BasicQos: self.on_qos,
            m.ConfirmSelect: self.on_confirm_select, m.BasicConsume: self.on_consume,
            m.BasicCancel: self.on_cancel, m.BasicGet: self.on_get,
            m.ConnectionClose: self.on_connection_close,
            m.TxSelect: self.on_tx_select, m.TxCommit: self.on_tx_commit,
            m.TxRollback: self.on_tx_rollback,
            m.ExchangeDeclare: self.on_exchange_declare,
            m.ExchangeDelete: self.on_exchange_delete, m.QueueBind: self.on_queue_bind,
            m.QueueUnbind: self.on_queue_unbind, m.BasicRecover: self.on_recover,
            m.ChannelFlow: self.on_flow,
        }

    # --- commands from the client ----------------------------------------------------------
    async def handle(self, msg) -> bool:
        """One client command; True when the client closed the connection. A ChannelError
        closes the channel; any other ProtocolError is the front end's to answer."""
        if type(msg) in INLINE:
            self.handle_now(msg)
            if self.full_links:
                await self.wait_link_room()
            return False
        ch_id = getattr(msg, "ch", 0)
        if ch_id in self.closed_channels and type(msg) is not m.ChannelOpen:
            return False  # frames in flight for a channel the server closed
        rid = getattr(msg, "rid", 0)
        if rid and ch_id:
            ch = self.channels.get(ch_id)
            if ch is not None:
                ch.order.append(rid)  # its reply leaves after the replies to earlier requests
        try:
            return bool(await self._handlers[type(msg)](msg))
        except ChannelError as exc:
            self._close_channel(ch_id, rid, exc)
            return False

    def handle_now(self, msg) -> None:
        """A publish, ack or nack (`INLINE`), handled without awaiting anything. A ChannelError
        closes the channel; any other ProtocolError is the front end's to answer."""
        ch_id = msg.ch
        if ch_id in self.closed_channels:
            return  # frames in flight for a channel the server closed
        try:
            self._now[type(msg)](msg)
        except ChannelError as exc:
            self._close_channel(ch_id, 0, exc)

    def handle_run(self, msgs: list, i: int) -> int:
        """The run of `INLINE` commands in `msgs` from index i on, as one batch of input
        (Router.begin_input: the rounds of the replicas it feeds run at its end, in this task);
        returns the index after the run. A ProtocolError (not a channel's) ends the run and is
        the front end's to answer. Call `wait_link_room` after it when `full_links`."""
        router = self.router
        n = len(msgs)
        router.begin_input()
        try:
            while i < n and type(msgs[i]) in INLINE:
                msg = msgs[i]
                i += 1
                self.handle_now(msg)
        finally:
            router.end_input()
        return i

    async def wait_link_room(self) -> None:
        """Back-pressure for publishes to remote leaders: after a run of publishes, wait while
        the link to a leader that one of them went to is past its writer's high watermark (the
        publish itself was queued: a run never waits halfway)."""
        while self.full_links:
            await self.router.wait_link_room(self.full_links.pop())

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

    def fail_channel(self, ch_id: int, code: int, text: str) -> None:
        """A front end found a channel error of its own (e.g. AMQP's user_id check)."""
        self._close_channel(ch_id, 0, ChannelError(code, text))

    def _close_channel(self, ch_id: int, rid: int, exc: ProtocolError) -> None:
        ch = self.channels.pop(ch_id, None)
        if ch is not None:
            self._release_channel(ch)
        self.closed_channels.add(ch_id)
        self.out(m.Fail(rid, ch_id, exc.code, exc.text))

    # --- output, in the order a channel needs ------------------------------------------------
    def _reply(self, ch_id: int, rid: int, value) -> None:
        self._put(ch_id, rid, m.Reply(rid, value))

    def _put(self, ch_id: int, rid: int, msg) -> None:
        """Send `msg` for channel `ch_id`; a reply (rid) waits for the replies to the requests
        before it, and nothing overtakes a waiting reply."""
        ch = self.channels.get(ch_id)
        if ch is None:
            self.out(msg)
            return
        if rid:
            order = ch.order
            if order and order[0] == rid:
                order.popleft()
                self.out(msg)
                if ch.held:
                    self._drain(ch)
                return
            if rid in order:
                ch.held.append((rid, msg))
                return
        if ch.held:
            ch.held.append((0, msg))
        else:
            self.out(msg)

    def _drain(self, ch: Channel) -> None:
        held, order, out = ch.held, ch.order, self.out
        while held:
            rid, msg = held[0]
            if not rid or rid not in order:
                held.popleft()
                out(msg)
                continue
            if order[0] == rid:
                held.popleft()
                order.popleft()
                out(msg)
                continue
            # the reply due next may have been produced after this one
            want = order[0]
            for i, (r, later) in enumerate(held):
                if r == want:
                    del held[i]
                    order.popleft()
                    out(later)
                    break
            else:
                return

    def _deliver_out(self, ch: Channel, msg) -> None:
        if not ch.active:
            ch.paused.append(msg)
        elif ch.held:
            ch.held.append((0, msg))
        else:
            self.out(msg)

    def _owner(self, ch: Channel) -> tuple:
        return (self.me, self.sid, ch.id)

    def _queue(self, name: str) -> QueueDef:
        """The queue's definition, or the channel errors RabbitMQ gives."""
        qdef = self.node.cluster.md.queues.get(name)
        if qdef is None:
            raise ChannelError(NOT_FOUND, f"no queue '{name}' in vhost '/'")
        if qdef.exclusive and qdef.owner != self.conn_id:
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
        self._reply(ch.id, msg.rid, None)

    async def on_confirm_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode")
        ch.confirm = True
        self._reply(ch.id, msg.rid, None)

    # --- transactions: commit-ok only once every mirror has the publishes (spec) ----------
    async def on_tx_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.confirm:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode")
        ch.tx = True
        self._reply(ch.id, msg.rid, None)

    async def on_tx_commit(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        pending, ch.tx_pending = ch.tx_pending, []
        ch.tx = False
        try:
            for op in pending:
                self._now[type(op)](op)
        finally:
            ch.tx = True
        await self.wait_link_room()
        if ch.inflight:
            ch.commit_rid = msg.rid
        else:
            self._commit_done(ch, msg.rid)

    def _commit_done(self, ch: Channel, rid: int) -> None:
        ch.commit_rid = 0
        if ch.tx_failed:
            reason, ch.tx_failed = ch.tx_failed, ""
            self._close_channel(ch.id, rid, ChannelError(NOT_FOUND, f"tx.commit failed: {reason}"))
        else:
            self._reply(ch.id, rid, None)

    async def on_tx_rollback(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        ch.tx_pending.clear()
        self._reply(ch.id, msg.rid, None)

    # --- queues ----------------------------------------------------------------------------
    def _queue_name(self, ch: Channel, name: str) -> str:
        """AMQP: an empty queue name means the last queue declared on the channel."""
        if name:
            return name
        if ch.last_queue is None:
            raise ChannelError(NOT_FOUND, "no previously declared queue")
        return ch.last_queue

    async def on_queue_declare(self, msg):
        ch = self._ch(msg.ch)
        value = await self.node.declare_queue(self, msg)
        if value is None and msg.queue not in self.node.cluster.md.queues:
            # it existed when the log took the declare, and was deleted since: declare it again
            value = await self.node.declare_queue(self, msg)
        ch.last_queue = msg.queue  # the server-chosen name too (declare_queue sets it)
        if value is not None:  # created: answer now
            self._reply(ch.id, msg.rid, value)
            return
        # it existed: its leader answers with the counts
        self._request(msg.queue, msg.rid, m.QDeclareOk(msg.queue, self._owner(ch), msg.rid))

    async def on_queue_delete(self, msg):
        ch = self._ch(msg.ch)
        name = self._queue_name(ch, msg.queue)
        qdef = self.node.cluster.md.queues.get(name)
        if qdef is None:
            self._reply(ch.id, msg.rid, 0)  # deleting a missing queue is fine in AMQP
            return
        self._queue(name)
        # not tracked as a request: the log's change answers it (`answer_delete`)
        op = m.QDelete(name, self._owner(ch), msg.rid, msg.if_unused, msg.if_empty)
        self._deletes[msg.rid] = op
        self._send(name, op)

    async def on_queue_purge(self, msg):
        ch = self._ch(msg.ch)
        name = self._queue_name(ch, msg.queue)
        self._queue(name)
        self._request(name, msg.rid, m.QPurge(name, self._owner(ch), msg.rid))

    # --- exchanges and bindings (cluster metadata, through the log) ---------------------------
    async def _propose(self, change: c.Change):
        try:
            return await self.node.cluster.propose(change)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        except trio.TooSlowError:
            raise ChannelError(INTERNAL_ERROR, "timed out waiting for the cluster to record the change") from None

    async def on_exchange_declare(self, msg):
        ch = self._ch(msg.ch)
        name = msg.exchange
        try:
            xmod.check_declare(name, msg.kind, msg.passive)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        md = self.node.cluster.md
        if msg.passive:
            if name not in md.exchanges:
                raise ChannelError(NOT_FOUND, f"no {xmod.describe(name)}")
        else:
            xdef = xmod.make_exchange(name, msg.kind, msg.durable, msg.auto_delete, msg.internal,
                                      xmod.plain(msg.arguments))
            existing = md.exchanges.get(name)
            if existing is None or existing != xdef:
                await self._propose(c.ExchangeDeclare(xdef))
        self._reply(ch.id, msg.rid, None)

    async def on_exchange_delete(self, msg):
        ch = self._ch(msg.ch)
        try:
            xmod.check_deletable(msg.exchange)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        if msg.exchange in self.node.cluster.md.exchanges:
            await self._propose(c.ExchangeDelete(msg.exchange, bool(msg.if_unused)))
        self._reply(ch.id, msg.rid, None)

    async def _binding(self, msg, kind: type[c.BindingAdd | c.BindingRemove]) -> None:
        ch = self._ch(msg.ch)
        qname = self._queue_name(ch, msg.queue)
        key = msg.routing_key
        if not msg.queue and not key:
            key = qname  # AMQP: both empty binds the last queue by its name
        md = self.node.cluster.md
        try:
            xmod.check_bindable(msg.exchange)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        xdef = md.exchanges.get(msg.exchange)
        if xdef is None:
            raise ChannelError(NOT_FOUND, f"no {xmod.describe(msg.exchange)}")
        self._queue(qname)  # 404 / 405 / the queue's node down
        args = xmod.plain(msg.arguments)
        try:
            xmod.check_binding_arguments(xdef.type, args)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        binding = Binding(qname, key, args)
        bound = binding in md.bindings.get(msg.exchange, ())
        if (kind is c.BindingAdd) != bound:
            await self._propose(kind(msg.exchange, binding))
        self._reply(ch.id, msg.rid, None)

    async def on_queue_bind(self, msg):
        await self._binding(msg, c.BindingAdd)

    async def on_queue_unbind(self, msg):
        await self._binding(msg, c.BindingRemove)

    # --- publishing ------------------------------------------------------------------------
    def _publishing_channel(self, msg):
        """The channel a publish batch goes out on now, or None when there is nothing to do
        yet (an empty batch, or a transaction that holds it until commit)."""
        self.publisher = True
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return None
        n = len(msg.bodies)
        if not n:
            return None
        if msg.props is not None and len(msg.props) != n:
            raise ProtocolError(COMMAND_INVALID, "publish: props must be nil or parallel to bodies")
        return ch

    def on_publish(self, msg):
        """warren's own publish: the default exchange, the routing key is the queue's name."""
        ch = self._publishing_channel(msg)
        if ch is None:
            return
        qname = msg.queue
        queues = [qname] if qname in self.node.cluster.md.queues else []
        self._publish(ch, queues, msg.bodies, msg.props, "", qname, False)

    def on_publish_to(self, msg):
        ch = self._publishing_channel(msg)
        if ch is None:
            return
        n = len(msg.bodies)
        props = msg.props
        md = self.node.cluster.md
        ex = msg.exchange
        if ex:
            xdef = md.exchanges.get(ex)
            if xdef is None:
                raise ChannelError(NOT_FOUND, f"no {xmod.describe(ex)}")
            if xdef.internal:
                raise ChannelError(ACCESS_REFUSED, f"cannot publish to internal {xmod.describe(ex)}")
            if xdef.type == "headers":
                # each message routes by its own headers: publish runs of equal routes
                routes = md.routes
                start = 0
                last = None
                for i in range(n + 1):
                    route = None
                    if i < n:
                        item = props[i] if props is not None else None
                        route = routes.route(ex, msg.routing_key, lambda item=item: propsmod.headers_of(item))
                    if i and (i == n or route != last):
                        self._publish(ch, last, msg.bodies[start:i],
                                      props[start:i] if props is not None else None,
                                      ex, msg.routing_key, msg.mandatory)
                        start = i
                    last = route
                return
        try:
            queues = md.routes.route(ex, msg.routing_key)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        self._publish(ch, queues, msg.bodies, props, ex, msg.routing_key, msg.mandatory)

    def _publish(self, ch: Channel, queues: list, bodies: list, props, exchange: str,
                 routing_key: str, mandatory: bool) -> None:
        """Send a batch to the queues it was routed to; returns, nacks or confirms at once what
        cannot be sent."""
        n = len(bodies)
        if ch.confirm:
            first = ch.next_seq
            ch.next_seq = first + n
        else:
            first = 0
        node = self.node
        md = node.cluster.md
        if not queues:
            if mandatory:
                self._put(ch.id, 0, m.Returned(ch.id, NO_ROUTE, "NO_ROUTE", exchange, routing_key,
                                               bodies, props))
            if first:
                self._put(ch.id, 0, m.Confirm(ch.id, [[first, first + n - 1]], [], ""))
            return
        live = []
        down = ""
        for qname in queues:
            qdef = md.queues.get(qname)
            reason = "" if qdef is None else node.queue_down_reason(qdef)
            if reason:
                down = reason
            elif qdef is not None:
                live.append(qname)
        if down or not live:
            # the message would not reach every queue it was routed to: refuse it
            if first:
                self._put(ch.id, 0, m.Confirm(ch.id, [], [[first, first + n - 1]],
                                              down or "no queue took the message"))
            return
        self.pseq = pseq = self.pseq + 1
        size = sum(map(len, bodies))
        fanout = Fanout(len(live)) if len(live) > 1 else None
        owner = self._owner(ch)
        router = self.router
        for qname in live:
            dq = self.inflight.get(qname)
            if dq is None:
                dq = self.inflight[qname] = deque()
            dq.append(Batch(pseq, ch.id, first, n, size, bodies, props, fanout))
            ch.inflight += n
            self.inflight_msgs += n
            self.inflight_bytes += size
            if router.link_full(qname):
                self.full_links.append(qname)  # the front end waits after this run (wait_link_room)
            qdef = node.cluster.md.queues.get(qname)
            epoch = qdef.epoch if qdef is not None else 0  # None: _send drops it
            self._send(qname, m.QPublish(qname, owner, pseq, bodies, props, False, epoch))

    # --- routing to the queue's leader, and resends ------------------------------------------
    def _send(self, qname: str, op) -> None:
        """Send to the queue's leader now (or leave it for the resend when the route is back)."""
        qdef = self.node.cluster.md.queues.get(qname)
        if qdef is None:
            return
        if qname not in self.routes:
            self.routes[qname] = (qdef.leader, qdef.epoch)
            if not self.closed:
                self.node.routing.setdefault(qname, {})[self.sid] = self
        self.router.to_leader(qname, op)

    def _drop_route(self, qname: str) -> None:
        self._ahead.pop(qname, None)
        self._held_settles.pop(qname, None)
        if self.routes.pop(qname, None) is not None:
            routing = self.node.routing
            held = routing.get(qname)
            if held is not None and held.pop(self.sid, None) is not None and not held:
                del routing[qname]

    def _request(self, qname: str, rid: int, op) -> None:
        """An operation the queue answers: remembered until answered, resent on a route change.
        A queue already gone or unavailable fails it at once: `meta_changed` fails requests
        when the metadata changes, but one made after the change would wait for the next. A
        re-declare goes through the log between its check and its request, and the queue's
        node can be recorded down meanwhile (tests/test_sim_cluster.py holds that open)."""
        self.rpcs[rid] = (qname, op)
        qdef = self.node.cluster.md.queues.get(qname)
        reason = _deleted(qname) if qdef is None else self.node.queue_down_reason(qdef)
        if reason:
            self.queue_lost(qname, reason)
            return
        self._send(qname, op)

    def meta_changed(self, touched: set[str] | None = None) -> None:
        """The metadata changed: resend to queues whose leader moved, tell the client about
        queues that are gone for good. `touched`: the only queues the change named (the node
        shows it only to sessions routing to one of them); None: any queue may have changed.

        A pending delete always has its queue in `routes`: it is sent with `_send`, and
        `queue_lost` fails it when it drops the route of a queue that still exists, so a
        change that names the queue reaches this session."""
        md = self.node.cluster.md
        for rid, op in list(self._deletes.items()):
            if op.queue not in md.queues:  # deleted, by another request (ours is answered already)
                self.answer_delete(rid, 0)
        names = list(self.routes) if touched is None else [q for q in sorted(touched) if q in self.routes]
        for qname in names:
            route = self.routes.get(qname)
            if route is None:
                continue  # dropped while an earlier name was handled: nothing left to do
            qdef = md.queues.get(qname)
            if qdef is None:
                self.queue_lost(qname, _deleted(qname))
            elif (qdef.leader, qdef.epoch) != route:
                self.routes[qname] = (qdef.leader, qdef.epoch)
                self._resend(qname, qdef)
            elif down := self.node.queue_down_reason(qdef):
                self.queue_lost(qname, down)

    def answer_delete(self, rid: int, count: int) -> None:
        """The log applied the deletion of the queue of our queue.delete `rid` (which it names,
        with the message count its leader saw), or another deletion of it: delete-ok."""
        pending = self._deletes.pop(rid, None)
        if pending is not None:
            self._put(pending.owner[2], rid, m.Reply(rid, count))

    def resend_all(self) -> None:
        """Every route changed at once (this node was counted down and is back)."""
        md = self.node.cluster.md
        for qname in list(self.routes):
            qdef = md.queues.get(qname)
            if qdef is not None:
                self._resend(qname, qdef)

    def route_changed(self, node: str) -> None:
        """The link to `node` went down or came back: resend to the queues it leads (operations
        sent while it was down were dropped; the leader dropped our consumers)."""
        md = self.node.cluster.md
        if node not in self.node.cluster.links:
            # down: nothing can be sent; the resend comes with the link. A queue the log
            # already counts unavailable (its node recorded down before this link broke) fails
            # now: no change of the metadata will come to say so.
            for qname in list(self.routes):
                qdef = md.queues.get(qname)
                if qdef is not None and qdef.leader == node and (
                        down := self.node.queue_down_reason(qdef)):
                    self.queue_lost(qname, down)
            return
        for qname in list(self.routes):
            qdef = md.queues.get(qname)
            if qdef is not None and qdef.leader == node:
                self._resend(qname, qdef)

    def _resend(self, qname: str, qdef: QueueDef) -> None:
        me, sid = self.me, self.sid
        epoch = qdef.epoch
        ops = [m.QPublish(qname, (me, sid, b.ch), b.pseq, b.bodies, b.props, True, epoch)
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
        self.log.info("resending to the queue's leader", queue=qname, leader=qdef.leader,
                      epoch=qdef.epoch, operations=len(ops))
        router = self.router
        for op in ops:
            router.to_leader(qname, op)

    # --- acknowledgements ------------------------------------------------------------------
    def _settle(self, ch: Channel, tags, upto: int) -> dict[str, list]:
        """Delivery tags -> {queue: [message ids]}; unknown tags are a channel error."""
        out: dict[str, list] = {}
        n = len(tags)
        if n and not upto and ch.tag_runs:  # the usual case: the oldest deliveries, in order
            if type(tags) is not list:
                tags = list(tags)
            done = ch.take_runs(tags, out)
            if done == n:
                return out
            tags = tags[done:]
            n = len(tags)
        table = ch.tags
        if n and not upto and not out:
            # known tags, all of one queue: in C loops
            entries = list(map(table.pop, tags, repeat(None, n)))
            if None not in entries:
                queues = list(map(_entry_queue, entries))
                if queues.count(queues[0]) == n:
                    return {queues[0]: list(map(_entry_id, entries))}
            table.update((t, e) for t, e in zip(tags, entries) if e is not None)  # go tag by tag
        for t in tags:
            entry = table.pop(t, None)
            if entry is None:
                raise ChannelError(PRECONDITION_FAILED, f"unknown delivery tag {t}")
            lst = out.get(entry[0])
            if lst is None:
                out[entry[0]] = [entry[1]]
            else:
                lst.append(entry[1])
        if upto < 0:
            upto = ch.next_tag - 1  # AMQP: tag 0 with multiple is everything delivered so far
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

    def on_ack(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        owner = self._owner(ch)
        for qname, ids in self._settle(ch, msg.tags, msg.multiple_upto).items():
            self._settle_to_leader(qname, m.QSettle(qname, owner, m.ACK, ids))

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
        self.router.to_leader(qname, msg)

    def on_nack(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        owner = self._owner(ch)
        how = m.REQUEUE if msg.requeue else m.DISCARD
        for qname, ids in self._settle(ch, msg.tags, msg.multiple_upto).items():
            self._settle_to_leader(qname, m.QSettle(qname, owner, how, ids))

    # --- consumers -------------------------------------------------------------------------
    async def on_consume(self, msg):
        ch = self._ch(msg.ch)
        qname = self._queue_name(ch, msg.queue)
        self._queue(qname)  # the channel errors for a missing, locked or unavailable queue
        tag = msg.consumer_tag or f"amq.ctag-{self.conn_id}-{next(self._ctags)}"
        if tag in ch.consumers or any(op.tag == tag and op.owner[2] == ch.id
                                      for _, op in self.rpcs.values() if type(op) is m.QConsume):
            raise ProtocolError(NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        ch.touched.add(qname)
        op = m.QConsume(qname, self._owner(ch), msg.rid, tag, msg.no_ack, ch.prefetch,
                        msg.exclusive, xmod.plain(msg.arguments))
        self._request(qname, msg.rid, op)

    async def on_cancel(self, msg):
        ch = self._ch(msg.ch)
        reg = ch.consumers.pop(msg.consumer_tag, None)
        if reg is None:
            self._reply(ch.id, msg.rid, msg.consumer_tag)
            return
        qdef = self.node.cluster.md.queues.get(reg.queue)
        if qdef is None or self.node.queue_down_reason(qdef):
            self._reply(ch.id, msg.rid, msg.consumer_tag)
            return
        self._request(reg.queue, msg.rid, m.QCancel(reg.queue, self._owner(ch), msg.rid, msg.consumer_tag))

    async def on_get(self, msg):
        ch = self._ch(msg.ch)
        qname = self._queue_name(ch, msg.queue)
        self._queue(qname)
        if msg.no_ack:
            self._noack_gets.add(msg.rid)
        else:
            ch.touched.add(qname)
        self._request(qname, msg.rid, m.QGet(qname, self._owner(ch), msg.rid, msg.no_ack))

    async def on_recover(self, msg):
        """basic.recover: every message delivered on the channel and not acknowledged goes
        back to its queue (redelivered). RabbitMQ refuses requeue=false; so does warren."""
        ch = self._ch(msg.ch)
        if not msg.requeue:
            raise ProtocolError(NOT_IMPLEMENTED, "requeue=false")
        owner = self._owner(ch)
        for qname, ids in self._settle(ch, list(ch.tags), 0).items():
            self._settle_to_leader(qname, m.QSettle(qname, owner, m.REQUEUE, ids))
        self._reply(ch.id, msg.rid, None)

    async def on_flow(self, msg):
        """channel.flow: pause or resume deliveries to this channel (held here meanwhile)."""
        ch = self._ch(msg.ch)
        ch.active = bool(msg.active)
        self._reply(ch.id, msg.rid, ch.active)
        if ch.active and ch.paused:
            paused, ch.paused = ch.paused, []
            for d in paused:
                self._deliver_out(ch, d)

    # --- queue events ----------------------------------------------------------------------
    def queue_events(self, events: list) -> None:
        """Events from queues (deliveries, acceptances, answers), handled at once."""
        if self.closed:
            return
        channels = self.channels
        node = self.node
        for ev in events:
            t = type(ev)
            if t is m.EvDeliver:
                if node.leaving:
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
                self._deliver_out(ch, m.Deliver(ev.ch, ev.tag, first, ev.bodies, ev.redelivered, ev.props))
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
                req = self.rpcs.pop(ev.rid, None) if ev.rid else None
                if req is None:
                    continue  # a re-registration (or a resent consume) answered again
                ch = channels.get(ev.ch)
                if ch is not None:
                    ch.consumers[ev.tag] = req[1]
                self._put(ev.ch, ev.rid, m.Reply(ev.rid, ev.tag))
            elif t is m.EvGetOk:
                if self.rpcs.pop(ev.rid, None) is None:
                    continue
                ch = channels.get(ev.ch)
                if ev.msg is None or ch is None:
                    self._noack_gets.discard(ev.rid)
                    self._put(ev.ch, ev.rid, m.Reply(ev.rid, None))
                    continue
                tag = ch.next_tag
                ch.next_tag += 1
                if ev.rid in self._noack_gets:
                    self._noack_gets.discard(ev.rid)
                else:
                    ch.tags[tag] = (ev.queue, ev.msg[0])
                self._put(ev.ch, ev.rid, m.Reply(ev.rid, [tag, ev.msg[1], ev.msg[3], ev.msg[2], ev.remaining]))
            elif t is m.EvCancelled:
                ch = channels.get(ev.ch)
                if ch is not None and ch.consumers.pop(ev.tag, None) is not None:
                    self._put(ev.ch, 0, m.Cancelled(ev.ch, ev.tag, ev.reason))
            elif t is m.EvRejected:
                for b in self.inflight.get(ev.queue, ()):
                    if b.pseq == ev.pseq:
                        b.rejected = list(ev.indexes)
                        break

    def _bodies_from_mirror(self, ch: Channel, ev: m.EvDeliver) -> m.EvDeliver | None:
        """A delivery the leader sent without its bodies: this node's mirror of the queue holds
        them (mirroring/replica.py `local_bodies`). Any it does not hold (it restarted empty
        meanwhile) go back to the leader, which delivers them again, flagged (the client never
        saw them), and with their bodies from then on. None when nothing is left to deliver."""
        bodies = self.router.mirror_bodies(ev)
        if None not in bodies:
            ev.bodies = bodies
            return ev
        owner = self._owner(ch)
        keep = [i for i, b in enumerate(bodies) if b is not None]
        missing = [mid for mid, b in zip(ev.ids, bodies) if b is None]
        self.log.warning("deliveries whose bodies this node's mirror lacks: given back to the "
                         "queue's leader", queue=ev.queue, messages=len(missing))
        self.router.to_leader(ev.queue, m.QSettle(ev.queue, owner, m.LACKED, missing))
        if not keep:
            return None
        new_index = {old: new for new, old in enumerate(keep)}
        return m.EvDeliver(ev.ch, ev.tag, ev.queue, [ev.ids[i] for i in keep], [bodies[i] for i in keep],
                           [new_index[i] for i in ev.redelivered if i in new_index],
                           [ev.props[i] for i in keep] if ev.props is not None else None, ev.epoch)

    def _stale_delivery(self, ch: Channel, ev: m.EvDeliver) -> None:
        """Deliveries a leader sent before its epoch ended, arriving after we moved on (a link
        that was cut and heals delivers what it held). The client never sees them: a promoted
        leader requeued everything unacknowledged when it took over and delivers it again,
        flagged; a leader that carried on in a new epoch still holds them as ours, so they are
        given back to it to deliver again (ids it does not hold as ours are ignored)."""
        self.router.to_leader(ev.queue, m.QSettle(ev.queue, self._owner(ch), m.REQUEUE, ev.ids))

    def superseded(self, events: list) -> None:
        """Events held while our node was out of step, which the log then counted down
        (Router.counted_down): their deliveries go back to the queue's leader unseen (one that
        requeued them already ignores them); everything else is handled as usual."""
        rest = []
        channels = self.channels
        for ev in events:
            if type(ev) is m.EvDeliver and ev.ch in channels:
                self._stale_delivery(channels[ev.ch], ev)
            else:
                rest.append(ev)
        if rest:
            self.queue_events(rest)

    def _closed_channel_delivery(self, ev: m.EvDeliver) -> None:
        """Deliveries for a channel this session no longer has. Its close told the leader of
        the day (owner_gone), but that leader may have died with the news before replicating
        it, and the one promoted from a mirror still counts the channel's consumer (dst seed
        2281: a consumer recovered after a full restart on channel 1, the client moved to
        channel 2, the leader was killed; the next one fed channel 1 its prefetch, stranded).
        Tell the present leader again: the channel's consumers go, its messages are requeued."""
        self.router.to_leader(ev.queue, m.QOwnerGone(ev.queue, (self.me, self.sid, ev.ch)))

    def _unknown_consumer(self, ch: Channel, ev: m.EvDeliver) -> None:
        """Deliveries for a consumer this channel does not have (cancelled meanwhile, or
        re-registered by a resend that crossed its cancellation): give them back and cancel it
        at the queue, so nothing sits unacknowledged for a consumer nobody reads."""
        owner = self._owner(ch)
        router = self.router
        router.to_leader(ev.queue, m.QSettle(ev.queue, owner, m.REQUEUE, ev.ids))
        router.to_leader(ev.queue, m.QCancel(ev.queue, owner, 0, ev.tag))

    def _batch_done(self, b: Batch, reason: str, confirms: dict) -> None:
        """A batch left the in-flight set (accepted, or refused with `reason`): count it off
        its channel and, once every queue it went to is done, collect its confirms into
        `confirms` {channel: [acks, nacks, reasons]}."""
        ch = self.channels.get(b.ch)
        if ch is not None:
            ch.inflight -= b.n
            if reason and (ch.tx or ch.commit_rid):
                ch.tx_failed = reason
            if ch.commit_rid and not ch.inflight:
                self._commit_done(ch, ch.commit_rid)
        rejected = b.rejected
        f = b.fanout
        if f is not None:
            f.left -= 1
            if reason:
                f.reason = reason
            if rejected:
                f.rejected.update(rejected)
            if f.left:
                return  # other queues still have it
            reason = f.reason
            rejected = f.rejected
        if not b.first:
            return
        entry = confirms.get(b.ch)
        if entry is None:
            entry = confirms[b.ch] = [[], [], []]
        first, last = b.first, b.first + b.n - 1
        if reason:
            _add_range(entry[1], first, last)
            if reason not in entry[2]:
                entry[2].append(reason)
        elif not rejected:
            _add_range(entry[0], first, last)
        else:
            for i in range(b.n):
                _add_range(entry[1] if i in rejected else entry[0], first + i, first + i)
            text = "the queue is full (x-overflow reject-publish)"
            if text not in entry[2]:
                entry[2].append(text)

    def _send_confirms(self, confirms: dict) -> None:
        for ch_id, (acks, nacks, reasons) in confirms.items():
            if ch_id in self.channels:
                self._put(ch_id, 0, m.Confirm(ch_id, acks, nacks, "; ".join(reasons)))

    def _accepted(self, qname: str, upto: int) -> None:
        """Publishes up to `upto` are on every mirror: release them, confirm them."""
        dq = self.inflight.get(qname)
        if not dq:
            return
        confirms: dict = {}
        n = size = 0
        while dq and dq[0].pseq <= upto:
            b = dq.popleft()
            n += b.n
            size += b.size
            self._batch_done(b, "", confirms)
        self.inflight_msgs -= n
        self.inflight_bytes -= size
        self._send_confirms(confirms)
        if self.has_credit:
            self._room.set()

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
        confirms: dict = {}
        for b in self.inflight.pop(qname, ()):
            self.inflight_msgs -= b.n
            self.inflight_bytes -= b.size
            self._batch_done(b, reason, confirms)
        self._send_confirms(confirms)
        failed = [(rid, op) for rid, (q, op) in self.rpcs.items() if q == qname]
        if qname in self.node.cluster.md.queues:
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
        for qname in list(self.routes):
            self._drop_route(qname)
        touched = {q for ch in self.channels.values() for q in ch.touched}
        for qname in touched:
            self.router.to_leader(qname, m.QSessionGone(qname, self.me, self.sid))
        self._room.set()

    async def delete_exclusive(self) -> None:
        for qname in list(self.exclusive_queues):
            with trio.move_on_after(5):
                try:
                    await self.node.cluster.propose(c.QueueDelete(qname))
                except ProtocolError:
                    pass


def _deleted(qname: str) -> str:
    return f"queue '{qname}' in vhost '/' was deleted"


def _add_range(ranges: list, first: int, last: int) -> None:
    """Append [first, last] to sorted inclusive ranges, merging with the last one if adjacent."""
    if ranges and ranges[-1][1] + 1 == first:
        ranges[-1][1] = last
    else:
        ranges.append([first, last])
