"""The management API's one way into the cluster's metadata and the queues' live counts.

Everything else in broker/management reads the metadata (members, queue definitions, policies,
exchanges, bindings) and the changes applied to it through the functions here, which turn them
into plain views (`QueueView`, tuples, dicts), so a change in how the metadata stores its records
changes this file only.

Live counts come from each queue's leader: the same `queue_stats` request that `warrenctl
list_queues` sends over the peer links (broker/control.py), one per running node.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import trio

from mirroring.changes import NodeDown, NodeUp, PolicyClear, PolicySet
from mirroring.exchanges import named_binding_rows
from mirroring.maintenance import sync_critical_queues
from mirroring.policy import effective_policy
from mirroring.records import DEFAULT_VHOST, QueueDef, qualify, shown, split_key  # noqa: F401 (shown: events.py)
from mirroring.replica import LEADING

from ..cluster import NodeStopped

VHOST = DEFAULT_VHOST
STATS_TIMEOUT = 5.0  # a node that does not answer in this long is left out of a listing


@dataclass(frozen=True, slots=True)
class QueueView:
    """A queue as the API shows it; `key` names it in the metadata and the live counts."""
    key: str
    vhost: str
    name: str
    durable: bool
    auto_delete: bool
    exclusive: bool
    arguments: dict
    leader: str
    mirrors: tuple  # oldest first
    synced: tuple
    epoch: int
    owner: object


def metadata(node):
    """The metadata: live while the app runs, else as last saved."""
    return node.md if node.app_running else node.cluster.load_metadata()


def applied(node):
    """The metadata as the node applies it, whether or not its app counts as running yet (a
    starting app replays its log before it runs: reading the saved state instead, as
    `metadata` does then, would read the whole file once per change replayed)."""
    return node.md


def _view(q: QueueDef) -> QueueView:
    return QueueView(q.key, q.vhost, q.name, q.durable, q.auto_delete, q.exclusive, dict(q.arguments), q.leader,
                     q.mirrors, q.synced, q.epoch, q.owner)


def paused_nodes(node) -> set[str]:
    """The members paused under pause_minority, as this node knows: itself, and the linked nodes
    that said so. Such a node takes no clients: as RabbitMQ's paused node (its app stopped), it
    shows as not running."""
    paused = set(node.cluster.paused_peers)
    if node.cluster.paused:
        paused.add(node.name)
    return paused


def sync_critical(md, node: str, running) -> list[str]:
    """The queues `node` holds the only synchronised replica of (mirroring/maintenance.py)."""
    return sync_critical_queues(md, node, running)


def key(vhost: str, name: str) -> str:
    """The key of a queue, exchange or policy of a vhost (mirroring/records.py `qualify`)."""
    return qualify(vhost, name)


def vhost_and_name(key_: str) -> tuple[str, str]:
    return split_key(key_)


def vhosts(md) -> list[dict]:
    return [{"name": v.name, "description": v.description, "tracing": v.tracing}
            for _, v in sorted(md.vhosts.items())]


def has_vhost(md, name: str) -> bool:
    return name in md.vhosts


def queue(md, key_: str) -> QueueView | None:
    q = md.queues.get(key_)
    return None if q is None else _view(q)


def queues(md, vhost: str | None = None) -> list[QueueView]:
    """Every queue (of `vhost` only, when given), by vhost and name."""
    views = [_view(q) for q in md.queues.values() if vhost is None or q.vhost == vhost]
    return sorted(views, key=lambda q: (q.vhost, q.name))


def mirror_counts(md) -> dict[str, int]:
    """{queue: how many mirrors the metadata lists}, in one pass (for /metrics)."""
    return {name: len(q.mirrors) for name, q in md.queues.items()}


def placement(md, name: str) -> tuple | None:
    """(leader, mirrors, synchronised mirrors) of a queue, None if there is no such queue: what
    the timeline compares, without a view of the whole definition."""
    q = md.queues.get(name)
    return None if q is None else (q.leader, q.mirrors, q.synced)


def touched(md) -> set[str] | None:
    """The queues the last change applied named, None if it may have touched any."""
    return md.touched


def change_facts(change) -> tuple[str, dict] | None:
    """What the timeline tells of an applied change that is not about one queue's placement:
    ("node_down", {node, reason}), ("node_up", {node}), ("policy_set", {name, pattern,
    definition}), ("policy_clear", {name}); None for any other change."""
    match change:
        case NodeDown():
            return "node_down", {"node": change.node, "reason": change.how}
        case NodeUp():
            return "node_up", {"node": change.node}
        case PolicySet(policy=record):
            return "policy_set", {"name": record.name, "pattern": record.pattern,
                                  "definition": record.definition}
        case PolicyClear():
            return "policy_clear", {"name": change.name}
    return None


def queue_names(md, vhost: str | None = None) -> list[str]:
    """The keys of every queue (of `vhost` only, when given)."""
    return [k for k, q in md.queues.items() if vhost is None or q.vhost == vhost]


def members(md) -> list[str]:
    """The cluster's members in the order they joined."""
    return list(md.members)


def cluster_name(md) -> str:
    return md.cluster_name


def down_reason(md, member: str) -> str | None:
    """"failure" or "shutdown" if the metadata records the member down, else None."""
    return md.down.get(member)


def metadata_version(md) -> int:
    return md.version


def policies(md, vhost: str | None = None) -> list[dict]:
    """Every policy (of `vhost` only, when given) as RabbitMQ's API lists it."""
    return [{"vhost": p.vhost, "name": p.name, "pattern": p.pattern, "apply-to": p.apply_to,
             "definition": p.definition, "priority": p.priority}
            for p in sorted(md.policies.values(), key=lambda p: (p.vhost, p.name))
            if vhost is None or p.vhost == vhost]


def has_policy(md, key_: str) -> bool:
    return key_ in md.policies


def policy_of(md, q: QueueView) -> tuple[str, dict]:
    """(name, definition) of the policy that applies to a queue, ("", {}) if none."""
    pol = effective_policy(md.policies, q.name, q.vhost)
    return (pol.name, dict(pol.definition)) if pol else ("", {})


def exchanges(md, vhost: str | None = None) -> list[dict]:
    """Every exchange (of `vhost` only, when given), with its `vhost`."""
    return [msgspec.structs.asdict(x) for _, x in sorted(md.exchanges.items())
            if vhost is None or x.vhost == vhost]


def exchange(md, key_: str) -> dict | None:
    x = md.exchanges.get(key_)
    return None if x is None else msgspec.structs.asdict(x)


def bindings(md, vhost: str | None = None) -> list[tuple]:
    """(vhost, source, destination, its type "queue" or "exchange", routing key, arguments) of
    every binding (of `vhost` only, when given), by name: the default exchange's implicit one to
    each queue first, then the declared ones by source, a source's bindings to exchanges after
    those to queues."""
    return named_binding_rows(md.queues, md.bindings, md.exchange_bindings, vhost)


def route(md, exchange_key: str, routing_key: str, headers=None) -> list[str]:
    """The names of the queues a message published to the exchange reaches, in its vhost
    (raises for a missing exchange)."""
    return [split_key(k)[1] for k in md.routes.route(exchange_key, routing_key, headers)]


# --- live counts ---------------------------------------------------------------------------------

async def replica_stats(node, names=None) -> tuple[dict, dict]:
    """({queue: its leader's stats}, {queue: {node: mirror's stats}}) from every running node
    (or only `names`); a node that fails to answer is left out."""
    leaders: dict = {}
    mirrors: dict = {}
    if not node.app_running:
        return leaders, mirrors

    async def one(name):
        try:
            with trio.fail_after(STATS_TIMEOUT):
                per_node = await node.cluster.call_node(name, "queue_stats", {})
        except (Exception, NodeStopped):  # noqa: BLE001 - a node going away is not an error here
            return
        for qname, st in per_node.items():
            if st["role"] == "leader":
                leaders[qname] = st
            else:
                mirrors.setdefault(qname, {})[st["node"]] = st

    async with trio.open_nursery() as nursery:
        for name in sorted(names if names is not None else node.running):
            if name in node.running:
                nursery.start_soon(one, name)
    return leaders, mirrors


def local_leader_counts(node) -> list[tuple]:
    """(queue, ready, unacknowledged, consumers, ready bytes, published, delivered, acked,
    synchronised mirrors, sync progress or None) for each queue this node leads, sorted: what
    `queue_stats` says of a leader, read straight from the replicas without a dict per queue
    (a scrape of 1,000 queues spends its time here)."""
    out = []
    for name, qp in node.router.replicas.items():
        r = qp.replica
        if r.state not in LEADING:
            continue
        q = r.q
        sync = r.sync
        out.append((name, len(q.ready), q.unacked_count, len(q.consumers), q.ready_bytes,
                    q.next_id - 1, q.delivered_total, q.acked_total, len(r.rep.synced()),
                    None if sync is None else sync.pacer.progress(trio.current_time())))
    out.sort()
    return out
