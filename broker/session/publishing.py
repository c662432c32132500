"""A session's publishes, from the client's command until the last queue's leader says every
mirror has them: routing through exchanges, publish batches in flight, confirms, returns,
transactions, and the credit window.

* Routing happens here, on the node that received the publish (mirroring/exchanges.py over the
  metadata). A message routed to several queues is sent to each leader with one publish batch
  number and confirmed once *every* queue, with all its mirrors, has it; it is nacked if any
  refuses it (its node is down, it is lost, or x-overflow reject-publish). A `mandatory` message
  no queue takes comes back (`Returned`) before its confirm, as RabbitMQ does.
* A publish through the default exchange to a direct reply-to name (`amq.rabbitmq.reply-to.`
  and a token) that is no queue's goes straight to the requesting channel
  (broker/session/replyto.py); one whose reply_to asks for direct reply-to has it rewritten
  first. Neither costs a plain publish anything but a flag's test.
* Publishes stay *in flight*, bodies and all, until the queue's leader says every mirror has
  them (`EvAccepted`); then confirm-mode channels get their confirms and transactions their
  commit-ok. That set is the credit window: past WINDOW_MSGS messages or WINDOW_BYTES bytes
  `has_credit` is false and the front end stops reading from the client (a held publisher),
  so a stalled mirror holds publishers and memory stays bounded. The core only says so; the
  driver waits (broker/session/driver.py), told through `when_room` that credit may be back.
* A session that has published is a *publisher*: while a memory alarm is on anywhere in the
  cluster, front ends stop reading from it (broker/memory.py); sessions that only consume and
  ack keep being read, so consumers drain the queues that hold the memory.

`PublishingPart` is one part of the session core (broker/session/core.py `Session`); it uses
the core's channels, `host`, `out` ordering (`_put`) and routes (`_send_to`).
"""

from __future__ import annotations

from collections import deque

from mirroring import exchanges as xmod
from mirroring.access import WRITE
from wire import messages as m
from wire import props as propsmod
from wire.errors import ACCESS_REFUSED, COMMAND_INVALID, NO_ROUTE, NOT_FOUND, PRECONDITION_FAILED, ProtocolError

from .channels import Channel, ChannelError, as_channel_error
from .replyto import PREFIX as REPLY_PREFIX

WINDOW_MSGS = 20_000
WINDOW_BYTES = 32 << 20


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
    __slots__ = ("pseq", "ch", "first", "n", "size", "bodies", "props", "rejected", "fanout", "ttl")

    def __init__(self, pseq, ch, first, n, size, bodies, props, fanout, ttl=None):
        self.pseq = pseq
        self.ch = ch
        self.first = first  # its first confirm sequence number (0: the channel does not confirm)
        self.n = n
        self.size = size
        self.bodies = bodies
        self.props = props
        self.rejected: list | None = None  # indexes the queue refused (reject-publish)
        self.fanout: Fanout | None = fanout
        self.ttl = ttl  # the messages' expiration (ms), None: none



class PublishingPart:
    """Publishes, confirms, transactions and credit (see the module docstring)."""

    @property
    def has_credit(self) -> bool:
        return self.inflight_msgs <= WINDOW_MSGS and self.inflight_bytes <= WINDOW_BYTES

    def _credit_may_be_back(self) -> None:
        """Tell the driver waiting for credit (`when_room`, at most once per wait)."""
        room = self.when_room
        if room is not None:
            self.when_room = None
            room()

    def on_confirm_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode")
        ch.confirm = True
        self._reply(ch.id, msg.rid, None)

    # --- transactions: commit-ok only once every mirror has the publishes (spec) ----------
    def on_tx_select(self, msg):
        ch = self._ch(msg.ch)
        if ch.confirm:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode")
        ch.tx = True
        self._reply(ch.id, msg.rid, None)

    def on_tx_commit(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        pending, ch.tx_pending = ch.tx_pending, []
        ch.tx_bytes = 0
        ch.tx = False
        try:
            for op in pending:
                self._NOW[type(op)](self, op)
        finally:
            ch.tx = True
        # the driver waits for room on a full link after this (`full_links`), before reading on
        if ch.inflight:
            ch.commit_rid = msg.rid
        else:
            self._commit_done(ch, msg.rid)

    def _hold_in_tx(self, ch: Channel, msg) -> None:
        """A publish batch waits in the transaction for tx.commit, within max_tx_bytes: past it
        the channel is closed (406) and the transaction is gone with it."""
        size = ch.tx_bytes + sum(map(len, msg.bodies))
        if size > self.max_tx_bytes:
            raise ChannelError(PRECONDITION_FAILED,
                               f"transaction on channel {ch.id} would hold {size} bytes of "
                               f"uncommitted publishes, more than max_tx_bytes ({self.max_tx_bytes}): "
                               "commit or roll back sooner")
        ch.tx_bytes = size
        ch.tx_pending.append(msg)

    def _commit_done(self, ch: Channel, rid: int) -> None:
        ch.commit_rid = 0
        if ch.tx_failed:
            reason, ch.tx_failed = ch.tx_failed, ""
            self._close_channel(ch.id, rid, ChannelError(NOT_FOUND, f"tx.commit failed: {reason}"))
        else:
            self._reply(ch.id, rid, None)

    def on_tx_rollback(self, msg):
        ch = self._ch(msg.ch)
        if not ch.tx:
            raise ChannelError(PRECONDITION_FAILED, "channel is not transactional")
        ch.tx_pending.clear()
        ch.tx_bytes = 0
        self._reply(ch.id, msg.rid, None)


    # --- publishing ------------------------------------------------------------------------
    def _publishing_channel(self, msg):
        """The channel a publish batch goes out on now, or None when there is nothing to do
        yet (an empty batch, or a transaction that holds it until commit)."""
        self.publisher = True
        ch = self._ch(msg.ch)
        if ch.tx:
            self._hold_in_tx(ch, msg)
            return None
        n = len(msg.bodies)
        if not n:
            return None
        if msg.props is not None and len(msg.props) != n:
            raise ProtocolError(COMMAND_INVALID, "publish: props must be nil or parallel to bodies")
        return ch

    def on_publish(self, msg):
        """warren's own publish: the default exchange, the routing key is the queue's name
        (messages with their own `expiration` come as PublishTo: broker/native.py reads it)."""
        acc = self._access  # write on the exchange: the compiled patterns' memo, while current
        if acc.version != self.host.access_version or not acc.allowed(WRITE, "exchange", ""):
            self.check_access(WRITE, "exchange", "")
        ch = self._publishing_channel(msg)
        if ch is None:
            return
        qname = self.key(msg.queue) if self._prefix else msg.queue
        if self.host.queue(qname) is not None:
            self._publish(ch, [qname], msg.bodies, msg.props, "", msg.queue, False)
        elif msg.queue.startswith(REPLY_PREFIX):
            self._send_reply(ch, msg.queue, msg.bodies, msg.props, False)
        else:
            self._publish(ch, [], msg.bodies, msg.props, "", msg.queue, False)

    def on_publish_to(self, msg):
        acc = self._access
        if acc.version != self.host.access_version or not acc.allowed(WRITE, "exchange", msg.exchange):
            self.check_access(WRITE, "exchange", msg.exchange)
        ch = self._publishing_channel(msg)
        if ch is None:
            return
        n = len(msg.bodies)
        props = msg.props
        if msg.reply:
            props = self._ask_for_reply(ch, props)
        host = self.host
        ex = msg.exchange
        if self._prefix:  # outside the default vhost: the exchange's key, or the queue's
            if not ex:
                qname = self.key(msg.routing_key)
                if host.queue(qname) is None and msg.routing_key.startswith(REPLY_PREFIX):
                    self._send_reply(ch, msg.routing_key, msg.bodies, props, msg.mandatory)
                    return
                queues = [qname] if host.queue(qname) is not None else []
                self._publish(ch, queues, msg.bodies, props, ex, msg.routing_key, msg.mandatory,
                              False, msg.ttl)
                return
            xkey = self.key(ex)
        else:
            xkey = ex
        if ex:
            xdef = host.exchange(xkey)
            if xdef is None:
                raise ChannelError(NOT_FOUND, f"no {xmod.describe(xkey)}")
            kind, internal = host.exchange_kind(xdef)
            if internal:
                raise ChannelError(ACCESS_REFUSED, f"cannot publish to internal {xmod.describe(xkey)}")
            if kind == "headers" or host.routes_by_headers(xkey):
                # each message routes by its own headers: publish runs of equal routes
                route_of = host.route
                start = 0
                last = None
                for i in range(n + 1):
                    route = None
                    if i < n:
                        item = props[i] if props is not None else None
                        route = route_of(xkey, msg.routing_key, lambda item=item: propsmod.headers_of(item))
                    if i and (i == n or route != last):
                        self._publish(ch, last, msg.bodies[start:i],
                                      props[start:i] if props is not None else None,
                                      ex, msg.routing_key, msg.mandatory, False, msg.ttl)
                        start = i
                    last = route
                return
        try:
            queues = host.route(xkey, msg.routing_key)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        if not queues and not ex and msg.routing_key.startswith(REPLY_PREFIX):
            self._send_reply(ch, msg.routing_key, msg.bodies, props, msg.mandatory)
            return
        self._publish(ch, queues, msg.bodies, props, ex, msg.routing_key, msg.mandatory, False, msg.ttl)

    def publish_routed(self, ch_id: int, queues: list, bodies: list, props, exchange: str,
                       routing_key: str, resent: bool) -> None:
        """A batch the node routed itself (broker/dead_letters.py); `resent`: it may have been
        published before, so its queues deliver it flagged redelivered."""
        self._publish(self._ch(ch_id), queues, bodies, props, exchange, routing_key, False, resent)

    def _publish(self, ch: Channel, queues: list, bodies: list, props, exchange: str,
                 routing_key: str, mandatory: bool, resent: bool = False, ttl: int | None = None) -> None:
        """Send a batch to the queues it was routed to; returns, nacks or confirms at once what
        cannot be sent."""
        n = len(bodies)
        if ch.confirm:
            first = ch.next_seq
            ch.next_seq = first + n
        else:
            first = 0
        host = self.host
        if not queues:
            if mandatory:
                self._put(ch.id, 0, m.Returned(ch.id, NO_ROUTE, "NO_ROUTE", exchange, routing_key,
                                               bodies, props))
            if first:
                self._put(ch.id, 0, m.Confirm(ch.id, [[first, first + n - 1]], [], ""))
            return
        live = []  # (queue, its definition)
        down = ""
        for qname in queues:
            qdef = host.queue(qname)
            reason = "" if qdef is None else host.queue_down_reason(qdef)
            if reason:
                down = reason
            elif qdef is not None:
                live.append((qname, qdef))
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
        link_full = host.link_full
        for qname, qdef in live:
            dq = self.inflight.get(qname)
            if dq is None:
                dq = self.inflight[qname] = deque()
            dq.append(Batch(pseq, ch.id, first, n, size, bodies, props, fanout, ttl))
            ch.inflight += n
            self.inflight_msgs += n
            self.inflight_bytes += size
            if link_full(qname):
                self.full_links.append(qname)  # the front end waits after this run (wait_link_room)
            self._send_to(qname, qdef, m.QPublish(qname, owner, pseq, bodies, props, resent,
                                                  host.queue_epoch(qdef), ttl))

    # --- confirms --------------------------------------------------------------------------
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
        if self.when_room is not None and self.has_credit:
            self._credit_may_be_back()

    def _lost_in_flight(self, qname: str, reason: str) -> None:
        """The queue is gone or unavailable: nack what is in flight to it."""
        confirms: dict = {}
        for b in self.inflight.pop(qname, ()):
            self.inflight_msgs -= b.n
            self.inflight_bytes -= b.size
            self._batch_done(b, reason, confirms)
        self._send_confirms(confirms)

    def _rejected(self, ev: m.EvRejected) -> None:
        """The queue refused some messages of a batch (x-overflow reject-publish): they are
        nacked when the batch is accepted."""
        for b in self.inflight.get(ev.queue, ()):
            if b.pseq == ev.pseq:
                b.rejected = list(ev.indexes)
                break


def _add_range(ranges: list, first: int, last: int) -> None:
    """Append [first, last] to sorted inclusive ranges, merging with the last one if adjacent."""
    if ranges and ranges[-1][1] + 1 == first:
        ranges[-1][1] = last
    else:
        ranges.append([first, last])
