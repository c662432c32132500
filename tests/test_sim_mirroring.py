"""Classic mirroring on the simulated network under MockClock: each test quotes the spec
sentence (../shared/spec/003_13d5cdb881a192fb.txt) it checks."""

from __future__ import annotations

import json

import pytest
import trio

from broker.control import ctl_call

from broker.simulation import PEER_PORT, TICKTIME, sim_cluster
from mirroring.changes import NodeDown

pytestmark = pytest.mark.timeout(30)


async def ctl(c, node: str, command: str, **args):
    """A warrenctl command as a user would send it (ctl role on the peer port)."""
    return await ctl_call(c.net.host(node), node, PEER_PORT, "warrenctl-test", b"s", command, args)


async def set_policy(c, name, pattern, definition, node="n1", **kw):
    return await ctl(c, node, "set_policy", name=name, pattern=pattern,
                     definition=json.dumps(definition) if isinstance(definition, dict) else definition,
                     **kw)


def qdef(c, queue, node="n1"):
    return c.nodes[node].md.queues[queue]


async def replicas_settled(c, queue, mirrors, synced=None, via="n1"):
    """Wait until the metadata lists these mirrors (and synced ones) on every running node."""
    def ok():
        for n in c.nodes.values():
            if n.name in c.killed or not n.app_running:
                continue
            q = n.md.queues.get(queue)
            if q is None or sorted(q.mirrors) != sorted(mirrors):
                return False
            if synced is not None and sorted(q.synced) != sorted(synced):
                return False
        return True
    await c.wait_for(ok, timeout=20)


async def declare_on_all_nodes(c, ch, queue):
    """Declare `queue` (under an `all` policy) on n1 through `ch`, wait for both mirrors to be
    synchronised, and turn on confirms."""
    await ch.queue_declare(queue, durable=True)
    await replicas_settled(c, queue, ["n2", "n3"], synced=["n2", "n3"])
    await ch.confirm_delivery()


def mirror_state(c, queue, node):
    return c.nodes[node].router.replicas[queue].replica.q


async def test_all_policy_mirrors_to_every_node_and_states_match(tmp_path, autojump_clock):
    """"all: Queue is mirrored across all nodes in the cluster." and "The mirrors apply the
    operations that occur to the leader in exactly the same order as the leader and thus
    maintain the same state"."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch1, ch3 = await c1.channel(), await c3.channel()
            await declare_on_all_nodes(c, ch1, "ha.q")
            for i in range(300):
                ch1.publish_nowait("ha.q", b"m%d" % i)
            assert await ch1.wait_for_confirms(timeout=10)
            await ch3.basic_qos(prefetch_count=50)
            consumer = await ch3.basic_consume("ha.q")
            n = 0
            async for msg in consumer:
                n += 1
                if n % 3:
                    ch3.basic_ack(msg.delivery_tag)
                if n == 120:
                    break
            await trio.sleep(1)
            leader = mirror_state(c, "ha.q", "n1")
            for m in ("n2", "n3"):
                assert mirror_state(c, "ha.q", m).comparable() == leader.comparable(), m
            rows = await ctl(c, "n2", "list_queues", columns=["name", "policy", "pid", "mirror_pids",
                                                               "synchronised_mirror_pids", "slave_pids",
                                                               "synchronised_slave_pids", "type",
                                                               "effective_policy_definition"])
            (row,) = rows
            assert row["policy"] == "ha-all"
            assert row["pid"].startswith("<n1.")
            assert sorted(p.split(".")[0] for p in row["mirror_pids"]) == ["<n2", "<n3"]
            assert sorted(row["synchronised_mirror_pids"]) == sorted(row["mirror_pids"])
            # RabbitMQ 3.10's names for the same lists (mirror_pids is their 3.11.4 alias)
            assert row["slave_pids"] == row["mirror_pids"]
            assert row["synchronised_slave_pids"] == row["synchronised_mirror_pids"]
            assert row["type"] == "classic" and row["effective_policy_definition"] == {"ha-mode": "all"}


async def test_leader_killed_oldest_mirror_promoted_consumers_continue(tmp_path, autojump_clock):
    """"The longest running mirror is promoted to leader"; "It requeues all messages that have
    been delivered to clients but are pending acknowledgement"; consumers without
    x-cancel-on-ha-failover keep consuming; "no messages that are published to the mirrored
    queue during this time will be lost"."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n2") as c2, c.connect("n3") as c3:
            ch2, ch3 = await c2.channel(), await c3.channel()
            await ch2.queue_declare("ha.q", durable=True, arguments={"x-queue-master-locator": "client-local"})
            await c.wait_for(lambda: "ha.q" in c.nodes["n1"].md.queues)
            # lead it from n1: declare through a connection to n1
        async with c.connect("n1") as c1:
            ch1 = await c1.channel()
            await ch1.queue_declare("ha.f", durable=True)
        await replicas_settled(c, "ha.f", ["n2", "n3"], synced=["n2", "n3"])
        assert qdef(c, "ha.f").mirrors == ("n2", "n3")  # n2 is the oldest mirror
        async with c.connect("n2") as c2, c.connect("n3") as c3:
            ch2, ch3 = await c2.channel(), await c3.channel()
            await ch2.confirm_delivery()
            confirmed: set[int] = set()
            nacked: set[int] = set()
            ch2.on_confirm = lambda first, last, ok, reason: (confirmed if ok else nacked).update(range(first, last + 1))
            await ch3.basic_qos(prefetch_count=20)
            consumer = await ch3.basic_consume("ha.f")
            delivered: list[tuple[int, bool]] = []

            async def publish():
                for i in range(1, 2001):
                    await ch2.basic_publish("", "ha.f", i.to_bytes(4, "big"))
                    if i % 50 == 0:
                        await trio.sleep(0.01)

            async def consume():
                # ids 1-5 are never acked before the failover: they must come back redelivered
                async for msg in consumer:
                    mid = int.from_bytes(msg.body, "big")
                    delivered.append((mid, msg.redelivered))
                    if mid > 5 or msg.redelivered:
                        ch3.basic_ack(msg.delivery_tag)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(publish)
                nursery.start_soon(consume)
                await trio.sleep(0.3)
                c.kill("n1")
                with trio.fail_after(TICKTIME * 3):
                    await c.wait_for(lambda: qdef(c, "ha.f", "n2").leader == "n2")
                await trio.sleep(60)
                nursery.cancel_scope.cancel()
                if not ({d for d, _ in delivered} >= set(range(1, 2001))):
                    missing = set(range(1, 2001)) - {d for d, _ in delivered}
                    raise AssertionError(f"missing {len(missing)}: {sorted(missing)[:20]}; confirmed {len(confirmed)} nacked {len(nacked)}; leader state {mirror_state(c, 'ha.f', 'n2').stats()} sessions {[(x.inflight_msgs, x._resend, x.routes, len(x.rpcs)) for x in c.nodes['n2'].sessions.values()]} last_pseq {mirror_state(c, 'ha.f', 'n2').last_pseq}")
            assert qdef(c, "ha.f", "n3").leader == "n2"
            assert qdef(c, "ha.f", "n3").mirrors == ("n3",)
            assert not nacked
            assert confirmed == set(range(1, 2001))
            ids = [d for d, _ in delivered]
            assert set(ids) == set(range(1, 2001))  # nothing lost
            assert {d for d, r in delivered if r} >= {1, 2, 3, 4, 5}  # unacked: redelivered
            # a repeat only for what was unacknowledged at the failover (ids 1-5 held back, and
            # at most the prefetch of 20 in flight), and every repeat flagged redelivered
            seen: set[int] = set()
            repeats = []
            for d, r in delivered:
                if d in seen:
                    repeats.append((d, r))
                seen.add(d)
            assert all(r for _, r in repeats), [x for x in repeats if not x[1]][:10]
            assert len({d for d, _ in repeats}) <= 5 + 20, len(repeats)


async def test_tx_commit_returns_once_every_mirror_has_the_messages(tmp_path, autojump_clock):
    """"a tx.commit-ok will only be returned to a client when the transaction has been applied
    across all mirrors of the queue"; a rollback drops what was published."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            await ch.queue_declare("ha.tx", durable=True, arguments={"x-queue-master-locator": "client-local"})
            await replicas_settled(c, "ha.tx", ["n1", "n3"], synced=["n1", "n3"])
            await ch.tx_select()
            for i in range(10):
                ch.publish_nowait("ha.tx", b"t%d" % i)
            await trio.sleep(1)
            assert mirror_state(c, "ha.tx", "n2").message_count == 0  # nothing before commit
            await ch.tx_commit()
            for node in ("n1", "n2", "n3"):
                assert mirror_state(c, "ha.tx", node).message_count == 10, node
            ch.publish_nowait("ha.tx", b"dropped")
            await ch.tx_rollback()
            await ch.tx_commit()
            assert mirror_state(c, "ha.tx", "n2").message_count == 10
            # a commit waits for the mirrors: with n3 cut off, it completes only after
            # net_ticktime declares n3 down
            c.net.partition({"n3"}, {"n1", "n2"})
            t0 = trio.current_time()
            ch.publish_nowait("ha.tx", b"late")
            await ch.tx_commit()
            assert trio.current_time() - t0 >= TICKTIME * 0.5
            assert mirror_state(c, "ha.tx", "n1").message_count == 11


async def fill(c, node, queue, n, size=100):
    async with c.connect(node) as conn:
        ch = await conn.channel()
        await ch.confirm_delivery()
        for i in range(n):
            ch.publish_nowait(queue, i.to_bytes(8, "big") + b"x" * (size - 8))
        assert await ch.wait_for_confirms(timeout=30)


async def test_sync_queue_fills_a_new_mirror_in_batches(tmp_path, autojump_clock):
    """"A new queue mirror will not receive existing messages" and "It is possible to manually
    synchronise a queue: rabbitmqctl sync_queue {name}"; the troubleshooting post's pitfall (a
    queue with no consumer never catches up) is resolved by it. Batches of ha-sync-batch-size."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("two.q", durable=True)
        await fill(c, "n1", "two.q", 1000)
        await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "exactly", "ha-params": 2,
                                                   "ha-sync-batch-size": 100})
        await replicas_settled(c, "two.q", ["n2"], synced=[])
        await trio.sleep(30)  # nobody consumes: it never catches up on its own
        assert qdef(c, "two.q").synced == ()
        assert mirror_state(c, "two.q", "n2").message_count == 0
        r = await ctl(c, "n1", "sync_queue", queue="two.q")
        assert r["started"] and r["unsynchronised"] == ["n2"], r
        await replicas_settled(c, "two.q", ["n2"], synced=["n2"])
        assert mirror_state(c, "two.q", "n2").comparable() == mirror_state(c, "two.q", "n1").comparable()
        st = await ctl(c, "n1", "sync_status", queue="two.q")
        assert st["last"]["status"] == "completed" and st["last"]["messages"] == 1000
        assert st["last"]["batches"] == 10
        rows = await ctl(c, "n3", "list_queues", columns=["name", "synchronised_mirror_pids"])
        assert len(rows[0]["synchronised_mirror_pids"]) == 1


async def test_automatic_sync_mode_syncs_a_new_mirror(tmp_path, autojump_clock):
    """"ha-sync-mode: automatic: a queue will automatically synchronise when a new mirror
    joins"."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("two.a", durable=True)
        await fill(c, "n1", "two.a", 500)
        await set_policy(c, "ha-two", r"^two\.", '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}')
        await replicas_settled(c, "two.a", ["n2"], synced=["n2"])
        assert mirror_state(c, "two.a", "n2").message_count == 500


async def test_operations_wait_while_syncing_and_cancel_releases_them(tmp_path, autojump_clock):
    """"while a queue is being synchronised, all other queue operations will be blocked" (held,
    not failed); `cancel_sync_queue` stops it and the mirror stays unsynchronised; a
    publisher's confirms come once the sync is over. The throughput limit paces the sync."""
    async with sim_cluster(tmp_path, mirroring_sync_max_throughput=100_000) as c:
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("two.s", durable=True)
        await fill(c, "n1", "two.s", 2000, size=1000)  # 2 MB: 20 s at 100 kB/s
        await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "exactly", "ha-params": 2})
        await replicas_settled(c, "two.s", ["n2"], synced=[])
        assert (await ctl(c, "n1", "sync_queue", queue="two.s"))["started"]
        await trio.sleep(5)
        st = await ctl(c, "n1", "sync_status", queue="two.s")
        assert st["running"]
        p = st["progress"]
        assert 0.8 * 100_000 <= p["rate_bytes"] <= 1.1 * 100_000, p
        rows = await ctl(c, "n2", "list_queues", columns=["name", "state", "sync_progress"])
        assert rows[0]["state"] == "syncing" and "%" in rows[0]["sync_progress"]
        async with c.connect("n3") as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            ch.publish_nowait("two.s", b"during the sync")
            with trio.move_on_after(3):
                await ch.wait_for_confirms()
            assert ch.outstanding, "the publish was confirmed while the queue was syncing"
            t0 = trio.current_time()
            assert (await ctl(c, "n1", "cancel_sync_queue", queue="two.s"))["cancelled"]
            assert await ch.wait_for_confirms(timeout=5)  # held, then released: not failed
            assert trio.current_time() - t0 < 2
        st = await ctl(c, "n1", "sync_status", queue="two.s")
        assert not st["running"] and st["last"]["status"] == "cancelled"
        assert 0 < st["last"]["messages"] < 2000
        assert st["unsynchronised"] == ["n2"]
        assert qdef(c, "two.s").synced == ()
        # a second sync completes the job, skipping what the first one delivered
        await ctl(c, "n1", "sync_queue", queue="two.s")
        await replicas_settled(c, "two.s", ["n2"], synced=["n2"])
        assert mirror_state(c, "two.s", "n2").comparable() == mirror_state(c, "two.s", "n1").comparable()


async def _publish_while_n1_leaves(c, monkeypatch, queue: str):
    """Stop n1's app with its record of going held up (a long `leaving` window), publish one
    message to `queue` through n2 inside it, and return (confirmed, nacked) after 2 s, then
    let the record through."""
    n1 = c.nodes["n1"]
    if n1.cluster.leader == "n1":  # its stop would hand the log over, out of step meanwhile
        now = trio.current_time()
        n1.cluster.raft.transfer_leadership(now)
        n1.cluster._after_raft(now)
        await c.wait_for(lambda: n1.cluster.leader not in ("n1", None) and n1.cluster.in_step(), 5,
                         "the metadata log led by another node, n1 in step")
    recorded = trio.Event()
    propose = n1.cluster.propose

    async def held_propose(change, **kw):
        if type(change) is NodeDown:
            await recorded.wait()
        return await propose(change, **kw)

    monkeypatch.setattr(n1.cluster, "propose", held_propose)
    confirmed, nacked = set(), set()
    async with c.connect("n2") as c2:
        ch = await c2.channel()
        await ch.confirm_delivery()
        ch.on_confirm = lambda first, last, ok, reason: (confirmed if ok else nacked).update(range(first, last + 1))
        c.nursery.start_soon(n1.stop_app)
        await c.wait_for(lambda: n1.leaving, 5, "n1 leaving")
        ch.publish_nowait(queue, b"sent while n1 leaves")
        await trio.sleep(2)
        during = set(confirmed), set(nacked)
        assert n1.cluster.in_step(), "n1 out of step: that alone would hold its confirms"
        recorded.set()
        await c.wait_for(lambda: not n1.app_running, 10, "n1's app stopped")
        await c.wait_for(lambda: confirmed or nacked, 10, "the publish answered")
    return during, (confirmed, nacked)


async def test_a_node_stopping_its_app_confirms_nothing_its_queue_would_lose(tmp_path, autojump_clock, monkeypatch):
    """From the moment a node stopping its app has asked the log to record it going (it is
    `leaving`), its replicas are as good as gone: a queue it leads with no mirror to promote
    must not confirm a publish then (dst seed 111127: a node promoted in the middle of its
    stop_app confirmed 500 publishes and lost them with its app a moment later). The record is
    held up here, so the window is long; the publish is answered, not lost: nacked once the
    queue's only node has gone."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            await (await c1.channel()).queue_declare("solo", durable=True)  # led by n1, no mirror
        during, after = await _publish_while_n1_leaves(c, monkeypatch, "solo")
        assert during == (set(), set()), "confirmed by the queue's only node, already on its way out"
        assert after == (set(), {1})


async def test_a_node_stopping_its_app_still_confirms_what_a_synchronised_mirror_holds(tmp_path, autojump_clock, monkeypatch):
    """The other side: with synchronised mirrors (one of them is promoted when the node has
    gone, ha-promote-on-shutdown when-synced), a confirm from the leaving leader is for a
    message that outlives it, so it is given at once, not turned into a nack."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            await declare_on_all_nodes(c, await c1.channel(), "ha.kept")
        during, after = await _publish_while_n1_leaves(c, monkeypatch, "ha.kept")
        assert during == ({1}, set()) and after == ({1}, set())
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            got = await ch.basic_get("ha.kept")  # from the promoted mirror
            assert got is not None and got.body == b"sent while n1 leaves"


# --- helpers for the rule tests ------------------------------------------------------------

async def publish_confirmed(ch, queue, bodies):
    """Publish with confirms on; True when every one was confirmed positively."""
    if not ch.confirming:
        await ch.confirm_delivery()
    for b in bodies:
        ch.publish_nowait(queue, b)
    return await ch.wait_for_confirms(timeout=TICKTIME * 4)


async def get_all(ch, queue, limit=100_000):
    """Take every ready message with basic.get (auto-ack); their bodies in order."""
    out = []
    while len(out) < limit:
        msg = await ch.basic_get(queue, auto_ack=True)
        if msg is None:
            return out
        out.append(msg.body)
    return out


def replica_nodes(c, queue):
    """Nodes that run a replica task of the queue: {node: role}."""
    return {n.name: n.router.replicas[queue].role for n in c.nodes.values()
            if n.name not in c.killed and n.app_running and queue in n.router.replicas}


async def policies(c, node="n1"):
    return await ctl(c, node, "list_policies")


# --- 1. exactly ----------------------------------------------------------------------------

async def test_exactly_two_verbatim_example_gives_one_mirror(tmp_path, autojump_clock):
    """"A count value of 2 means 2 replicas: 1 queue leader and 1 queue mirror." with the spec's
    example definition '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}'."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-two", r"^two\.",
                         '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}')
        (pol,) = await policies(c)
        assert pol["definition"] == {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("two.replicas", durable=True)
            await c.wait_for(lambda: len(qdef(c, "two.replicas").mirrors) == 1, timeout=10)
            await trio.sleep(1)
            q = qdef(c, "two.replicas")
            assert q.leader == "n1" and len(q.mirrors) == 1
            assert sorted(replica_nodes(c, "two.replicas").values()) == ["leader", "mirror"]
            (row,) = await ctl(c, "n3", "list_queues", columns=["name", "policy", "pid", "mirror_pids"])
            assert row["policy"] == "ha-two" and len(row["mirror_pids"]) == 1


async def test_exactly_more_than_nodes_mirrors_to_all(tmp_path, autojump_clock):
    """"If there are fewer than count nodes in the cluster, the queue is mirrored to all
    nodes.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-five", r"^five\.", {"ha-mode": "exactly", "ha-params": 5})
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            await ch.queue_declare("five.q", durable=True)
        await replicas_settled(c, "five.q", ["n1", "n3"])
        assert qdef(c, "five.q").leader == "n2"
        assert replica_nodes(c, "five.q") == {"n1": "mirror", "n2": "leader", "n3": "mirror"}


async def test_exactly_replaces_a_lost_mirror_on_another_node(tmp_path, autojump_clock):
    """"If there are more than count nodes in the cluster, and a node containing a mirror goes
    down, then a new mirror will be created on another node.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "exactly", "ha-params": 2})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("two.q", durable=True)
            await c.wait_for(lambda: len(qdef(c, "two.q").mirrors) == 1, timeout=10)
            (first,) = qdef(c, "two.q").mirrors
            other = ({"n2", "n3"} - {first}).pop()
            c.kill(first)
            with trio.fail_after(TICKTIME * 3):
                await c.wait_for(lambda: qdef(c, "two.q").mirrors == (other,))
            await c.wait_for(lambda: replica_nodes(c, "two.q") == {"n1": "leader", other: "mirror"},
                             timeout=5)
            # the replacement mirror really follows: confirms need it, and it holds the message
            assert await publish_confirmed(ch, "two.q", [b"after"])
            await trio.sleep(0.5)
            assert mirror_state(c, "two.q", other).comparable() == \
                mirror_state(c, "two.q", "n1").comparable()


# --- 3. nodes with unknown / stopped names ---------------------------------------------------

async def test_nodes_policy_ignores_names_that_are_not_members(tmp_path, autojump_clock):
    """"If any of those node names are not a part of the cluster, this does not constitute an
    error.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-nodes", r"^nodes\.",
                         {"ha-mode": "nodes", "ha-params": ["n2", "rabbit@nowhere", "n3"]})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("nodes.q", durable=True)
        await c.wait_for(lambda: qdef(c, "nodes.q").leader in ("n2", "n3"), timeout=10)
        q = qdef(c, "nodes.q")
        assert {q.leader, *q.mirrors} == {"n2", "n3"}
        assert "n1" not in replica_nodes(c, "nodes.q")


async def test_nodes_policy_with_no_listed_node_running_uses_declaring_node(tmp_path, autojump_clock):
    """"If none of the nodes in the list are online at the time when the queue is declared then
    the queue will be created on the node that the declaring client is connected to.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-nodes", r"^nodes\.",
                         {"ha-mode": "nodes", "ha-params": ["rabbit@ghost", "n1"]})
        c.kill("n1")
        await c.wait_for(lambda: "n1" in c.nodes["n2"].md.down, timeout=TICKTIME * 3)
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            await ch.queue_declare("nodes.q", durable=True)
            assert qdef(c, "nodes.q", "n3").leader == "n3"
            assert qdef(c, "nodes.q", "n3").mirrors == ()
            assert await publish_confirmed(ch, "nodes.q", [b"x"])


# --- 4. exclusive --------------------------------------------------------------------------

async def test_exclusive_queues_are_never_mirrored(tmp_path, autojump_clock):
    """"exclusive queues are never mirrored (even if they match a policy stating that they
    should be). They are also never durable (even if declared as such).\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            await ch.queue_declare("ha.excl", durable=True, exclusive=True)
            await ch.queue_declare("ha.shared", durable=True)
            await replicas_settled(c, "ha.shared", ["n1", "n3"])
            assert qdef(c, "ha.excl").mirrors == ()
            assert qdef(c, "ha.excl").durable is False
            assert replica_nodes(c, "ha.excl") == {"n2": "leader"}
            # a policy change re-plans every queue: still not mirrored
            await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "exactly", "ha-params": 3})
            await trio.sleep(1)
            assert qdef(c, "ha.excl").mirrors == ()
            assert replica_nodes(c, "ha.excl") == {"n2": "leader"}


# --- 2. all and joining nodes ----------------------------------------------------------------

async def test_all_adds_a_mirror_on_a_joining_node(tmp_path, autojump_clock):
    """"When a new node is added to the cluster, the queue will be mirrored to that node." and
    "At this point, the new mirror will be empty: it will not contain any existing contents of
    the queue.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("ha.q", durable=True)
            await replicas_settled(c, "ha.q", ["n2", "n3"], synced=["n2", "n3"])
            assert await publish_confirmed(ch, "ha.q", [b"old%d" % i for i in range(5)])
            c.names.append("n4")
            n4 = await c.start_node("n4")
            await n4.stop_app()
            await n4.join_cluster("n1", PEER_PORT)
            await n4.start_app()
            await c.wait_running(["n1", "n2", "n3", "n4"])
            await replicas_settled(c, "ha.q", ["n2", "n3", "n4"], synced=["n2", "n3"])
            assert qdef(c, "ha.q").mirrors[-1] == "n4"  # the youngest
            assert await publish_confirmed(ch, "ha.q", [b"new"])
            await trio.sleep(0.5)
            assert [m[1] for m in mirror_state(c, "ha.q", "n4").ready] == [b"new"]
            assert len(mirror_state(c, "ha.q", "n2").ready) == 6
            # draining the head it lacks synchronises it
            assert len(await get_all(ch, "ha.q")) == 6
            await replicas_settled(c, "ha.q", ["n2", "n3", "n4"], synced=["n2", "n3", "n4"])


async def test_all_restarted_node_comes_back_as_youngest_empty_mirror(tmp_path, autojump_clock):
    """"as you restart other nodes, if they were previously part of a mirrored queue then they
    will rejoin the mirrored queue" and "when a mirror rejoins a mirrored queue, it throws away
    any durable local contents it already has and starts empty.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("ha.q", durable=True)
            await replicas_settled(c, "ha.q", ["n2", "n3"], synced=["n2", "n3"])
            assert await publish_confirmed(ch, "ha.q", [b"a", b"b"])
            c.kill("n2")
            with trio.fail_after(TICKTIME * 3):
                await replicas_settled(c, "ha.q", ["n3"])
            await c.restart("n2")
            await c.wait_running(["n1", "n2", "n3"])
            await replicas_settled(c, "ha.q", ["n3", "n2"], synced=["n3"])
            assert qdef(c, "ha.q").mirrors == ("n3", "n2")  # n2 is now the youngest
            await trio.sleep(0.5)
            assert len(mirror_state(c, "ha.q", "n2").ready) == 0
            assert len(mirror_state(c, "ha.q", "n3").ready) == 2


# --- 5. policy changes on live queues ---------------------------------------------------------

async def test_policy_change_makes_a_live_queue_mirrored_and_back(tmp_path, autojump_clock):
    """"Policies can change at any time; it is valid to create a non-mirrored queue, and then
    make it mirrored at some later point (and vice versa)." and "As messages are drained from
    the mirrored queue, the size of the head of the queue for which the new mirror is missing
    messages, will shrink until eventually the mirror's contents precisely match the leader's
    contents.\""""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("p.q", durable=True)
            assert await publish_confirmed(ch, "p.q", [b"%d" % i for i in range(10)])
            assert replica_nodes(c, "p.q") == {"n1": "leader"}
            await set_policy(c, "ha-p", r"^p\.", {"ha-mode": "all"})
            await replicas_settled(c, "p.q", ["n2", "n3"], synced=[])
            await trio.sleep(1)
            assert qdef(c, "p.q").synced == ()  # still missing the 10 older messages
            assert len(mirror_state(c, "p.q", "n2").ready) == 0
            assert await publish_confirmed(ch, "p.q", [b"10"])
            assert len(await get_all(ch, "p.q", limit=10)) == 10
            await replicas_settled(c, "p.q", ["n2", "n3"], synced=["n2", "n3"])
            assert [m[1] for m in mirror_state(c, "p.q", "n3").ready] == [b"10"]
            await ctl(c, "n2", "clear_policy", name="ha-p")
            await replicas_settled(c, "p.q", [])
            await c.wait_for(lambda: replica_nodes(c, "p.q") == {"n1": "leader"}, timeout=5)
            assert await get_all(ch, "p.q") == [b"10"]


async def test_exactly_three_to_two_keeps_the_oldest_mirror(tmp_path, autojump_clock):
    """"Whenever the HA policy for a queue changes it will endeavour to keep its existing
    mirrors as far as this fits with the new policy.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-x", r"^x\.", {"ha-mode": "exactly", "ha-params": 3})
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            await ch.queue_declare("x.q", durable=True)
            await replicas_settled(c, "x.q", ["n1", "n2"])
            oldest = qdef(c, "x.q").mirrors[0]
            pid_before = c.nodes[oldest].router.replicas["x.q"].replica.pid
            await set_policy(c, "ha-x", r"^x\.", {"ha-mode": "exactly", "ha-params": 2})
            await replicas_settled(c, "x.q", [oldest])
            await c.wait_for(lambda: set(replica_nodes(c, "x.q")) == {"n3", oldest}, timeout=5)
            assert c.nodes[oldest].router.replicas["x.q"].replica.pid == pid_before  # the same mirror, kept


async def test_highest_priority_policy_wins(tmp_path, autojump_clock):
    """"If a queue that's expected to be mirroring is not, this usually means ... that another
    policy takes priority (and does not enable mirroring)." (the highest priority matching
    policy applies)."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^q", {"ha-mode": "all"}, priority=1)
        await set_policy(c, "plain", r"^q\.", {"queue-master-locator": "client-local"}, priority=5)
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("q.one", durable=True)
            await ch.queue_declare("qq", durable=True)
            await replicas_settled(c, "qq", ["n2", "n3"])
            assert qdef(c, "q.one").mirrors == ()
            rows = {r["name"]: r for r in await ctl(c, "n1", "list_queues",
                                                     columns=["name", "policy", "mirror_pids"])}
            assert rows["q.one"]["policy"] == "plain" and rows["q.one"]["mirror_pids"] == []
            assert rows["qq"]["policy"] == "ha-all" and len(rows["qq"]["mirror_pids"]) == 2
            # raise the mirroring policy above the other: the live queue becomes mirrored
            await set_policy(c, "ha-all", r"^q", {"ha-mode": "all"}, priority=9)
            await replicas_settled(c, "q.one", ["n2", "n3"])


# --- 6. bad definitions ----------------------------------------------------------------------

@pytest.mark.parametrize("definition, key", [
    ('{"ha-mode":"exactly","ha-params":2', "definition"),  # bad JSON
    ({"ha-mode": "most"}, "ha-mode"),
    ({"ha-mode": "exactly"}, "ha-params"),
    ({"ha-mode": "exactly", "ha-params": 0}, "ha-params"),
    ({"ha-mode": "exactly", "ha-params": "2"}, "ha-params"),
    ({"ha-mode": "nodes", "ha-params": "n1"}, "ha-params"),
    ({"ha-mode": "all", "ha-sync-mode": 1}, "ha-sync-mode"),
    ({"ha-mode": "all", "ha-promote-on-failure": "never"}, "ha-promote-on-failure"),
    ({"ha-mode": "all", "ha-sync-batch-size": -1}, "ha-sync-batch-size"),
    ({"queue-master-locator": "random"}, "queue-master-locator"),
    ({"ha-params": 2}, "ha-params"),
])
async def test_bad_policy_definition_is_refused_and_nothing_changes(tmp_path, autojump_clock,
                                                                     definition, key):
    """"A bad definition (bad JSON, unknown mode, `exactly` without a positive count, wrong
    type) is refused with an error naming the key; nothing changes." (issue #3; the spec's
    `set_policy ... '{"ha-mode":"exactly","ha-params":2,...}'` validation)."""
    from wire.errors import ProtocolError
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "exactly", "ha-params": 2})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("two.q", durable=True)
            await c.wait_for(lambda: len(qdef(c, "two.q").mirrors) == 1, timeout=10)
        before_pol = await policies(c)
        before_q = qdef(c, "two.q")
        version = c.nodes["n1"].md.version
        for name in ("ha-two", "other"):
            with pytest.raises(ProtocolError) as err:
                await set_policy(c, name, r"^two\.", definition, node="n2")
            assert f"'{key}'" in err.value.text, err.value.text
        assert await policies(c, "n3") == before_pol
        assert c.nodes["n1"].md.version == version
        assert qdef(c, "two.q") == before_q


# --- 7. leader placement ----------------------------------------------------------------------

async def test_queue_master_locator_argument_client_local_and_balanced(tmp_path, autojump_clock):
    """"Pick the node hosting the minimum number of leaders of the same queue type: balanced";
    "Pick the node the client that declares the queue is connected to: client-local", set with
    "the `x-queue-master-locator` optional queue argument\""""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            await ch.queue_declare("local", durable=True, arguments={"x-queue-master-locator": "client-local"})
            assert qdef(c, "local").leader == "n2"
            for i in range(3):
                await ch.queue_declare(f"bal{i}", durable=True,
                                       arguments={"x-queue-master-locator": "balanced"})
            # n2 already leads "local": the fewest leaders are on n1 (most senior on a tie),
            # then n3, then all three lead one each and n1 is picked again
            assert [qdef(c, f"bal{i}").leader for i in range(3)] == ["n1", "n3", "n1"]


async def test_queue_master_locator_policy_key(tmp_path, autojump_clock):
    """"setting the `queue-master-locator` policy key" chooses the strategy: balanced spreads
    leaders over the nodes, client-local keeps them on the declaring client's node."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "spread", r"^bal\.", {"queue-master-locator": "balanced"})
        await set_policy(c, "here", r"^loc\.", {"ha-mode": "exactly", "ha-params": 2,
                                                "queue-master-locator": "client-local"})
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            for i in range(3):
                await ch.queue_declare(f"bal.{i}", durable=True)
            for i in range(3):
                await ch.queue_declare(f"loc.{i}", durable=True)
            assert [qdef(c, f"bal.{i}").leader for i in range(3)] == ["n1", "n2", "n3"]
            assert [qdef(c, f"loc.{i}").leader for i in range(3)] == ["n3"] * 3


async def test_queue_leader_locator_node_setting_and_policy_override(tmp_path, autojump_clock,
                                                                    monkeypatch):
    """"defining the `queue_leader_locator` key in the configuration file": the declaring
    node's setting applies when neither the argument nor the policy sets one; the policy key
    and the argument override it."""
    from broker.simulation import SimCluster
    plain = SimCluster.config

    def config(self, name):
        cfg = plain(self, name)
        cfg.queue_leader_locator = "balanced" if name == "n3" else "client-local"
        return cfg
    monkeypatch.setattr(SimCluster, "config", config)
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "here", r"^loc\.", {"queue-master-locator": "client-local"})
        async with c.connect("n3") as c3, c.connect("n1") as c1:
            ch3, ch1 = await c3.channel(), await c1.channel()
            await ch3.queue_declare("a", durable=True)  # n3's own setting: balanced
            await ch3.queue_declare("b", durable=True)
            await ch3.queue_declare("e", durable=True)
            assert [qdef(c, q).leader for q in ("a", "b", "e")] == ["n1", "n2", "n3"]
            # every node leads one: balanced would pick n1 now
            await ch3.queue_declare("loc.1", durable=True)  # policy: client-local
            await ch3.queue_declare("c", durable=True, arguments={"x-queue-master-locator": "client-local"})
            assert qdef(c, "loc.1").leader == "n3" and qdef(c, "c").leader == "n3"
            await ch1.queue_declare("d", durable=True)  # n1's setting: client-local
            assert qdef(c, "d").leader == "n1"


# --- 8. confirms and credit wait for every mirror ---------------------------------------------

async def test_confirms_and_publisher_held_until_silent_mirror_declared_down(tmp_path, autojump_clock,
                                                                          monkeypatch):
    """"a message will only be confirmed to the publisher when it has been accepted by all of
    the mirrors" and "Publishers will remain blocked until all mirrors issue credit or until the
    remaining nodes consider the mirror to be disconnected from the cluster.\""""
    import broker.session.publishing as publishing
    monkeypatch.setattr(publishing, "WINDOW_MSGS", 100)
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("ha.q", durable=True)
            await replicas_settled(c, "ha.q", ["n2", "n3"], synced=["n2", "n3"])
            # every mirror acknowledges one message first: a mirror counts as stalled when it
            # owes acknowledgements and its last one is stall_after old, so without it how
            # long the set-up took would decide when n3 is dropped
            assert await publish_confirmed(ch, "ha.q", [b"first"])
            confirmed: set[int] = set()
            ch.on_confirm = lambda a, b, ok, r: ok and confirmed.update(range(a, b + 1))
            (session,) = c.nodes["n1"].sessions.values()
            c.net.partition(["n1", "n2"], ["n3"])  # n3 goes silent: no link break, no rep_ok
            start = trio.current_time()
            for i in range(1000):  # 20 publish frames of 50 (the client batches what is queued)
                ch.publish_nowait("ha.q", b"%d" % i)
                if i % 50 == 49:
                    await trio.sleep(0.01)
            peak = 0
            while trio.current_time() - start < TICKTIME * 0.75:
                peak = max(peak, session.inflight_msgs)
                await trio.sleep(0.01)
            assert not confirmed  # n2 has them, n3 does not answer: nothing is confirmed
            assert 100 <= session.inflight_msgs < 1000  # the session stopped reading: held
            assert peak <= 100 + 50, peak  # bounded: the window plus one batch
            with trio.fail_after(TICKTIME * 3):
                await c.wait_for(lambda: len(confirmed) == 1000)
            assert "n3" not in qdef(c, "ha.q").mirrors
            assert len(mirror_state(c, "ha.q", "n1").ready) == 1 + 1000


# --- 9. promotion rules --------------------------------------------------------------------

async def _unsynced_mirrored_queue(c, ch, name, definition, old=10, new=3, durable=True):
    """A queue led by n1 holding `old` messages its mirrors (n2, n3, added by a policy
    afterwards) lack, then `new` that every replica has."""
    await ch.queue_declare(name, durable=durable)
    assert await publish_confirmed(ch, name, [b"old%d" % i for i in range(old)])
    await set_policy(c, "ha", "^" + name + "$", definition)
    await replicas_settled(c, name, ["n2", "n3"], synced=[])
    assert await publish_confirmed(ch, name, [b"new%d" % i for i in range(new)])
    await trio.sleep(0.5)


async def test_when_synced_on_failure_keeps_queue_unavailable_until_leader_returns(tmp_path,
                                                                                  autojump_clock):
    """"When set to `when-synced`, it will make sure that unsynchronised mirrors are not
    promoted." and "In the event of queue leader node failure the queue will become unavailable
    until queue leader recovers.\""""
    from broker.client.errors import ChannelClosedByBroker
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await _unsynced_mirrored_queue(c, ch, "w.q", {"ha-mode": "all",
                                                          "ha-promote-on-failure": "when-synced"})
        c.net.partition(["n1"], ["n2", "n3"])
        with trio.fail_after(TICKTIME * 3):
            await c.wait_for(lambda: "n1" in c.nodes["n2"].md.down)
        await trio.sleep(1)
        assert qdef(c, "w.q", "n2").leader == "n1"  # nobody promoted
        assert replica_nodes(c, "w.q").get("n2") != "leader"
        async with c.connect("n2") as c2:
            ch2 = await c2.channel()
            await ch2.confirm_delivery()
            answers: list[tuple[int, int, bool, str]] = []
            ch2.on_confirm = lambda first, last, ok, reason: answers.append((first, last, ok, reason))
            ch2.publish_nowait("w.q", b"during")
            assert not await ch2.wait_for_confirms(timeout=5)
            # read the answer from the callback: wait_for_confirms empties ch2.nacked
            assert answers == [(1, 1, False, "home node 'n1' of durable queue 'w.q' in vhost '/' "
                                             "is down or inaccessible")], answers
            ch3 = await c2.channel()
            with pytest.raises(ChannelClosedByBroker) as err:
                await ch3.queue_declare("w.q", durable=True)
            assert err.value.reply_text == ("home node 'n1' of durable queue 'w.q' in vhost '/' "
                                            "is down or inaccessible")
        c.net.heal()
        await c.wait_running(["n1", "n2", "n3"])
        await c.wait_for(lambda: all(not n.md.down for n in c.nodes.values()), timeout=TICKTIME * 3)
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            got = await get_all(ch, "w.q")
        assert got == [b"old%d" % i for i in range(10)] + [b"new%d" % i for i in range(3)]


async def test_default_promotes_unsynchronised_mirror_on_failure_losing_the_head(tmp_path,
                                                                                 autojump_clock):
    """"By default if a queue's leader node fails ... the oldest mirror will be promoted to be
    the new leader. In some circumstances this mirror can be unsynchronised, which will cause
    data loss." ("An uncontrolled leader shutdown ... will still trigger a promotion of an
    unsynchronised mirror.")"""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await _unsynced_mirrored_queue(c, ch, "a.q", {"ha-mode": "all"})
        c.kill("n1")
        with trio.fail_after(TICKTIME * 3):
            await c.wait_for(lambda: qdef(c, "a.q", "n2").leader == "n2")
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            got = await get_all(ch, "a.q")
        assert got == [b"new%d" % i for i in range(3)]  # the 10 only n1 had are lost


@pytest.mark.parametrize("definition, synced, promoted", [
    ({"ha-mode": "all"}, True, True),
    ({"ha-mode": "all"}, False, False),
    ({"ha-mode": "all", "ha-promote-on-shutdown": "always"}, False, True),
    ({"ha-mode": "all", "ha-promote-on-shutdown": "always",
      "ha-promote-on-failure": "when-synced"}, False, False),
])
async def test_controlled_shutdown_promotion(tmp_path, autojump_clock, definition, synced, promoted):
    """"By default, RabbitMQ will refuse to promote an unsynchronised mirror on controlled
    leader shutdown"; "set the `ha-promote-on-shutdown` policy key to `always`" to promote it;
    "If the `ha-promote-on-failure` policy key is set to `when-synced`, unsynchronised mirrors
    will not be promoted even if the `ha-promote-on-shutdown` key is set to `always`.\""""
    from broker.client.errors import ChannelClosedByBroker
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            if synced:
                await set_policy(c, "ha", r"^s\.q$", definition)
                await ch.queue_declare("s.q", durable=True)
                await replicas_settled(c, "s.q", ["n2", "n3"], synced=["n2", "n3"])
                assert await publish_confirmed(ch, "s.q", [b"m%d" % i for i in range(13)])
            else:
                await _unsynced_mirrored_queue(c, ch, "s.q", definition)
        await ctl(c, "n1", "stop_app")
        await trio.sleep(1)
        q = qdef(c, "s.q", "n2")
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            if promoted:
                assert q.leader == "n2" and q.mirrors == ("n3",)
                got = await get_all(ch, "s.q")
                assert len(got) == (13 if synced else 3)
            else:
                assert q.leader == "n1"
                assert replica_nodes(c, "s.q").get("n2") == "mirror"
                with pytest.raises(ChannelClosedByBroker) as err:
                    await ch.basic_get("s.q")
                assert "is down or inaccessible" in err.value.reply_text


# --- 10. x-cancel-on-ha-failover -----------------------------------------------------------

async def test_cancel_on_ha_failover_argument(tmp_path, autojump_clock):
    """"they can consume with the argument `x-cancel-on-ha-failover` set to `true`. Their
    consuming will then be cancelled on failover"; the others keep consuming, and "all
    unacknowledged messages are redelivered with the `redelivered` flag set.\""""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("ha.q", durable=True)
            await replicas_settled(c, "ha.q", ["n2", "n3"], synced=["n2", "n3"])
            assert await publish_confirmed(ch, "ha.q", [b"%02d" % i for i in range(20)])
        async with c.connect("n2") as c2, c.connect("n3") as c3:
            cha, chb = await c2.channel(), await c3.channel()
            await cha.basic_qos(prefetch_count=5)
            await chb.basic_qos(prefetch_count=5)
            ca = await cha.basic_consume("ha.q", arguments={"x-cancel-on-ha-failover": True})
            cb = await chb.basic_consume("ha.q")
            first_a = [await ca.__anext__() for _ in range(5)]
            first_b = [await cb.__anext__() for _ in range(5)]
            before = {m.body for m in first_a + first_b}
            assert len(before) == 10 and not any(m.redelivered for m in first_a + first_b)
            c.kill("n1")
            with trio.fail_after(TICKTIME * 3):
                rest_a = [m async for m in ca]  # ends when cancelled
            assert rest_a == []
            assert ca.cancelled_reason and "failed over" in ca.cancelled_reason
            got: dict[bytes, bool] = {}
            with trio.fail_after(TICKTIME * 3):
                async for msg in cb:  # the same consumer, no new basic.consume
                    got[msg.body] = msg.redelivered
                    chb.basic_ack(msg.delivery_tag)
                    if len(got) == 20:
                        break
            assert set(got) == {b"%02d" % i for i in range(20)}
            # the unacknowledged ones are flagged; so is everything else the new leader held
            # then (the old leader may have delivered it without the new one hearing of it)
            assert {b for b, r in got.items() if r} >= before
            assert all(got.values())
            assert cb.cancelled_reason is None


# --- 11. nodes hand-over ------------------------------------------------------------------

async def test_nodes_policy_change_keeps_old_leader_until_a_new_mirror_is_synchronised(
        tmp_path, autojump_clock):
    """"if a queue is on [A B] (with A the leader), and you give it a nodes policy telling it to
    be on [C D], it will initially end up on [A C D]. As soon as the queue synchronises on its
    new mirrors [C D], the leader on A will shut down.\""""
    async with sim_cluster(tmp_path, names=("n1", "n2", "n3", "n4")) as c:
        await set_policy(c, "ha-nodes", r"^nodes\.", {"ha-mode": "nodes", "ha-params": ["n1", "n2"]})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("nodes.q", durable=True)
            await replicas_settled(c, "nodes.q", ["n2"])
            assert qdef(c, "nodes.q").leader == "n1"
            assert await publish_confirmed(ch, "nodes.q", [b"h%d" % i for i in range(20)])
        await set_policy(c, "ha-nodes", r"^nodes\.", {"ha-mode": "nodes", "ha-params": ["n3", "n4"]})
        await replicas_settled(c, "nodes.q", ["n3", "n4"], synced=[])
        await trio.sleep(TICKTIME)
        q = qdef(c, "nodes.q")
        assert q.leader == "n1" and q.mirrors == ("n3", "n4")  # [A C D]
        assert replica_nodes(c, "nodes.q") == {"n1": "leader", "n3": "mirror", "n4": "mirror"}
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            assert await publish_confirmed(ch, "nodes.q", [b"t0", b"t1"])
            assert await get_all(ch, "nodes.q", limit=20) == [b"h%d" % i for i in range(20)]
            await c.wait_for(lambda: qdef(c, "nodes.q").leader in ("n3", "n4"), timeout=10)
            await c.wait_for(lambda: set(replica_nodes(c, "nodes.q")) == {"n3", "n4"}, timeout=10)
            q = qdef(c, "nodes.q")
            assert {q.leader, *q.mirrors} == {"n3", "n4"}
            assert await get_all(ch, "nodes.q") == [b"t0", b"t1"]


# --- 12. no promotable mirror: durable waits, non-durable is deleted -----------------------------

@pytest.mark.parametrize("durable", [True, False])
async def test_leader_lost_without_promotable_mirror(tmp_path, autojump_clock, durable):
    """"A durable queue will become unavailable until the node comes back. All operations on a
    durable queue with unavailable leader node will fail with a message ... home node
    'rabbit@hostname' of durable queue 'queue-name' in vhost '/' is down or inaccessible" and
    "A non-durable one will be deleted.\""""
    from broker.client.errors import ChannelClosedByBroker
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await _unsynced_mirrored_queue(c, ch, "t.q", {"ha-mode": "all",
                                                          "ha-promote-on-failure": "when-synced"},
                                           durable=durable)
        c.kill("n1")
        with trio.fail_after(TICKTIME * 3):
            await c.wait_for(lambda: "n1" in c.nodes["n2"].md.down)
        await trio.sleep(1)
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            if durable:
                assert qdef(c, "t.q", "n3").leader == "n1"
                with pytest.raises(ChannelClosedByBroker) as err:
                    await ch.queue_declare("t.q", durable=True)
                assert err.value.reply_text == ("home node 'n1' of durable queue 't.q' in vhost "
                                                "'/' is down or inaccessible")
            else:
                assert "t.q" not in c.nodes["n2"].md.queues
                assert "t.q" not in c.nodes["n3"].md.queues
                assert replica_nodes(c, "t.q") == {}
                with pytest.raises(ChannelClosedByBroker):
                    await ch.queue_declare("t.q", passive=True)


async def test_large_messages_never_make_a_frame_too_big(tmp_path, autojump_clock):
    """More bodies than one frame may hold (16 MB of 64 KiB messages, frames of 8 MiB) cross
    replication and delivery in several batches; an auto-ack consumer with unlimited prefetch
    (which sends nothing back) still gets every one."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch = await c1.channel()
            await ch.queue_declare("ha.big", durable=True)
            await replicas_settled(c, "ha.big", ["n2", "n3"], synced=["n2", "n3"])
            await ch.confirm_delivery()
            for i in range(256):
                ch.publish_nowait("ha.big", i.to_bytes(4, "big") + b"b" * (65536 - 4))
            assert await ch.wait_for_confirms(timeout=30)
            assert mirror_state(c, "ha.big", "n2").message_count == 256
            sub = await c3.channel()
            consumer = await sub.basic_consume("ha.big", auto_ack=True)
            got = []
            with trio.fail_after(30):
                async for msg in consumer:
                    got.append(int.from_bytes(msg.body[:4], "big"))
                    if len(got) == 256:
                        break
            assert got == list(range(256))


async def test_publishes_resent_to_a_new_leader_are_not_enqueued_twice(tmp_path, autojump_clock):
    """"no messages that are published to the mirrored queue during this time will be lost" -
    nor doubled: the session resends what was in flight to the promoted mirror, which already
    has most of it and must not enqueue it again. Nothing was delivered before the failover, so
    every message must come out exactly once."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "exactly", "ha-params": 2})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("two.d", durable=True)
        await c.wait_for(lambda: qdef(c, "two.d").mirrors == ("n2",) and
                         qdef(c, "two.d").synced == ("n2",), 20)
        # the leader-mirror link is slow (0.5 s each way): a publish reaches the mirror after
        # 0.5 s and its acknowledgement the leader after 1 s, so in between it is on both and
        # not yet confirmed
        c.net.delay("n1", "n2", 0.5)
        async with c.connect("n3") as c3:
            ch3 = await c3.channel()
            await ch3.confirm_delivery()
            for i in range(200):
                ch3.publish_nowait("two.d", i.to_bytes(4, "big"))
            await trio.sleep(0.75)
            assert mirror_state(c, "two.d", "n2").message_count == 200
            session = next(iter(c.nodes["n3"].sessions.values()))
            assert session.inflight_msgs > 0
            c.kill("n1")
            assert await ch3.wait_for_confirms(timeout=TICKTIME * 3)
            got = await get_all(ch3, "two.d")
        ids = [int.from_bytes(b, "big") for b in got]
        assert sorted(ids) == list(range(200)), f"{len(ids)} messages, {len(ids) - len(set(ids))} repeats"


async def test_a_last_ack_reaches_the_mirrors_within_the_settle_linger(tmp_path, autojump_clock):
    """Acks alone wait at most SETTLE_LINGER for a batch to ride with; the queue's task sleeps
    meanwhile, and a round run at the end of a peer batch (QueueProcess.after_batch) must move
    its timer to that deadline, not leave it at the next housekeeping tick a second away."""
    from mirroring.replica import SETTLE_LINGER

    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1, c.connect("n2") as c2:
            ch1, ch2 = await c1.channel(), await c2.channel()
            await declare_on_all_nodes(c, ch1, "ha.q")
            ch1.publish_nowait("ha.q", b"only")
            assert await ch1.wait_for_confirms(timeout=10)
            consumer = await ch2.basic_consume("ha.q")  # on n2: the ack reaches n1 over a peer link
            async for msg in consumer:
                await trio.sleep(0.5)  # every housekeeping timer is well under way
                ch2.basic_ack(msg.delivery_tag)
                break
            await trio.sleep(SETTLE_LINGER + 0.05)
            for node in ("n2", "n3"):
                assert not mirror_state(c, "ha.q", node).unacked, node


async def test_acks_of_a_promoted_leaders_redeliveries_wait_for_the_route_to_it(tmp_path, autojump_clock, monkeypatch):
    """"It requeues all messages that have been delivered to clients but are pending
    acknowledgement": the promoted leader redelivers to a consumer whose node has not yet
    applied the change that names it (its metadata lags). The consumer's acks of the
    redeliveries must reach the new leader, which alone counts them in flight; sent where the
    lagging metadata points, to the old leader, they were lost, and the new leader held the
    consumer's prefetch used up for good (dst seed 116560: 4,164 messages stranded). Every
    message published after the failover must still be delivered."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "nodes", "ha-params": ["n1", "n2"]})
        async with c.connect("n2") as c2:
            await (await c2.channel()).queue_declare(
                "two.q", durable=True, arguments={"x-queue-master-locator": "client-local"})
        await replicas_settled(c, "two.q", ["n1"], synced=["n1"])
        assert qdef(c, "two.q").leader == "n2"
        n3 = c.nodes["n3"]
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            pub, sub = await c1.channel(), await c3.channel()
            await pub.confirm_delivery()
            await sub.basic_qos(prefetch_count=10)
            consumer = await sub.basic_consume("two.q")
            got: list[tuple[int, bool, int]] = []  # (id, redelivered, delivery tag)

            async def consume():
                async for msg in consumer:
                    got.append((int(msg.body), msg.redelivered, msg.delivery_tag))

            c.nursery.start_soon(consume)
            for i in range(10):
                pub.publish_nowait("two.q", b"%d" % i)
            assert await pub.wait_for_confirms(timeout=10)
            await c.wait_for(lambda: len(got) == 10, 5, "the first ten delivered by n2")
            # n3 has not heard yet that the change naming n1 is committed (the log's next word
            # to it is late): by what it knows it is in step, and it has not applied the
            # change, so its route still names n2 when n1's redelivery comes
            assert n3.cluster.leader == "n1", "the log led by the node that survives"
            apply = n3.cluster._apply_committed
            monkeypatch.setattr(n3.cluster, "_apply_committed", lambda: None)
            monkeypatch.setattr(n3.cluster, "in_step", lambda now=None: True)
            c.kill("n2")
            await c.wait_for(lambda: qdef(c, "two.q").leader == "n1", 10, "n1 promoted")
            await c.wait_for(lambda: len(got) == 20, 10, "n1's redelivery of the ten")
            assert all(redelivered for _, redelivered, _ in got[10:])
            assert n3.md.queues["two.q"].leader == "n2", "n3's metadata caught up too soon"
            sub.basic_ack(got[-1][2], multiple=True)  # every delivery so far, of both leaders
            await trio.sleep(0.5)
            monkeypatch.undo()
            apply()
            await c.wait_for(lambda: n3.md.queues["two.q"].leader == "n1", 5, "n3 caught up")
            for i in range(10, 20):  # a prefetch's worth: the new leader must count none in flight
                pub.publish_nowait("two.q", b"%d" % i)
            assert await pub.wait_for_confirms(timeout=10)
            await c.wait_for(lambda: {i for i, _, _ in got} == set(range(20)), 10,
                             "every message published after the failover delivered")


async def test_a_policy_carries_queue_limits_as_rabbitmq_policies_do(tmp_path, autojump_clock):
    """RabbitMQ's policies set a classic queue's limits besides its ha keys. `max-length` added
    to the policy of a mirrored queue that holds ten messages drops its oldest six, on every
    replica alike; where the queue's own x-max-length is lower, that one counts (the lower of
    the two, RabbitMQ's rule); `overflow: reject-publish` from the policy nacks what does not
    fit; `queue-mode: lazy` is accepted."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await declare_on_all_nodes(c, ch, "ha.lim")
            await ch.queue_declare("ha.own", durable=True, arguments={"x-max-length": 2})
            await replicas_settled(c, "ha.own", ["n2", "n3"])
            for i in range(10):
                ch.publish_nowait("ha.lim", b"%d" % i)
                ch.publish_nowait("ha.own", b"%d" % i)
            assert await ch.wait_for_confirms(timeout=10)

            def bodies(queue, node):
                return [m[1] for m in mirror_state(c, queue, node).ready]

            assert bodies("ha.lim", "n1") == [b"%d" % i for i in range(10)]
            assert bodies("ha.own", "n1") == [b"8", b"9"]
            await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all", "max-length": 4, "queue-mode": "lazy"})
            await c.wait_for(lambda: all(bodies("ha.lim", n) == [b"6", b"7", b"8", b"9"]
                                         for n in ("n1", "n2", "n3")), 5, "the oldest six dropped everywhere")
            assert all(bodies("ha.own", n) == [b"8", b"9"] for n in ("n1", "n2", "n3"))  # its own 2 < 4
            ch.publish_nowait("ha.own", b"10")
            assert await ch.wait_for_confirms(timeout=10)
            assert bodies("ha.own", "n1") == [b"9", b"10"]

            await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all", "max-length": 4,
                                                     "overflow": "reject-publish"})
            nacked: set[int] = set()
            ch.on_confirm = lambda first, last, ok, reason: None if ok else nacked.update(range(first, last + 1))
            await trio.sleep(0.5)
            ch.publish_nowait("ha.lim", b"too many")
            assert not await ch.wait_for_confirms(timeout=10)
            assert len(nacked) == 1
            assert bodies("ha.lim", "n1") == [b"6", b"7", b"8", b"9"]
            for n in ("n2", "n3"):
                assert mirror_state(c, "ha.lim", n).comparable() == mirror_state(c, "ha.lim", "n1").comparable()
