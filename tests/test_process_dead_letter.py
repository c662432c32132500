"""A retry loop under kill -9 of the work queue's leader, on real `warren-server` processes: a
work queue dead-letters what its worker rejects to a retry queue, whose TTL sends it back. The
worker rejects every message once and acknowledges it the second time; the publisher and the
worker are connected to the node that is killed (each with the list of every node). The chaos
checker judges the acknowledged deliveries (nothing confirmed lost, a repeat always flagged
`redelivered`), and the rejections are judged the same way: a message rejected twice in its
first pass was delivered twice, so the second must be flagged."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter

import pytest
import trio
from cluster_procs import ProcessCluster
from test_process_faults import TICK, Load, node_of, row, thread, wait_row

from bench.chaos.clients import Consumer, rotate
from broker.client import aio

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

WORK, RETRY = "dlx.work", "dlx.retry"
RETRY_TTL_MS = 300


@pytest.fixture
def cluster(request):
    tmp = tempfile.mkdtemp(prefix="warren-dlx-")
    failed_before = request.session.testsfailed
    with ProcessCluster(3, net_ticktime=TICK, tmpdir=tmp) as c:
        yield c
        if request.session.testsfailed > failed_before:
            c.dump_logs(60)
            print(f"node logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


async def declare(c, via: str, q: str, arguments: dict) -> None:
    async with aio.open_connection([c.client_addr(via)], reconnect=False) as conn:
        await (await conn.channel()).queue_declare(q, durable=True, arguments=arguments)
    r = await thread(wait_row, c, via, q, lambda r: len(r["synchronised_mirror_pids"]) == 2, 15,
                     f"two synchronised mirrors of {q}")
    assert node_of(r["pid"]) == via, r


def test_a_retry_loop_loses_nothing_and_flags_repeats_when_the_work_queues_leader_is_killed(cluster):
    c = cluster

    async def main():
        await thread(c.ctl_ok, "n1", "set_policy", "ha-dlx", r"^dlx\.",
                     json.dumps({"ha-mode": "all", "ha-sync-mode": "automatic"}))
        await declare(c, "n1", WORK, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": RETRY})
        await declare(c, "n2", RETRY, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": WORK,
                                       "x-message-ttl": RETRY_TTL_MS})
        load = Load(c, WORK, ["n1"], [], rate=300)
        worker = Consumer(load.h, 0, rotate(c.all_client_addrs(), c.client_addr("n1")), WORK,
                          prefetch=50, retries=1)
        load.cons = [worker]
        async with trio.open_nursery() as n:
            await load.start(n)
            await trio.sleep(3.0)
            before = await thread(row, c, "n2", WORK)
            load.fault("kill", "n1", before)
            await thread(c.kill9, "n1")
            await trio.sleep(TICK * 2 + 3)
            await load.finish(n, drain_node="n2")
            n.cancel_scope.cancel()
        v, msg = load.verdict("kill -9 of the work queue's leader in a retry loop")
        assert v.confirmed > 1000, msg
        assert v.lost == 0 and v.ok, msg
        first_pass = Counter(mid for mid, died, flagged in worker.rejections if died == 0 and not flagged)
        twice = sorted(mid for mid, k in first_pass.items() if k > 1)
        assert twice == [], f"rejected twice in their first pass without redelivered: {twice[:10]}"
        assert len(first_pass) >= v.confirmed * 0.9, "the worker did not reject first passes"

    trio.run(main)
