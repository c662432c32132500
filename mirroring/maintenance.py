"""Maintenance rules over the metadata: which node may be taken down without losing a queue's
only synchronised replica, and when a rolling restart may go on to the next node.

RabbitMQ's `node-is-mirror-sync-critical` check, as warren has it (`warrenctl
node_is_mirror_sync_critical` and the HTTP health check of that name both ask
`sync_critical_queues`): a node is critical for a queue it leads when the queue is mirrored (its
policy sets `ha-mode`, or it has mirrors) and none of its synchronised mirrors is on a running
node. Stopping that node would leave only unsynchronised mirrors (not promoted on a controlled
shutdown by default) or none: the queue would go down or lose messages.

`replicas` is the one place here that reads queue definitions.

Pure: no trio, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .planner import ha_for


@dataclass(frozen=True, slots=True)
class QueueReplicas:
    """Where one queue's replicas are, as the metadata records them."""

    name: str
    leader: str
    mirrors: tuple[str, ...]
    synced: tuple[str, ...]  # the mirrors the leader reported synchronised
    mirrored: bool  # a policy sets ha-mode, or mirrors exist
    sync_mode: str  # "manual", "automatic" or "background"

    @property
    def unsynchronised(self) -> tuple[str, ...]:
        return tuple(n for n in self.mirrors if n not in self.synced)


def replicas(md) -> list[QueueReplicas]:
    """Every queue's replicas, by name."""
    out = []
    for name, q in sorted(md.queues.items()):
        ha = ha_for(md.policies, q)
        out.append(QueueReplicas(name, q.leader, q.mirrors,
                                 tuple(n for n in q.synced if n in q.mirrors),
                                 ha.mode is not None or bool(q.mirrors), ha.sync_mode))
    return out


def sync_critical_queues(md, node: str, running) -> list[str]:
    """The mirrored queues `node` leads whose only synchronised replica it holds (no
    synchronised mirror on a node in `running`), by name: empty when `node` may be stopped."""
    running = set(running)
    return [q.name for q in replicas(md)
            if q.leader == node and q.mirrored
            and not any(n in running and n != node for n in q.synced)]


def unsynchronised_queues(md, running, least_mirrors: dict[str, int] | None = None) -> dict[str, str]:
    """The mirrored queues a rolling restart must wait for before its next node: {name: why}.

    A queue waits while one of its mirrors is unsynchronised, while its leader is not running,
    or while it has fewer mirrors than `least_mirrors` gives it (the count it had before the
    node went down: its mirror on the returning node is not placed yet)."""
    running = set(running)
    least_mirrors = least_mirrors or {}
    waiting = {}
    for q in replicas(md):
        if not q.mirrored:
            continue
        if q.leader not in running:
            waiting[q.name] = f"its leader {q.leader} is not running"
        elif len(q.mirrors) < least_mirrors.get(q.name, 0):
            waiting[q.name] = (f"{len(q.mirrors)} mirror(s) of {least_mirrors[q.name]} placed")
        elif q.unsynchronised:
            waiting[q.name] = f"unsynchronised on {', '.join(q.unsynchronised)}"
    return waiting


def mirror_counts(md) -> dict[str, int]:
    """{queue: how many mirrors it has}, for the mirrored queues."""
    return {q.name: len(q.mirrors) for q in replicas(md) if q.mirrored}
