"""The demo of `make demo` (broker/demo.py) tells the truth: it kills the node the cluster reports
as the queue's leader, wherever that is, and says so; and a wait that runs out names what it was
waiting for instead of hanging."""

from __future__ import annotations

import pytest
import trio

from broker import demo
from broker.client.aio import open_connection
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        yield c


def test_it_kills_the_actual_leader_and_says_so(cluster, capsys):
    async def declare_on_n2():
        async with open_connection([cluster.client_addr("n2")]) as conn:
            ch = await conn.channel()
            await ch.queue_declare(demo.FAILOVER, durable=True,
                                   arguments={"x-queue-master-locator": "client-local"})

    trio.run(declare_on_n2)  # led by n2, not n1: the demo must not assume n1
    stats = trio.run(demo.failover_demo, cluster, 1.5, 500, 0.5)
    out = capsys.readouterr().out
    assert stats["leader_before"] == "n2"
    assert not cluster.alive("n2") and cluster.alive("n1") and cluster.alive("n3")
    assert "kill -9 of n2 (the leader of demo.failover)" in out
    assert "== killed n2 (pid" in out
    assert stats["leader_after"] in ("n1", "n3")
    assert f"demo.failover is now led by {stats['leader_after']}" in out
    assert "via n1" in out and "via n3" in out  # the load goes through the nodes that survive
    assert stats["lost"] == 0 and stats["confirmed"] == stats["published"] > 0


def test_a_deadline_names_what_it_waited_for():
    async def never():
        with demo.deadline(0.05, lambda: "something that never comes (3 of 4 so far)"):
            await trio.sleep(10)

    with pytest.raises(TimeoutError, match=r"^timed out after 0.05 s waiting for something that "
                                           r"never comes \(3 of 4 so far\)$"):
        trio.run(never)
