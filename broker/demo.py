"""The failover part of the README's first command: a mirrored queue loses its leader's node
(kill -9) while a publisher and a consumer run, and the summary shows what happened to every
message. `broker.localcluster demo` runs it on the local 3-node cluster it started.
"""

from __future__ import annotations

import time

import trio

from broker.client.aio import open_connection

QUEUE = "demo.failover"


async def failover_demo(cluster, seconds: float = 4.0, rate: int = 5000, kill_at: float = 1.5) -> dict:
    """Publish ids at `rate` msgs/s via n2 (confirms), consume via n3 (manual acks), kill -9 the
    leader's node n1 at `kill_at`; returns and prints the summary."""
    print(cluster.ctl_ok("n1", "set_policy", "ha-demo", r"^demo\.", '{"ha-mode":"all"}'))
    stats = {"published": 0, "confirmed": 0, "nacked": 0, "delivered": 0, "redelivered": 0,
             "duplicates": 0, "lost": 0, "gap_ms": 0.0}
    confirmed: set[int] = set()
    seen: set[int] = set()
    times: list[float] = []
    async with open_connection([cluster.client_addr("n1")]) as setup:
        ch = await setup.channel()
        await ch.queue_declare(QUEUE, durable=True, arguments={"x-queue-master-locator": "client-local"})
    with trio.fail_after(10):
        while True:
            rows = cluster.ctl_json("n1", "list_queues", "name", "synchronised_mirror_pids")
            if any(r["name"] == QUEUE and len(r["synchronised_mirror_pids"]) == 2 for r in rows):
                break
            await trio.sleep(0.05)
    print(cluster.ctl_ok("n1", "list_queues", "name", "policy", "pid", "mirror_pids",
                         "synchronised_mirror_pids"))
    publishing_done = trio.Event()
    async with open_connection([cluster.client_addr("n2"), cluster.client_addr("n3")]) as pconn, \
            open_connection([cluster.client_addr("n3"), cluster.client_addr("n2")]) as cconn:
        pub = await pconn.channel()
        await pub.confirm_delivery()

        def on_confirm(first, last, ok, reason):
            if ok:
                confirmed.update(range(first, last + 1))
            else:
                stats["nacked"] += last - first + 1

        pub.on_confirm = on_confirm
        sub = await cconn.channel()
        await sub.basic_qos(200)
        consumer = await sub.basic_consume(QUEUE)
        t0 = time.monotonic()

        async def publisher():
            n = 0
            while (elapsed := time.monotonic() - t0) < seconds:
                due = int(elapsed * rate)
                while n < due:
                    n += 1
                    await pub.basic_publish("", QUEUE, n.to_bytes(8, "big") + b"." * 1016)
                await trio.sleep(0.005)
            stats["published"] = n
            with trio.move_on_after(10):
                await pub.wait_for_confirms()
            publishing_done.set()

        async def consumer_task():
            async for msg in consumer:
                mid = int.from_bytes(msg.body[:8], "big")
                times.append(time.monotonic())
                stats["delivered"] += 1
                if msg.redelivered:
                    stats["redelivered"] += 1
                if mid in seen:
                    stats["duplicates"] += 1
                seen.add(mid)
                sub.basic_ack(msg.delivery_tag)
                if publishing_done.is_set() and confirmed <= seen:
                    return

        async def killer():
            await trio.sleep(kill_at)
            print(f"== kill -9 n1 (the leader of {QUEUE}) at t={kill_at:.1f} s")
            cluster.kill9("n1")
            stats["killed_at"] = time.monotonic()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher)
            nursery.start_soon(killer)
            with trio.move_on_after(seconds + 20):
                await consumer_task()
            nursery.cancel_scope.cancel()
    stats["confirmed"] = len(confirmed)
    stats["lost"] = len(confirmed - seen)
    killed = stats.pop("killed_at", None)
    if killed is not None and times:
        around = [t for t in times if killed - 1 <= t <= killed + 10]
        gaps = [b - a for a, b in zip(around, around[1:])]
        stats["gap_ms"] = round(max(gaps, default=0.0) * 1000, 1)
    print(f"published {stats['published']}, confirmed {stats['confirmed']}, nacked {stats['nacked']}, "
          f"delivered {stats['delivered']} ({len(seen)} distinct), redelivered {stats['redelivered']}, "
          f"duplicates {stats['duplicates']}, lost {stats['lost']} (confirmed but never delivered); "
          f"longest pause in deliveries around the kill: {stats['gap_ms']} ms")
    print(cluster.ctl_ok("n2", "list_queues", "name", "policy", "pid", "mirror_pids",
                         "synchronised_mirror_pids", "messages"))
    return stats
