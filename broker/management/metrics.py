"""`GET /metrics`: Prometheus's text exposition format, through prometheus_client.

Each node reports what it holds, as rabbitmq_prometheus does: its queue leaders' counts
(`rabbitmq_queue_*`, labelled by vhost and queue), its connections, channels and memory, plus
warren's own view of mirroring (`warren_*`): mirrors and synchronised mirrors per queue, a running
batch sync's progress and bytes per second, promotions this node has applied, and the last
failover's delivery gap. Names follow rabbitmq_prometheus where a metric has a counterpart.

A scrape asks no peer: it reads this node's queue leaders (what the `queue_stats` request says
of them, without a dict per queue: `state.local_leader_counts`) and the metadata.
prometheus_client writes the node-wide families; the per-queue ones, most of the samples with
many queues, are written in the same format by `queue_families`, which escapes each queue's
labels once (prometheus_client's writer took 0.2 s for 1,000 queues). Nothing is counted per
message for it: the totals are those the queues keep per batch.
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import state


# the per-queue families: (name, type, help, the value's place in a `local_leader_counts` row);
# a counter's samples are NAME_total, as prometheus_client writes them
QUEUE_FAMILIES = (
    ("rabbitmq_queue_messages_ready", "gauge", "Messages ready to be delivered to consumers", 1),
    ("rabbitmq_queue_messages_unacked", "gauge",
     "Messages delivered to consumers but not yet acknowledged", 2),
    ("rabbitmq_queue_consumers", "gauge", "Consumers of the queue", 3),
    ("rabbitmq_queue_messages_ready_bytes", "gauge", "Body bytes of the ready messages", 4),
    ("rabbitmq_queue_messages_published", "counter", "Messages published to the queue", 5),
    ("rabbitmq_queue_messages_delivered", "counter",
     "Messages delivered to consumers or fetched with basic.get", 6),
    ("rabbitmq_queue_messages_acked", "counter", "Messages acknowledged by consumers", 7),
    ("warren_queue_synchronised_mirrors", "gauge", "Mirrors that hold every message of the queue", 8),
)
# a running batch sync's families: only queues that sync have a sample
SYNC_FAMILIES = (
    ("warren_queue_sync_progress_ratio", "gauge",
     "A running batch sync's messages sent over its total (0 to 1)",
     lambda p: p["messages"] / max(1, p["total_messages"])),
    ("warren_queue_sync_bytes_per_second", "gauge", "A running batch sync's body bytes per second",
     lambda p: p["rate_bytes"]),
    ("warren_queue_sync_eta_seconds", "gauge", "A running batch sync's time left, estimated",
     lambda p: p["eta"]),
)


@functools.lru_cache(maxsize=65536)
def queue_labels(name: str) -> str:
    """A queue's label set as a sample line writes it (escaped once, kept for the next scrape)."""
    escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return f'{{queue="{escaped}",vhost="{state.VHOST}"}} '


def queue_families(md, rows: list[tuple]) -> str:
    """The per-queue families in the text format, from `state.local_leader_counts` rows. With
    1,000 queues these are most of a scrape's samples, and prometheus_client's writer escapes
    and checks each sample's labels anew (about 15 us a sample here: 0.2 s for 13,000); this
    writes the same lines with each queue's label set escaped once."""
    mirror_counts = state.mirror_counts(md)
    labels = list(map(queue_labels, [row[0] for row in rows]))
    out = []

    def family(sample: str, kind: str, doc: str) -> None:
        out.append(f"# HELP {sample} {doc}\n# TYPE {sample} {kind}\n")

    for metric, kind, doc, i in QUEUE_FAMILIES:
        sample = metric + "_total" if kind == "counter" else metric
        family(sample, kind, doc)
        out.extend(f"{sample}{lab}{row[i]}\n" for lab, row in zip(labels, rows))
    family("rabbitmq_queue_messages", "gauge", "Messages ready and unacknowledged")
    out.extend(f"rabbitmq_queue_messages{lab}{row[1] + row[2]}\n" for lab, row in zip(labels, rows))
    family("warren_queue_mirrors", "gauge", "Mirrors the metadata lists for the queue")
    out.extend(f"warren_queue_mirrors{lab}{mirror_counts.get(row[0], 0)}\n"
               for lab, row in zip(labels, rows))
    syncing = [(lab, row[9]) for lab, row in zip(labels, rows) if row[9] is not None]
    for metric, kind, doc, value in SYNC_FAMILIES:
        family(metric, kind, doc)
        out.extend(f"{metric}{lab}{float(value(p))!r}\n" for lab, p in syncing)
    return "".join(out)


class _Snapshot:
    """One scrape's node-wide families, gathered before prometheus_client asks for them."""

    def __init__(self, management, rows: list[tuple]):
        self.management = management
        self.rows = rows

    def describe(self):  # no describe pass: the families are made at collect time
        return []

    def collect(self):
        m = self.management
        node = m.node
        md = state.metadata(node)
        rows = self.rows

        def gauge(name, doc, labels):
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name, doc, labels):
            return CounterMetricFamily(name, doc, labels=labels)

        info = gauge("rabbitmq_identity_info", "The node and cluster this node is",
                     ["rabbitmq_node", "rabbitmq_cluster"])
        info.add_metric([node.name, state.cluster_name(md)], 1)
        yield info

        queues = gauge("rabbitmq_queues", "Queues led by this node", [])
        queues.add_metric([], len(rows))
        yield queues
        for i, metric, doc in ((5, "rabbitmq_global_messages_received",
                                "Messages published to the queues this node leads"),
                               (6, "rabbitmq_global_messages_delivered",
                                "Messages delivered by the queues this node leads"),
                               (7, "rabbitmq_global_messages_acknowledged",
                                "Messages acknowledged at the queues this node leads")):
            family = counter(metric, doc, [])
            family.add_metric([], sum(row[i] for row in rows))
            yield family

        sessions = node.clients()
        for metric, doc, value in (
                ("rabbitmq_connections", "Client connections open on this node", len(sessions)),
                ("rabbitmq_channels", "Channels open on this node", sum(len(s.channels) for s in sessions)),
                ("rabbitmq_consumers", "Consumers of the queues this node leads",
                 sum(row[3] for row in rows))):
            family = gauge(metric, doc, [])
            family.add_metric([], value)
            yield family

        memory = node.memory.status()
        for metric, doc, value in (
                ("rabbitmq_process_resident_memory_bytes", "Memory used by the node (RSS)",
                 memory.get("memory_used")),
                ("rabbitmq_resident_memory_limit_bytes", "The memory high watermark in bytes",
                 memory.get("memory_limit")),
                ("rabbitmq_alarms_memory_used_watermark", "1 while this node's memory alarm is on",
                 1 if memory.get("memory_alarm") else 0)):
            if value is not None:
                family = gauge(metric, doc, [])
                family.add_metric([], value)
                yield family

        running = node.running
        up = gauge("warren_node_running", "1 for a member this node sees running, else 0", ["node"])
        for member in state.members(md):
            up.add_metric([member], 1 if member in running else 0)
        yield up
        paused = gauge("warren_node_paused", "1 while this node is paused (pause_minority)", [])
        paused.add_metric([], 1 if node.cluster.paused else 0)
        yield paused
        promotions = counter("warren_promotions", "Mirrors promoted to leader, as this node applied them", [])
        promotions.add_metric([], m.timeline.promotions)
        yield promotions
        if m.timeline.last_gap is not None:
            gap = gauge("warren_last_failover_gap_seconds",
                        "From a leader's node's link breaking to its mirror's promotion, the last time", [])
            gap.add_metric([], m.timeline.last_gap)
            yield gap


async def render_metrics(management) -> bytes:
    node = management.node
    rows = state.local_leader_counts(node) if node.app_running else []
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(management, rows))
    return generate_latest(registry) + queue_families(state.metadata(node), rows).encode()
