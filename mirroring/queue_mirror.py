"""A queue's contents as a mirror keeps them (part of `QueueState`, mirroring/queue.py): the
snapshot a leader starts a mirror from, a mirror's reset to it, a full sync's batches, and
applying the leader's effects in its order. What the module docstring of queue.py says of
effects, late mirrors and unacknowledged entries holds here."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from heapq import merge
from itertools import islice, repeat, starmap
from operator import itemgetter

from wire.messages import (ECancel, EConsume, EDeadHead, EDeadSettle, EDeliver, EDrop, EDropIds,
                           EEnqueue, EFailover, EGet, ENodeGone, EOwnerGone, EPurge, ESessionGone,
                           ESettle)

from .consumer import Consumer

_msg_id = itemgetter(0)
_msg_body = itemgetter(1)


class MirrorSide:
    """The mirror's side of replication (a part of `QueueState`)."""

    def mirror_snapshot(self, with_messages: bool = False, now: float = 0.0) -> dict:
        """What a new mirror needs to follow this leader: consumers with their credit, the
        unacknowledged ids (so acks stay exact), publish de-duplication marks, the TTL
        batches (as time left from `now`: clocks differ between nodes), and with
        `with_messages` (a full sync) no more: the messages come in sync batches."""
        return {
            "expiry": [[last, at - now] for last, at in self.expiry],
            "expired_upto": self.expired_upto,
            "next_id": self.next_id,
            "consumers": [[list(c.owner), c.tag, c.no_ack, c.prefetch, c.exclusive, c.arguments,
                           c.in_flight] for c in self.consumers.values()],
            "unacked": [[mid, list(o), k[1] if k else None] for mid, (o, k, _) in self.unacked.items()],
            "last_pseq": [[list(k), v] for k, v in self.last_pseq.items()],
            "had_consumer": self.had_consumer,
            "redeliver_below": self.redeliver_below,
        }

    def reset_as_mirror(self, snap: dict, now: float = 0.0) -> None:
        """Throw away everything and start following a leader from `snap` (spec: a mirror that
        (re)joins "throws away any ... local contents it already has and starts empty")."""
        self.expiry = deque((last, now + left) for last, left in snap.get("expiry", ()))
        ats = [at for _, at in self.expiry]
        self.mixed_deadlines = any(b < a for a, b in zip(ats, ats[1:])) or float("inf") in ats
        self.expired_upto = snap.get("expired_upto", 0)
        self.ready.clear()
        self.ready_bytes = 0
        self.next_id = snap["next_id"]

        self.consumers = {}
        for owner, tag, no_ack, prefetch, exclusive, arguments, in_flight in snap["consumers"]:
            owner = tuple(owner)
            self.consumers[(owner, tag)] = Consumer(owner, tag, no_ack, prefetch, exclusive,
                                                    arguments, in_flight)
        self.unacked = {mid: (tuple(o), (tuple(o), tag) if tag is not None else None, None)
                        for mid, o, tag in snap["unacked"]}
        self.last_pseq = {tuple(k): v for k, v in snap["last_pseq"]}
        self.had_consumer = snap["had_consumer"]
        self.redeliver_below = snap.get("redeliver_below", 0)

    def add_synced_messages(self, msgs: list) -> None:
        """A batch of a full sync: messages [id, body, props, redelivered] the leader holds
        below this mirror's start. Ready ones go in id order; unacked ones fill their stubs."""
        unacked = self.unacked
        back = []
        for mid, body, props, red in msgs:
            entry = unacked.get(mid)
            if entry is not None:
                unacked[mid] = (entry[0], entry[1], (mid, body, props, red))
            else:
                back.append((mid, body, props, red))
        if back:
            back.sort()
            self.ready_bytes += sum(len(m[1]) for m in back)
            ready = self.ready
            if self.prioritised:
                ready.merge_in(back)  # each in its place among those of its priority
                return
            k = bisect_left(ready, back[0][0], key=_msg_id)
            if k == len(ready) or back[-1][0] < ready[k][0]:
                # the usual case (batches arrive in id order): one contiguous run goes in at k
                ready.rotate(-k)
                ready.extendleft(reversed(back))
                ready.rotate(k)
            else:
                merged = list(merge(back, ready))
                ready.clear()
                ready.extend(merged)

    def ready_by_id(self):
        """The ready messages in id order (a plain queue's deque is in that order)."""
        return self.ready.by_id() if self.prioritised else self.ready

    def ready_between(self, lo: int, hi: int, limit: int) -> list:
        """Up to `limit` ready messages with lo < id < hi, in id order, without walking the
        queue from its head (a bisection over the sorted deque, then indexed reads)."""
        ready = self.ready
        if self.prioritised:
            return ready.between(lo, hi, limit)
        k = bisect_right(ready, lo, key=_msg_id)
        out = []
        n = len(ready)
        while k < n and len(out) < limit:
            m = ready[k]
            if m[0] >= hi:
                break
            out.append(m)
            k += 1
        return out

    def apply_effects(self, effects: list, now: float = 0.0, sent: float | None = None) -> None:
        """Apply a leader's effects, in its order (see the module docstring). A mirror records no
        effects of its own, so the public methods serve; only enqueue ids, deliveries and gets,
        which a late mirror may lack, need their own handling. `now` is this replica's clock and
        `sent` the leader's when it sent them: a deadline the leader gave is moved by the
        difference (without `sent`, a TTL runs from `now`)."""
        assert self.effects is None, "a replica that records effects cannot apply a leader's"
        for eff in effects:
            t = type(eff)
            if t is EEnqueue:
                self.next_id = eff.first
                at = None if eff.at is None or sent is None else eff.at + (now - sent)
                self.publish(eff.bodies, eff.props, eff.origin, eff.pseq, eff.redelivered, now,
                             eff.ttl, at)
            else:
                _APPLY[t](self, eff)

    def _apply_get(self, eff: EGet) -> None:
        m = None
        if self.ready and self.ready[0][0] == eff.id:
            m = self.ready.popleft()
            self.ready_bytes -= len(m[1])
        if not eff.no_ack:
            self.unacked[eff.id] = (tuple(eff.owner), None, m)

    def _apply_consume(self, eff: EConsume) -> None:

        owner = tuple(eff.owner)
        self.consumers[(owner, eff.tag)] = Consumer(owner, eff.tag, eff.no_ack, eff.prefetch,
                                                    eff.exclusive, eff.arguments)
        self.had_consumer = True

    def _apply_deliveries(self, eff: EDeliver) -> None:
        rounds = eff.rounds
        ready = self.ready
        if len(rounds) == 1:
            # the usual case: one consumer took a run from the head of the queue, which this
            # replica holds in the same order; done in C loops
            owner, tag, ids = rounds[0]
            n = len(ids)
            if n and len(ready) >= n and ready[0][0] == ids[0] and list(map(_msg_id, islice(ready, n))) == ids:
                msgs = list(starmap(ready.popleft, repeat((), n)))
                # (the same messages as the leader's run: its size is theirs)
                self.ready_bytes -= eff.size or sum(map(len, map(_msg_body, msgs)))
                owner = tuple(owner)
                key = (owner, tag)
                c = self.consumers.get(key)
                if c is not None and not c.no_ack:
                    c.in_flight += n
                    self._hold(owner, key, ids, msgs)
                self._rotate()
                return
        delivered = set()
        for _, _, ids in rounds:
            delivered.update(ids)
        have = {}
        while ready and ready[0][0] in delivered:
            m = ready.popleft()
            have[m[0]] = m
            self.ready_bytes -= len(m[1])
        for owner, tag, ids in rounds:
            owner = tuple(owner)
            key = (owner, tag)
            c = self.consumers.get(key)
            if c is None or c.no_ack:
                continue
            c.in_flight += len(ids)
            self._hold(owner, key, ids, [have.get(mid) for mid in ids])  # None: a message it lacked
        self._rotate()

    def comparable(self) -> tuple:
        """The whole state as plain values, to compare a mirror with its leader in tests."""
        return (
            list(self.ready), self.next_id, self.ready_bytes,
            sorted((mid, o, k, m) for mid, (o, k, m) in self.unacked.items()),
            [(k, c.no_ack, c.prefetch, c.exclusive, c.in_flight) for k, c in self.consumers.items()],
            sorted(self.last_pseq.items()), self.had_consumer, self.redeliver_below,
            [last for last, _ in self.expiry], self.expired_upto,
        )


_APPLY = {
    EDrop: lambda q, e: q.drop_upto(e.upto, e.expired),
    EDeliver: MirrorSide._apply_deliveries,
    EGet: MirrorSide._apply_get,
    ESettle: lambda q, e: q.settle(tuple(e.owner), e.how, e.ids),
    EConsume: MirrorSide._apply_consume,
    ECancel: lambda q, e: q.remove_consumer(tuple(e.owner), e.tag),
    EOwnerGone: lambda q, e: q.owner_gone(tuple(e.owner)),
    ESessionGone: lambda q, e: q.session_gone(e.node, e.sid),
    ENodeGone: lambda q, e: q.node_gone(e.node, e.forget_publishers, e.run),
    EPurge: lambda q, e: q.purge(),
    EFailover: lambda q, e: q.failover(e.redeliver_below),
    EDeadHead: lambda q, e: q.apply_dead_head(e),
    EDropIds: lambda q, e: q.apply_drop_ids(e),
    EDeadSettle: lambda q, e: q.dead_settle(tuple(e.owner), e.ids, tuple(e.holder)),
}
