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
* A reply to a channel of this node is delivered at once, and is unroutable (returned when
  mandatory) if that channel has no such consumer any more. A reply to another node goes over
  the peer link (`EvDirectReply`); it is unroutable only if there is no link. As in RabbitMQ,
  replies are not queued anywhere: one whose consumer went meanwhile is dropped.

`ReplyToPart` is one part of the session core (broker/session/core.py `Session`).
"""

from __future__ import annotations

import base64
import secrets

from wire import messages as m
from wire import props as propsmod
from wire.errors import PRECONDITION_FAILED

from .channels import Channel, ChannelError

REPLY_TO = "amq.rabbitmq.reply-to"
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
        # the name it was sent to is the routing key it is delivered with
        props = [["", routing_key, propsmod.NO_PROPS] if item is None else item
                 for item in (props or [None] * len(bodies))]
        if dest is not None and self.host.direct_reply(
                dest[0], dest[1], m.EvDirectReply(dest[2], dest[3], routing_key, bodies, props)):
            n = len(bodies)
            if ch.confirm:
                first = ch.next_seq
                ch.next_seq = first + n
                self._put(ch.id, 0, m.Confirm(ch.id, [[first, first + n - 1]], [], ""))
            return
        self._publish(ch, [], bodies, props, "", routing_key, mandatory)  # unroutable

    def take_reply(self, ev: m.EvDirectReply) -> bool:
        """Replies for one of our channels: delivered to its reply consumer; False when the
        channel has none (or a newer one than the reply was for)."""
        ch = self.channels.get(ev.ch)
        if self.closed or ch is None or ch.reply_tag is None or ch.reply_key != ev.key:
            return False
        first = ch.next_tag
        ch.next_tag = first + len(ev.bodies)
        self._deliver_out(ch, m.Deliver(ch.id, ch.reply_tag, first, ev.bodies, [], ev.props))
        return True
