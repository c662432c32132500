"""The part of a queue's contents (mirroring/queue.py `QueueState`) that drops messages from
the head: by TTL (the deadlines in `expiry`, in id order, only the head expiring as in
RabbitMQ's classic queues) and by the length limits of x-overflow drop-head. A priority queue's
ready messages are not in id order (mirroring/priority_store.py), so what is "up to an id" is
asked of its store; its drop-head takes from the head in delivery order, the highest priority
first, as RabbitMQ's priority queues do (an `EDropIds` effect names the messages)."""

from __future__ import annotations

from bisect import bisect_left
from operator import itemgetter

from wire.messages import EDrop, EDropIds

NEVER = float("inf")  # the deadline of messages that have none, queued behind some that have one
_msg_id = itemgetter(0)


class ExpirySide:
    """TTL expiry and drop-head of a `QueueState` (see the module docstring)."""

    def _oldest_ready(self) -> int | None:
        """The lowest ready id (a priority queue's ready messages are not in id order)."""
        ready = self.ready
        if self.prioritised:
            return ready.oldest()
        return ready[0][0] if ready else None

    def _expired_upto(self, upto: int) -> bool:
        """Every id up to `upto` has expired: the TTL bookkeeping moves on (True if it did)."""
        advanced = False
        exp = self.expiry
        while exp and exp[0][0] <= upto:
            exp.popleft()
            advanced = True
        if not exp:
            self.mixed_deadlines = False
        if upto > self.expired_upto:
            self.expired_upto = upto
            advanced = True
        return advanced

    def drop_upto(self, upto: int, expired: bool = False) -> int:
        """Drop every ready message with an id up to `upto` (they sit at the head); with
        `expired`, every id up to it has expired (TTL bookkeeping moves on)."""
        advanced = self._expired_upto(upto) if expired else False
        ready = self.ready
        if self.prioritised:
            oldest = ready.oldest()
            if not (oldest is not None and oldest <= upto) and not advanced:
                return 0
            if self.effects is not None:
                self.effects.append(EDrop(upto, expired))
            n, size = ready.drop_upto(upto)
            self.ready_bytes -= size
            return n
        if not (ready and ready[0][0] <= upto) and not advanced:
            return 0
        if self.effects is not None:
            self.effects.append(EDrop(upto, expired))
        n = 0
        size = 0
        popleft = ready.popleft
        while ready and ready[0][0] <= upto:
            size += len(popleft()[1])
            n += 1
        self.ready_bytes -= size
        return n

    def expired_by(self, now: float, inclusive: bool = True) -> int:
        """The highest id expired at the head by `now` (with `inclusive`, also what expires
        exactly now: a TTL of 0 means "delivered at once or never"); 0: none. As RabbitMQ's
        classic queues, only the head expires: a message waits behind one whose deadline is
        later (or that has none) while that one is in the queue."""
        upto = self.expired_upto
        exp = self.expiry
        n = len(exp)
        i = 0
        while i < n and (exp[i][1] < now or (inclusive and exp[i][1] == now)):
            upto = exp[i][0]
            i += 1
        if i == n or not self.mixed_deadlines:
            return upto  # deadlines in id order: the first one not due stops the rest
        # the entries whose messages are all gone hold nothing back: skip them
        k = bisect_left(exp, self._oldest_held(), key=_msg_id)
        while k < n and (exp[k][1] < now or (inclusive and exp[k][1] == now)):
            upto = exp[k][0]
            k += 1
        return upto

    def _oldest_held(self) -> int:
        """The lowest id of a message in the queue (ready or unacknowledged), or `next_id`."""
        low = self._oldest_ready()
        if low is None:
            low = self.next_id
        if self._unacked:
            low = min(low, min(self._unacked))
        for run in self._runs:
            if run[2][run[4]] < low:
                low = run[2][run[4]]
        return low

    def expire(self, now: float, inclusive: bool = True) -> int:
        """Drop the ready messages whose TTL ran out by `now` (see `expired_by`)."""
        upto = self.expired_by(now, inclusive)
        if upto == 0:
            return 0
        return self.drop_upto(upto, True)

    def next_expiry(self) -> float | None:
        """When the head's deadline is (None: it has none), or earlier."""
        exp = self.expiry
        if not exp:
            return None
        at = exp[0][1]
        if self.mixed_deadlines:
            k = bisect_left(exp, self._oldest_held(), key=_msg_id)
            if k < len(exp):
                at = min(at, exp[k][1])
        return None if at == NEVER else at

    def drop_over(self, limits) -> int:
        """x-overflow drop-head: drop ready messages from the head until the queue is within
        its length limits (`limits`: mirroring/queue.py `Limits`)."""
        if self.prioritised:
            return len(self.drop_ids(self.over_limits_ids(limits)))
        upto = self.over_limits(limits)
        return self.drop_upto(upto) if upto else 0

    def _over(self, limits, msgs) -> list:
        """The first of `msgs` (ready messages from the head) that must go for the queue to be
        within its length limits."""
        max_len = limits.max_length if limits.max_length is not None else float("inf")
        max_bytes = limits.max_bytes if limits.max_bytes is not None else float("inf")
        n = len(self.ready)
        size = self.ready_bytes
        out = []
        if n <= max_len and size <= max_bytes:
            return out
        for msg in msgs:
            if n <= max_len and size <= max_bytes:
                break
            out.append(msg)
            n -= 1
            size -= len(msg[1])
        return out

    def over_limits(self, limits) -> int:
        """A queue without priorities: the last id of the oldest ready messages that must go
        for it to be within its length limits (0: none)."""
        over = self._over(limits, self.ready)
        return over[-1][0] if over else 0

    def over_limits_ids(self, limits) -> list[int]:
        """A priority queue: the ids of the ready messages that must go for it to be within its
        length limits, from the head in delivery order (its highest priority first)."""
        return [msg[0] for msg in self._over(limits, self.ready)]

    def drop_ids(self, ids: list[int], holder: tuple | None = None) -> list:
        """A priority queue's drop-head of the ready messages `ids` (`over_limits_ids`): dropped,
        or with `holder` taken to be dead-lettered (held as unacknowledged by `holder`, as
        `dead_head` holds them). Returns the messages taken; a mirror applies the same."""
        if not ids:
            return []
        if self.effects is not None:
            self.effects.append(EDropIds(list(ids), holder))
        msgs = self.ready.take_ids(ids)
        self.ready_bytes -= sum(len(msg[1]) for msg in msgs)
        if holder is not None:
            have = {msg[0]: msg for msg in msgs}
            unacked = self.unacked
            for mid in ids:  # what this replica lacks is held as a stub, as in apply_dead_head
                unacked[mid] = (holder, None, have.get(mid))
        return msgs

    def apply_drop_ids(self, eff: EDropIds) -> None:
        """A mirror: the leader's `drop_ids`."""
        self.drop_ids(eff.ids, tuple(eff.holder) if eff.holder is not None else None)
