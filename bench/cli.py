"""`warren-bench`: benchmark commands (not tests).

    warren-bench throughput [--seconds 10] [--size 1024] [--window 2000] [--prefetch 1000]

starts a one-node cluster of real processes (or uses `--nodes HOST:PORT`), runs one publisher
with pipelined confirms (at most --window unconfirmed) and one consumer with manual acks on one
non-mirrored queue, both at once, and prints msgs/s for each.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import trio

from broker import localcluster
from broker.client.aio import open_connection


async def throughput(nodes: list[str], seconds: float, size: int, window: int, prefetch: int) -> dict:
    body = b"x" * size
    queue = f"bench.{os.getpid()}"
    stats = {"published": 0, "confirmed": 0, "consumed": 0}
    async with open_connection(nodes) as pconn, open_connection(nodes) as cconn:
        pch = await pconn.channel()
        await pch.queue_declare(queue)
        await pch.confirm_delivery()
        room = trio.Semaphore(window)

        def on_confirm(first, last, ok, reason):
            n = last - first + 1
            stats["confirmed"] += n
            for _ in range(n):
                room.release()

        pch.on_confirm = on_confirm
        cch = await cconn.channel()
        await cch.basic_qos(prefetch)
        consumer = await cch.basic_consume(queue)
        deadline = trio.current_time() + seconds

        async def publish():
            while trio.current_time() < deadline:
                for _ in range(100):
                    await room.acquire()
                    pch.publish_nowait(queue, body)
                stats["published"] += 100

        async def consume():
            async for msg in consumer:
                stats["consumed"] += 1
                cch.basic_ack(msg.delivery_tag)

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            n.start_soon(consume)
            await publish()
            with trio.move_on_after(10):
                await pch.wait_for_confirms()
            while stats["consumed"] < stats["published"] and trio.current_time() < deadline + 10:
                await trio.sleep(0.05)
            elapsed = time.perf_counter() - t0
            n.cancel_scope.cancel()
        await cch.queue_delete(queue)
    return {
        "size": size, "seconds": round(elapsed, 2), **stats,
        "publish_confirm_msgs_per_s": round(stats["confirmed"] / elapsed),
        "consume_ack_msgs_per_s": round(stats["consumed"] / elapsed),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="warren-bench")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput", help="one non-mirrored queue: publish with confirms, consume with acks")
    t.add_argument("--seconds", type=float, default=10.0)
    t.add_argument("--size", type=int, default=1024)
    t.add_argument("--window", type=int, default=2000, help="max unconfirmed publishes")
    t.add_argument("--prefetch", type=int, default=1000)
    t.add_argument("--nodes", help="use a running node (HOST:CLIENT_PORT) instead of starting one")
    args = p.parse_args(argv)
    if args.nodes:
        result = trio.run(throughput, args.nodes.split(","), args.seconds, args.size, args.window, args.prefetch)
    else:
        home = Path(tempfile.mkdtemp(prefix="warren-bench-"))
        # Free ports: a `make cluster` (or another engineer's) on 5691.. may be running.
        with localcluster.LocalCluster(home, 1, free_ports=True) as cluster:
            result = trio.run(throughput, cluster.all_client_addrs(), args.seconds, args.size,
                              args.window, args.prefetch)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
