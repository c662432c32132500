"""Six failures users met under load, each driven the way it was met: real `warren-server`
processes (tests/cluster_procs.py), publishers with confirms and consumers with manual acks
through `broker.client.aio` with a list of every node, and the verdict of the chaos checker
(bench/chaos/checker.py) on what happened to every message id: every confirmed message
delivered, repeats only with `redelivered`, nothing left unanswered on a live connection,
nothing found only by a second consumer.

Each failure message says which promise broke, with the checker's numbers.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time

import pytest
import trio
from cluster_procs import ProcessCluster

from bench.chaos.checker import Fault, History, Phase, check, spec_allows_loss
from bench.chaos.clients import Consumer, Publisher, rotate
from broker.client import aio
from broker.client.errors import AMQPError

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

TICK = 3.0  # net_ticktime of most tests: short, so a wait for failure detection stays short
CLUSTER_TICK = 10.0  # `python -m broker.localcluster start`'s default, where report 1 was seen
RATE = 2000


@pytest.fixture
def cluster(request):
    yield from _cluster(request, TICK)


@pytest.fixture
def default_tick_cluster(request):
    yield from _cluster(request, CLUSTER_TICK)


def _cluster(request, tick: float):
    tmp = tempfile.mkdtemp(prefix=f"warren-faults-{request.node.name[:40]}-")
    failed_before = request.session.testsfailed
    with ProcessCluster(3, net_ticktime=tick, tmpdir=tmp) as c:
        try:
            yield c
        finally:
            for name in c.names:
                c.sigcont(name)
            if request.session.testsfailed > failed_before:
                c.dump_logs(60)
                print(f"node logs kept in {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)


# --- helpers ---------------------------------------------------------------------------------

def node_of(pid: str) -> str:
    return pid.strip("<>").split(".")[0]


def rows(c: ProcessCluster, on: str) -> list[dict]:
    r = c.ctl(on, "list_queues", "name", "pid", "leader", "mirror_pids", "synchronised_mirror_pids",
              "messages", "state", "--formatter", "json", "-t", "4", timeout=10)
    return json.loads(r.stdout) if r.returncode == 0 else []


def row(c: ProcessCluster, on: str, q: str) -> dict | None:
    return next((r for r in rows(c, on) if r["name"] == q), None)


def wait_row(c, on, q, pred, timeout, what) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = row(c, on, q)
        if last is not None and pred(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g} s; list_queues on {on}: {last}")


async def thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def declare(c: ProcessCluster, via: str, q: str) -> None:
    async with aio.open_connection([c.client_addr(via)], reconnect=False) as conn:
        ch = await conn.channel()
        await ch.queue_declare(q, durable=True)


async def mirrored(c: ProcessCluster, q: str, leader: str, definition: dict, mirrors: int) -> dict:
    """Policy on `q`, declared through `leader` (client-local: it leads), `mirrors` synchronised."""
    await thread(c.ctl_ok, "n1", "set_policy", f"ha-{q}", f"^{q}$", json.dumps(definition))
    await declare(c, leader, q)
    r = await thread(wait_row, c, leader, q, lambda r: len(r["synchronised_mirror_pids"]) >= mirrors,
                     15, f"{mirrors} synchronised mirror(s) of {q}")
    assert node_of(r["pid"]) == leader, r
    return r


class Load:
    """Publishers and consumers on chosen nodes, each with the list of every node (its own
    first), recording one history; then the end of every chaos schedule: stop publishing,
    wait for the last confirms, drain with the same consumers, drain again with a fresh one."""

    def __init__(self, c: ProcessCluster, q: str, publishers: list[str], consumers: list[str],
                 rate: int = RATE, prefetch: int = 500, window: int = 1000, careful: bool = False):
        self.c, self.q = c, q
        self.h = History()
        addrs = c.all_client_addrs()
        per = rate / max(1, len(publishers))
        self.pubs = [Publisher(self.h, i, rotate(addrs, c.client_addr(n)), q, rate=per, window=window,
                               careful=careful)
                     for i, n in enumerate(publishers)]
        self.cons = [Consumer(self.h, i, rotate(addrs, c.client_addr(n)), q, prefetch=prefetch)
                     for i, n in enumerate(consumers)]
        self.prefetch = prefetch

    async def start(self, nursery) -> None:
        for cl in self.cons:
            await nursery.start(cl.run)
        for p in self.pubs:
            await nursery.start(p.run)
        self.h.phases.append(Phase(time.time(), "load"))

    def fault(self, kind: str, target: str, before: dict | None = None, how: str = "crash",
              policy: dict | None = None) -> Fault:
        """Record a fault (with the spec's allowance from the queue's replicas `before` it)."""
        allowed = None
        if before is not None:
            policy = policy or {}
            allowed = spec_allows_loss(node_of(before["pid"]) if before["pid"] else before["leader"],
                                       [node_of(p) for p in before["mirror_pids"]],
                                       [node_of(p) for p in before["synchronised_mirror_pids"]],
                                       {target}, how, policy.get("ha-promote-on-failure", "always"),
                                       policy.get("ha-promote-on-shutdown", "when-synced"))
        f = Fault(time.time(), kind, target, {}, None, allowed)
        self.h.faults.append(f)
        return f

    async def finish(self, nursery, confirm_timeout: float = 10.0, quiet: float = 4.0,
                     drain_node: str = "n1") -> None:
        for p in self.pubs:
            p.stop.set()
        self.h.phases.append(Phase(time.time(), "publish_end"))
        deadline = trio.current_time() + confirm_timeout
        while any(p.unanswered for p in self.pubs) and trio.current_time() < deadline:
            await trio.sleep(0.05)
        self.h.phases.append(Phase(time.time(), "drain1"))
        await self._drain(self.cons, quiet, {x.id for p in self.pubs for x in p.pubs if x.outcome == "ack"})
        self.h.phases.append(Phase(time.time(), "drain1_end"))
        for cl in self.cons:
            cl.stop.set()
        await trio.sleep(0.3)
        self.h.phases.append(Phase(time.time(), "drain2"))
        fresh = Consumer(self.h, len(self.cons), rotate(self.c.all_client_addrs(), self.c.client_addr(drain_node)),
                         self.q, prefetch=self.prefetch)
        try:
            with trio.fail_after(15):
                await nursery.start(fresh.run)
            await self._drain([fresh], 2.0, set())
        except (AMQPError, trio.TooSlowError) as exc:
            self.h.anomalies.append(f"the second consumer could not subscribe through {drain_node}: {exc!r}")
        fresh.stop.set()
        for p in self.pubs:
            p.release.set()
        self.h.phases.append(Phase(time.time(), "end"))
        self.h.publishes = [x for p in self.pubs for x in p.pubs]

    async def _drain(self, consumers, quiet: float, want: set[int]) -> None:
        start = last_change = trio.current_time()
        last = -1
        while trio.current_time() - start < 30:
            total = sum(cl.count for cl in consumers)
            if total != last:
                last, last_change = total, trio.current_time()
            seen = set().union(*(cl.ids for cl in self.cons + consumers))
            if want and want <= seen and trio.current_time() - last_change > 0.3:
                return
            if trio.current_time() - last_change > quiet:
                return
            await trio.sleep(0.05)

    def verdict(self, what: str, tick: float = TICK):
        v = check(self.h, stranded_after=5.0, recovery_grace=2 * tick + 3)
        msg = "\n".join([f"{what}: {v.line()}", *[f"  - {r}" for r in v.reasons],
                         f"  client errors: {[p.errors[:3] for p in self.pubs]} {[c.errors[:3] for c in self.cons]}"])
        print(msg)
        return v, msg


# --- 1. stop_app of the leader, start_app 3 s later ----------------------------------------------

@pytest.mark.parametrize("placement", ["publisher-elsewhere-consumer-on-leader",
                                       "publisher-on-leader-consumer-elsewhere"])
def test_stop_app_and_start_app_of_the_leader_under_load_keeps_confirming_and_delivering(
        default_tick_cluster, placement):
    """After `stop_app` of the leader's node (start_app 3 s later) the queue
    must keep confirming and delivering; every confirmed message reaches the consumer that stayed
    subscribed, and no publish is left without an answer. On `make cluster`'s net_ticktime (10 s),
    as reported (with 3 s the first placement passes today)."""
    c, q = default_tick_cluster, "faults.stopapp"
    pub_node, con_node = ("n2", "n1") if placement.startswith("publisher-elsewhere") else ("n1", "n3")
    policy = {"ha-mode": "all", "ha-sync-mode": "automatic"}

    async def main():
        await mirrored(c, q, "n1", policy, 2)
        load = Load(c, q, [pub_node], [con_node])
        async with trio.open_nursery() as n:
            await load.start(n)
            await trio.sleep(2.0)
            before = await thread(row, c, "n2", q)
            f = load.fault("stop_app", "n1", before, how="shutdown", policy=policy)
            await thread(c.ctl_ok, "n1", "stop_app")
            await trio.sleep(3.0)
            await thread(c.ctl_ok, "n1", "start_app")
            f.t_end = time.time()
            await trio.sleep(3.0)
            await load.finish(n, drain_node="n2")
            n.cancel_scope.cancel()
        v, msg = load.verdict(f"stop_app/start_app of leader n1 ({placement})", CLUSTER_TICK)
        assert f.loss_allowed is None, f"both mirrors were synchronised before the stop: {before}"
        assert v.confirmed > 5000, msg
        assert v.lost == 0, "confirmed messages lost:\n" + msg
        assert v.stuck == 0, "publishes never confirmed nor nacked:\n" + msg
        assert v.stranded == 0 and not v.stranded_consumers, "messages stranded:\n" + msg
        assert v.ok, msg

    trio.run(main)


# --- 2. kill -9 of the node a confirming publisher is connected to --------------------------------

@pytest.mark.parametrize("publisher", ["publishes-at-once", "waits-for-the-client-recovery"])
def test_kill9_of_the_publishers_node_answers_every_publish(cluster, publisher):
    """The publisher's node (a mirror) is killed; the client reconnects and
    keeps publishing; every publish must then be confirmed or nacked (the client nacks the ones
    lost with the connection), none left hanging, and nothing confirmed lost. The application
    publishes as soon as the client is connected again (as the application that met this did), or, the second time,
    only once the client has told it that it recovered its channels (`on_reconnect`): that one
    leaves the client's recovery out and tests the broker alone."""
    c, q = cluster, "faults.pubnode"
    policy = {"ha-mode": "all", "ha-sync-mode": "automatic"}

    async def main():
        await mirrored(c, q, "n1", policy, 2)
        load = Load(c, q, ["n2"], ["n3"], careful=publisher.startswith("waits"))
        async with trio.open_nursery() as n:
            await load.start(n)
            await trio.sleep(2.0)
            before = await thread(row, c, "n1", q)
            f = load.fault("kill", "n2", before, how="crash", policy=policy)
            await thread(c.kill9, "n2")
            await trio.sleep(3.0)
            await thread(c.restart, "n2")
            f.t_end = time.time()
            await trio.sleep(2.0)
            await load.finish(n)
            n.cancel_scope.cancel()
        v, msg = load.verdict(f"kill -9 of the publisher's node n2 ({publisher})")
        reconnects = load.pubs[0].conn.reconnects if load.pubs[0].conn else None
        assert reconnects, f"the publisher never reconnected (reconnects={reconnects}): the test did not test"
        assert v.stuck == 0, "publishes never confirmed nor nacked after the reconnect:\n" + msg
        assert v.lost == 0, "confirmed messages lost:\n" + msg
        assert v.ok, msg

    trio.run(main)


# --- 3. a whole-cluster restart, then publish -------------------------------------------------

def test_after_a_full_cluster_restart_publishes_are_confirmed_and_the_nodes_agree_on_the_leader(cluster):
    """`make demo` twice: a mirrored queue fails over (kill -9 of its
    leader), the nodes still running are stopped with SIGTERM, and all three start again;
    then publishes with confirms must be confirmed, the nodes must agree on the leader and that
    leader must run it, and the new messages must be delivered. (What the queue held before the
    full restart may be lost: the broker is in-memory.)"""
    c, q = cluster, "faults.restart"

    async def main():
        await mirrored(c, q, "n1", {"ha-mode": "all"}, 2)
        async with aio.open_connection([c.client_addr("n2")], reconnect=False) as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            for i in range(2000):
                ch.publish_nowait(q, i.to_bytes(8, "big"))
            assert await ch.wait_for_confirms(timeout=10)
        await thread(c.kill9, "n1")
        await thread(wait_row, c, "n2", q, lambda r: r["pid"] and node_of(r["pid"]) != "n1", 10,
                     "a promotion after kill -9 of n1")
        for n in ("n2", "n3"):  # the end of the first `make demo`: SIGTERM of what still runs
            code = await thread(c.sigterm, n)
            assert code == 0, f"SIGTERM of {n}: exit code {code}"
        for n in c.names:  # the second `make demo` starts the three nodes on the same data
            await thread(c.restart, n)
        await thread(c.wait_running, "n1", {"n1", "n2", "n3"}, 20)

        views = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            views = {n: await thread(row, c, n, q) for n in c.names}
            if all(v and v["pid"] for v in views.values()) and \
                    len({(v["leader"], node_of(v["pid"])) for v in views.values()}) == 1 and \
                    all(v["leader"] == node_of(v["pid"]) for v in views.values()):
                break
            await trio.sleep(0.3)
        assert all(v and v["pid"] for v in views.values()), f"no running leader after the restart: {views}"
        leaders = {(v["leader"], node_of(v["pid"])) for v in views.values()}
        assert len(leaders) == 1 and all(a == b for a, b in leaders), \
            f"the metadata's leader and the replica acting as leader disagree: {views}"

        # the second `make demo`: declare again through n1, publish with confirms, consume
        n_msgs = 2000
        ids = set(range(10_000, 10_000 + n_msgs))
        async with aio.open_connection([c.client_addr("n1"), c.client_addr("n2")], reconnect=False) as conn:
            ch = await conn.channel()
            with trio.move_on_after(10):
                await ch.queue_declare(q, durable=True)
            await ch.confirm_delivery()
            for i in sorted(ids):
                ch.publish_nowait(q, i.to_bytes(8, "big"))
            ok = None
            with trio.move_on_after(15):
                ok = await ch.wait_for_confirms()
            assert ok is not None, (f"wait_for_confirms still waiting 15 s after publishing {n_msgs} "
                                    f"messages ({len(ch.outstanding)} unanswered); list_queues: {views}")
            assert ok, f"publishes nacked after the restart: {ch.nacked[:3]}"
        got: set[int] = set()
        async with aio.open_connection([c.client_addr("n3")], reconnect=False) as conn:
            ch = await conn.channel()
            await ch.basic_qos(500)
            consumer = await ch.basic_consume(q)
            with trio.move_on_after(15):
                async for msg in consumer:
                    got.add(int.from_bytes(msg.body[:8], "big"))
                    ch.basic_ack(msg.delivery_tag)
                    if ids <= got:
                        break
        assert ids <= got, f"{len(ids - got)} of the {n_msgs} messages confirmed after the restart never delivered"

    trio.run(main)


# --- 4. queue.declare right after kill -9 of the leader -------------------------------------------

def test_declare_through_a_survivor_right_after_kill9_of_the_leader_is_answered(default_tick_cluster):
    """The queue exists (ha-mode all, one confirmed message); kill -9 of its
    leader; a `queue.declare` through a surviving node at once must be answered (declare-ok,
    after the promotion), and the message must still be there. On `make cluster`'s net_ticktime
    as reported (a fresh cluster there promotes late, which leaves the declare no chance to
    arrive after the promotion by luck)."""
    c, q = default_tick_cluster, "faults.declare"

    async def main():
        await mirrored(c, q, "n1", {"ha-mode": "all"}, 2)
        async with aio.open_connection([c.client_addr("n2")], reconnect=False) as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            await ch.basic_publish("", q, (7).to_bytes(8, "big"))
            assert await ch.wait_for_confirms(timeout=10)
        async with aio.open_connection([c.client_addr("n2")], reconnect=False) as conn:
            ch = await conn.channel()
            await thread(c.kill9, "n1")
            t = trio.current_time()
            answer = None
            with trio.move_on_after(CLUSTER_TICK + 5):
                answer = await ch.queue_declare(q, durable=True)
            took = trio.current_time() - t
            assert answer is not None, f"queue.declare through n2 unanswered {took:.1f} s after kill -9 of the leader n1"
            assert answer.message_count == 1, answer
            got = None
            with trio.move_on_after(5):
                got = await ch.basic_get(q, auto_ack=True)
            assert got is not None and int.from_bytes(got.body[:8], "big") == 7, got

    trio.run(main)


# --- 5. stop_app/start_app of one node, then of the other (a `nodes` policy) ----------------------

def test_restarting_both_nodes_of_a_nodes_policy_in_turn_leaves_a_mirror_and_agreement(cluster):
    """A queue on {"ha-mode":"nodes","ha-params":["n1","n2"],
    "ha-promote-on-shutdown":"always"} with 20,000 confirmed messages, a client on n3; restart
    (stop_app, start_app) the leader's node, wait for the failover, restart the other. Then the
    queue must have its mirror back within a few seconds, every node must list the same leader
    and mirrors, and it must take and deliver new messages. (Messages may be lost here: the
    spec promotes an unsynchronised mirror on shutdown with ha-promote-on-shutdown always.)"""
    c, q = cluster, "faults.nodes"
    policy = {"ha-mode": "nodes", "ha-params": ["n1", "n2"], "ha-promote-on-shutdown": "always"}

    async def main():
        await mirrored(c, q, "n1", policy, 1)
        async with aio.open_connection([c.client_addr("n3")], reconnect=False) as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            for i in range(20_000):
                ch.publish_nowait(q, i.to_bytes(8, "big") + b"x" * 100)
            assert await ch.wait_for_confirms(timeout=30)
        # restart the leader's node, wait for the failover, then restart the other
        await thread(c.ctl_ok, "n1", "stop_app")
        await thread(wait_row, c, "n3", q, lambda r: r["pid"] and node_of(r["pid"]) == "n2", 10,
                     "the failover to n2 after stop_app of n1")
        await trio.sleep(1.0)
        await thread(c.ctl_ok, "n1", "start_app")
        await thread(wait_row, c, "n3", q, lambda r: [node_of(p) for p in r["mirror_pids"]] == ["n1"], 10,
                     "n1 back as a mirror after its start_app")
        await trio.sleep(1.0)
        await thread(c.ctl_ok, "n2", "stop_app")
        await trio.sleep(1.0)
        await thread(c.ctl_ok, "n2", "start_app")
        t = time.monotonic()
        views: dict = {}
        while time.monotonic() - t < 10:
            views = {n: await thread(row, c, n, q) for n in c.names}
            shapes = {(v["leader"], tuple(map(node_of, v["mirror_pids"]))) if v else None for v in views.values()}
            if len(shapes) == 1 and None not in shapes and all(v["pid"] and v["mirror_pids"] for v in views.values()):
                break
            await trio.sleep(0.3)
        took = time.monotonic() - t
        assert all(v and v["mirror_pids"] for v in views.values()), \
            f"the queue has no mirror {took:.0f} s after restarting n2: {views}"
        shapes = {n: (v["leader"], [node_of(p) for p in v["mirror_pids"]]) for n, v in views.items()}
        assert len({json.dumps(x) for x in shapes.values()}) == 1, f"the nodes disagree on leader/mirrors: {shapes}"
        leader, mirrors = next(iter(shapes.values()))
        assert {leader, *mirrors} == {"n1", "n2"}, shapes
        # it still works: a new message is confirmed and delivered
        async with aio.open_connection([c.client_addr("n3")], reconnect=False) as conn:
            ch = await conn.channel()
            await ch.queue_purge(q)
            await ch.confirm_delivery()
            await ch.basic_publish("", q, (99_999).to_bytes(8, "big"))
            assert await ch.wait_for_confirms(timeout=10), "a publish after both restarts was not confirmed"
            got = await ch.basic_get(q, auto_ack=True)
            assert got is not None and int.from_bytes(got.body[:8], "big") == 99_999

    trio.run(main)


# --- 6. the failover pause of kill -9 of the leader ---------------------------------------------

FAILOVER_GAP_LIMIT = 0.2  # README: 69 ms measured; the aim: under 100 ms at p99


def test_failover_pause_after_kill9_of_the_leader_of_a_fresh_cluster_is_short(tmp_path):
    """`make demo`'s failover (a cluster started seconds before, the default
    net_ticktime of `make cluster`, 10 s) under 2,000 msgs/s: the longest pause in deliveries
    around kill -9 of the leader must stay well under a second (the README claims 69 ms; the
    aim is 100 ms at p99; a run allows 200 ms for the noise of a shared 2-core
    machine), and the checker must find nothing lost.

    The pause is a tail figure and this is one sample of it: a run on a machine that stalled
    (in one full suite on this 2-core VM it paused 238 ms, 0.4 s after a 20 ms failover; eight
    reruns alone gave 14-22 ms) gets a second run on a fresh cluster, and the test fails when
    both are slow.
    A lost message fails at once."""
    gaps = []
    for attempt in (1, 2):
        gap, at, v, msg = _failover_gap(tmp_path / f"run{attempt}")
        assert v.lost == 0 and v.ok, msg
        gaps.append(f"{gap * 1000:.0f} ms (from {at:+.3f} s after the kill)")
        if gap < FAILOVER_GAP_LIMIT:
            return
        print(f"run {attempt}: deliveries paused {gaps[-1]}")
    raise AssertionError(f"deliveries paused {' then '.join(gaps)} around kill -9 of the leader, in two "
                         f"fresh clusters; limit {FAILOVER_GAP_LIMIT * 1000:.0f} ms\n{msg}")


def _failover_gap(tmp_path):
    """One fresh cluster, kill -9 of the leader under load: (the longest pause between two
    deliveries around the kill, when it began after the kill, the checker's verdict, its text)."""
    tmp_path.mkdir()
    with ProcessCluster(3, net_ticktime=10.0, tmpdir=str(tmp_path)) as c:
        q = "faults.gap"
        policy = {"ha-mode": "all"}

        async def main():
            await mirrored(c, q, "n1", policy, 2)
            load = Load(c, q, ["n2"], ["n3"], prefetch=200)
            async with trio.open_nursery() as n:
                await load.start(n)
                await trio.sleep(1.5)
                before = await thread(row, c, "n2", q)
                f = load.fault("kill", "n1", before, how="crash", policy=policy)
                await thread(c.kill9, "n1")
                f.t_end = time.time()
                await trio.sleep(3.0)
                await load.finish(n, drain_node="n2")
                n.cancel_scope.cancel()
            return load, f

        load, f = trio.run(main)
        v, msg = load.verdict("kill -9 of leader n1 in a fresh cluster", 10.0)
        times = sorted(d.t for d in load.h.deliveries)
        gaps = [(b - a, a) for a, b in zip(times, times[1:]) if b >= f.t - 0.2 and a <= f.t + 10]
        gap, at = max(gaps, default=(float("nan"), 0.0))
        if not gap < FAILOVER_GAP_LIMIT:
            c.dump_logs(30)
        return gap, at - f.t, v, msg
