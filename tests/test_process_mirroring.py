"""Classic mirroring against real failures of real `warren-server` processes.

Each test starts its own 3-node cluster (n1 leads every queue: it is declared by a client on n1,
client-local placement) with a short net_ticktime, runs a publisher with confirms and a consumer
with manual acks, and then breaks a node for real: `kill -9`, SIGSTOP/SIGCONT or `stop_app`.
Every body starts with an 8-byte big-endian id; afterwards the chaos checker
(bench/chaos/checker.py) judges by id: every confirmed id delivered, every repeat flagged
`redelivered`, repeats only for what was unacknowledged when the node failed, and the ids the
consumer held back unacknowledged redelivered after a failover.
"""

from __future__ import annotations

import itertools
import json
import shutil
import struct
import sys
import tempfile
import time

import pytest
import trio
from cluster_procs import ProcessCluster

from bench.chaos.checker import Delivery, History, Publish, check
from broker.client import aio
from broker.client.errors import ChannelClosedByBroker

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

TICK = 3.0  # net_ticktime of every node, seconds
PAD = b"x" * 120
GAP_LIMIT = 0.2  # s: README measures 69 ms for kill -9 of the leader; the aim is < 100 ms p99
HOLD = frozenset(range(1, 6))  # ids the consumers leave unacknowledged until they come back


@pytest.fixture
def cluster(request):
    # not tmp_path: pytest prunes /tmp/pytest-of-<user> from other sessions running concurrently
    tmp = tempfile.mkdtemp(prefix=f"warren-mirroring-{request.node.name[:40]}-")
    failed_before = request.session.testsfailed
    with ProcessCluster(3, net_ticktime=TICK, tmpdir=tmp) as c:
        try:
            yield c
        finally:
            for name in c.names:  # a stopped node must not outlive its test
                c.sigcont(name)
            if request.session.testsfailed > failed_before:
                c.dump_logs(80)
                print(f"node logs kept in {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)


# --- helpers ---------------------------------------------------------------------------------

def body(i: int) -> bytes:
    return struct.pack(">Q", i) + PAD


def msg_id(b: bytes) -> int:
    return struct.unpack(">Q", b[:8])[0]


def pid_node(pid: str) -> str:
    """'<n2.7.0>' -> 'n2'"""
    return pid.strip("<>").split(".")[0]


def queue_row(c: ProcessCluster, on: str, q: str) -> dict:
    rows = c.ctl_json(on, "list_queues", "name", "pid", "mirror_pids", "synchronised_mirror_pids",
                      "messages")
    return next(r for r in rows if r["name"] == q)


def wait_row(c: ProcessCluster, on: str, q: str, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    row = None
    while time.monotonic() < deadline:
        r = c.ctl(on, "list_queues", "name", "pid", "mirror_pids", "synchronised_mirror_pids",
                  "messages", "--formatter", "json", "-t", "3")
        if r.returncode == 0:
            row = next((x for x in json.loads(r.stdout) if x["name"] == q), None)
            if row is not None and pred(row):
                return row
        time.sleep(0.05)
    raise AssertionError(f"list_queues on {on} never satisfied the condition; last row {row}")


async def ctl(c: ProcessCluster, fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


class Publisher:
    """Publishes ids 1, 2, ... at about `rate` msgs/s with confirms; records every confirm."""

    def __init__(self, c: ProcessCluster, node: str, queue: str, rate: int = 2000,
                 reconnect_to: tuple[str, ...] = ()):
        self.c, self.node, self.queue, self.rate = c, node, queue, rate
        self.reconnect_to = reconnect_to  # other nodes to reconnect to (none: no reconnection)
        self.next_id = 1
        self.confirmed: set[int] = set()
        self.confirm_times: list[tuple[float, int]] = []  # (time, how many ids confirmed)
        self.nacked: list[tuple[int, int, str]] = []
        self.stop = trio.Event()
        self.done = trio.Event()
        self.conn = None

    def on_confirm(self, first: int, last: int, ok: bool, reason: str) -> None:
        if ok:
            self.confirmed.update(range(first, last + 1))
            self.confirm_times.append((trio.current_time(), last - first + 1))
        else:
            self.nacked.append((first, last, reason))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        nodes = [self.c.client_addr(n) for n in (self.node, *self.reconnect_to)]
        async with aio.open_connection(nodes, reconnect=bool(self.reconnect_to)) as conn:
            self.conn = conn
            ch = await conn.channel()
            await ch.confirm_delivery()
            ch.on_confirm = self.on_confirm
            self.ch = ch
            task_status.started()
            burst = max(1, self.rate // 200)
            while not self.stop.is_set():
                if not conn.connected.is_set():  # publish only while connected
                    await trio.sleep(0.01)
                    continue
                for _ in range(burst):
                    seq = await ch.basic_publish("", self.queue, body(self.next_id))
                    assert seq == self.next_id
                    self.next_id += 1
                await trio.sleep(0.005)
            with trio.move_on_after(15):
                await ch.wait_for_confirms()
            self.done.set()

    @property
    def published(self) -> int:
        return self.next_id - 1

    def confirms_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in self.confirm_times if t0 <= t < t1)


class Consumer:
    """Consumes with manual acks, one per message, except the ids in `hold`: those stay
    unacknowledged until they come back redelivered (after a failover), so a failover always
    has unacknowledged messages to requeue; records (time, id, redelivered)."""

    def __init__(self, c: ProcessCluster, node: str, queue: str, prefetch: int = 200,
                 hold: frozenset = frozenset()):
        self.c, self.node, self.queue, self.prefetch = c, node, queue, prefetch
        self.hold = hold
        self.deliveries: list[tuple[float, int, bool]] = []
        self.ids: set[int] = set()
        self.changed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with aio.open_connection([self.c.client_addr(self.node)], reconnect=False) as conn:
            self.conn = conn
            ch = await conn.channel()
            await ch.basic_qos(self.prefetch)
            self.consumer = await ch.basic_consume(self.queue)
            task_status.started()
            async for msg in self.consumer:
                i = msg_id(msg.body)
                self.deliveries.append((trio.current_time(), i, msg.redelivered))
                self.ids.add(i)
                if i not in self.hold or msg.redelivered:
                    ch.basic_ack(msg.delivery_tag)
                if len(self.deliveries) % 64 == 0:
                    self.changed.set()
                    self.changed = trio.Event()

    async def wait_for(self, ids: set[int], timeout: float) -> None:
        with trio.move_on_after(timeout):
            while not ids <= self.ids:
                with trio.move_on_after(0.05):
                    await self.changed.wait()

    def summary(self, confirmed: set[int]) -> dict:
        n = len(self.deliveries)
        return {"delivered": n, "distinct": len(self.ids), "duplicates": n - len(self.ids),
                "redelivered": sum(1 for _, _, r in self.deliveries if r),
                "lost": len(confirmed - self.ids)}

    def gap_around(self, t: float, before: float = 0.2, after: float = 5.0) -> tuple[float, float]:
        """(longest pause between deliveries overlapping [t - before, t + after], time from t to
        the end of that pause). The pause bounds the failover: deliveries already on their way
        when the leader died can still arrive after t."""
        times = [d[0] for d in self.deliveries]
        best, resume = 0.0, float("nan")
        for a, b in itertools.pairwise(times):
            if b >= t - before and a <= t + after and b - a > best:
                best, resume = b - a, b - t
        return best, resume


def judge(pub: Publisher, con: Consumer, unacked: int, what: str) -> str:
    """The checker's verdict on one publisher and one consumer, by id, plus the failover's own
    rules: repeats only for what could be unacknowledged when the node failed (`unacked`: the
    held ids and the prefetch window), and the held ids back with `redelivered`. Returns the
    summary line; fails with the checker's reasons."""
    nacked = {i for a, b, _ in pub.nacked for i in range(a, b + 1)}
    h = History(
        publishes=[Publish(i, 0, pub.node, 0.0, "ack" if i in pub.confirmed else "nack" if i in nacked else None,
                           0.0 if i in pub.confirmed or i in nacked else None, queue=pub.queue)
                   for i in range(1, pub.next_id)],
        deliveries=[Delivery(i, 0, con.node, t, red, pub.queue) for t, i, red in con.deliveries])
    v = check(h)
    line = f"{what}: {v.line()}"
    print(line)
    assert v.lost == 0, f"{line}\nconfirmed but never delivered: {v.lost_ids}"
    assert v.duplicates_unflagged == 0, f"{line}\nrepeated without redelivered: {v.duplicate_ids_unflagged}"
    assert v.stuck == 0 and v.phantom == 0, f"{line}\n{v.reasons}"
    assert v.duplicates <= unacked, f"{line}\n{v.duplicates} ids repeated; at most {unacked} were unacknowledged"
    back = {i for _, i, red in con.deliveries if red}
    assert con.hold <= back, f"{line}\nheld back unacknowledged but never redelivered: {sorted(con.hold - back)}"
    return line


async def declare(c: ProcessCluster, node: str, q: str) -> None:
    async with aio.open_connection([c.client_addr(node)], reconnect=False) as conn:
        ch = await conn.channel()
        await ch.queue_declare(q, durable=True)


def mirrored_all_synced(c: ProcessCluster, q: str, definition: str) -> dict:
    """Set a policy on `q`, wait until both mirrors are synchronised; the row, leader n1."""
    c.ctl_ok("n1", "set_policy", f"ha-{q}", f"^{q}$", definition)
    row = wait_row(c, "n1", q, lambda r: len(r["synchronised_mirror_pids"]) == 2)
    assert pid_node(row["pid"]) == "n1"
    assert sorted(map(pid_node, row["mirror_pids"])) == ["n2", "n3"]
    return row


# --- tests -----------------------------------------------------------------------------------

def test_kill9_of_leader_under_load_promotes_oldest_mirror_and_loses_no_confirmed_message(cluster):
    c, q = cluster, "ha-kill"

    async def main():
        await declare(c, "n1", q)
        row = await ctl(c, mirrored_all_synced, c, q, '{"ha-mode":"all"}')
        oldest = pid_node(row["mirror_pids"][0])

        pub, con = Publisher(c, "n2", q), Consumer(c, "n3", q, hold=HOLD)
        async with trio.open_nursery() as n:
            await n.start(con.run)
            await n.start(pub.run)
            await trio.sleep(1.0)
            t_kill = trio.current_time()
            await ctl(c, c.kill9, "n1")
            await trio.sleep(1.5)
            pub.stop.set()
            with trio.fail_after(20):
                await pub.done.wait()
            await con.wait_for(pub.confirmed, 10)
            after = await ctl(c, wait_row, c, "n2", q, lambda r: r["pid"] != "")
            n.cancel_scope.cancel()

        s = con.summary(pub.confirmed)
        gap, resume = con.gap_around(t_kill)
        before = [t for t, _, _ in con.deliveries if t < t_kill]
        steady = (before[-1] - before[0]) / max(1, len(before) - 1) if len(before) > 1 else float("nan")
        cgap = max((b[0] - a[0] for a, b in zip(pub.confirm_times, pub.confirm_times[1:])
                    if b[0] >= t_kill), default=float("nan"))
        print(f"\nkill -9 of leader n1: published={pub.published} confirmed={len(pub.confirmed)} "
              f"nacked={pub.nacked} {s}")
        print(f"longest delivery gap around the kill: {gap * 1000:.1f} ms (it ended "
              f"{resume * 1000:.1f} ms after the kill; steady inter-delivery {steady * 1000:.2f} ms); "
              f"longest confirm gap after the kill: {cgap * 1000:.1f} ms "
              f"[target < 78 ms, RabbitMQ ~155 ms; kill -9 of a local process breaks links at once]")

        assert pid_node(after["pid"]) == oldest, (after, oldest)
        assert [pid_node(p) for p in after["mirror_pids"]] == [n for n in ("n2", "n3") if n != oldest]
        assert con.consumer.cancelled_reason is None
        assert con.conn.reconnects == 0 and pub.conn.reconnects == 0
        assert pub.nacked == []
        assert len(pub.confirmed) == pub.published > 1000
        judge(pub, con, len(HOLD) + con.prefetch, "kill -9 of leader n1")
        assert gap < GAP_LIMIT, (f"delivery gap {gap * 1000:.0f} ms around the kill (README: 69 ms; "
                                 f"limit {GAP_LIMIT * 1000:.0f} ms)")

    trio.run(main)


def test_sigstop_of_mirror_holds_confirms_until_net_ticktime_then_it_rejoins_unsynchronised(cluster):
    c, q = cluster, "ha-stop"

    async def main():
        await declare(c, "n1", q)
        await ctl(c, mirrored_all_synced, c, q, '{"ha-mode":"all"}')

        pub = Publisher(c, "n2", q)
        async with trio.open_nursery() as n:
            await n.start(pub.run)
            await trio.sleep(0.7)
            t_stop = trio.current_time()
            at_stop = pub.next_id
            c.sigstop("n3")
            await trio.sleep(TICK * 1.25 + 1.5)
            resumed = [t for t, _ in pub.confirm_times if t > t_stop + 0.3]
            held = pub.confirms_between(t_stop + 0.3, t_stop + 0.8 * TICK)
            during = pub.next_id - at_stop
            row_down = await ctl(c, queue_row, c, "n1", q)
            pub.stop.set()
            with trio.fail_after(15):
                await pub.done.wait()
            n.cancel_scope.cancel()

        first_after = resumed[0] - t_stop if resumed else float("nan")
        print(f"\nSIGSTOP of mirror n3: confirms during [0.3 s, {0.8 * TICK:.1f} s] after the stop: "
              f"{held}; confirms resumed {first_after:.2f} s after the stop "
              f"(net_ticktime {TICK:g} s); published={pub.published} confirmed={len(pub.confirmed)}")
        assert held == 0, "confirms advanced while a mirror was stopped"
        assert resumed, "confirms never resumed after net_ticktime declared the node down"
        assert 0.8 * TICK <= first_after <= 1.25 * TICK + 1.0, first_after
        assert pub.nacked == []
        assert len(pub.confirmed) == pub.published
        assert pid_node(row_down["pid"]) == "n1"
        assert [pid_node(p) for p in row_down["mirror_pids"]] == ["n2"], row_down
        # the publisher was not blocked from sending, only its confirms held: it went on at
        # about its 2,000 msgs/s (far below the 20,000 messages of credit) for TICK * 1.25 + 1.5 s
        assert during > 0.5 * pub.rate * (TICK * 1.25 + 1.5), during

        # SIGCONT: n3 rejoins and becomes a new mirror, unsynchronised while the queue holds
        # messages it never received
        c.sigcont("n3")
        row = await ctl(c, wait_row, c, "n1", q,
                        lambda r: sorted(map(pid_node, r["mirror_pids"])) == ["n2", "n3"], 15)
        assert row["messages"] == pub.published
        assert [pid_node(p) for p in row["synchronised_mirror_pids"]] == ["n2"], row

        con = Consumer(c, "n1", q)
        async with trio.open_nursery() as n:
            await n.start(con.run)
            await con.wait_for(pub.confirmed, 10)
            row = await ctl(c, wait_row, c, "n1", q,
                            lambda r: len(r["synchronised_mirror_pids"]) == 2, 10)
            n.cancel_scope.cancel()
        s = con.summary(pub.confirmed)
        print(f"after SIGCONT and drain: {s}; synchronised_mirror_pids={row['synchronised_mirror_pids']}")
        assert s["lost"] == 0
        assert row["messages"] == 0

    trio.run(main)


def test_stop_app_of_leader_under_load_promotes_a_synchronised_mirror(cluster):
    c, q = cluster, "ha-stopapp"

    async def main():
        await declare(c, "n1", q)
        row = await ctl(c, mirrored_all_synced, c, q,
                        '{"ha-mode":"all","ha-promote-on-shutdown":"when-synced"}')
        oldest = pid_node(row["mirror_pids"][0])

        pub, con = Publisher(c, "n2", q), Consumer(c, "n3", q, hold=HOLD)
        async with trio.open_nursery() as n:
            await n.start(con.run)
            await n.start(pub.run)
            await trio.sleep(1.0)
            t0 = trio.current_time()
            await ctl(c, c.ctl_ok, "n1", "stop_app")
            t_stopped = trio.current_time()
            await trio.sleep(1.5)
            pub.stop.set()
            with trio.fail_after(20):
                await pub.done.wait()
            await con.wait_for(pub.confirmed, 10)
            after = await ctl(c, wait_row, c, "n2", q, lambda r: r["pid"] != "")
            n.cancel_scope.cancel()

        s = con.summary(pub.confirmed)
        gap, _ = con.gap_around(t0, after=t_stopped - t0 + 2)
        print(f"\nstop_app of leader n1 (took {t_stopped - t0:.2f} s): published={pub.published} "
              f"confirmed={len(pub.confirmed)} nacked={pub.nacked} {s}; longest delivery gap "
              f"{gap * 1000:.1f} ms; new leader {after['pid']}")
        assert pid_node(after["pid"]) == oldest, after
        assert con.consumer.cancelled_reason is None
        assert con.conn.reconnects == 0 and pub.conn.reconnects == 0
        assert pub.nacked == []
        assert len(pub.confirmed) == pub.published > 1000
        judge(pub, con, len(HOLD) + con.prefetch, "stop_app of leader n1")
        # a controlled stop hands the queue over before the node goes: no longer a pause than a
        # crash's failover
        assert gap < GAP_LIMIT, f"delivery gap {gap * 1000:.0f} ms around stop_app (limit {GAP_LIMIT * 1000:.0f} ms)"

    trio.run(main)


def test_kill9_of_the_leader_the_publisher_is_connected_to_with_confirms_in_flight(cluster):
    """The publisher's own node is the leader that dies: the publishes in flight are reported
    as nacks ("connection lost") by the client, which reconnects to another node and goes on;
    every publish is answered, nothing confirmed is lost, and the consumer's unacknowledged
    messages come back redelivered."""
    c, q = cluster, "ha-pubdies"

    async def main():
        await declare(c, "n1", q)
        await ctl(c, mirrored_all_synced, c, q, '{"ha-mode":"all"}')
        pub = Publisher(c, "n1", q, reconnect_to=("n2", "n3"))
        con = Consumer(c, "n3", q, hold=HOLD)
        async with trio.open_nursery() as n:
            await n.start(con.run)
            await n.start(pub.run)
            await trio.sleep(1.0)
            # freeze n1 first so that publishes are surely in flight (sent, unconfirmed) when it dies
            await ctl(c, c.sigstop, "n1")
            await trio.sleep(0.3)
            before = pub.next_id - 1
            await ctl(c, c.kill9, "n1")
            await trio.sleep(2.0)
            pub.stop.set()
            with trio.fail_after(30):
                await pub.done.wait()
            await con.wait_for(pub.confirmed, 10)
            n.cancel_scope.cancel()

        lost_with_conn = sorted(i for a, b, r in pub.nacked if r == "connection lost" for i in range(a, b + 1))
        print(f"\npublisher on the killed leader: published={pub.published} confirmed={len(pub.confirmed)} "
              f"nacked with the connection={len(lost_with_conn)} reconnects={pub.conn.reconnects}")
        assert pub.conn.reconnects >= 1
        assert lost_with_conn and all(i < before + 2000 for i in lost_with_conn)
        after_kill = [i for i in pub.confirmed if i > (lost_with_conn[-1] if lost_with_conn else before)]
        assert len(after_kill) > 1000, "confirms did not resume after the reconnection"
        answered = pub.confirmed | set(lost_with_conn) | {i for a, b, _ in pub.nacked for i in range(a, b + 1)}
        unanswered = sorted(set(range(1, pub.next_id)) - answered)
        assert not unanswered, f"{len(unanswered)} publishes never answered, e.g. {unanswered[:10]}"
        judge(pub, con, len(HOLD) + con.prefetch, "kill -9 of the publisher's node (the leader)")

    trio.run(main)


def test_kill9_of_leader_with_only_unsynchronised_mirrors_and_promote_on_failure_when_synced(cluster):
    c, q = cluster, "ha-nopromo"
    expected = f"home node 'n1' of durable queue '{q}' in vhost '/' is down or inaccessible"

    async def main():
        await declare(c, "n1", q)
        async with aio.open_connection([c.client_addr("n2")], reconnect=False) as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            for i in range(1, 101):
                await ch.basic_publish("", q, body(i))
            assert await ch.wait_for_confirms(timeout=10)
        # the mirrors start empty: unsynchronised while the 100 messages sit in the queue
        await ctl(c, c.ctl_ok, "n1", "set_policy", "ha-nopromo", f"^{q}$",
                  '{"ha-mode":"all","ha-promote-on-failure":"when-synced"}')
        row = await ctl(c, wait_row, c, "n1", q, lambda r: len(r["mirror_pids"]) == 2)
        await trio.sleep(0.3)
        row = await ctl(c, queue_row, c, "n1", q)
        assert row["synchronised_mirror_pids"] == [] and row["messages"] == 100, row

        await ctl(c, c.kill9, "n1")
        await ctl(c, c.wait_running, "n2", {"n2", "n3"})
        await trio.sleep(0.5)  # give the coordinator time for a (wrong) promotion

        async with aio.open_connection([c.client_addr("n2")], reconnect=False) as conn:
            errors = []
            for op in ("declare", "consume", "get", "purge"):
                ch = await conn.channel()
                try:
                    with trio.fail_after(5):
                        if op == "declare":
                            await ch.queue_declare(q, durable=True)
                        elif op == "consume":
                            await ch.basic_consume(q)
                        elif op == "get":
                            await ch.basic_get(q)
                        else:
                            await ch.queue_purge(q)
                except ChannelClosedByBroker as exc:
                    errors.append((op, exc.reply_code, exc.reply_text))
                else:
                    errors.append((op, None, "succeeded"))
            # a publish with confirms is nacked, naming the reason
            ch = await conn.channel()
            await ch.confirm_delivery()
            reasons = []
            ch.on_confirm = lambda a, b, ok, reason: reasons.append((ok, reason))
            await ch.basic_publish("", q, body(1000))
            with trio.move_on_after(5):
                await ch.wait_for_confirms()
        print(f"\noperations on {q} with its leader killed and no synchronised mirror: {errors}; "
              f"publish: {reasons}")
        for op, code, text in errors:
            assert code == 404 and text == expected, (op, code, text)
        assert reasons == [(False, expected)], reasons

        rows = await ctl(c, c.ctl_json, "n2", "list_queues", "name", "pid", "mirror_pids", "leader", "state")
        row = next(r for r in rows if r["name"] == q)
        assert row["leader"] == "n1" and row["pid"] == "" and row["state"] == "down", row
        for n in ("n2", "n3"):
            st = await ctl(c, c.ctl_json, n, "list_queues", "name", "pid")
            assert next(r for r in st if r["name"] == q)["pid"] == ""

    trio.run(main)
