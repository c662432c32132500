"""Whole-cluster tests on SimNetwork under trio's MockClock (autojump)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from broker.client.errors import ChannelClosedByBroker

from broker.session import Session
from broker.simulation import TICKTIME, sim_cluster
from mirroring.changes import PolicySet
from mirroring.records import Policy
from wire import messages as m

pytestmark = pytest.mark.timeout(20)


async def test_cluster_forms_and_members_agree(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        for name, node in c.nodes.items():
            assert node.running == {"n1", "n2", "n3"}, name
            assert list(node.md.members) == ["n1", "n2", "n3"], name
        versions = {(n.md.version, n.md.digest()) for n in c.nodes.values()}
        assert len(versions) == 1


async def test_a_proposal_that_is_not_a_change_is_refused_and_a_typed_one_commits(tmp_path, autojump_clock):
    """Proposals cross the peer wire as plain arrays; the log's leader types them (and says
    what is wrong with one that is not a change) before planning it."""
    async with sim_cluster(tmp_path) as c:
        leader = c.nodes["n1"].cluster.leader
        asker = c.nodes[next(n for n in c.nodes if n != leader)].cluster
        link = asker.links[leader]
        for bad, why in ((["frobnicate", 1], "unknown metadata change 'frobnicate'"),
                         (["node.up", "n2", "seven"], "Expected `int`")):
            reply = await asker._call(link, lambda rid, bad=bad: m.MetaPropose(rid, bad))
            assert not reply.ok and why in reply.error, reply
        await asker.propose(PolicySet(Policy("ha", ".*", {"ha-mode": "all"}, 0, "queues")))
        await c.wait_for(lambda: all("ha" in n.md.policies for n in c.nodes.values()))
        assert len({(n.md.version, n.md.digest()) for n in c.nodes.values()}) == 1


def record_running_changes(node):
    """Wrap the node's link_up/link_down hooks to log (time, 'up'|'down', peer)."""
    events = []
    up, down = node.link_up, node.link_down

    def on_up(peer):
        events.append((trio.current_time(), "up", peer))
        return up(peer)

    def on_down(peer):
        events.append((trio.current_time(), "down", peer))
        return down(peer)

    node.link_up, node.link_down = on_up, on_down
    return events


async def test_declare_publish_consume_across_nodes(tmp_path, autojump_clock):
    """Declared on n1 (its leader), published via n2, consumed via n3: all routed to n1.

    The consumer subscribes before the messages exist: see
    test_consume_with_messages_already_ready for why."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1, c.connect("n2") as c2, c.connect("n3") as c3:
            ch1, ch2, ch3 = await c1.channel(), await c2.channel(), await c3.channel()
            await ch1.queue_declare("q", durable=True)
            await c.wait_for(lambda: all("q" in n.md.queues for n in c.nodes.values()))
            assert all(n.md.queues["q"].leader == "n1" for n in c.nodes.values())
            assert set(c.nodes["n1"].router.replicas) == {"q"}
            assert not c.nodes["n2"].router.replicas and not c.nodes["n3"].router.replicas
            consumer = await ch3.basic_consume("q")
            await ch2.confirm_delivery()
            for i in range(5):
                ch2.publish_nowait("q", b"m%d" % i)
            assert await ch2.wait_for_confirms(timeout=10)
            got = []
            with trio.fail_after(10):
                async for msg in consumer:
                    got.append(msg.body)
                    assert msg.redelivered is False
                    ch3.basic_ack(msg.delivery_tag)
                    if len(got) == 5:
                        break
            assert got == [b"m0", b"m1", b"m2", b"m3", b"m4"]
            state = c.nodes["n1"].router.replicas["q"].replica.q
            await c.wait_for(lambda: state.stats()["messages"] == 0, timeout=5)


async def test_consume_with_messages_already_ready(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch1, ch3 = await c1.channel(), await c3.channel()
            await ch1.queue_declare("q")
            await ch1.confirm_delivery()
            ch1.publish_nowait("q", b"x")
            assert await ch1.wait_for_confirms(timeout=10)
            consumer = await ch3.basic_consume("q")
            with trio.fail_after(5):
                msg = await consumer.__anext__()
            assert msg.body == b"x"


async def test_home_node_down(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch1 = await c1.channel()
            await ch1.queue_declare("q", durable=True)
            await ch1.queue_declare("t", durable=False)
            await c.wait_for(lambda: all({"q", "t"} <= set(n.md.queues) for n in c.nodes.values()))
        c.kill("n1")
        await c.wait_running(["n2", "n3"], timeout=3 * TICKTIME)
        await c.wait_for(lambda: all("t" not in c.nodes[n].md.queues for n in ("n2", "n3")),
                         timeout=10)
        assert all("q" in c.nodes[n].md.queues for n in ("n2", "n3"))
        expected = "home node 'n1' of durable queue 'q' in vhost '/' is down or inaccessible"
        async with c.connect("n2") as c2:
            for op in ("get", "consume", "declare", "passive"):
                ch = await c2.channel()
                with pytest.raises(ChannelClosedByBroker) as ei:
                    if op == "get":
                        await ch.basic_get("q")
                    elif op == "consume":
                        await ch.basic_consume("q")
                    elif op == "declare":
                        await ch.queue_declare("q", durable=True)
                    else:
                        await ch.queue_declare("q", passive=True)
                assert ei.value.reply_text == expected, op
                assert ei.value.reply_code == 404


async def test_partition_detected_after_net_ticktime_and_heals(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        events = record_running_changes(c.nodes["n1"])
        t0 = trio.current_time()
        c.net.partition(["n1", "n2"], ["n3"])
        await c.wait_for(lambda: "n3" not in c.nodes["n1"].running, timeout=5 * TICKTIME)
        downs = [t for t, kind, peer in events if kind == "down" and peer == "n3"]
        assert downs, events
        elapsed = downs[0] - t0
        # RabbitMQ detects within [0.75, 1.25] x net_ticktime; ticks every ticktime/4 here
        assert TICKTIME * 0.75 <= elapsed <= TICKTIME * 1.25 + 0.5, elapsed
        # n3 sees both its links fall silent within the same window (each link ticks on its own
        # phase, so not at the same instant as n1)
        await c.wait_for(lambda: c.nodes["n3"].running == {"n3"}, timeout=TICKTIME)
        assert trio.current_time() - t0 <= TICKTIME * 1.25 + 0.5
        assert c.nodes["n1"].running == {"n1", "n2"}
        c.net.heal()
        await c.wait_running(["n1", "n2", "n3"], timeout=5 * TICKTIME)


async def test_dropped_links_detected_at_once(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        events = record_running_changes(c.nodes["n1"])
        t0 = trio.current_time()
        c.net.drop("n1", "n3")
        await c.wait_for(lambda: any(k == "down" and p == "n3" for _, k, p in events), timeout=TICKTIME)
        (t_down,) = [t for t, k, p in events if k == "down" and p == "n3"][:1]
        assert t_down - t0 < 0.5
        await c.wait_running(["n1", "n2", "n3"], timeout=5 * TICKTIME)


async def test_exclusive_queue_deleted_when_connection_closes(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n2") as conn:
            ch = await conn.channel()
            await ch.queue_declare("ex", exclusive=True)
            await c.wait_for(lambda: all("ex" in n.md.queues for n in c.nodes.values()))
            assert c.nodes["n1"].md.queues["ex"].leader == "n2"
            async with c.connect("n3") as other:
                och = await other.channel()
                with pytest.raises(ChannelClosedByBroker) as ei:
                    await och.basic_get("ex")
                assert ei.value.reply_code == 405
        await c.wait_for(lambda: all("ex" not in n.md.queues for n in c.nodes.values()), timeout=10)


async def test_redeclare_with_different_durable(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch1 = await c1.channel()
            await ch1.queue_declare("q", durable=True)
            ch3 = await c3.channel()
            with pytest.raises(ChannelClosedByBroker) as ei:
                await ch3.queue_declare("q", durable=False)
            assert ei.value.reply_code == 406
            assert ei.value.reply_text == ("inequivalent arg 'durable' for queue 'q' in vhost '/': "
                                           "received 'false' but current is 'true'")
            assert "PRECONDITION_FAILED" in str(ei.value) or ei.value.reply_code == 406
            # an equivalent redeclare still works on a fresh channel
            ch3b = await c3.channel()
            await ch3b.queue_declare("q", durable=True)


async def test_nack_requeue_sets_redelivered(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1, c.connect("n2") as c2:
            ch1 = await c1.channel()
            await ch1.queue_declare("q")
            ch2 = await c2.channel()
            await ch2.basic_qos(prefetch_count=1)
            consumer = await ch2.basic_consume("q")  # before publishing: see the xfail above
            await ch1.confirm_delivery()
            ch1.publish_nowait("q", b"a")
            ch1.publish_nowait("q", b"b")
            assert await ch1.wait_for_confirms(timeout=10)
            with trio.fail_after(10):
                first = await consumer.__anext__()
                assert (first.body, first.redelivered) == (b"a", False)
                ch2.basic_nack(first.delivery_tag, requeue=True)
                again = await consumer.__anext__()
                assert (again.body, again.redelivered) == (b"a", True)
                ch2.basic_ack(again.delivery_tag)
                nxt = await consumer.__anext__()
                assert (nxt.body, nxt.redelivered) == (b"b", False)
                ch2.basic_ack(nxt.delivery_tag)


async def test_killed_node_restarts_and_rejoins(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        c.kill("n3")
        await c.wait_running(["n1", "n2"], timeout=3 * TICKTIME)
        await c.restart("n3")
        await c.wait_running(["n1", "n2", "n3"], timeout=5 * TICKTIME)


async def test_join_without_persistence_is_kept(tmp_path, autojump_clock):
    """Nodes without a data dir (persist=False) keep what join_cluster took: one cluster of three
    with one metadata, and a queue declared on one node is known and served on the others."""
    async with sim_cluster(tmp_path) as c:
        for name, node in c.nodes.items():
            assert node.running == {"n1", "n2", "n3"}, name
            assert list(node.md.members) == ["n1", "n2", "n3"], name
            assert not node.persist and not node.cluster._file.exists(), name
        assert len({(n.md.version, n.md.digest(), n.md.cluster_name) for n in c.nodes.values()}) == 1
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch1, ch3 = await c1.channel(), await c3.channel()
            await ch1.queue_declare("kept", durable=True)
            await c.wait_for(lambda: all("kept" in n.md.queues for n in c.nodes.values()), timeout=10)
            await ch1.confirm_delivery()
            ch1.publish_nowait("kept", b"m")
            assert await ch1.wait_for_confirms(timeout=10)
            got = await ch3.basic_get("kept", auto_ack=True)
            assert got is not None and got.body == b"m"


async def test_publishes_lost_with_their_connection_are_nacked_by_the_client(tmp_path, autojump_clock):
    """The node a confirming publisher is connected to dies with its publishes in flight: the
    client answers every one of them (a nack "connection lost" for those the broker never
    confirmed), so the application can publish them again; none is left hanging."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n2") as conn:
            await (await conn.channel()).queue_declare("q", durable=True)
        c.net.delay("n1", "n2", 0.5)  # what n1's session forwards to the leader is slow
        async with c.client("p", ["n1", "n3"]) as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            outcome: dict[int, tuple[bool, str]] = {}
            ch.on_confirm = lambda a, b, ok, why: outcome.update((s, (ok, why)) for s in range(a, b + 1))
            for i in range(50):
                ch.publish_nowait("q", b"%d" % i)
            await trio.sleep(0.2)
            c.kill("n1")
            with trio.fail_after(TICKTIME * 3):
                assert await ch.wait_for_confirms() is False
        assert sorted(outcome) == list(range(1, 51)), "a publish got no answer"
        assert {why for ok, why in outcome.values() if not ok} == {"connection lost"}


async def test_an_idle_cluster_does_not_replan_every_tick(tmp_path, autojump_clock):
    """The log's leader asks the planner again only when the metadata or the running members
    changed: planning copies and walks every queue (1,000 queues stalled clients for ms)."""
    async with sim_cluster(tmp_path) as c:
        asked = []
        for node in c.nodes.values():
            cluster = node.cluster
            real = cluster.propose

            async def counting(change, *a, real=real, **kw):
                asked.append(change.kind)
                return await real(change, *a, **kw)

            cluster.propose = counting
        await trio.sleep(10)  # 20 liveness ticks
        assert asked.count("replan") <= 1, asked
        # a change to what the planner reads brings one back
        await c.nodes["n1"].cluster.propose(PolicySet(Policy("ha", ".*", {"ha-mode": "all"}, 0,
                                                              "queues")))
        await trio.sleep(2)
        assert 1 <= asked.count("replan") <= 3, asked


async def test_forgetting_the_other_member_of_a_two_node_cluster_is_refused_at_once(tmp_path, autojump_clock):
    """The metadata log changes only with a majority of its members: in a two-member cluster
    whose other member is stopped, forget_cluster_node cannot be recorded. It says so at once,
    naming the members, instead of waiting out the command's timeout."""
    from broker.control import ctl_call
    from broker.simulation import PEER_PORT
    from wire.errors import ProtocolError

    async def ctl(via, command, **args):
        return await ctl_call(c.net.host(via), via, PEER_PORT, "test", b"s", command, args)

    async with sim_cluster(tmp_path) as c:
        c.kill("n3")
        await ctl("n1", "forget_cluster_node", node="n3")  # two of three run: recorded
        await c.wait_for(lambda: sorted(c.nodes["n1"].md.members) == ["n1", "n2"], 10)
        await c.nodes["n2"].stop_app()
        t0 = trio.current_time()
        with pytest.raises(ProtocolError) as err:
            await ctl("n1", "forget_cluster_node", node="n2")
        assert trio.current_time() - t0 < 1
        assert "majority of its 2 members (n1, n2), and only n1 run" in str(err.value)
        assert sorted(c.nodes["n1"].md.members) == ["n1", "n2"]


async def _rejoin_while_cut_off(c, gone: str, via: str, cut: str) -> None:
    """`gone` is killed and forgotten through `via`; then, while `cut` is cut off from the other
    two, `gone` joins again as a new node through `via`."""
    from broker.control import ctl_call
    from broker.simulation import PEER_PORT

    c.kill(gone)
    await ctl_call(c.net.host(via), via, PEER_PORT, "test", b"s", "forget_cluster_node", {"node": gone})
    rest = sorted({"n1", "n2", "n3"} - {gone})
    await c.wait_for(lambda: all(sorted(c.nodes[n].md.members) == rest for n in rest),
                     10, f"{gone} forgotten on {rest}")
    c.net.partition([cut], sorted({"n1", "n2", "n3"} - {cut}))
    c.start_fresh(gone, via)
    await c.wait_for(lambda: sorted(c.nodes[via].md.members) == ["n1", "n2", "n3"]
                     and c.nodes[gone].app_running, 20, f"{gone} back as a member")


async def _heal_and_catch_up(c, stale: str, leader: str) -> None:
    """Heal the cut: `stale` knows every member and is in step with the log within two
    ticktimes, and `leader` still leads it."""
    c.net.heal()
    healed = trio.current_time()
    await c.wait_for(lambda: sorted(c.nodes[stale].md.members) == ["n1", "n2", "n3"]
                     and c.nodes[stale].cluster.in_step(), 3 * TICKTIME, f"{stale} in step with the log")
    assert c.nodes[leader].cluster.leader == leader
    assert trio.current_time() - healed < 2 * TICKTIME


async def test_a_member_that_missed_a_rejoin_follows_the_rejoined_log_leader(tmp_path, autojump_clock):
    """n3 is cut off (and restarts) while n2, forgotten, joins again as a new node and then leads
    the metadata log. n3's own view still has n2 removed, yet n2 is the leader the majority elected: once
    the cut heals, n3 takes the log from it and is in step at once (dst seed 50115: n3 ignored
    n2 as a non-member for 30 s, until n2 stopped; its queue leader, cut off from the log,
    could not give way to the one promoted meanwhile)."""
    async with sim_cluster(tmp_path) as c:
        await _rejoin_while_cut_off(c, gone="n2", via="n1", cut="n3")
        # n3 restarts, still cut off: what n1 had sent it meanwhile (n2's joining) is lost with
        # its old process; then n1 restarts and hands the log's leadership to n2
        await c.nodes["n3"].stop_app()
        c.kill("n3")
        await c.restart("n3")
        await c.nodes["n1"].stop_app()
        c.kill("n1")
        await c.wait_for(lambda: c.nodes["n2"].cluster.leader == "n2", 10, "n2 leading the log")
        await c.restart("n1")
        await c.wait_for(lambda: c.nodes["n1"].app_running and c.nodes["n2"].cluster.leader == "n2",
                         10, "n1 back, n2 still leading")
        assert sorted(c.nodes["n3"].md.members) == ["n1", "n3"]  # n3 has not heard of it
        await _heal_and_catch_up(c, stale="n3", leader="n2")


async def test_a_member_that_missed_a_rejoin_lets_the_rejoined_log_leader_link_to_it(tmp_path, autojump_clock):
    """n1 is forgotten, and joins again through n2 while n3 is cut off; then n1 leads the log.
    n3's view still has n1 removed, so it refused n1's link as a non-member's, while n1 was the
    only node that could bring that view up to date: n3 stayed paused (pause_minority) and its
    queues out of step for 30 s (dst seed 105384). A node out of touch with a majority now
    accepts the link, takes the log from n1 and is in step at once."""
    async with sim_cluster(tmp_path) as c:
        await _rejoin_while_cut_off(c, gone="n1", via="n2", cut="n3")
        # n2 stops its app and hands the log to n1 (the only voter it can reach), then comes back
        await c.nodes["n2"].stop_app()
        await c.wait_for(lambda: c.nodes["n1"].cluster.leader == "n1", 10, "n1 leading the log")
        await c.nodes["n2"].start_app()
        await c.wait_for(lambda: c.nodes["n2"].app_running and c.nodes["n1"].cluster.leader == "n1",
                         10, "n2 back, n1 still leading")
        # n3 has not heard of it, and knows it is cut off from a majority (pause_minority)
        await c.wait_for(lambda: c.nodes["n3"].cluster.paused, 3 * TICKTIME, "n3 paused")
        assert sorted(c.nodes["n3"].md.members) == ["n2", "n3"]
        await _heal_and_catch_up(c, stale="n3", leader="n1")


async def test_a_non_members_link_is_refused_unless_the_node_is_cut_off_from_a_majority(tmp_path, autojump_clock):
    """A node its view does not list (n9, with the right cookie) is told to join first by a node
    in touch with a majority; a node cut off from the majority (paused) takes its link, since
    its own view may be the one behind (dst seed 105384)."""
    from broker.framed import FramedStream
    from broker.peers import dial_handshake
    from broker.simulation import PEER_PORT
    from wire.errors import ProtocolError

    async def link_from_n9(to: str):
        framed = FramedStream(await c.net.host("n9").connect(to, PEER_PORT))
        await dial_handshake(framed, "n9", b"s", "peer")
        # the acceptor speaks first: its LinkHello if it takes the link, else why it does not
        return await framed.receive(frozenset({"link.hello"}))

    async with sim_cluster(tmp_path) as c:
        with pytest.raises(ProtocolError) as err:
            await link_from_n9("n1")
        assert "node n9 is not a member of cluster" in str(err.value)
        assert "run join_cluster on it first" in str(err.value)
        c.net.partition(["n1"], ["n2", "n3"])
        await c.wait_for(lambda: c.nodes["n1"].cluster.paused, 3 * TICKTIME, "n1 paused")
        hello = await link_from_n9("n1")
        assert hello is not None and hello.KIND == "link.hello"


async def test_a_refused_link_is_read_and_logged_once_on_each_side(tmp_path, autojump_clock, monkeypatch):
    """A node that was forgotten while down and restarted without a reset dials its old peers;
    they refuse it ("not a member ... run join_cluster on it first"). Its dialer must read that
    reason, though its LinkHello goes out after the refusal closed the connection (it read
    "connection is broken": dst seed 105384), and say it once, not at each retry; the members
    refusing it say so once too."""
    from broker.control import ctl_call
    from broker.node import Node
    from broker.simulation import PEER_PORT, traced

    refusals = []
    note = Node._note_refusal
    monkeypatch.setattr(Node, "_note_refusal", lambda self, node, reason: (
        refusals.append((self.name, node)), note(self, node, reason)))
    trace = []
    with traced(trace):
        async with sim_cluster(tmp_path) as c:
            c.kill("n3")
            await ctl_call(c.net.host("n1"), "n1", PEER_PORT, "test", b"s", "forget_cluster_node", {"node": "n3"})
            await c.wait_for(lambda: sorted(c.nodes["n1"].md.members) == ["n1", "n2"], 10, "n3 forgotten")
            await c.restart("n3")
            await trio.sleep(20)
            assert "n3" not in c.nodes["n1"].cluster.links and "n3" not in c.nodes["n2"].cluster.links

    def events(name, node):
        return [dict(fields) for _, event, fields in trace
                if event == name and dict(fields).get("node") == repr(node)]

    assert refusals.count(("n1", "n3")) >= 5 and refusals.count(("n2", "n3")) >= 5  # it kept dialing
    said = events("link refused", "n3")
    assert sorted(f["peer"] for f in said) == ["'n1'", "'n2'"], said
    for f in said:
        assert "node n3 is not a member of cluster" in f["reason"] and "run join_cluster on it first" in f["reason"]
    for member in ("n1", "n2"):
        # (a member whose app stops at the end refuses the other's redial too: not counted)
        logged = [f for f in events("peer link refused", member) if f["peer"] == "'n3'"]
        assert len(logged) == 1, logged
        assert "not a member" in logged[0]["reason"]


async def test_start_app_on_a_node_still_joining_its_seed_is_refused(tmp_path, autojump_clock):
    """A new node waits to join through its seed. `warrenctl start_app` then is refused with why,
    and the node joins and starts its app by itself once the seed answers (dst seed 54014: a
    stop_app/start_app during the wait started the app alone, and the join loop then failed
    for good with "stop the app first")."""
    from broker.control import ctl_call
    from broker.simulation import PEER_PORT
    from wire.errors import ProtocolError

    async def ctl(via, command, **args):
        return await ctl_call(c.net.host(via), via, PEER_PORT, "test", b"s", command, args)

    async with sim_cluster(tmp_path) as c:
        c.kill("n3")
        await ctl("n1", "forget_cluster_node", node="n3")
        await c.wait_for(lambda: sorted(c.nodes["n1"].md.members) == ["n1", "n2"], 10)
        c.net.partition(["n1", "n2"], ["n3"])  # the seed cannot be reached for now
        c.start_fresh("n3", "n1")
        await c.wait_for(lambda: c.nodes["n3"].joining_seed is not None, 5, "n3 waiting for its seed")
        with pytest.raises(ProtocolError) as err:
            await ctl("n3", "start_app")
        assert "still joining the cluster through its seed n1" in str(err.value)
        assert not c.nodes["n3"].app_running
        c.net.heal()
        await c.wait_for(lambda: c.nodes["n3"].app_running and c.nodes["n3"].running == {"n1", "n2", "n3"},
                         20, "n3 joined and running with the others")
        assert sorted(c.nodes["n3"].md.members) == ["n1", "n2", "n3"]


async def test_a_redeclare_that_outlives_its_queues_node_is_refused_not_left_waiting(tmp_path, autojump_clock):
    """A re-declare checks the queue, then goes through the log, then asks the queue's leader
    for its counts. If the leader's node is recorded down in between, nothing fails the request
    later (the change has been applied already), so it must fail when it is made: it hung until
    the node came back (tests/test_process_cluster.py, 1 run in 16). The window is held open
    here: n2's declare returns only once the log records n1 down."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch1 = await c1.channel()
            await ch1.queue_declare("q", durable=True)
            await c.wait_for(lambda: all("q" in n.md.queues for n in c.nodes.values()))
        n2 = c.nodes["n2"]
        declare = n2.declare_queue

        async def declare_then_wait_for_the_down_record(session, msg):
            value = await declare(session, msg)
            await c.wait_for(lambda: "n1" in n2.md.down, timeout=10)
            return value

        n2.declare_queue = declare_then_wait_for_the_down_record
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            c.kill("n1")
            with trio.fail_after(20):
                with pytest.raises(ChannelClosedByBroker) as ei:
                    await ch.queue_declare("q", durable=True)
        assert ei.value.reply_code == 404
        assert ei.value.reply_text == "home node 'n1' of durable queue 'q' in vhost '/' is down or inaccessible"


async def test_a_declare_that_races_a_delete_declares_the_queue_again(tmp_path, autojump_clock):
    """Another client deletes the queue while a re-declare of it goes through the log (the
    window held open as above): the declare finds it gone when it would ask for its counts,
    and declares it again, as it would have had it come a moment later."""
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n2") as c2, c.connect("n3") as c3:
            ch, other = await c2.channel(), await c3.channel()
            await ch.queue_declare("q", durable=True)
            await c.wait_for(lambda: all("q" in n.md.queues for n in c.nodes.values()))
            n2 = c.nodes["n2"]
            declare = n2.declare_queue
            raced = []

            async def declare_while_another_deletes(session, msg):
                value = await declare(session, msg)
                if not raced:
                    raced.append(value)
                    await other.queue_delete("q")
                    await c.wait_for(lambda: "q" not in n2.md.queues, timeout=10)
                return value

            n2.declare_queue = declare_while_another_deletes
            with trio.fail_after(20):
                ok = await ch.queue_declare("q", durable=True)
            assert raced == [None]  # the first declare found the queue there
            assert ok.message_count == 0
            await c.wait_for(lambda: all("q" in n.md.queues for n in c.nodes.values()))


async def test_a_deposed_log_leader_does_not_report_its_proposal_committed_by_another_leaders_entry(
        tmp_path, autojump_clock):
    """n1 leads the metadata log and is cut off; its timers are held, as a frozen process's are
    (the simulation's pause keeps them running), so it still believes it leads while n2 and n3
    elect a new leader and commit entries of their own. A change proposed on n1 then takes the
    next index of n1's log. When the cut heals, n1 learns the new leader's log and applies it:
    the entry committed at that index is another leader's, and n1 must not report its own
    change committed (it reported it done with the other entry's value: a queue.delete that
    never happened answered delete-ok; found by tests/test_sim_in_flight.py, seed 179, on real
    scheduling). The proposal is tried again with the new leader instead, and done."""
    from mirroring.policy import make_policy

    async with sim_cluster(tmp_path) as c:
        n1 = c.nodes["n1"].cluster
        assert n1.leader == "n1"
        # a frozen process's timers: no check-quorum step-down while it is cut off
        n1.raft._quorum_heard = lambda now: True
        c.net.partition(["n1"], ["n2", "n3"])
        await c.wait_for(lambda: c.nodes["n2"].cluster.leader in ("n2", "n3"), timeout=20)
        new_leader = c.nodes[c.nodes["n2"].cluster.leader].cluster
        await c.wait_for(lambda: new_leader.applied >= n1.raft.last_index + 1, timeout=20)
        assert n1.raft.role.value == "leader"  # it still believes so

        record = make_policy("p", "^p$", {"ha-mode": "all"})
        done: list = []

        async def propose():
            done.append(await n1.propose(PolicySet(record)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(propose)
            await trio.sleep(0.05)  # appended to n1's log, which cannot commit it
            del n1.raft._quorum_heard
            c.net.heal()
        assert len(done) == 1
        await c.wait_for(lambda: all("p" in n.md.policies for n in c.nodes.values()), timeout=20)


async def test_a_change_naming_its_queues_is_shown_only_to_the_sessions_routing_to_them(
        tmp_path, autojump_clock, monkeypatch):
    """Every metadata change used to be shown to every session of every node, so N clients each
    declaring a reply queue cost O(N^2): 3,000 took 10.8 s on three local nodes. A change that
    names its queues (a declare, a delete, a queue's update) now reaches only the sessions
    routing to one of them (`Node.routing`), and the index empties as sessions go."""
    shown: list[int] = []
    real = Session.meta_changed

    def counted(self, *args):
        shown.append(self.sid)
        return real(self, *args)

    monkeypatch.setattr(Session, "meta_changed", counted)
    async with sim_cluster(tmp_path) as c:
        async with AsyncExitStack() as stack:
            consumers, sids = [], []
            for i in range(9):
                node = f"n{i % 3 + 1}"
                conn = await stack.enter_async_context(c.connect(node))
                ch = await conn.channel()
                await ch.queue_declare(f"work.{i}")
                consumers.append(await ch.basic_consume(f"work.{i}"))
                sids.append(max(c.nodes[node].sessions))  # this connection's session: the newest
            await c.wait_for(lambda: all(len(n.md.queues) == 9 for n in c.nodes.values()))
            shown.clear()
            async with c.connect("n1") as admin:
                ach = await admin.channel()
                for i in range(5):
                    await ach.queue_declare(f"other.{i}")
                assert not set(shown) & set(sids), "a declare was shown to sessions not routing to it"
                assert all(sum(len(s) for s in n.routing.values()) == 3 for n in c.nodes.values())
                await ach.queue_delete("work.4")
                with trio.fail_after(10):
                    assert [m async for m in consumers[4]] == []  # ends: cancelled
                assert "was deleted" in consumers[4].cancelled_reason
                assert set(shown) & set(sids) == {sids[4]}
                assert all(k.cancelled_reason is None for j, k in enumerate(consumers) if j != 4)
        await c.wait_for(lambda: not any(n.routing for n in c.nodes.values()), 10,
                         "every node's routing index to empty once its sessions closed")


async def test_a_declare_on_a_quiet_cluster_is_answered_in_a_few_network_trips(tmp_path, autojump_clock):
    """The log's leader sends a round of proposals to its followers at once, as one append (not
    at its next heartbeat): a declare through a follower costs a few trips of the simulated
    network, far less than a heartbeat period."""
    async with sim_cluster(tmp_path) as c:
        follower = next(n for n in c.names if n != c.nodes["n1"].cluster.leader)
        heartbeat = c.nodes[follower].cluster.raft.heartbeat
        async with c.connect(follower) as conn:
            ch = await conn.channel()
            await ch.queue_declare("warm")
            await trio.sleep(heartbeat * 1.5)
            t = trio.current_time()
            await ch.queue_declare("quick")
            took = trio.current_time() - t
        assert took < heartbeat / 4, f"a declare took {took:.3f} s (heartbeat {heartbeat:.3f} s)"


async def test_a_queue_is_routable_through_every_node_once_its_declare_is_answered(tmp_path, autojump_clock):
    """A node the log's leader reaches late (its links are slow) still knows a queue by the time
    the declare through another node is answered: a publish through it right after routes to
    the queue, where it was dropped as unroutable while that node had not applied the
    declaration yet."""
    async with sim_cluster(tmp_path) as c:
        leader = c.nodes["n1"].cluster.leader
        late, via = [n for n in c.names if n != leader][:2]
        for other in c.names:
            if other != late:
                c.net.delay(late, other, 0.3)
        async with c.connect(via) as cv, c.connect(late) as cl:
            chv, chl = await cv.channel(), await cl.channel()
            await chl.confirm_delivery()
            for i in range(3):
                await chv.queue_declare(f"q{i}")
                assert f"q{i}" in c.nodes[late].md.queues
                chl.publish_nowait(f"q{i}", b"x")
                assert await chl.wait_for_confirms(timeout=10)
            for i in range(3):
                qdef = c.nodes[via].md.queues[f"q{i}"]
                state = c.nodes[qdef.leader].router.replicas[f"q{i}"].replica.q
                assert state.stats()["messages"] == 1, f"q{i}"


async def test_the_last_nodes_of_a_cluster_stopped_at_once_do_not_wait_for_a_majority(tmp_path, autojump_clock):
    """n1 is killed, then n2 and n3 stop together (the end of `make demo`, `make stop`): the one
    left last has no majority to record its going, and stops at once instead of waiting out
    the hand-over's timeout (5 s, which every whole-cluster shutdown used to pay)."""
    from broker.node import SHUTDOWN_HANDOVER_TIMEOUT
    async with sim_cluster(tmp_path) as c:
        c.kill("n1")
        await c.wait_for(lambda: all(c.nodes[n].running == {"n2", "n3"} for n in ("n2", "n3")),
                         3 * TICKTIME, "n2 and n3 without n1")
        took = {}

        async def stop(name):
            start = trio.current_time()
            await c.nodes[name].stop_app()
            took[name] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop, "n2")
            nursery.start_soon(stop, "n3")
        assert max(took.values()) < SHUTDOWN_HANDOVER_TIMEOUT / 2, took
        assert not any(c.nodes[n].app_running for n in ("n2", "n3"))


async def test_a_client_connection_given_up_by_its_caller_closes_its_socket(tmp_path, autojump_clock):
    """A caller that cancels the block its connection lives in (a timeout around it, a request
    whose client went away: the management API's own connections to the client port) still
    has the socket closed, so the node ends its side at once: it stayed open, half-closed,
    until the client's objects were collected (seen as fds held by `make fuzz`'s node)."""
    async with sim_cluster(tmp_path) as c:
        node = c.nodes["n1"]
        before = node.client_sockets
        with trio.CancelScope() as scope:
            async with c.client("c1", ["n1"], reconnect=False) as conn:
                await conn.channel()
                assert node.client_sockets == before + 1
                scope.cancel()
                await trio.sleep(1)
        await c.wait_for(lambda: node.client_sockets == before, 5, "the node to see the socket closed")


async def test_force_gc_runs_a_full_collection_and_says_what_it_freed(tmp_path, autojump_clock):
    """`force_gc` (rabbitmqctl's command): the node's collector runs rarely on its own, so an
    operator (and `make fuzz`) asks for a full pass to tell the node's state from garbage."""
    import gc
    from broker.control import ctl_call
    from broker.simulation import PEER_PORT
    async with sim_cluster(tmp_path) as c:
        gc.disable()
        try:
            for _ in range(5000):  # garbage only the cyclic collector can free
                cycle: list = []
                cycle.append(cycle)
            del cycle
            freed = await ctl_call(c.net.host("n1"), "n1", PEER_PORT, "test", b"s", "force_gc", {})
        finally:
            gc.enable()
        assert freed["collected_objects"] >= 5000, freed
        assert freed["python_blocks_after"] < freed["python_blocks_before"] - 4000, freed
        assert c.nodes["n1"].memory.probe.trims >= 1  # and the C allocator was asked to give back


async def test_warrens_client_gives_a_message_its_own_expiration(tmp_path, autojump_clock):
    """The `expiration` property through warren's own client, as through AMQP: a message
    expires after its own TTL (milliseconds, a string or an int), the others in the same batch
    keep theirs, and a bad one closes the channel with RabbitMQ's text."""
    async with sim_cluster(tmp_path) as c:
        async with c.client("c1", ["n1"]) as conn:
            ch = await conn.channel()
            await ch.queue_declare("ttl.q")
            await ch.confirm_delivery()
            ch.publish_nowait("ttl.q", b"soon", {"expiration": "1000"})
            ch.publish_nowait("ttl.q", b"kept", {"content_type": "text/plain"})
            ch.publish_nowait("ttl.q", b"later", {"expiration": 30000})
            ch.publish_nowait("ttl.q", b"plain")
            assert await ch.wait_for_confirms(5)
            await trio.sleep(5)
            got = []
            while (msg := await ch.basic_get("ttl.q", auto_ack=True)) is not None:
                got.append(msg.body)
            assert got == [b"kept", b"later", b"plain"]
            await ch.basic_publish("", "ttl.q", b"bad", {"expiration": "soon"})
            with pytest.raises(ChannelClosedByBroker) as ei:
                await ch.basic_get("ttl.q")
            assert ei.value.reply_code == 406
            assert "invalid expiration 'soon': no_integer" in ei.value.reply_text
