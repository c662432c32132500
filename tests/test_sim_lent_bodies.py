"""Deliveries on the simulated network: bodies that come from the consumer's node's own mirror
(mirroring/replica.py `local_bodies`, broker/session/consumers.py `_bodies_from_mirror`), and deliveries
for a consumer its node no longer has, which go back to the queue.

A leader sends a delivery for a consumer on a node that holds a mirror of the queue without its
bodies; that node's session takes them from its mirror. These tests check that the consumer gets
each message's own body, unflagged, that the leader does so only where a mirror holds the
messages, and that a mirror lacking them costs nothing but a redelivery.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio

from broker.simulation import sim_cluster
from wire import messages as m

from tests.test_sim_mirroring import declare_on_all_nodes, publish_confirmed, replicas_settled, set_policy

pytestmark = pytest.mark.timeout(30)


def spy_deliveries(c, node: str) -> list:
    """Record (to node, with bodies?) of each EvDeliver the router of `node` sends to a session."""
    router = c.nodes[node].router
    seen = []
    real = router.to_session

    def to_session(to, sid, events):
        seen.extend((to, bool(ev.bodies)) for ev in events if type(ev) is m.EvDeliver)
        real(to, sid, events)
    router.to_session = to_session
    return seen


@asynccontextmanager
async def mirrored_everywhere(tmp_path, consumer_node: str):
    """A 3-node cluster with queue ha.q led by n1 and mirrored on n2 and n3: (cluster, the
    deliveries n1 sends, a publishing channel on n1, a channel on `consumer_node`)."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        sent = spy_deliveries(c, "n1")
        async with c.connect("n1") as c1, c.connect(consumer_node) as cx:
            ch1, chx = await c1.channel(), await cx.channel()
            await declare_on_all_nodes(c, ch1, "ha.q")
            yield c, sent, ch1, chx


async def consume(ch, queue, n, auto_ack=False):
    """The first n messages a consumer gets: (body, redelivered)."""
    await ch.basic_qos(prefetch_count=40)
    consumer = await ch.basic_consume(queue, auto_ack=auto_ack)
    got = []
    with trio.fail_after(20):
        async for msg in consumer:
            got.append((msg.body, msg.redelivered))
            if not auto_ack:
                ch.basic_ack(msg.delivery_tag)
            if len(got) == n:
                break
    return got


@pytest.mark.parametrize("busy_mirror", [False, True])
async def test_a_consumer_on_a_mirrors_node_gets_the_bodies_from_that_mirror(tmp_path, autojump_clock,
                                                                            busy_mirror):
    """busy_mirror: the mirror's task never runs its round at the end of a peer batch (as when
    it is already due to run): the session has it apply its inbox first (QueueProcess.catch_up)."""
    async with mirrored_everywhere(tmp_path, "n3") as (c, sent, ch1, ch3):
        if busy_mirror:
            qp = c.nodes["n3"].router.replicas["ha.q"]
            qp.after_batch = lambda: (setattr(qp, "_noted", False), qp._wake.set())
        bodies = [b"m%d-" % i + bytes([i % 251]) * (i % 700) for i in range(300)]
        assert await publish_confirmed(ch1, "ha.q", bodies)
        got = await consume(ch3, "ha.q", 300)
    assert got == [(b, False) for b in bodies]  # each its own body, in order, none flagged
    to_n3 = [with_bodies for to, with_bodies in sent if to == "n3"]
    assert to_n3 and not any(to_n3), "the leader sent the mirror's node the bodies again"


async def test_the_leaders_own_node_and_a_node_without_a_mirror_get_the_bodies(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "two", r"^two\.", {"ha-mode": "nodes", "ha-params": ["n1", "n2"]})
        sent = spy_deliveries(c, "n1")
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch1, ch1b, ch3 = await c1.channel(), await c1.channel(), await c3.channel()
            await ch1.queue_declare("two.q", durable=True)
            await replicas_settled(c, "two.q", ["n2"], synced=["n2"])
            assert await publish_confirmed(ch1, "two.q", [b"x%d" % i for i in range(100)])
            got3 = await consume(ch3, "two.q", 50)
            await ch3.close()
            got1 = await consume(ch1b, "two.q", 50)
    assert sorted(b for b, _ in got3 + got1) == sorted(b"x%d" % i for i in range(100))
    assert {to for to, _ in sent} >= {"n1", "n3"}
    assert all(with_bodies for _, with_bodies in sent)


async def test_a_no_ack_consumer_on_a_mirrors_node_gets_the_bodies_from_the_leader(tmp_path, autojump_clock):
    """A mirror keeps no unacknowledged entry for a no-ack consumer's deliveries, so it could
    not lend their bodies."""
    async with mirrored_everywhere(tmp_path, "n2") as (c, sent, ch1, ch2):
        assert await publish_confirmed(ch1, "ha.q", [b"y%d" % i for i in range(80)])
        got = await consume(ch2, "ha.q", 80, auto_ack=True)
    assert got == [(b"y%d" % i, False) for i in range(80)]
    assert sent and all(with_bodies for _, with_bodies in sent)


async def test_a_mirror_that_lacks_the_bodies_gives_them_back_and_nothing_is_lost(tmp_path, autojump_clock):
    """As if the mirror had restarted empty just before the delivery reached its node: the
    session gives the messages back (LACKED), the leader delivers them again, flagged and with
    their bodies, and sends that node's later deliveries with their bodies too."""
    async with mirrored_everywhere(tmp_path, "n3") as (c, sent, ch1, ch3):
        mirror = c.nodes["n3"].router.replicas["ha.q"].replica
        real = mirror.local_bodies
        lacked = set()

        def lacking_the_first(ids):
            lacked.update(() if lacked else ids)
            return [None if i in lacked else b for i, b in zip(ids, real(ids))]
        mirror.local_bodies = lacking_the_first
        assert await publish_confirmed(ch1, "ha.q", [b"z%d" % i for i in range(200)])
        got = await consume(ch3, "ha.q", 200)
        await trio.sleep(1)
        leader = c.nodes["n1"].router.replicas["ha.q"].replica
        assert leader.rep.mirrors["n3"].lends is False
        assert leader.q.stats()["messages"] == 0
    assert sorted(got) == sorted((b"z%d" % i, i + 1 in lacked) for i in range(200))
    assert lacked and len(got) == 200
    to_n3 = [with_bodies for to, with_bodies in sent if to == "n3"]
    assert to_n3[0] is False and all(to_n3[1:]), to_n3


async def test_a_mirror_that_started_after_the_messages_does_not_lend_them(tmp_path, autojump_clock):
    """Mirrors added to a queue that already holds messages start empty (ha-sync-mode manual):
    the messages older than a mirror's start go to its node's consumer with their bodies, the
    newer ones without, and every one arrives unflagged."""
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha", r"^ha\.", {"ha-mode": "nodes", "ha-params": ["n1"]})
        sent = spy_deliveries(c, "n1")
        async with c.connect("n1") as c1, c.connect("n3") as c3:
            ch1, ch3 = await c1.channel(), await c3.channel()
            await ch1.queue_declare("ha.q", durable=True)
            assert await publish_confirmed(ch1, "ha.q", [b"old%d" % i for i in range(60)])
            await set_policy(c, "ha", r"^ha\.", {"ha-mode": "all"})
            await replicas_settled(c, "ha.q", ["n2", "n3"], synced=[])
            assert await publish_confirmed(ch1, "ha.q", [b"new%d" % i for i in range(60)])
            got = await consume(ch3, "ha.q", 120)
    assert got == [(b"old%d" % i, False) for i in range(60)] + [(b"new%d" % i, False) for i in range(60)]
    to_n3 = [with_bodies for to, with_bodies in sent if to == "n3"]
    assert True in to_n3 and False in to_n3


@pytest.mark.parametrize("stale", ["session", "channel"])
async def test_deliveries_for_a_consumer_its_node_no_longer_has_go_back(tmp_path, autojump_clock, stale):
    """A leader may still count a consumer whose session or channel is gone (a promoted mirror
    that never heard of the close: dst seeds 9550, 2281). Its node tells the leader the owner is
    gone (QOwnerGone): that consumer goes, and what was in flight to it reaches the consumer
    that is there. The stale consumer is registered here straight at the leader, as the old
    leader's replication would have left it."""
    async with mirrored_everywhere(tmp_path, "n2") as (c, sent, ch1, ch2):
        sid = next(iter(c.nodes["n2"].sessions))
        owner = ("n2", sid + 12345, 1) if stale == "session" else ("n2", sid, 99)
        c.nodes["n2"].router.to_leader("ha.q", m.QConsume("ha.q", owner, 0, "ghost", False, 20, False, {}))
        await trio.sleep(0.5)
        assert await publish_confirmed(ch1, "ha.q", [b"g%d" % i for i in range(60)])
        await trio.sleep(0.5)
        got = await consume(ch2, "ha.q", 60)
        leader = c.nodes["n1"].router.replicas["ha.q"].replica
        assert all(key[1] != "ghost" for key in leader.q.consumers)
    assert sorted(b for b, _ in got) == sorted(b"g%d" % i for i in range(60))
