"""Dead-lettering across nodes and failovers, on the simulated network under MockClock: a
dead-lettered message stays in its queue (held by the leader's node's dead-letter publisher,
replicated to the mirrors) until the dead-letter queue's mirrors all have the copy, so the death
of the source queue's leader before then loses nothing: the new leader dead-letters it again,
flagged redelivered. A retry loop (work queue -> retry queue with a TTL -> back) keeps going
across the death of the work queue's leader."""

from __future__ import annotations

import pytest
import trio

from broker.simulation import TICKTIME, sim_cluster
from test_sim_mirroring import mirror_state, qdef, replicas_settled, set_policy

pytestmark = pytest.mark.timeout(60)

TTL_MS = 200


async def declared(c, ch, queue, arguments):
    await ch.queue_declare(queue, durable=True, arguments=arguments)
    await replicas_settled(c, queue, ["n2", "n3"], synced=["n2", "n3"])


async def test_an_unconfirmed_dead_letter_survives_the_source_leaders_death(tmp_path, autojump_clock,
                                                                           monkeypatch):
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n3") as c3:  # the dead-letter queue is led by n3, which stays
            await (await c3.channel()).queue_declare("ha.dead", durable=True)
        await replicas_settled(c, "ha.dead", ["n1", "n2"], synced=["n1", "n2"])
        async with c.connect("n1") as c1:
            ch1 = await c1.channel()
            await declared(c, ch1, "ha.work", {"x-message-ttl": TTL_MS, "x-dead-letter-exchange": "",
                                               "x-dead-letter-routing-key": "ha.dead"})
        # n1's publisher never hears its copies confirmed: the source keeps holding the message
        publisher = c.nodes["n1"].dead_letters
        monkeypatch.setattr(publisher, "_let_go", lambda done: None)
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            await ch.confirm_delivery()
            ch.publish_nowait("ha.work", b"job")
            assert await ch.wait_for_confirms(timeout=TICKTIME)
            await c.wait_for(lambda: mirror_state(c, "ha.dead", "n2").message_count == 1, timeout=5)
            held = mirror_state(c, "ha.work", "n2")
            assert not held.ready and [e[0] for e in held.unacked.values()] == [publisher.holder]

            c.kill("n1")
            await c.wait_for(lambda: qdef(c, "ha.work", "n2").leader == "n2", timeout=TICKTIME * 3)
            await c.wait_for(lambda: mirror_state(c, "ha.dead", "n2").message_count == 2, timeout=5)
            first = await ch.basic_get("ha.dead", auto_ack=True)
            again = await ch.basic_get("ha.dead", auto_ack=True)
            assert (first.body, first.redelivered) == (b"job", False)
            assert (again.body, again.redelivered) == (b"job", True)  # may be a second copy: flagged
            assert [d["reason"] for d in again.properties["headers"]["x-death"]] == ["expired"]
            work = mirror_state(c, "ha.work", "n2")
            await c.wait_for(lambda: not work.unacked and not work.ready, timeout=5)


async def test_a_retry_loop_goes_on_across_the_work_queues_leader_death(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            ch1 = await c1.channel()
            await declared(c, ch1, "ha.work", {"x-dead-letter-exchange": "",
                                               "x-dead-letter-routing-key": "ha.retry"})
            await declared(c, ch1, "ha.retry", {"x-message-ttl": TTL_MS, "x-dead-letter-exchange": "",
                                                "x-dead-letter-routing-key": "ha.work"})
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            await ch.confirm_delivery()
            for i in range(20):
                ch.publish_nowait("ha.work", b"job%d" % i)
            assert await ch.wait_for_confirms(timeout=TICKTIME)

            async def reject_all(rounds: int) -> dict:
                seen: dict[bytes, int] = {}
                for _ in range(rounds):
                    with trio.move_on_after(TTL_MS / 1000 * 4):
                        while True:
                            msg = await ch.basic_get("ha.work")
                            if msg is None:
                                await trio.sleep(0.01)
                                continue
                            seen[msg.body] = seen.get(msg.body, 0) + 1
                            ch.basic_reject(msg.delivery_tag, requeue=False)
                return seen

            assert sorted(await reject_all(1)) == sorted(b"job%d" % i for i in range(20))
            c.kill("n1")
            await c.wait_for(lambda: qdef(c, "ha.work", "n2").leader != "n1", timeout=TICKTIME * 3)
            seen = await reject_all(2)
            assert sorted(seen) == sorted(b"job%d" % i for i in range(20))  # none lost
            msg = None
            while msg is None:
                msg = await ch.basic_get("ha.work", auto_ack=True)
                await trio.sleep(0.01)
            deaths = {(d["queue"], d["reason"]): d["count"] for d in msg.properties["headers"]["x-death"]}
            assert deaths[("ha.work", "rejected")] >= 2 and deaths[("ha.retry", "expired")] >= 2
