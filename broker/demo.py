"""The demo that `make demo` (`python -m broker.localcluster demo`) runs on a local 3-node cluster
of its own (var/demo, wiped at each start, so that every run tells the same story): publish and
consume through the client, then kill -9 the leader of a mirrored queue under load and show what
happened to every message.

Two rules keep it honest. Every wait has a deadline, and running out of one raises a TimeoutError
that names what was awaited (the command line prints it as one line). Every message it prints is
read from the cluster or the clients, never assumed: the leader it kills is the one the cluster
reports for the queue, and the node a connection went through is the one it reached.
"""

from __future__ import annotations

import contextlib
import time

import trio

from broker.client.aio import open_connection

ORDERS = "demo.orders"
FAILOVER = "demo.failover"


class Step:
    """What a phase of the demo is waiting for right now (named by a deadline that runs out)."""

    def __init__(self, what: str = ""):
        self.what = what

    def __call__(self) -> str:
        return self.what


@contextlib.contextmanager
def deadline(seconds: float, what):
    """Fail with TimeoutError("timed out after N s waiting for WHAT") when the block takes longer;
    `what` may be a callable, called at that moment (to say how far it got)."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        text = what() if callable(what) else what
        raise TimeoutError(f"timed out after {seconds:g} s waiting for {text}") from None


def queue_row(cluster, node: str, queue: str, *columns: str) -> dict:
    """The list_queues row of `queue` as `node` sees it (RuntimeError if it has none)."""
    rows = cluster.ctl_json(node, "list_queues", "name", *columns)
    for row in rows:
        if row["name"] == queue:
            return row
    raise RuntimeError(f"node {node} lists no queue {queue!r}")


def show(text: str) -> None:
    """Print a warrenctl listing, with one blank line after it."""
    print(text.rstrip("\n") + "\n")


def running_nodes(cluster, node: str) -> list[str]:
    return sorted(cluster.cluster_status(node)["running_nodes"])


async def basics(cluster, count: int = 10_000) -> None:
    """Publish `count` x 1 KiB with confirms through n1, then consume them with manual acks
    through a node other than the queue's leader, and show the queue on both sides."""
    first = cluster.names[0]
    step = Step(f"{first} to accept a client connection")
    with deadline(45, step):
        async with open_connection([cluster.client_addr(first)]) as pub_conn:
            step.what = f"{first} to declare {ORDERS}"
            pub = await pub_conn.channel()
            await pub.queue_declare(ORDERS, durable=True)
            await pub.confirm_delivery()
            step.what = f"the confirms of {count:,} publishes to {ORDERS}"
            t0 = time.perf_counter()
            for i in range(count):
                await pub.basic_publish("", ORDERS, b"order-%d" % i + b"." * 1000)
            ok = await pub.wait_for_confirms()
            t1 = time.perf_counter()
            print(f"published {count:,} x 1 KiB to {ORDERS} via {pub_conn.node} with confirms: "
                  f"{'all confirmed' if ok else 'some were NACKED'}, {count / (t1 - t0):,.0f} msgs/s")
            step.what = f"{pub_conn.node} to close the connection"
    show(cluster.ctl_ok(first, "list_queues", "name", "durable", "leader", "pid", "messages", "consumers"))
    leader = queue_row(cluster, first, ORDERS, "leader")["leader"]
    via = [n for n in reversed(cluster.names) if n != leader] or [leader]
    got = 0
    step = Step(f"{' or '.join(via)} to accept a client connection")
    with deadline(45, lambda: step.what.format(got=got)):
        async with open_connection([cluster.client_addr(n) for n in via]) as sub_conn:
            step.what = f"a consumer on {ORDERS}"
            sub = await sub_conn.channel()
            await sub.basic_qos(500)
            consumer = await sub.basic_consume(ORDERS)
            step.what = f"{count:,} deliveries from {ORDERS} ({{got:,}} so far)"
            t1 = time.perf_counter()
            async for msg in consumer:
                got += 1
                sub.basic_ack(msg.delivery_tag)
                if got == count:
                    break
            t2 = time.perf_counter()
            print(f"consumed {got:,} via {sub_conn.node} (the queue's leader is {leader}) with manual "
                  f"acks: {got / (t2 - t1):,.0f} msgs/s")
            await trio.sleep(0.2)
            step.what = f"{sub_conn.node} to close the connection"
            show(cluster.ctl_ok(sub_conn.node, "list_queues", "name", "durable", "policy", "leader", "pid",
                                "mirror_pids", "synchronised_mirror_pids", "messages",
                                "messages_unacknowledged", "consumers"))


class FailoverTally:
    """What the failover run saw: the publishes confirmed or nacked, every delivery (its id, the
    moment it arrived, whether it was a repeat), when the leader was killed, and what was cut
    short."""

    def __init__(self):
        self.stats = {"published": 0, "confirmed": 0, "nacked": 0, "delivered": 0, "redelivered": 0,
                      "duplicates": 0, "lost": 0, "gap_ms": 0.0}
        self.confirmed: set[int] = set()
        self.seen: set[int] = set()
        self.times: list[float] = []
        self.notes: list[str] = []
        self.killed_at: list[float] = []

    def on_confirm(self, first_tag, last_tag, ok, reason) -> None:
        if ok:
            self.confirmed.update(range(first_tag, last_tag + 1))
        else:
            self.stats["nacked"] += last_tag - first_tag + 1

    def delivered(self, msg) -> None:
        mid = int.from_bytes(msg.body[:8], "big")
        self.times.append(time.monotonic())
        self.stats["delivered"] += 1
        if msg.redelivered:
            self.stats["redelivered"] += 1
        if mid in self.seen:
            self.stats["duplicates"] += 1
        self.seen.add(mid)

    def finish(self) -> None:
        """Count the confirmed and the lost, and the longest pause in deliveries around the kill."""
        stats = self.stats
        stats["confirmed"] = len(self.confirmed)
        stats["lost"] = len(self.confirmed - self.seen)
        if self.killed_at and self.times:
            around = [t for t in self.times if self.killed_at[0] - 1 <= t <= self.killed_at[0] + 10]
            gaps = [b - a for a, b in zip(around, around[1:])]
            stats["gap_ms"] = round(max(gaps, default=0.0) * 1000, 1)


async def failover_demo(cluster, seconds: float = 4.0, rate: int = 5000, kill_at: float = 1.5) -> dict:
    """A queue mirrored to every node: publish ids at `rate` msgs/s (confirms) and consume them
    (manual acks) through the two nodes that do not lead it, kill -9 the leader's node at
    `kill_at`, and report what happened to every message. Returns the summary."""
    running, leader = await _mirrored_queue(cluster)
    if leader not in cluster.procs or not cluster.alive(leader):
        raise RuntimeError(f"{FAILOVER} is led by {leader}, which is not a running node this demo "
                           f"started: it kills only its own nodes")
    others = [n for n in running if n != leader and n in cluster.procs]
    if not others:
        raise RuntimeError(f"only {leader} runs: a failover needs a second running node")
    print(f"== publishing {rate:,} msgs/s for {seconds:g} s via {others[0]}, consuming via "
          f"{others[-1]}; kill -9 of {leader} (the leader of {FAILOVER}) at t={kill_at:g} s")
    tally = FailoverTally()
    await _publish_consume_and_kill(cluster, tally, others, leader, seconds, rate, kill_at)
    tally.finish()
    _report_failover(cluster, tally, others[0], leader)
    return tally.stats


async def _mirrored_queue(cluster) -> tuple[list[str], str]:
    """Declare FAILOVER under a policy mirroring it to every node and wait until all its mirrors
    are synchronised: the running nodes and the queue's leader."""
    first = cluster.names[0]
    cluster.ctl_ok(first, "set_policy", "ha-demo", r"^demo\.", '{"ha-mode":"all"}')
    print("policy ha-demo: queues matching ^demo\\. are mirrored to every node (ha-mode all)")
    with deadline(30, f"{first} to declare {FAILOVER}"):
        async with open_connection([cluster.client_addr(first)]) as setup:
            ch = await setup.channel()
            await ch.queue_declare(FAILOVER, durable=True, arguments={"x-queue-master-locator": "client-local"})
    running = running_nodes(cluster, first)
    want = len(running) - 1
    row: dict = {}

    def mirrors_so_far() -> str:
        return (f"{FAILOVER} to have {want} synchronised mirrors (it has "
                f"{len(row.get('synchronised_mirror_pids', []))} of {len(row.get('mirror_pids', []))})")

    with deadline(20, mirrors_so_far):
        while True:
            row = queue_row(cluster, first, FAILOVER, "leader", "mirror_pids", "synchronised_mirror_pids")
            if len(row["synchronised_mirror_pids"]) >= want:
                break
            await trio.sleep(0.1)
    show(cluster.ctl_ok(first, "list_queues", "name", "policy", "leader", "pid", "mirror_pids",
                         "synchronised_mirror_pids"))
    return running, row["leader"]


async def _publish_consume_and_kill(cluster, tally: FailoverTally, others: list[str], leader: str,
                                    seconds: float, rate: int, kill_at: float) -> None:
    """Publish for `seconds` through `others[0]`, consume through `others[-1]`, kill -9 `leader`
    at `kill_at`; end once every confirmed message is delivered, or a drain time after."""
    pub_nodes = [cluster.client_addr(n) for n in others]
    sub_nodes = list(reversed(pub_nodes))
    publishing_done = trio.Event()
    drain = 20.0
    step = Step(f"connections to {others[0]} (publisher) and {others[-1]} (consumer)")
    with deadline(seconds + drain + 45, step):
        async with open_connection(pub_nodes) as pconn, open_connection(sub_nodes) as cconn:
            step.what = f"a publisher with confirms and a consumer on {FAILOVER}"
            pub = await pconn.channel()
            await pub.confirm_delivery()
            pub.on_confirm = tally.on_confirm
            sub = await cconn.channel()
            await sub.basic_qos(200)
            consumer = await sub.basic_consume(FAILOVER)
            t0 = time.monotonic()

            async def publisher():
                n = 0
                while (elapsed := time.monotonic() - t0) < seconds:
                    due = int(elapsed * rate)
                    while n < due:
                        n += 1
                        await pub.basic_publish("", FAILOVER, n.to_bytes(8, "big") + b"." * 1016)
                    await trio.sleep(0.005)
                tally.stats["published"] = n
                with trio.move_on_after(10) as waited:
                    await pub.wait_for_confirms()
                if waited.cancelled_caught:
                    tally.notes.append(f"stopped waiting for confirms after 10 s: "
                                       f"{n - len(tally.confirmed) - tally.stats['nacked']:,} "
                                       f"publishes never confirmed")
                publishing_done.set()

            async def consumer_task():
                async for msg in consumer:
                    tally.delivered(msg)
                    sub.basic_ack(msg.delivery_tag)

            async def until_all_delivered(scope):
                """Every confirmed message delivered: a last half second for late repeats."""
                await publishing_done.wait()
                while not tally.confirmed <= tally.seen:
                    await trio.sleep(0.05)
                await trio.sleep(0.5)
                scope.cancel()

            async def killer():
                await trio.sleep(kill_at)
                pid = cluster.procs[leader].pid
                cluster.kill9(leader)
                tally.killed_at.append(time.monotonic())
                print(f"== killed {leader} (pid {pid}) with SIGKILL at t={tally.killed_at[0] - t0:.1f} s")

            step.what = (f"the failover run to end ({seconds:g} s of publishing, then at most "
                         f"{drain:g} s of deliveries)")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publisher)
                nursery.start_soon(killer)
                with trio.move_on_after(seconds + drain) as draining:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(until_all_delivered, inner.cancel_scope)
                        await consumer_task()
                if draining.cancelled_caught:
                    tally.notes.append(f"stopped waiting for deliveries {seconds + drain:g} s after "
                                       f"the start: {len(tally.confirmed - tally.seen):,} confirmed "
                                       f"messages were not delivered by then")
                nursery.cancel_scope.cancel()
            step.what = "the publisher's and the consumer's connections to close"


def _report_failover(cluster, tally: FailoverTally, survivor: str, leader: str) -> None:
    """Print the counts and which node leads FAILOVER now; record the leaders in the stats."""
    stats = tally.stats
    for note in tally.notes:
        print(note)
    print(f"published {stats['published']:,}, confirmed {stats['confirmed']:,}, nacked "
          f"{stats['nacked']:,}, delivered {stats['delivered']:,} ({len(tally.seen):,} distinct), "
          f"redelivered {stats['redelivered']:,}, duplicates {stats['duplicates']:,}, lost "
          f"{stats['lost']:,} (confirmed but never delivered); longest pause in deliveries around "
          f"the kill: {stats['gap_ms']} ms")
    after = queue_row(cluster, survivor, FAILOVER, "leader")["leader"]
    if after == leader:
        print(f"{FAILOVER} is still led by {leader} (down): no mirror was promoted")
    else:
        print(f"{FAILOVER} is now led by {after} (a mirror promoted when {leader} went down)")
    stats["leader_before"], stats["leader_after"] = leader, after
    show(cluster.ctl_ok(survivor, "list_queues", "name", "policy", "leader", "pid", "mirror_pids",
                         "synchronised_mirror_pids", "messages"))


def run(cluster) -> None:
    """The whole demo on a started cluster (the caller stops it)."""
    show(cluster.ctl_ok(cluster.names[0], "cluster_status"))

    async def main():
        await basics(cluster)
        print("== failover: a queue mirrored to every node loses its leader under load")
        await failover_demo(cluster)

    try:
        trio.run(main)
    except BaseExceptionGroup as group:  # a nursery's single error: raise it as itself
        while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
            group = group.exceptions[0]
        raise group from None
