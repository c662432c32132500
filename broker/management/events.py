"""The timeline: a small bounded ring of what happened to the cluster's nodes and queues, as this
node saw it, for the web UI and `GET /api/warren/events`.

It is fed where the metadata is applied (`Node.meta_changed` hands each change on): a node
recorded down or up, a policy set or cleared, and for each queue the change touched, what moved
in its placement (declared, deleted, a leader promoted, a mirror added or dropped, a mirror
synchronised). A promotion carries the *delivery gap*: from the moment this node's link to the
old leader's node broke (`link_down`) to the moment it applied the promotion, the time during
which nobody could serve the queue. Batch syncs are not in the metadata: their start and end
are recorded when the API sees them (`sync_seen`), or starts them.

An event names its queue as RabbitMQ does, by `queue` (its name) and `vhost`; its text names
it with its vhost outside "/" (records.shown).

Cost: a change that names its queues compares those; any other change (a node's run, a policy:
rare) compares every queue's placement, a tuple comparison each.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import trio

from . import state

EVENTS_KEPT = 2000
GAP_WINDOW = 120.0  # a link that broke longer ago than this does not explain a promotion


class Timeline:
    def __init__(self, node, size: int = EVENTS_KEPT):
        self.node = node
        self.events: deque[dict] = deque(maxlen=size)
        self._ids = itertools.count(1)
        self._placement: dict[str, tuple] = {}  # queue -> (leader, mirrors, synced) last seen
        self._link_down_at: dict[str, float] = {}  # node -> trio time its link broke
        self._syncing: set[str] = set()
        self.promotions = 0
        self.last_gap: float | None = None

    # --- feeding -------------------------------------------------------------------------------
    def add(self, kind: str, text: str, queue: str | None = None, node: str | None = None,
            **extra) -> dict:
        """An event; `queue` is the key of the queue it is about (records.qualify)."""
        vhost, name = state.vhost_and_name(queue) if queue is not None else (None, None)
        event = {"id": next(self._ids), "at": time.time(), "kind": kind, "queue": name,
                 "vhost": vhost, "node": node, "text": text, **extra}
        self.events.append(event)
        return event

    def link_down(self, node: str) -> None:
        self._link_down_at[node] = trio.current_time()

    def resync(self, md) -> None:
        """Take the placements as they are now, saying nothing (start-up, a snapshot)."""
        self._placement = {name: state.placement(md, name) for name in state.queue_names(md)}

    def meta_changed(self, change, md) -> None:
        if change is None:
            self.resync(md)
            return
        facts = state.change_facts(change)
        if facts is not None:
            kind, f = facts
            if kind == "node_down":
                self.add(kind, f"node {f['node']} down ({f['reason']})", node=f["node"], reason=f["reason"])
            elif kind == "node_up":
                self.add(kind, f"node {f['node']} up", node=f["node"])
            elif kind == "policy_set":
                self.add("policy", f"policy {f['name']} set: pattern {f['pattern']!r}, "
                                   f"{f['definition']}", policy=f["name"])
            else:
                self.add("policy", f"policy {f['name']} cleared", policy=f["name"])
        touched = state.touched(md)
        names = touched if touched is not None else {*self._placement, *state.queue_names(md)}
        placements = self._placement
        for name in names:
            now = state.placement(md, name)
            if now != placements.get(name):
                self._compare(name, placements.get(name), now)

    def _compare(self, name: str, before: tuple | None, now: tuple | None) -> None:
        if now is None:
            del self._placement[name]
            self._syncing.discard(name)
            self.add("queue_deleted", f"queue {state.shown(name)} deleted", queue=name)
            return
        self._placement[name] = now
        leader, mirrors, synced = now
        if before is None:
            self.add("queue_declared", f"queue {state.shown(name)} declared, leader on {leader}",
                     queue=name, node=leader)
            before = (leader, (), ())
        old_leader, old_mirrors, old_synced = before
        if leader != old_leader:
            gap = None
            broke = self._link_down_at.get(old_leader)
            if broke is not None and trio.current_time() - broke < GAP_WINDOW:
                gap = round(trio.current_time() - broke, 3)
                self.last_gap = gap
            self.promotions += 1
            text = f"mirror on {leader} promoted to leader (was {old_leader})"
            if gap is not None:
                text += f"; delivery gap {gap * 1000:.0f} ms"
            self.add("promoted", text, queue=name, node=leader, previous=old_leader, gap=gap)
        for added in [n for n in mirrors if n not in old_mirrors and n != old_leader]:
            self.add("mirror_added", f"mirror added on {added}", queue=name, node=added)
        for dropped in [n for n in old_mirrors if n not in mirrors and n != leader]:
            self.add("mirror_dropped", f"mirror on {dropped} dropped", queue=name, node=dropped)
        for node in [n for n in synced if n not in old_synced]:
            self.add("mirror_synchronised", f"mirror on {node} synchronised", queue=name, node=node)

    def sync_seen(self, name: str, progress: dict | None, leader: str) -> None:
        """What a leader's stats say of its batch sync (None: none runs)."""
        if progress is not None and name not in self._syncing:
            self._syncing.add(name)
            self.add("sync_started", f"sync started: {progress['total_messages']:,} messages "
                                     f"to mirrors", queue=name, node=leader)
        elif progress is None and name in self._syncing:
            self._syncing.discard(name)
            self.add("sync_finished", "sync finished", queue=name, node=leader)

    # --- reading -------------------------------------------------------------------------------
    def since(self, after: int = 0, queue: str | None = None, limit: int = 200,
              vhost: str | None = None) -> list[dict]:
        """The events after `after`; of the queues named `queue` (of `vhost`, when given)."""
        out = [e for e in self.events if e["id"] > after
               and (queue is None or e["queue"] == queue) and (vhost is None or e["vhost"] == vhost)]
        return out[-limit:]
