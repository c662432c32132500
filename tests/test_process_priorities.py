"""Priority queues and single active consumers against kill -9 of real `warren-server`
processes, through AMQP (pika), with clients on the node that fails: a single active consumer
whose node dies is replaced by the next one, and a priority queue whose leader dies is served by
its promoted mirror in priority order, whether that mirror followed from the start or was
filled by a batch sync. Checked message by message: nothing confirmed lost, nothing delivered
twice without `redelivered`."""

from __future__ import annotations

import json
import time

import pika
import pytest
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

TICK = 3.0


@pytest.fixture
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3, net_ticktime=TICK) as c:
        yield c


def connect(c, node: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(c.amqp_url(node)))


def set_policy(c, pattern: str, definition: dict) -> None:
    c.call("n1", "set_policy", {"name": "ha", "pattern": pattern, "definition": json.dumps(definition),
                                "priority": 0, "apply_to": "queues"})


def queue_row(c, node: str, queue: str) -> dict | None:
    rows = c.call(node, "list_queues", {"columns": ["name", "pid", "mirror_pids", "synchronised_mirror_pids"]})
    return next((r for r in rows if r["name"] == queue), None)


def wait_until(predicate, timeout: float, what: str, conns=()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        for conn in conns:
            conn.process_data_events(0.02)
        if not conns:
            time.sleep(0.05)


def wait_synced(c, node: str, queue: str, mirrors: int) -> None:
    def ok():
        row = queue_row(c, node, queue)
        return row is not None and len(row["synchronised_mirror_pids"]) == mirrors
    wait_until(ok, 20, f"{queue} with {mirrors} synchronised mirrors")


def publish_confirmed(ch, queue: str, messages: list[tuple[int, int | None]]) -> None:
    """Each (id, priority) published with confirms on: pika raises if one is not confirmed."""
    for i, p in messages:
        ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(priority=p))


def test_single_active_consumer_whose_node_dies_is_replaced_by_the_next(cluster):
    c = cluster
    set_policy(c, r"^sac\.", {"ha-mode": "all"})
    q = "sac.q"
    pub_conn = connect(c, "n1")
    pub = pub_conn.channel()
    pub.queue_declare(q, arguments={"x-single-active-consumer": True})
    wait_synced(c, "n3", q, 2)
    pub.confirm_delivery()

    first_got, second_got = [], []  # (id, redelivered)
    a_conn, b_conn = connect(c, "n2"), connect(c, "n3")
    a = a_conn.channel()
    a.basic_qos(prefetch_count=10)

    def on_first(ch, method, props, body):
        i = int(body)
        first_got.append((i, method.redelivered))
        if i <= 50:  # the rest stays unacknowledged when its node dies
            ch.basic_ack(method.delivery_tag)

    a.basic_consume(q, on_first)
    b = b_conn.channel()
    b.basic_consume(q, lambda ch, method, props, body: second_got.append((int(body), method.redelivered)),
                    auto_ack=True)
    publish_confirmed(pub, q, [(i, None) for i in range(1, 101)])
    wait_until(lambda: len(first_got) == 60, 10, "the active consumer's 60", [a_conn, b_conn])
    b_conn.process_data_events(0.3)
    assert second_got == [] and [i for i, _ in first_got] == list(range(1, 61))

    c.kill9("n2")  # the active consumer's node
    wait_until(lambda: {i for i, _ in second_got} >= set(range(51, 101)), 20,
               "the next consumer to get the rest", [b_conn])
    b_conn.process_data_events(0.3)
    held = set(range(51, 61))  # delivered to the first, never acknowledged: flagged
    assert sorted(second_got) == sorted([(i, True) for i in held] + [(i, False) for i in range(61, 101)])
    acked = {i for i, _ in first_got if i <= 50}
    assert acked | {i for i, _ in second_got} == set(range(1, 101))  # nothing confirmed lost
    for conn in (pub_conn, b_conn):
        conn.close()


PRIORITIES = [0, 9, 3, 9, None, 5, 3, 1, 12, 0]  # 12: counted as the maximum (9); None as 0


def batch(start: int, n: int) -> list[tuple[int, int | None]]:
    return [(i, PRIORITIES[i % len(PRIORITIES)]) for i in range(start, start + n)]


def by_priority(messages) -> list[int]:
    return [i for i, p in sorted(messages, key=lambda m: (-min(m[1] or 0, 9), m[0]))]


def test_priorities_after_a_sync_and_a_promotion(cluster):
    """The queue's older messages reach its mirrors by a batch sync, the newer by replication;
    its leader (with the publisher on its node) is killed, and the promoted mirror hands out
    everything in priority order, FIFO within a priority, each message once."""
    c = cluster
    q = "prio.q"
    pub_conn = connect(c, "n1")
    pub = pub_conn.channel()
    pub.queue_declare(q, arguments={"x-max-priority": 9})
    pub.confirm_delivery()
    synced_part = batch(1, 300)
    publish_confirmed(pub, q, synced_part)
    set_policy(c, r"^prio\.", {"ha-mode": "all", "ha-sync-batch-size": 64})
    wait_until(lambda: len((queue_row(c, "n1", q) or {}).get("mirror_pids", ())) == 2, 20, "two mirrors")
    replicated = batch(301, 200)  # the mirrors hold these before the sync brings the older
    publish_confirmed(pub, q, replicated)
    assert c.call("n1", "sync_queue", {"queue": q})["started"]
    wait_synced(c, "n1", q, 2)

    c.kill9("n1")
    wait_until(lambda: (queue_row(c, "n2", q) or {}).get("pid", "").startswith("<n2."), 20,
               "n2 to lead the queue")
    conn = connect(c, "n2")
    ch = conn.channel()
    got = []
    while (msg := ch.basic_get(q, auto_ack=True))[0] is not None:
        got.append((int(msg[2]), msg[1].priority, msg[0].redelivered))
    conn.close()
    assert [i for i, _, _ in got] == by_priority(synced_part + replicated)
    assert all(red for _, _, red in got)  # the promoted leader may not know what was delivered
    assert {(i, p) for i, p, _ in got} == set(synced_part + replicated)  # priorities carried
