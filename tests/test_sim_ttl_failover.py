"""Message TTL across a failover, on the simulated network under MockClock: a promoted mirror
expires each message at the deadline its old leader gave it, neither later (its clock started
again at the promotion) nor never, whether the TTL is the queue's `x-message-ttl` argument or a
policy's `message-ttl` key."""

from __future__ import annotations

import pytest
import trio

from broker.simulation import TICKTIME, sim_cluster
from test_sim_mirroring import mirror_state, publish_confirmed, qdef, replicas_settled, set_policy

pytestmark = pytest.mark.timeout(30)

TTL = 10 * TICKTIME  # seconds: long enough for the leader to die and a mirror to take over
SLACK = 1e-3  # how far either side of a deadline the queue is looked at


async def expiry_after_failover(tmp_path, queue: str, policy: dict, arguments: dict) -> None:
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all", **policy})
        async with c.connect("n1") as c1:  # led by n1
            await (await c1.channel()).queue_declare(queue, durable=True, arguments=arguments)
        await replicas_settled(c, queue, ["n2", "n3"], synced=["n2", "n3"])
        async with c.connect("n2") as c2:
            ch = await c2.channel()
            # two publish batches some seconds apart: each has its own deadline
            assert await publish_confirmed(ch, queue, [b"a1", b"a2"])
            await trio.sleep(TICKTIME)
            assert await publish_confirmed(ch, queue, [b"b1"])
            published_at = trio.current_time()
            leader = mirror_state(c, queue, "n1")
            deadlines = [at for _, at in leader.expiry]
            assert len(deadlines) == 2 and deadlines[1] - deadlines[0] >= TICKTIME
            assert deadlines[1] == pytest.approx(published_at + TTL, abs=SLACK)
            for node in ("n2", "n3"):
                assert list(mirror_state(c, queue, node).expiry) == list(leader.expiry), node

            await trio.sleep(TTL / 3)  # part-way through their life, the leader dies
            c.kill("n1")
            with trio.fail_after(TICKTIME * 3):
                await c.wait_for(lambda: qdef(c, queue, "n2").leader == "n2")
            promoted = mirror_state(c, queue, "n2")
            assert [at for _, at in promoted.expiry] == deadlines

            def ready():
                return [body for _, body, *_ in mirror_state(c, queue, "n2").ready]

            await trio.sleep_until(deadlines[0] - SLACK)
            assert ready() == [b"a1", b"a2", b"b1"]
            await trio.sleep_until(deadlines[0] + SLACK)
            assert ready() == [b"b1"]  # dropped by the new leader's own timer, unasked
            await trio.sleep_until(deadlines[1] - SLACK)
            assert ready() == [b"b1"]
            await trio.sleep_until(deadlines[1] + SLACK)
            assert ready() == []
            assert (await ch.queue_declare(queue, passive=True)).message_count == 0
            assert await ch.basic_get(queue, auto_ack=True) is None


async def test_x_message_ttl_deadlines_survive_the_leaders_death(tmp_path, autojump_clock):
    await expiry_after_failover(tmp_path, "ha.ttl", {}, {"x-message-ttl": int(TTL * 1000)})


async def test_message_ttl_policy_deadlines_survive_the_leaders_death(tmp_path, autojump_clock):
    await expiry_after_failover(tmp_path, "ha.pttl", {"message-ttl": int(TTL * 1000)}, {})
