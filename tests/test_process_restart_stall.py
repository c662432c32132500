"""No confirm stall when a node's mirror is stopped and started again in one go (real
`warren-server` processes).

The mirror's node is frozen (SIGSTOP) while a policy change drops its mirror of the queue and a
second one adds it back. The queue's leader sends the new mirror's start at once; the frozen node
finds it, with the two changes, in its sockets when it wakes, and hands the start to the replica
it still runs before it applies the changes that end that replica and start a new one. Before
the fix the stopping replica answered the start, the new one ignored every batch, and the
publisher's confirms waited net_ticktime (10 s here), until the leader gave up on the silent
mirror: the stall a second `make demo` showed after a cluster restart, where the restarted node
catches up on the metadata the same way. Now the new replica tells its leader it follows nothing
(mirroring/replica.py `_on_batch_not_following`), and the leader starts it again.
"""

from __future__ import annotations

import json
import tempfile
import time

import pytest
import trio
from cluster_procs import ProcessCluster

from bench.chaos.checker import STALL_LIMIT, Publish, confirm_stalls
from broker.client import aio

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

QUEUE = "stall.q"
TICKTIME = 10.0  # the default: a leader waits this long before it gives up on a silent mirror


def set_policy(c: ProcessCluster, on: str, definition: dict) -> None:
    c.call(on, "set_policy", {"name": "ha-stall", "pattern": "^stall", "definition": json.dumps(definition)})


async def publish_through_a_mirror_restart(c: ProcessCluster, pubs: list) -> float:
    """Publish with confirms to a queue led by the metadata log's leader while a mirror's node
    sleeps through its mirror going and coming back; returns when that node woke."""
    leader = c.cluster_status("n1")["metadata_leader"]
    mirror, other = [n for n in c.names if n != leader]
    set_policy(c, leader, {"ha-mode": "all"})
    async with aio.open_connection([c.client_addr(leader)]) as conn:
        ch = await conn.channel()
        await ch.queue_declare(QUEUE, durable=True, arguments={"x-queue-master-locator": "client-local"})
        await ch.confirm_delivery()

        def confirmed(first, last, ok, reason):
            now = time.monotonic()
            for seq in range(first, last + 1):
                pubs[seq - 1].outcome, pubs[seq - 1].t_conf = "ack" if ok else "nack", now
        ch.on_confirm = confirmed

        async def publisher():
            while True:
                pubs.append(Publish(len(pubs), 0, leader, time.monotonic()))
                await ch.basic_publish("", QUEUE, b"x" * 100)
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher)
            await trio.sleep(1.5)  # the mirrors started and synchronised (the queue is new)
            c.sigstop(mirror)
            try:
                await trio.to_thread.run_sync(set_policy, c, leader,
                                              {"ha-mode": "nodes", "ha-params": [leader, other]})
                await trio.sleep(0.3)
                await trio.to_thread.run_sync(set_policy, c, leader, {"ha-mode": "all"})
                await trio.sleep(0.3)
            finally:
                c.sigcont(mirror)
            woke = time.monotonic()
            await trio.sleep(TICKTIME + 3)
            nursery.cancel_scope.cancel()
        await ch.wait_for_confirms(timeout=30)
    return woke


def test_confirms_do_not_wait_for_a_mirror_started_again_while_its_node_slept(request):
    tmp = tempfile.mkdtemp(prefix="warren-restart-stall-")
    failed_before = request.session.testsfailed
    with ProcessCluster(3, net_ticktime=TICKTIME, tmpdir=tmp) as c:
        try:
            pubs: list = []
            woke = trio.run(publish_through_a_mirror_restart, c, pubs)
            end = time.monotonic()
            after = [(max(a, woke), b) for a, b, _ in confirm_stalls(pubs, {}, end) if b > woke]
            stall = max((b - a for a, b in after), default=0.0)
            dropped = [line.strip() for n in c.names for line in open(c.log_path(n))
                       if "no acknowledgement for" in line]
            assert stall < STALL_LIMIT, f"confirms waited {stall:.1f} s after the mirror's node woke: {dropped}"
            assert not dropped, dropped
        finally:
            for name in c.names:
                c.sigcont(name)
            if request.session.testsfailed > failed_before:
                c.dump_logs(60)
