"""The client survives the death of the node it is connected to (real processes, kill -9)."""

from __future__ import annotations

import pytest
import trio

from broker.client import aio
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        yield c


def drop(conn: aio.Connection) -> None:
    """Drop the connection without the graceful close, which currently costs the client its 5 s
    close timeout (see test_process_cluster.test_graceful_close_is_prompt). Call it as the last
    statement inside `async with open_connection(...)`; all publishes were confirmed by then."""
    conn.closing = True
    conn._nursery.cancel_scope.cancel()


def test_client_reconnects_and_keeps_consuming_after_kill9_of_its_node(cluster):
    addrs = {n: cluster.client_addr(n) for n in cluster.names}

    async def publish(bodies):
        async with aio.open_connection([addrs["n3"]], reconnect=False) as pub:
            ch = await pub.channel()
            await ch.confirm_delivery()
            for b in bodies:
                await ch.basic_publish("", "RQ", b)
            assert await ch.wait_for_confirms()
            drop(pub)

    async def main():
        # the durable queue's leader is n1 (declared by a client on n1, client-local placement)
        async with aio.open_connection([addrs["n1"]], reconnect=False) as c1:
            ch = await c1.channel()
            await ch.queue_declare("RQ", durable=True)
            drop(c1)

        reconnected = trio.Event()
        seen_nodes = []

        def on_reconnect(node):
            seen_nodes.append(node)
            reconnected.set()

        async with aio.open_connection([addrs["n2"], addrs["n1"], addrs["n3"]], on_reconnect=on_reconnect,
                                       max_retry_delay=0.5) as conn:
            assert conn.node == "n2"
            ch = await conn.channel()
            await ch.queue_declare("RQ", durable=True)
            consumer = await ch.basic_consume("RQ", auto_ack=True)

            received = []

            async def receive_until(n):
                async for msg in consumer:
                    received.append(msg.body)
                    if len(received) >= n:
                        return

            with trio.fail_after(10):
                await publish([b"before-1", b"before-2"])
                await receive_until(2)
            assert received == [b"before-1", b"before-2"]

            await trio.to_thread.run_sync(cluster.kill9, "n2")
            with trio.fail_after(20):
                await reconnected.wait()
            assert conn.node in ("n1", "n3") and conn.node != "n2"
            assert seen_nodes == [conn.node]
            assert conn.reconnects == 1
            kinds = [e[1] for e in conn.events]
            assert "disconnected" in kinds and "reconnected" in kinds
            assert "recovery-failed" not in kinds, conn.events
            assert consumer.cancelled_reason is None
            assert ch.is_open

            with trio.fail_after(15):
                await publish([b"after-1", b"after-2", b"after-3"])
                await receive_until(5)
            assert received[2:] == [b"after-1", b"after-2", b"after-3"]
            # the server sees the re-created consumer on the node the client now uses
            rows = await trio.to_thread.run_sync(cluster.ctl_json, "n1", "list_consumers")
            assert [r["queue_name"] for r in rows] == ["RQ"]
            await ch.queue_delete("RQ")
            drop(conn)

    trio.run(main)
