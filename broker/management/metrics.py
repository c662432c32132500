"""`GET /metrics`: Prometheus's text exposition format, through prometheus_client.

Each node reports what it holds, as rabbitmq_prometheus does: its queue leaders' counts
(`rabbitmq_queue_*`, labelled by vhost and queue), its connections, channels and memory, plus
warren's own view of mirroring (`warren_*`): mirrors and synchronised mirrors per queue, a running
batch sync's progress and bytes per second, promotions this node has applied, and the last
failover's delivery gap. Names follow rabbitmq_prometheus where a metric has a counterpart.

A scrape asks no peer: it reads this node's replicas (the `queue_stats` request, answered
locally) and the metadata, so a node with 1,000 queues answers in a few milliseconds. Nothing is
counted per message for it: the totals are those the queues keep per batch.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import state

QUEUE_LABELS = ["vhost", "queue"]


class _Snapshot:
    """One scrape's data, gathered before prometheus_client asks for the families."""

    def __init__(self, management, replicas: dict):
        self.management = management
        self.replicas = replicas

    def describe(self):  # no describe pass: the families are made at collect time
        return []

    def collect(self):
        m = self.management
        node = m.node
        md = state.metadata(node)
        leaders = {name: st for name, st in self.replicas.items() if st["role"] == "leader"}

        def gauge(name, doc, labels=QUEUE_LABELS):
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name, doc, labels=QUEUE_LABELS):
            return CounterMetricFamily(name, doc, labels=labels)

        info = gauge("rabbitmq_identity_info", "The node and cluster this node is",
                     ["rabbitmq_node", "rabbitmq_cluster"])
        info.add_metric([node.name, state.cluster_name(md)], 1)
        yield info

        ready = gauge("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers")
        unacked = gauge("rabbitmq_queue_messages_unacked",
                        "Messages delivered to consumers but not yet acknowledged")
        total = gauge("rabbitmq_queue_messages", "Messages ready and unacknowledged")
        ready_bytes = gauge("rabbitmq_queue_messages_ready_bytes", "Body bytes of the ready messages")
        consumers = gauge("rabbitmq_queue_consumers", "Consumers of the queue")
        published = counter("rabbitmq_queue_messages_published", "Messages published to the queue")
        delivered = counter("rabbitmq_queue_messages_delivered",
                            "Messages delivered to consumers or fetched with basic.get")
        acked = counter("rabbitmq_queue_messages_acked", "Messages acknowledged by consumers")
        mirrors = gauge("warren_queue_mirrors", "Mirrors the metadata lists for the queue")
        synced = gauge("warren_queue_synchronised_mirrors", "Mirrors that hold every message of the queue")
        sync_ratio = gauge("warren_queue_sync_progress_ratio",
                           "A running batch sync's messages sent over its total (0 to 1)")
        sync_rate = gauge("warren_queue_sync_bytes_per_second", "A running batch sync's body bytes per second")
        sync_eta = gauge("warren_queue_sync_eta_seconds", "A running batch sync's time left, estimated")
        sums = {"published": 0, "delivered": 0, "acked": 0}
        for name, st in sorted(leaders.items()):
            labels = [state.VHOST, name]
            ready.add_metric(labels, st["messages_ready"])
            unacked.add_metric(labels, st["messages_unacknowledged"])
            total.add_metric(labels, st["messages"])
            ready_bytes.add_metric(labels, st["ready_bytes"])
            consumers.add_metric(labels, st["consumers"])
            published.add_metric(labels, st.get("published", 0))
            delivered.add_metric(labels, st.get("delivered", 0))
            acked.add_metric(labels, st.get("acked", 0))
            for key in sums:
                sums[key] += st.get(key, 0)
            q = state.queue(md, name)
            mirrors.add_metric(labels, len(q.mirrors) if q else 0)
            synced.add_metric(labels, len(st.get("synced", ())))
            progress = st.get("sync")
            if progress:
                sync_ratio.add_metric(labels, progress["messages"] / max(1, progress["total_messages"]))
                sync_rate.add_metric(labels, progress["rate_bytes"])
                sync_eta.add_metric(labels, progress["eta"])
        yield from (ready, unacked, total, ready_bytes, consumers, published, delivered, acked,
                    mirrors, synced, sync_ratio, sync_rate, sync_eta)

        queues = gauge("rabbitmq_queues", "Queues led by this node", [])
        queues.add_metric([], len(leaders))
        yield queues
        for key, metric, doc in (("published", "rabbitmq_global_messages_received",
                                  "Messages published to the queues this node leads"),
                                 ("delivered", "rabbitmq_global_messages_delivered",
                                  "Messages delivered by the queues this node leads"),
                                 ("acked", "rabbitmq_global_messages_acknowledged",
                                  "Messages acknowledged at the queues this node leads")):
            family = counter(metric, doc, [])
            family.add_metric([], sums[key])
            yield family

        sessions = list(node.sessions.values())
        for metric, doc, value in (
                ("rabbitmq_connections", "Client connections open on this node", len(sessions)),
                ("rabbitmq_channels", "Channels open on this node", sum(len(s.channels) for s in sessions)),
                ("rabbitmq_consumers", "Consumers of the queues this node leads",
                 sum(st["consumers"] for st in leaders.values()))):
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
    replicas = await state.local_stats(management.node)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(management, replicas))
    return generate_latest(registry)
