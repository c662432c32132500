"""The ready messages of a priority queue (`x-max-priority`): one FIFO per priority, the highest
served first, FIFO within a priority. It takes the place of the plain deque a `QueueState`
(mirroring/queue.py) keeps for a queue without priorities, and answers the deque operations the
queue uses, in delivery order (`popleft`, `extend`, `extendleft`, `[0]`, iteration, `len`,
`clear`), plus what a plain deque does by id because its order is the id order: putting
requeued and synced messages back in their places (`merge_in`), dropping by id (`drop_upto`,
`oldest`, `take_ids`) and reading by id (`by_id`, `between`).

A message's priority is its `priority` property, counted as the queue's maximum above it and 0
when absent (RabbitMQ's rule); it is read from the properties whenever a message is placed, so a
message needs no other record of it, and a mirror, a sync and a promoted leader place it alike.
Within a priority the messages stay in id order, so a requeued message goes back to its place
among those of its priority, and the messages up to an id are at the heads of the FIFOs."""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from heapq import merge
from itertools import islice
from operator import itemgetter

from wire.props import priority_of

MAX_PRIORITY = 255  # the largest x-max-priority RabbitMQ accepts
_msg_id = itemgetter(0)


class PriorityReady:
    """Ready messages (id, body, props, redelivered) by priority (see the module docstring)."""

    __slots__ = ("max", "levels", "top", "_n")

    def __init__(self, max_priority: int):
        self.max = max_priority
        self.levels = [deque() for _ in range(max_priority + 1)]
        self.top = -1  # the highest priority that holds a message (-1: none)
        self._n = 0

    def _level(self, msg: tuple) -> int:
        p = priority_of(msg[2])
        return p if p <= self.max else self.max

    def _fall(self) -> None:
        """Move `top` down to the highest priority that still holds a message."""
        levels = self.levels
        t = self.top
        while t >= 0 and not levels[t]:
            t -= 1
        self.top = t

    # --- the deque operations, in delivery order --------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self):
        levels = self.levels
        for p in range(self.top, -1, -1):
            yield from levels[p]

    def __getitem__(self, i: int) -> tuple:
        if i == 0 and self._n:
            return self.levels[self.top][0]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("index out of range")
        return next(islice(iter(self), i, None))

    def extend(self, msgs) -> None:
        levels = self.levels
        top = self.top
        n = 0
        for m in msgs:
            p = self._level(m)
            levels[p].append(m)
            if p > top:
                top = p
            n += 1
        self.top = top
        self._n += n

    def extendleft(self, msgs) -> None:
        """Put back messages taken from the heads, given in the reverse of their order."""
        levels = self.levels
        for m in msgs:
            p = self._level(m)
            levels[p].appendleft(m)
            if p > self.top:
                self.top = p
            self._n += 1

    def popleft(self) -> tuple:
        if not self._n:
            raise IndexError("pop from an empty queue")
        lv = self.levels[self.top]
        m = lv.popleft()
        self._n -= 1
        if not lv:
            self._fall()
        return m

    def clear(self) -> None:
        for lv in self.levels[:self.top + 1]:
            lv.clear()
        self.top = -1
        self._n = 0

    # --- by id ------------------------------------------------------------------------------
    def merge_in(self, msgs: list) -> None:
        """Put messages (sorted by id) in their places by id among those of their priority:
        requeued ones, a sync's."""
        groups: dict[int, list] = {}
        for m in msgs:
            groups.setdefault(self._level(m), []).append(m)
        levels = self.levels
        for p, group in groups.items():
            lv = levels[p]
            if not lv or group[-1][0] < lv[0][0]:
                lv.extendleft(reversed(group))
            else:
                merged = list(merge(group, lv, key=_msg_id))
                lv.clear()
                lv.extend(merged)
            if p > self.top:
                self.top = p
        self._n += len(msgs)

    def oldest(self) -> int | None:
        """The lowest id held (None: empty)."""
        heads = [lv[0][0] for lv in self.levels[:self.top + 1] if lv]
        return min(heads) if heads else None

    def drop_upto(self, upto: int) -> tuple[int, int]:
        """Drop every message with an id up to `upto` (the heads of the FIFOs); returns how many
        and their body bytes."""
        n = size = 0
        for lv in self.levels[:self.top + 1]:
            while lv and lv[0][0] <= upto:
                size += len(lv.popleft()[1])
                n += 1
        self._n -= n
        self._fall()
        return n, size

    def take_ids(self, ids) -> list:
        """Remove and return the messages with these ids, in the order of `ids`: a drop-head's,
        a prefix of the delivery order, so the heads of the FIFOs from the highest priority
        down. A replica that lacks some of them (a mirror not yet synchronised) holds the rest
        at its heads all the same: an id not held is passed over."""
        want = set(ids)
        found = {}
        levels = self.levels
        for p in range(self.top, -1, -1):
            lv = levels[p]
            while lv and lv[0][0] in want:
                msg = lv.popleft()
                found[msg[0]] = msg
        self._n -= len(found)
        self._fall()
        return [found[mid] for mid in ids if mid in found]

    def take_upto(self, upto: int) -> list:
        """Remove and return every message with an id up to `upto`, in id order."""
        runs = []
        for lv in self.levels[:self.top + 1]:
            run = []
            while lv and lv[0][0] <= upto:
                run.append(lv.popleft())
            if run:
                runs.append(run)
        taken = list(merge(*runs, key=_msg_id)) if len(runs) > 1 else (runs[0] if runs else [])
        self._n -= len(taken)
        self._fall()
        return taken

    def by_id(self):
        """Every message, in id order."""
        return merge(*(lv for lv in self.levels[:self.top + 1] if lv), key=_msg_id)

    def between(self, lo: int, hi: int, limit: int) -> list:
        """Up to `limit` messages with lo < id < hi, in id order."""
        runs = []
        for lv in self.levels[:self.top + 1]:
            k = bisect_right(lv, lo, key=_msg_id)
            run = []
            for m in islice(lv, k, k + limit):
                if m[0] >= hi:
                    break
                run.append(m)
            if run:
                runs.append(run)
        if len(runs) == 1:
            return runs[0]
        return list(islice(merge(*runs, key=_msg_id), limit))
