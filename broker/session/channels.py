"""A session's channels and their delivery tags: the Channel record (unacknowledged deliveries
as runs and a tag table), the channel commands that need no queue (open, close, qos, flow,
recover), acknowledgements turned into per-queue id lists, and the session's output in the
order a channel needs it.

Per channel, replies leave in the order of the requests (AMQP needs it: a queue on another node
may answer a declare after a local exchange.bind answered at once), and nothing else for that
channel overtakes a held reply (a consumer's first delivery never precedes its consume-ok).
`channel.flow` pauses a channel's deliveries (held here) until it resumes.

A channel keeps each delivery as one run (first tag, queue, ids), and an ack of the oldest runs'
tags in order (what consumers send) becomes id lists by slicing them; anything else reads
`tags`, the tag -> (queue, id) table the runs spill into first (the same two forms as a queue's
unacknowledged messages, mirroring/queue.py).

`ChannelsPart` is one part of the session core (broker/session/core.py `Session`); it uses the
core's `channels`, `closed_channels`, `out`, `host`, `sid` and `_settle_to_leader`.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import itemgetter

from wire import messages as m
from wire.errors import COMMAND_INVALID, NOT_ALLOWED, NOT_IMPLEMENTED, PRECONDITION_FAILED, ProtocolError

# what a command's handler returns when the client closed the connection
CLOSE = "close"

_entry_queue, _entry_id = itemgetter(0), itemgetter(1)  # a channel's tag table entry: (queue, message id)


class ChannelError(ProtocolError):
    """Closes the channel, not the connection (an AMQP channel exception)."""


def as_channel_error(exc: ProtocolError) -> ProtocolError:
    """A refusal from the metadata or routing: codes below 500 close the channel only."""
    if isinstance(exc, ChannelError) or exc.code >= 500:
        return exc
    return ChannelError(exc.code, exc.text)


class Channel:
    """One open channel: its modes, its delivery tags and unacknowledged deliveries, its
    consumers, its transaction, and its replies waiting for their turn."""

    __slots__ = ("id", "prefetch", "confirm", "next_seq", "next_tag", "_tags", "tag_runs", "consumers",
                 "touched", "tx", "tx_pending", "tx_bytes", "inflight", "commit_rid", "tx_failed",
                 "order", "held", "active", "paused", "last_queue", "reply_tag", "reply_key")

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
        self.tx_bytes = 0  # the bodies' bytes in tx_pending (bounded by the session's max_tx_bytes)
        self.inflight = 0  # messages of this channel not yet accepted by every mirror
        self.commit_rid = 0  # a tx.commit waiting for them
        self.tx_failed = ""
        self.order: deque[int] = deque()  # request ids awaiting their reply, in request order
        self.held: deque[tuple] = deque()  # (rid or 0, output) waiting for an earlier reply
        self.active = True  # channel.flow
        self.paused: list = []  # deliveries held while the flow is off
        self.last_queue: str | None = None  # the queue an empty name stands for (AMQP)
        self.reply_tag: str | None = None  # its direct reply-to consumer (session/replyto.py)
        self.reply_key = ""

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



class ChannelsPart:
    """Channels, their output order and their acknowledgements (see the module docstring)."""

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

    # --- channel commands that need no queue ------------------------------------------------
    def on_channel_open(self, msg):
        if msg.ch in self.channels or msg.ch <= 0:
            raise ProtocolError(COMMAND_INVALID, f"channel {msg.ch} is already open or invalid")
        if len(self.channels) >= self.channel_max:  # RabbitMQ's refusal, a connection error
            raise ProtocolError(NOT_ALLOWED, f"number of channels opened ({len(self.channels)}) has "
                                             f"reached the negotiated channel_max ({self.channel_max})")
        self.closed_channels.discard(msg.ch)
        self.channels[msg.ch] = Channel(msg.ch)
        self.out(m.Reply(msg.rid, None))

    def on_channel_close(self, msg):
        ch = self.channels.pop(msg.ch, None)
        if ch is not None:
            self._release_channel(ch)
        self.out(m.Reply(msg.rid, None))

    def on_connection_close(self, msg):
        self.out(m.Reply(msg.rid, None))
        return CLOSE

    def on_qos(self, msg):
        ch = self._ch(msg.ch)
        if msg.prefetch_count < 0 or msg.prefetch_count > 65535:
            raise ChannelError(PRECONDITION_FAILED, "prefetch_count must be between 0 and 65535")
        ch.prefetch = msg.prefetch_count
        self._reply(ch.id, msg.rid, None)

    def on_recover(self, msg):
        """basic.recover: every message delivered on the channel and not acknowledged goes
        back to its queue (redelivered). RabbitMQ refuses requeue=false; so does warren."""
        ch = self._ch(msg.ch)
        if not msg.requeue:
            raise ProtocolError(NOT_IMPLEMENTED, "requeue=false")
        owner = self._owner(ch)
        for qname, ids in self._settle(ch, list(ch.tags), 0).items():
            self._settle_to_leader(qname, m.QSettle(qname, owner, m.REQUEUE, ids))
        self._reply(ch.id, msg.rid, None)

    def on_flow(self, msg):
        """channel.flow: pause or resume deliveries to this channel (held here meanwhile)."""
        ch = self._ch(msg.ch)
        ch.active = bool(msg.active)
        self._reply(ch.id, msg.rid, ch.active)
        if ch.active and ch.paused:
            paused, ch.paused = ch.paused, []
            for d in paused:
                self._deliver_out(ch, d)

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

    def on_nack(self, msg):
        ch = self._ch(msg.ch)
        if ch.tx:
            ch.tx_pending.append(msg)
            return
        owner = self._owner(ch)
        how = m.REQUEUE if msg.requeue else m.DISCARD
        for qname, ids in self._settle(ch, msg.tags, msg.multiple_upto).items():
            self._settle_to_leader(qname, m.QSettle(qname, owner, how, ids))

    def _release_channel(self, ch: Channel) -> None:
        owner = self._owner(ch)
        for qname in ch.touched:
            self.host.to_leader(qname, m.QOwnerGone(qname, owner))
