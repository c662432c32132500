"""A node frozen (SIGSTOP, a paused VM) that the cluster counted down while it slept.

When it wakes it reads first what waited in its sockets: deliveries its queue leaders sent
before the freeze. The leaders requeued those, flagged, for other consumers when the log
recorded the node down, so the node's sessions must not show them (broker/router.py
`counted_down`: held while the node is out of step with the log and given back once it learns
it was counted down; what comes later on a link opened before that is never read). The freeze here is shorter than the peer links' own freeze rule (0.7 x
net_ticktime), so only this rule stands between the client and an unflagged repeat; a peer
whose silence from the node began earlier can count it down that soon (dst seed 68350).

The same holds for a node under stop_app whose links are slow: what reaches it after its
shutdown record was committed is not shown (dst seed 30123, which no longer reaches that case
since the driver and Raft changed; the last test stages it).
"""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import AMQPConnectionError
from broker.simulation import sim_cluster
from mirroring.changes import NodeDown, NodeUp
from tests.test_sim_partitions import qdef, set_policy

pytestmark = pytest.mark.timeout(60)

N = 40
# net_ticktime for these runs: the links tick every 5 s, so the frozen node writes nothing to the
# leader's node between that node closing its end and the frozen node reading what waited (the
# simulated network fails a write to a closed end at once; real TCP fails only the next one)
TICK = 20.0
FREEZE = 2.5  # longer than the election timeout (2 s), far shorter than the links' freeze rule


async def declare_led_on_n2(c, name: str) -> None:
    """A queue led on n2 and mirrored on n1 only: n3 holds no mirror, so its consumers'
    deliveries carry their bodies."""
    await set_policy(c, {"ha-mode": "nodes", "ha-params": ["n2", "n1"], "ha-sync-mode": "automatic"})
    async with c.connect("n2") as conn:
        ch = await conn.channel()
        await ch.queue_declare(name, durable=True)
    await c.wait_for(lambda: qdef(c, name).leader == "n2" and qdef(c, name).synced == ("n1",),
                     20, "the queue led on n2, mirrored on n1")


async def consume(c, queue: str, seen: list, name: str, node: str, ack: bool, ready=None,
                  task_status=trio.TASK_STATUS_IGNORED):
    """A consumer on `node` (prefetch 100) recording (name, id, redelivered) in arrival order;
    `ack`: acknowledge each, or hold them all. Sets `ready` once N deliveries were seen in all.
    Its connection may be closed under it (a stopping node)."""
    try:
        async with c.connect(node) as sub:
            sch = await sub.channel()
            await sch.basic_qos(100)
            deliveries = await sch.basic_consume(queue)
            task_status.started()
            async for msg in deliveries:
                seen.append((name, int.from_bytes(msg.body, "big"), msg.redelivered))
                if ready is not None and len(seen) >= N:
                    ready.set()
                if ack:
                    sch.basic_ack(msg.delivery_tag)
    except AMQPConnectionError:
        pass


def unflagged_repeats(seen: list) -> list:
    first: dict[int, tuple] = {}
    out = []
    for who, i, red in seen:
        if i in first and not red:
            out.append((first[i], (who, i)))
        first.setdefault(i, (who, i))
    return out


@pytest.mark.parametrize("late", [False, True], ids=["read-before-the-record", "read-after-the-record"])
async def test_deliveries_waiting_for_a_frozen_node_counted_down_are_not_shown(tmp_path, autojump_clock, late):
    """`late`: the leader's link to the frozen node is slow, so what waited for it arrives after
    the node has learnt from the log's leader that it was counted down (the link is reset);
    otherwise it arrives first and is held until then (the node is out of step)."""
    async with sim_cluster(tmp_path, net_ticktime=TICK) as c:
        await declare_led_on_n2(c, "p.f")
        seen: list[tuple[str, int, bool]] = []  # (consumer, id, redelivered), in arrival order

        frozen = c.nodes["n3"]
        run = frozen.cluster.incarnation
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(consume, c, "p.f", seen, "frozen", "n3", False, done)
            c.pause("n3")
            paused_at = trio.current_time()
            resume_at = paused_at + FREEZE
            if late:
                c.net.delay("n2", "n3", FREEZE + 0.8)
            async with c.connect("n2") as conn:  # the leader delivers these to n3, into its socket
                ch = await conn.channel()
                await ch.confirm_delivery()
                for i in range(N):
                    ch.publish_nowait("p.f", i.to_bytes(4, "big"))
                assert await ch.wait_for_confirms(timeout=5)
            await trio.sleep(0.2)
            # the log (led by n1, which formed the cluster) counts n3 down, as a peer whose
            # silence from it began before the freeze would: the leader requeues what it sent there
            await c.nodes["n1"].cluster.propose(NodeDown("n3", run, "failure"))
            await nursery.start(consume, c, "p.f", seen, "other", "n1", True, done)
            with trio.fail_after(5):
                await done.wait()
            # n3 wakes out of step with the log (the freeze is longer than the election
            # timeout) but before the links' own freeze rule would act
            await trio.sleep_until(resume_at)
            c.resume("n3")
            if late:  # the stale bytes arrive 0.3 s after the wake
                await trio.sleep(1)
                c.net.delay("n2", "n3", 0)
            await c.wait_for(lambda: c.nodes["n2"].md.up.get("n3") == run and "n2" in frozen.cluster.links,
                             30, "n3 recorded up again and linked to the leader's node")
            await trio.sleep(1)
            # the frozen node's consumer is registered again and served: more messages are shared
            # between the two consumers
            async with c.connect("n2") as conn:
                ch = await conn.channel()
                await ch.confirm_delivery()
                for i in range(N, 2 * N):
                    ch.publish_nowait("p.f", i.to_bytes(4, "big"))
                assert await ch.wait_for_confirms(timeout=5)
            await c.wait_for(lambda: {i for _, i, _ in seen} >= set(range(2 * N)), 10, "every message")
            nursery.cancel_scope.cancel()
        first = [(who, i, red) for who, i, red in seen if i < N]
        assert sorted(i for who, i, _ in first if who == "other") == list(range(N))
        assert all(red for who, _, red in first if who == "other"), "requeued, so flagged"
        shown_by_frozen = [(i, red) for who, i, red in first if who == "frozen"]
        assert all(red for _, red in shown_by_frozen), \
            f"{sum(not r for _, r in shown_by_frozen)} ids repeated unflagged by the frozen node's consumer"
        later = [(who, i, red) for who, i, red in seen if i >= N]
        assert sorted(i for _, i, _ in later) == list(range(N, 2 * N)), "each later message once"
        assert not any(red for _, _, red in later)
        assert {who for who, _, _ in later} == {"frozen", "other"}, "both consumers served"


async def test_deliveries_reaching_a_stopping_node_after_its_shutdown_record_are_not_shown(tmp_path, autojump_clock):
    """stop_app of a consumer's node whose links are slow: its shutdown record is committed
    (and the queue's leader requeues, flagged, for another consumer what it had sent there)
    before the deliveries on their way there arrive, and before the node hears its record
    committed and closes its clients' connections. Those late deliveries must not be shown
    (broker/node.py `leaving`; dst seed 30123 found it first)."""
    async with sim_cluster(tmp_path, net_ticktime=TICK) as c:
        await declare_led_on_n2(c, "p.s")
        seen: list[tuple[str, int, bool]] = []

        async with trio.open_nursery() as nursery:
            await nursery.start(consume, c, "p.s", seen, "stopping", "n3", False)
            await nursery.start(consume, c, "p.s", seen, "other", "n1", True)
            # the record reaches the log's leader (n1) in 0.6 s and its result comes back in 1.2 s;
            # the leader's deliveries reach n3 in 0.9 s: after the record, before the close
            c.net.delay("n1", "n3", 0.6)
            c.net.delay("n2", "n3", 0.9)
            async with c.connect("n2") as conn:
                ch = await conn.channel()
                for i in range(N):
                    ch.publish_nowait("p.s", i.to_bytes(4, "big"))
                await trio.sleep(0)
            await c.nodes["n3"].stop_app()
            await c.wait_for(lambda: {i for _, i, _ in seen} >= set(range(N)), 10, "every message")
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
        unflagged = unflagged_repeats(seen)
        assert not unflagged, f"{len(unflagged)} repeats without redelivered, e.g. {unflagged[:2]}"


@pytest.mark.parametrize("back_up", [False, True], ids=["down", "down-and-up-again"])
async def test_a_run_counted_down_in_a_snapshot_is_acted_on_as_a_record_would_be(
        tmp_path, autojump_clock, monkeypatch, back_up):
    """A node that lagged past the log's compaction learns the news from a snapshot, which holds
    no record. If its own run was up before and was counted down since (down in the snapshot,
    or up again: the metadata counts each run's times down), it gives back what its sessions
    were sent and hold unseen, as on the record, and when up again registers its consumers
    anew; a peer that learns that way that another node's run went down closes its link to
    that run, as on the record."""
    from mirroring.metadata import Metadata

    async with sim_cluster(tmp_path, net_ticktime=TICK) as c:
        n2, n3 = c.nodes["n2"], c.nodes["n3"]
        run = n3.cluster.incarnation
        md = Metadata.from_snapshot(n3.md.snapshot())
        md.apply(NodeDown("n3", run, "failure"))
        if back_up:
            md.apply(NodeUp("n3", run))
            assert md.up["n3"] == run
        snapshot = md.snapshot()
        given_back, resent = [], []
        monkeypatch.setattr(n3.router, "counted_down", lambda: given_back.append(True))
        async with c.connect("n3"):
            session, = n3.sessions.values()
            monkeypatch.setattr(session, "resend_all", lambda: resent.append(True))
            link = n2.cluster.links["n3"]
            assert link.incarnation == run

            for node in (n3, n2):  # each installs the snapshot as Raft hands it over
                monkeypatch.setattr(node.cluster.raft, "take_committed",
                                    lambda: [("snapshot", node.cluster.applied + 1, snapshot)])
                node.cluster._apply_committed()
            assert given_back == [True], "the node did not give back what its sessions held"
            assert resent == ([True] if back_up else []), "consumers not registered anew"
            assert link.cancel_scope.cancel_called, "the peer kept its link to the run counted down"
