"""The state of one queue replica: ready messages, consumers, unacknowledged deliveries.

Rules (everything that changes a queue's contents lives in this file):

* Messages get increasing ids in publish order; `ready` is always sorted by id.
* A consumer belongs to an *owner* (node, session id, channel). Unacknowledged messages are
  tracked per owner, so cancelling a consumer keeps its deliveries ack-able on the channel,
  while closing the channel (`owner_gone`) requeues them.
* Delivery is round-robin over consumers that have credit (prefetch minus in-flight; prefetch
  0 means unlimited). `dispatch()` hands out as much as credit allows, in batches per consumer.
* A requeued message goes back to its original place (by id) with `redelivered` set.

A message is the tuple (id, body, props, redelivered): tuples keep the per-message cost low.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from heapq import merge

from wire.errors import ACCESS_REFUSED, PRECONDITION_FAILED, ProtocolError

MAX_DISPATCH = 2048  # messages handed out per dispatch() call, so one queue cannot hog the loop


@dataclass(slots=True)
class Consumer:
    owner: tuple
    tag: str
    no_ack: bool
    prefetch: int
    exclusive: bool = False
    arguments: dict = field(default_factory=dict)
    in_flight: int = 0

    def credit(self) -> int:
        if self.no_ack or self.prefetch == 0:
            return MAX_DISPATCH
        return self.prefetch - self.in_flight


class QueueState:
    """One queue's contents and consumers. Pure: no I/O, no clock."""

    def __init__(self, name: str):
        self.name = name
        self.ready: deque[tuple] = deque()
        self.next_id = 1
        self.consumers: dict[tuple, Consumer] = {}  # (owner, tag) -> Consumer, in rotation order
        self.unacked: dict[int, tuple] = {}  # msg id -> (owner, consumer key or None, message)
        self.ready_bytes = 0
        self.had_consumer = False

    # --- queries ---------------------------------------------------------------------------
    @property
    def message_count(self) -> int:
        return len(self.ready)

    def stats(self) -> dict:
        return {
            "messages_ready": len(self.ready),
            "messages_unacknowledged": len(self.unacked),
            "messages": len(self.ready) + len(self.unacked),
            "consumers": len(self.consumers),
            "ready_bytes": self.ready_bytes,
        }

    # --- publishing ------------------------------------------------------------------------
    def publish(self, bodies: list, props: list | None) -> tuple[int, int]:
        """Enqueue a batch; returns the first and last id given."""
        first = self.next_id
        n = len(bodies)
        if props is None:
            self.ready.extend(zip(range(first, first + n), bodies, [None] * n, [False] * n))
        else:
            self.ready.extend(zip(range(first, first + n), bodies, props, [False] * n))
        self.next_id = first + n
        self.ready_bytes += sum(map(len, bodies))
        return first, first + n - 1

    def purge(self) -> int:
        n = len(self.ready)
        self.ready.clear()
        self.ready_bytes = 0
        return n

    # --- consumers -------------------------------------------------------------------------
    def add_consumer(self, owner: tuple, tag: str, no_ack: bool, prefetch: int,
                     exclusive: bool = False, arguments: dict | None = None) -> Consumer:
        key = (owner, tag)
        if key in self.consumers:
            raise ProtocolError(PRECONDITION_FAILED, f"consumer tag {tag!r} is already in use on this channel")
        if any(c.exclusive for c in self.consumers.values()) or (exclusive and self.consumers):
            raise ProtocolError(ACCESS_REFUSED,
                                f"queue '{self.name}' in vhost '/' in exclusive use")
        c = Consumer(owner, tag, no_ack, prefetch, exclusive, arguments or {})
        self.consumers[key] = c
        self.had_consumer = True
        return c

    def remove_consumer(self, owner: tuple, tag: str) -> Consumer | None:
        """Cancel: the consumer gets nothing more; its unacked messages stay with the owner."""
        c = self.consumers.pop((owner, tag), None)
        if c is not None:
            for mid, (o, key, msg) in self.unacked.items():
                if key == (owner, tag):
                    self.unacked[mid] = (o, None, msg)
        return c

    def owner_gone(self, owner: tuple) -> int:
        """A channel closed: drop its consumers and requeue everything it had not acked."""
        for key in [k for k in self.consumers if k[0] == owner]:
            del self.consumers[key]
        ids = [mid for mid, (o, _, _) in self.unacked.items() if o == owner]
        self.requeue(owner, ids)
        return len(ids)

    def owners_gone(self, predicate) -> int:
        """Many owners at once (a session or a whole node went away)."""
        owners = {k[0] for k in self.consumers if predicate(k[0])}
        owners |= {o for (o, _, _) in self.unacked.values() if predicate(o)}
        return sum(self.owner_gone(o) for o in owners)

    # --- delivery --------------------------------------------------------------------------
    def dispatch(self) -> list[tuple[Consumer, list[tuple]]]:
        """Hand ready messages to consumers with credit, round-robin.

        Returns [(consumer, [message, ...]), ...]; messages of manual-ack consumers are
        recorded as unacknowledged."""
        if not self.ready or not self.consumers:
            return []
        active = [c for c in self.consumers.values() if c.credit() > 0]
        if not active:
            return []
        out: dict[tuple, list] = {}
        ready = self.ready
        budget = MAX_DISPATCH
        if len(active) == 1:
            c = active[0]
            n = min(c.credit(), len(ready), budget)
            batch = [ready.popleft() for _ in range(n)]
            out[(c.owner, c.tag)] = batch
        else:
            credits = [c.credit() for c in active]
            lists = [[] for _ in active]
            n_active = len(active)
            i = 0
            while ready and budget:
                for _ in range(n_active):
                    if credits[i] > 0:
                        break
                    i = (i + 1) % n_active
                else:
                    break  # nobody has credit left
                lists[i].append(ready.popleft())
                credits[i] -= 1
                budget -= 1
                i = (i + 1) % n_active
            for c, lst in zip(active, lists):
                if lst:
                    out[(c.owner, c.tag)] = lst
        result = []
        unacked = self.unacked
        for key, batch in out.items():
            c = self.consumers[key]
            self.ready_bytes -= sum(len(m[1]) for m in batch)
            if not c.no_ack:
                c.in_flight += len(batch)
                for m in batch:
                    unacked[m[0]] = (c.owner, key, m)
            result.append((c, batch))
        # rotate: the consumer served first goes to the back, for fairness across calls
        if len(self.consumers) > 1:
            first = next(iter(self.consumers))
            self.consumers[first] = self.consumers.pop(first)
        return result

    def get(self, owner: tuple, no_ack: bool) -> tuple | None:
        """basic.get: take the head message, tracking it as unacked unless no_ack."""
        if not self.ready:
            return None
        m = self.ready.popleft()
        self.ready_bytes -= len(m[1])
        if not no_ack:
            self.unacked[m[0]] = (owner, None, m)
        return m

    # --- settlement ------------------------------------------------------------------------
    def _take(self, owner: tuple, ids) -> list[tuple]:
        taken = []
        unacked = self.unacked
        consumers = self.consumers
        for mid in ids:
            entry = unacked.get(mid)
            if entry is None or entry[0] != owner:
                continue  # already settled (e.g. requeued by a failover): ignore
            del unacked[mid]
            key = entry[1]
            if key is not None:
                c = consumers.get(key)
                if c is not None:
                    c.in_flight -= 1
            taken.append(entry[2])
        return taken

    def ack(self, owner: tuple, ids) -> int:
        return len(self._take(owner, ids))

    def discard(self, owner: tuple, ids) -> int:
        """nack/reject without requeue: the message is dropped (no dead-lettering here)."""
        return len(self._take(owner, ids))

    def requeue(self, owner: tuple, ids) -> int:
        msgs = self._take(owner, ids)
        if not msgs:
            return 0
        back = sorted((m[0], m[1], m[2], True) for m in msgs)
        self.ready_bytes += sum(len(m[1]) for m in back)
        ready = self.ready
        if not ready or back[-1][0] < ready[0][0]:
            ready.extendleft(reversed(back))
        else:
            merged = list(merge(back, ready))
            ready.clear()
            ready.extend(merged)
        return len(back)
