"""Partitions on the simulated network: what pause_minority and the metadata log promise.

* A leader cut off from the majority confirms nothing a mirror on the other side has not
  acknowledged; the majority promotes a synchronised mirror; after the heal the old leader steps
  down; every confirmed message is delivered (checked by id).
* A link cut between a session's node and the queue leader's node only (both still see the
  majority): the leader drops the session's consumers and requeues their messages, and when the
  link is back the session registers its consumer again, so it keeps receiving.
"""

from __future__ import annotations

import json

import pytest
import trio

from broker.control import ctl_call
from broker.simulation import PEER_PORT, TICKTIME, sim_cluster

pytestmark = pytest.mark.timeout(60)


async def set_policy(c, definition: dict, pattern: str = r"^p\.") -> None:
    await ctl_call(c.net.host("n1"), "n1", PEER_PORT, "t", b"s", "set_policy",
                   {"name": "p", "pattern": pattern, "definition": json.dumps(definition)})


def qdef(c, name, node="n2"):
    return c.nodes[node].md.queues[name]


async def plain_queue_off_the_log_leader(c, name: str) -> tuple[str, str, str]:
    """Declare `name` (durable, not mirrored) on one of the two nodes that do not lead the
    metadata log; (the log's leader, the queue's node, the other node)."""
    log_leader = c.nodes["n1"].cluster.leader
    q_node, other = [n for n in c.names if n != log_leader]
    async with c.connect(q_node) as conn:
        ch = await conn.channel()
        await ch.queue_declare(name, durable=True)
    return log_leader, q_node, other


async def test_a_leader_cut_off_from_the_majority_confirms_nothing_that_is_lost(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, {"ha-mode": "all", "ha-sync-mode": "automatic"})
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("p.q", durable=True)
        await c.wait_for(lambda: sorted(qdef(c, "p.q").synced) == ["n2", "n3"], 20, "mirrors synced")
        confirmed: set[int] = set()
        seq_to_id: dict[int, int] = {}
        # a publisher that can only reach n1 (it follows its node into the minority)
        async with c.client("pub", ["n1"], reconnect=False) as pub:
            pch = await pub.channel()
            await pch.confirm_delivery()
            pch.on_confirm = lambda a, b, ok, why: ok and confirmed.update(seq_to_id[s] for s in range(a, b + 1))

            async def publish(first: int, n: int):
                for i in range(first, first + n):
                    seq = pch.publish_nowait("p.q", i.to_bytes(4, "big"))
                    seq_to_id[seq] = i
                    await trio.sleep(0.01)

            await publish(0, 100)
            await c.wait_for(lambda: set(range(100)) <= confirmed, 10, "the first 100 confirms")
            c.net.partition(["n1", "pub"], ["n2", "n3"])
            with trio.move_on_after(TICKTIME * 3):  # the pause closes the publisher's connection
                try:
                    await publish(100, 400)
                except Exception:  # noqa: BLE001 - its connection went with the pause
                    pass
        after_cut = confirmed - set(range(100))
        # the majority promoted one of its (synchronised) mirrors meanwhile
        await c.wait_for(lambda: qdef(c, "p.q").leader in ("n2", "n3"), 20, "a promotion")
        c.net.heal()
        await c.wait_for(lambda: c.nodes["n1"].md.queues["p.q"].leader != "n1", 30, "n1 to catch up")
        got: set[int] = set()
        async with c.connect("n2") as conn:
            ch = await conn.channel()
            while True:
                msg = await ch.basic_get("p.q", auto_ack=True)
                if msg is None:
                    break
                got.add(int.from_bytes(msg.body, "big"))
        lost = confirmed - got
        assert not lost, f"confirmed and lost: {sorted(lost)[:10]} ({len(lost)}; {len(after_cut)} confirmed after the cut)"


async def test_a_consumer_keeps_receiving_after_its_link_to_the_leader_comes_back(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        # the queue's leader and the consumer's node are the two nodes that do not lead the
        # metadata log: cutting the link between them leaves both with a working majority
        _, q_node, s_node = await plain_queue_off_the_log_leader(c, "p.c")
        got: list[int] = []
        async with c.client("sub", [s_node], reconnect=False) as sub, c.connect(q_node) as pconn:
            sch = await sub.channel()
            consumer = await sch.basic_consume("p.c")
            pch = await pconn.channel()
            await pch.confirm_delivery()

            async def consume():
                async for msg in consumer:
                    got.append(int.from_bytes(msg.body, "big"))
                    sch.basic_ack(msg.delivery_tag)

            async with trio.open_nursery() as n:
                n.start_soon(consume)
                for i in range(20):
                    pch.publish_nowait("p.c", i.to_bytes(4, "big"))
                assert await pch.wait_for_confirms(timeout=10)
                await c.wait_for(lambda: len(set(got)) == 20, 10, "the first 20")
                c.net.partition([q_node], [s_node])  # only that link
                await trio.sleep(TICKTIME * 2)  # the link times out on both sides
                assert s_node not in c.nodes[q_node].links
                c.net.heal()
                await c.wait_for(lambda: s_node in c.nodes[q_node].links, 30, "the link back")
                for i in range(20, 40):
                    pch.publish_nowait("p.c", i.to_bytes(4, "big"))
                assert await pch.wait_for_confirms(timeout=10)
                await c.wait_for(lambda: set(got) >= set(range(40)), 20,
                                 "the consumer to receive what was published after the link came back")
                n.cancel_scope.cancel()


async def test_a_leader_cut_off_stops_delivering_to_its_own_consumers_before_it_is_replaced(
        tmp_path, autojump_clock):
    """The leader's node falls into a minority with a consumer of its own (connected to it
    only). The majority promotes a mirror after net_ticktime and redelivers, flagged, what the
    old leader had not had acknowledged; the old leader pauses its clients (pause_minority) a
    while later. Until then it must not hand its consumer anything: it is out of step with the
    metadata log (broker/router.py `may_deliver`), and whatever it handed out now would reach
    its consumer unflagged after the new leader's flagged redelivery elsewhere."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, {"ha-mode": "all", "ha-sync-mode": "automatic"})
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("p.r", durable=True)
            await ch.confirm_delivery()
            for i in range(2000):
                ch.publish_nowait("p.r", i.to_bytes(4, "big"))
            assert await ch.wait_for_confirms(timeout=10)
        await c.wait_for(lambda: sorted(qdef(c, "p.r").synced) == ["n2", "n3"], 20, "mirrors synced")
        seen: list[tuple[float, str, int, bool]] = []  # (time, consumer, id, redelivered)
        cut_at = []

        async def old_leaders_consumer():
            """Connected to n1 only; slow, so n1's queue always has more to hand it."""
            try:
                async with c.client("sub", ["n1"], reconnect=False) as sub:
                    sch = await sub.channel()
                    await sch.basic_qos(5)
                    async for msg in await sch.basic_consume("p.r"):
                        seen.append((trio.current_time(), "old", int.from_bytes(msg.body, "big"),
                                     msg.redelivered))
                        await trio.sleep(0.02)
                        sch.basic_ack(msg.delivery_tag)
            except Exception:  # noqa: BLE001 - its connection goes with the pause
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(old_leaders_consumer)
            await trio.sleep(1)
            cut_at.append(trio.current_time())
            c.net.partition(["n1", "sub"], ["n2", "n3"])
            await c.wait_for(lambda: qdef(c, "p.r").leader in ("n2", "n3"), 30, "a promotion")
            async with c.connect("n2") as conn2:
                ch2 = await conn2.channel()
                await ch2.basic_qos(100)
                other = await ch2.basic_consume("p.r")
                with trio.move_on_after(TICKTIME):
                    async for msg in other:
                        seen.append((trio.current_time(), "new", int.from_bytes(msg.body, "big"),
                                     msg.redelivered))
                        ch2.basic_ack(msg.delivery_tag)
            nursery.cancel_scope.cancel()
        old_after_cut = [s for s in seen if s[1] == "old" and s[0] > cut_at[0] + TICKTIME / 2]
        assert not old_after_cut, f"{len(old_after_cut)} deliveries by the cut-off leader, e.g. {old_after_cut[:3]}"
        first: dict[int, tuple] = {}
        unflagged = []
        for s in sorted(seen):
            if s[2] in first and not s[3]:
                unflagged.append((first[s[2]], s))
            first.setdefault(s[2], s)
        assert not unflagged, f"{len(unflagged)} repeats without redelivered, e.g. {unflagged[:2]}"
        assert {s[2] for s in seen} == set(range(2000))


async def test_a_publisher_whose_queue_node_is_counted_down_then_cut_off_is_nacked_not_left_waiting(
        tmp_path, autojump_clock):
    """The log counts a queue's node down while the publisher's node still has its link to it
    (only the link to the log's leader broke), then that link breaks too. Nothing changes in
    the metadata then, so nothing but the broken link can tell the session: it fails the queue
    at once (as a change naming it would), and the publisher's messages are nacked, not left
    waiting until the node comes back."""
    async with sim_cluster(tmp_path) as c:
        log_leader, q_node, p_node = await plain_queue_off_the_log_leader(c, "p.alone")
        async with c.connect(p_node) as pconn:
            pch = await pconn.channel()
            await pch.confirm_delivery()
            pch.publish_nowait("p.alone", b"before")
            assert await pch.wait_for_confirms(timeout=10)
            c.net.partition([log_leader], [q_node])
            await c.wait_for(lambda: q_node in c.nodes[p_node].md.down, 30,
                             "the log to count the queue's node down")
            assert q_node in c.nodes[p_node].links  # still linked: publishes still go there
            c.net.partition([p_node], [q_node])
            pch.publish_nowait("p.alone", b"lost with the link")  # sent into the cut
            with trio.fail_after(TICKTIME * 3):  # the link times out after about TICKTIME
                assert await pch.wait_for_confirms() is False  # nacked, not left waiting
            assert q_node not in c.nodes[p_node].links


async def test_a_paused_minority_resumes_as_soon_as_it_hears_the_leader(tmp_path, autojump_clock):
    """A node paused by pause_minority takes clients again the moment it hears from the
    metadata log's leader, not at its next periodic check (up to half a second later): a client
    that connects as soon as the cluster is whole again (a node just rejoined and started) is
    not refused as "cannot reach a majority" by a node that can."""
    async with sim_cluster(tmp_path) as c:
        n1 = c.nodes["n1"].cluster
        c.net.partition(["n1"], ["n2", "n3"])
        await c.wait_for(lambda: n1.paused, 3 * TICKTIME, "n1 paused")
        c.net.heal()
        for _ in range(int(3 * TICKTIME / 0.001)):
            if n1.raft.has_quorum_contact(trio.current_time()):
                break
            await trio.sleep(0.001)
        else:
            pytest.fail("n1 never heard from a leader after the heal")
        assert not n1.paused, "n1 heard from the leader and still refuses clients"


async def test_an_app_started_again_is_not_paused_before_it_has_dialed(tmp_path, autojump_clock):
    """A node paused by pause_minority, its app stopped and started again once the partition is
    over, gets a new grace before it pauses: it does not refuse clients for the old run's
    silence before it has even dialed its peers."""
    async with sim_cluster(tmp_path) as c:
        node = c.nodes["n1"]
        c.net.partition(["n1"], ["n2", "n3"])
        await c.wait_for(lambda: node.cluster.paused, 3 * TICKTIME, "n1 paused")
        await node.stop_app()
        c.net.heal()
        await node.start_app()
        seen_paused = False
        for _ in range(int(TICKTIME / 0.001)):
            seen_paused = seen_paused or node.cluster.paused
            if node.cluster.raft.has_quorum_contact(trio.current_time()):
                break
            await trio.sleep(0.001)
        else:
            pytest.fail("n1 never heard from a leader after its app started")
        assert not seen_paused and not node.cluster.paused


async def test_a_node_paused_behind_a_partial_partition_shows_paused_to_the_node_it_still_reaches(
        tmp_path, autojump_clock):
    """Cut only the link between the metadata log's leader and one other node: that node hears
    no leader and pauses (pause_minority), though its link to the third node stays up. The
    third node's /api/nodes shows it paused and not running (as RabbitMQ shows a paused node,
    whose app is stopped), and its own is-in-service check fails; both recover once it resumes."""
    from broker.management import Management
    from broker.management.app import nodes_json, out_of_service
    from broker.management.state import metadata

    async with sim_cluster(tmp_path) as c:
        leader = c.nodes["n1"].cluster.leader
        cut, witness = [n for n in c.names if n != leader]
        c.net.partition([leader], [cut])
        await c.wait_for(lambda: c.nodes[cut].cluster.paused, 3 * TICKTIME, f"{cut} paused")
        seen = c.nodes[witness]
        assert cut in seen.running  # the link is up: only the paused state can tell

        def row(name):
            rows = nodes_json(Management(seen), metadata(seen))
            return next(r for r in rows if r["name"] == name)

        assert "cannot reach a majority" in out_of_service(c.nodes[cut])  # is-in-service: 503
        await c.wait_for(lambda: row(cut)["paused"], TICKTIME, f"{witness} hears {cut} paused")
        assert row(cut)["running"] is False
        assert row(leader)["running"] is True and row(leader)["paused"] is False
        c.net.heal()
        await c.wait_for(lambda: not c.nodes[cut].cluster.paused, 3 * TICKTIME, f"{cut} resumed")
        await c.wait_for(lambda: row(cut)["running"], TICKTIME, f"{witness} hears {cut} resumed")
        assert row(cut)["paused"] is False
        assert out_of_service(c.nodes[cut]) is None
