"""The session's outputs as AMQP 0-9-1 frames (broker/amqp/protocol.py): a reply becomes the
request's `-ok` method (or nothing, with nowait), a failure closes the channel (or the
connection), deliveries carry their properties as published, and confirms become basic.ack /
basic.nack frames in the channel's sequence. `OutputPart` is one part of `AmqpProtocol`; it
uses the protocol's channels, requests and output.
"""

from __future__ import annotations

from pamqp import commands

from wire import messages as m
from wire import props as propsmod

from . import codec
from .connection_level import State, _error_text

class OutputPart:
    """Session output -> frames (see the module docstring)."""

    # --- session output -> frames -------------------------------------------------------------
    def send_output(self, msg) -> None:
        """One output of the session (Reply, Fail, Deliver, Confirm, Cancelled, Returned)."""
        if self.state is not State.OPENED:
            return
        t = type(msg)
        if t is m.Deliver:
            self._deliver(msg)
        elif t is m.Confirm:
            self._confirm(msg)
        elif t is m.Reply:
            self._reply(msg)
        elif t is m.Fail:
            self._fail(msg)
        elif t is m.Cancelled:
            c = self.channels.get(msg.ch)
            if c is None or c.closing:
                return
            c.consumers.pop(msg.consumer_tag, None)
            if self.capabilities.get("consumer_cancel_notify"):
                self._method(msg.ch, commands.Basic.Cancel(msg.consumer_tag, True))
        elif t is m.Returned:
            c = self.channels.get(msg.ch)
            if c is None or c.closing:
                return
            out = self._out
            props = msg.props
            for i, body in enumerate(msg.bodies):
                item = props[i] if props is not None else None
                codec.return_frames(msg.ch, msg.code, msg.text, msg.exchange, msg.routing_key, body,
                                    propsmod.to_raw(item), self.frame_max, out)

    def _deliver(self, msg: m.Deliver) -> None:
        ch = msg.ch
        c = self.channels.get(ch)
        if c is None or c.closing:
            return  # the session requeues what a closed channel had
        tag = msg.consumer_tag
        codec.deliver_batch(ch, tag, msg.first_tag, msg.bodies,
                            set(msg.redelivered) if msg.redelivered else (), msg.props,
                            c.consumers.get(tag, ""), propsmod.to_raw, self.frame_max, self._out)

    def _confirm(self, msg: m.Confirm) -> None:
        c = self.channels.get(msg.ch)
        if c is None or c.closing:
            return
        ranges = [(a, b, True) for a, b in msg.acks] + [(a, b, False) for a, b in msg.nacks]
        if len(ranges) > 1:
            ranges.sort()
        for first, last, ok in ranges:
            if first == c.low:
                self._ack_frame(msg.ch, last, last > first, ok)
                c.low = last + 1
                ooo = c.ooo
                while c.low in ooo:
                    ooo.discard(c.low)
                    c.low += 1
            else:
                # an earlier message is still unconfirmed: "multiple" would cover it too
                for seq in range(first, last + 1):
                    self._ack_frame(msg.ch, seq, False, ok)
                    c.ooo.add(seq)

    def _ack_frame(self, ch: int, tag: int, multiple: bool, ok: bool) -> None:
        if ok:
            self._method(ch, commands.Basic.Ack(tag, multiple))
        else:
            self._method(ch, commands.Basic.Nack(tag, multiple, False))

    def _reply(self, msg: m.Reply) -> None:
        req = self.requests.pop(msg.rid, None)
        if req is None:
            return
        ch, kind, nowait, _ = req
        c = self.channels.get(ch)
        if c is None or c.closing:
            return
        v = msg.value
        C = commands
        if kind == "channel.close":
            self._method(ch, C.Channel.CloseOk())
            self._drop_channel(ch)
            return
        if kind.startswith("basic.consume:"):
            c.consumers[v] = kind[len("basic.consume:"):] or c.last_queue
            if not nowait:
                self._method(ch, C.Basic.ConsumeOk(v))
            return
        if kind == "queue.declare":
            c.last_queue = v[0]
            if not nowait:
                self._method(ch, C.Queue.DeclareOk(v[0], v[1], v[2]))
            return
        if kind.startswith("basic.get:"):
            if v is None:
                self._method(ch, C.Basic.GetEmpty())
                return
            tag, body, redelivered, item, remaining = v
            exchange, key = propsmod.routing_of(item, kind[len("basic.get:"):] or c.last_queue)
            codec.get_ok_frames(ch, tag, bool(redelivered), exchange, key, remaining, body,
                                propsmod.to_raw(item), self.frame_max, self._out)
            return
        if kind == "basic.cancel":
            c.consumers.pop(v, None)
        if nowait:
            return
        method = _REPLIES[kind](v)
        if method is not None:
            self._method(ch, method)

    def _fail(self, msg: m.Fail) -> None:
        req = self.requests.pop(msg.rid, None) if msg.rid else None
        ch = msg.ch
        c = self.channels.get(ch)
        if c is None:
            return
        if c.close_sent:
            return
        c.closing = c.close_sent = True
        c.method = None
        index = req[3] if req is not None else 0
        self._method(ch, commands.Channel.Close(msg.code, _error_text(msg.code, msg.text)[:255],
                                                index >> 16, index & 0xFFFF))


_REPLIES = {
    "channel.open": lambda v: commands.Channel.OpenOk(),
    "channel.flow": lambda v: commands.Channel.FlowOk(bool(v)),
    "basic.qos": lambda v: commands.Basic.QosOk(),
    "basic.cancel": lambda v: commands.Basic.CancelOk(v),
    "basic.recover": lambda v: commands.Basic.RecoverOk(),
    "confirm.select": lambda v: commands.Confirm.SelectOk(),
    "tx.select": lambda v: commands.Tx.SelectOk(),
    "tx.commit": lambda v: commands.Tx.CommitOk(),
    "tx.rollback": lambda v: commands.Tx.RollbackOk(),
    "exchange.declare": lambda v: commands.Exchange.DeclareOk(),
    "exchange.delete": lambda v: commands.Exchange.DeleteOk(),
    "exchange.bind": lambda v: commands.Exchange.BindOk(),
    "exchange.unbind": lambda v: commands.Exchange.UnbindOk(),
    "queue.bind": lambda v: commands.Queue.BindOk(),
    "queue.unbind": lambda v: commands.Queue.UnbindOk(),
    "queue.purge": lambda v: commands.Queue.PurgeOk(v or 0),
    "queue.delete": lambda v: commands.Queue.DeleteOk(v or 0),
}

