"""Direct reply-to, as RabbitMQ 3.10 has it: an RPC client consumes from the pseudo-queue
`amq.rabbitmq.reply-to` (no queue is declared), its requests' `reply_to` is rewritten to a name
for its channel, and a reply published to that name through the default exchange goes straight
to that channel, on whichever node its connection is.

* The consumer must be no-ack (RabbitMQ's 406 "reply consumer cannot acknowledge"); one per
  channel ("reply consumer already set").
* A publish whose reply_to is `amq.rabbitmq.reply-to` (the front end says so: `PublishTo.reply`)
  needs that consumer on its channel (406 "fast reply consumer does not exist"); its reply_to
  becomes `amq.rabbitmq.reply-to.<token>`, the token naming the node, the session, the channel
  and a key drawn when the consumer started, so a reply cannot reach a later consumer on the
  same channel number.
* A queue.declare of the pseudo-queue, or of a reply-to name, is passive whatever it asks, as in
  RabbitMQ: declare-ok with no message and one consumer, or 404 for a name whose consumer is
  gone (`reply_queue_exists`).
* A reply to a channel of this node is delivered at once, and is unroutable (returned when
  mandatory) if that channel has no such consumer any more. A reply to another node goes over
  the peer link (`EvDirectReply`); with no link it is unroutable. When the publisher must hear
  the outcome (its channel confirms, or the publish is mandatory) the other node answers
  (`EvReplyTaken`) and the confirm, or the return, waits for that answer, so a reply to a
  client that is gone is unroutable wherever that client was, as in RabbitMQ; if the link
  breaks first the publish is nacked (it may or may not have been delivered). Otherwise
  nothing waits. As in RabbitMQ, replies are not queued anywhere.

`ReplyToPart` is one part of the session core (broker/session/core.py `Session`).
"""

from __future__ import annotations

import base64
import secrets

from wire import messages as m
from wire import props as propsmod
from wire.errors import NO_ROUTE, PRECONDITION_FAILED

from .channels import Channel, ChannelError

REPLY_TO = propsmod.REPLY_TO
PREFIX = REPLY_TO + "."


def encode_token(node: str, sid: int, ch: int, key: str) -> str:
    raw = f"{node}\x00{sid}\x00{ch}\x00{key}".encode()
    return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(name: str) -> tuple[str, int, int, str] | None:
    """(node, session, channel, key) of a reply-to name; None when it is not one of ours."""
    text = name[len(PREFIX):]
    try:
        node, sid, ch, key = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode().split("\x00")
        return node, int(sid), int(ch), key
    except ValueError:  # bad base64, bad UTF-8, wrong number of parts, not numbers
        return None


def reply_queue_exists(name: str, me: str, sessions: dict, linked) -> bool:
    """A queue.declare of the pseudo-queue or of a reply-to name (any declare of one is passive,
    as in RabbitMQ): the pseudo-queue always exists; a name of one of this node's channels while
    its reply consumer is there; a name of another node's channel while that node is linked."""
    if name == REPLY_TO:
        return True
    dest = decode_token(name) if name.startswith(PREFIX) else None
    if dest is None:
        return False
    node, sid, ch, key = dest
    if node != me:
        return linked(node)
    session = sessions.get(sid)
    channel = session.channels.get(ch) if session is not None else None
    return channel is not None and channel.reply_tag is not None and channel.reply_key == key


class ReplyToPart:
    """The reply consumers of a session's channels, and the replies to and from them (see the
    module docstring)."""

    def _reply_consume(self, ch: Channel, msg) -> None:
        if not msg.no_ack:
            raise ChannelError(PRECONDITION_FAILED, "reply consumer cannot acknowledge")
        if ch.reply_tag is not None:
            raise ChannelError(PRECONDITION_FAILED, "reply consumer already set")
        ch.reply_tag = msg.consumer_tag or f"amq.ctag-{self.conn_id}-{next(self._ctags)}"
        ch.reply_key = secrets.token_hex(8)
        self._reply(ch.id, msg.rid, ch.reply_tag)

    def _ask_for_reply(self, ch: Channel, props: list | None) -> list:
        """A batch of requests whose reply_to asks for direct reply-to: rewritten to name this
        channel."""
        if ch.reply_tag is None:
            raise ChannelError(PRECONDITION_FAILED, "fast reply consumer does not exist")
        name = encode_token(self.me, self.sid, ch.id, ch.reply_key)
        return [propsmod.with_reply_to(item, name) for item in props]

    def _send_reply(self, ch: Channel, routing_key: str, bodies: list, props, mandatory: bool) -> None:
        """A publish to a reply-to name through the default exchange: to its channel now."""
        dest = decode_token(routing_key)
        if dest is None:
            self._publish(ch, [], bodies, props, "", routing_key, mandatory)  # unroutable
            return
        node, sid, to_ch, key = dest
        # the name it was sent to is the routing key it is delivered with
        props = [["", routing_key, propsmod.NO_PROPS] if item is None else item
                 for item in (props or [None] * len(bodies))]
        ev = m.EvDirectReply(to_ch, key, routing_key, bodies, props)
        if node != self.me and (ch.confirm or mandatory):
            self._reply_rids += 1
            ev.rid, ev.sender = self._reply_rids, (self.me, self.sid)
        if not self.host.direct_reply(node, sid, ev):
            self._publish(ch, [], bodies, props, "", routing_key, mandatory)  # unroutable
            return
        n = len(bodies)
        first = 0
        if ch.confirm:
            first = ch.next_seq
            ch.next_seq = first + n
        if ev.rid:  # the outcome comes from the other node
            self._replies_out[ev.rid] = (ch.id, first, n, ev, mandatory, node)
        elif first:
            self._put(ch.id, 0, m.Confirm(ch.id, [[first, first + n - 1]], [], ""))

    def _reply_in(self, ev: m.EvDirectReply) -> None:
        """Replies from another node's publisher; it may wait for the outcome."""
        taken = self.take_reply(ev)
        if ev.rid and ev.sender is not None:
            self.host.to_session(ev.sender[0], ev.sender[1], [m.EvReplyTaken(ev.rid, taken)])

    def _reply_outcome(self, rid: int, taken: bool, reason: str = "") -> None:
        """The outcome of replies sent to another node: confirmed, returned first when no one
        took them and they were mandatory; nacked with `reason` when it is unknown."""
        out = self._replies_out.pop(rid, None)
        if out is None:
            return
        ch_id, first, n, ev, mandatory, _ = out
        if ch_id not in self.channels:
            return
        if not taken and not reason and mandatory:
            self._put(ch_id, 0, m.Returned(ch_id, NO_ROUTE, "NO_ROUTE", "", ev.routing_key,
                                           ev.bodies, ev.props))
        if first:
            done = [[first, first + n - 1]]
            self._put(ch_id, 0, m.Confirm(ch_id, [] if reason else done, done if reason else [],
                                          reason))

    def _replies_lost(self, node: str) -> None:
        """The link to `node` broke: replies sent there whose outcome never came are nacked."""
        for rid in [r for r, out in self._replies_out.items() if out[5] == node]:
            self._reply_outcome(rid, False, f"the link to node {node} broke before the reply "
                                            "was known to be delivered")

    def take_reply(self, ev: m.EvDirectReply) -> bool:
        """Replies for one of our channels: delivered to its reply consumer; False when the
        channel has none (or a newer one than the reply was for)."""
        ch = self.channels.get(ev.ch)
        if self.closed or ch is None or ch.reply_tag is None or ch.reply_key != ev.key:
            return False
        first = ch.next_tag
        ch.next_tag = first + len(ev.bodies)
        self._deliver_out(ch, m.Deliver(ch.id, ch.reply_tag, first, ev.bodies, [], ev.props, None))
        return True
