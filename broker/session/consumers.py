"""A session's consumers and what reaches them: basic.consume, basic.cancel and basic.get, and
the deliveries, consume-oks, get-oks and cancellations their queues send back.

Deliveries from a leader epoch older than the route's are dropped (and given back): a deposed
leader's last words must not reach the client after the new leader's. Deliveries for a channel
or a consumer the session no longer has go back to the queue's leader, which is told the owner
or the consumer is gone, so nothing sits unacknowledged for a consumer nobody reads.
Consumers that asked for `x-cancel-on-ha-failover` are cancelled, not re-registered, when their
queue's leader moves (broker/session/core.py `_resend`).

`ConsumersPart` is one part of the session core (broker/session/core.py `Session`); it uses the
core's channels, `host`, requests (`_request`, `rpcs`) and output ordering (`_put`).
"""

from __future__ import annotations

from mirroring import exchanges as xmod
from mirroring.access import READ
from mirroring.queue import check_consume_arguments
from wire import messages as m
from wire.errors import NOT_ALLOWED, ProtocolError

from .channels import Channel, as_channel_error
from .replyto import REPLY_TO


class ConsumersPart:
    """Consumers, gets and deliveries (see the module docstring)."""

    def on_consume(self, msg):
        ch = self._ch(msg.ch)
        if msg.queue == REPLY_TO:
            self._reply_consume(ch, msg)
            return
        qname = self._queue_name(ch, msg.queue)
        self.check_access(READ, "queue", qname)
        self._queue(qname)  # the channel errors for a missing, locked or unavailable queue
        tag = msg.consumer_tag or f"amq.ctag-{self.conn_id}-{next(self._ctags)}"
        if tag in ch.consumers or any(op.tag == tag and op.owner[2] == ch.id
                                      for _, op in self.rpcs.values() if type(op) is m.QConsume):
            raise ProtocolError(NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'")
        arguments = xmod.plain(msg.arguments)
        try:
            check_consume_arguments(qname, arguments)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        ch.touched.add(qname)
        op = m.QConsume(qname, self._owner(ch), msg.rid, tag, msg.no_ack, ch.prefetch,
                        msg.exclusive, arguments)
        self._request(qname, msg.rid, op)

    def on_cancel(self, msg):
        ch = self._ch(msg.ch)
        reg = ch.consumers.pop(msg.consumer_tag, None)
        if reg is None:
            if ch.reply_tag == msg.consumer_tag:
                ch.reply_tag = None
            self._reply(ch.id, msg.rid, msg.consumer_tag)
            return
        qdef = self.host.queue(reg.queue)
        if qdef is None or self.host.queue_down_reason(qdef):
            self._reply(ch.id, msg.rid, msg.consumer_tag)
            return
        self._request(reg.queue, msg.rid, m.QCancel(reg.queue, self._owner(ch), msg.rid, msg.consumer_tag))

    def on_get(self, msg):
        ch = self._ch(msg.ch)
        qname = self._queue_name(ch, msg.queue)
        self.check_access(READ, "queue", qname)
        self._queue(qname)
        if msg.no_ack:
            self._noack_gets.add(msg.rid)
        else:
            ch.touched.add(qname)
        self._request(qname, msg.rid, m.QGet(qname, self._owner(ch), msg.rid, msg.no_ack))


    # --- what the queues send back -----------------------------------------------------------
    def _consume_ok(self, ev: m.EvConsumeOk) -> None:
        req = self.rpcs.pop(ev.rid, None) if ev.rid else None
        if req is None:
            return  # a re-registration (or a resent consume) answered again
        ch = self.channels.get(ev.ch)
        if ch is not None:
            ch.consumers[ev.tag] = req[1]
        self._put(ev.ch, ev.rid, m.Reply(ev.rid, ev.tag))

    def _get_ok(self, ev: m.EvGetOk) -> None:
        if self.rpcs.pop(ev.rid, None) is None:
            return
        ch = self.channels.get(ev.ch)
        if ev.msg is None or ch is None:
            self._noack_gets.discard(ev.rid)
            self._put(ev.ch, ev.rid, m.Reply(ev.rid, None))
            return
        tag = ch.next_tag
        ch.next_tag += 1
        if ev.rid in self._noack_gets:
            self._noack_gets.discard(ev.rid)
        else:
            ch.tags[tag] = (ev.queue, ev.msg[0])
        self._put(ev.ch, ev.rid, m.Reply(ev.rid, [tag, ev.msg[1], ev.msg[3], ev.msg[2], ev.remaining]))

    def _cancelled(self, ev: m.EvCancelled) -> None:
        ch = self.channels.get(ev.ch)
        if ch is not None and ch.consumers.pop(ev.tag, None) is not None:
            self._put(ev.ch, 0, m.Cancelled(ev.ch, ev.tag, ev.reason))

    def _bodies_from_mirror(self, ch: Channel, ev: m.EvDeliver) -> m.EvDeliver | None:
        """A delivery the leader sent without its bodies: this node's mirror of the queue holds
        them (mirroring/replica.py `local_bodies`). Any it does not hold (it restarted empty
        meanwhile) go back to the leader, which delivers them again, flagged (the client never
        saw them), and with their bodies from then on. None when nothing is left to deliver."""
        bodies = self.host.mirror_bodies(ev)
        if None not in bodies:
            ev.bodies = bodies
            return ev
        owner = self._owner(ch)
        keep = [i for i, b in enumerate(bodies) if b is not None]
        missing = [mid for mid, b in zip(ev.ids, bodies) if b is None]
        self.log.warning("deliveries whose bodies this node's mirror lacks: given back to the "
                         "queue's leader", queue=ev.queue, messages=len(missing))
        self.host.to_leader(ev.queue, m.QSettle(ev.queue, owner, m.LACKED, missing))
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
        self.host.to_leader(ev.queue, m.QSettle(ev.queue, self._owner(ch), m.REQUEUE, ev.ids))

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
        self.host.to_leader(ev.queue, m.QOwnerGone(ev.queue, (self.me, self.sid, ev.ch)))

    def _unknown_consumer(self, ch: Channel, ev: m.EvDeliver) -> None:
        """Deliveries for a consumer this channel does not have (cancelled meanwhile, or
        re-registered by a resend that crossed its cancellation): give them back and cancel it
        at the queue, so nothing sits unacknowledged for a consumer nobody reads."""
        owner = self._owner(ch)
        host = self.host
        host.to_leader(ev.queue, m.QSettle(ev.queue, owner, m.REQUEUE, ev.ids))
        host.to_leader(ev.queue, m.QCancel(ev.queue, owner, 0, ev.tag))
