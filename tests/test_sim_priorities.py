"""Priority queues and single active consumers across failures, on the simulated network under
MockClock: a mirror holds its leader's priority order (whether it followed from the start or
was filled by a batch sync) and delivers in it once promoted; a single active consumer whose node
dies is replaced by the next one, which gets what the first left unacknowledged; a promoted
leader keeps the replicated registration order, so the active consumer stays active."""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import ConnectionLost
from broker.simulation import TICKTIME, sim_cluster
from test_sim_mirroring import ctl, mirror_state, publish_confirmed, qdef, replicas_settled, set_policy

pytestmark = pytest.mark.timeout(60)

PRIORITIES = [0, 3, 9, 3, None, 12, 1, 9, 0, 5]  # 12 counts as the maximum, 9; None as 0


def body(i: int, p) -> bytes:
    return f"{i}:{p}".encode()


def by_priority(published: list[tuple[int, object]]) -> list[bytes]:
    """RabbitMQ's order: higher priority first (capped at 9), publish order within a priority."""
    return [body(i, p) for i, p in sorted(published, key=lambda x: (-min(x[1] or 0, 9), x[0]))]


async def publish_priorities(ch, queue, start: int, priorities) -> list[tuple[int, object]]:
    if not ch.confirming:
        await ch.confirm_delivery()
    out = []
    for k, p in enumerate(priorities):
        i = start + k
        ch.publish_nowait(queue, body(i, p), None if p is None else {"priority": p})
        out.append((i, p))
    assert await ch.wait_for_confirms(timeout=TICKTIME * 4)
    return out


async def take_all(ch, queue) -> list[tuple[bytes, bool]]:
    out = []
    while (msg := await ch.basic_get(queue, auto_ack=True)) is not None:
        out.append((msg.body, msg.redelivered))
    return out


async def promoted_delivers_by_priority(c, queue, published, unacked=()) -> None:
    """Kill the leader (n1); the promoted n2 gives everything back by priority, and exactly
    what may have been delivered before flagged."""
    c.kill("n1")
    with trio.fail_after(TICKTIME * 3):
        await c.wait_for(lambda: qdef(c, queue, "n2").leader == "n2")
    async with c.connect("n2") as c2:
        got = await take_all(await c2.channel(), queue)
    assert [b for b, _ in got] == by_priority(published)
    # a promoted leader flags everything it holds (the old leader may have delivered it)
    assert all(red for _, red in got)


async def test_a_mirror_holds_its_leaders_priority_order_and_delivers_it_once_promoted(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
        async with c.connect("n1") as c1:
            await (await c1.channel()).queue_declare("ha.p", durable=True, arguments={"x-max-priority": 9})
        await replicas_settled(c, "ha.p", ["n2", "n3"], synced=["n2", "n3"])
        async with c.connect("n3") as c3:
            ch = await c3.channel()
            published = await publish_priorities(ch, "ha.p", 0, PRIORITIES)
            # two taken and requeued: back in their priority's places, on every replica
            taken = [await ch.basic_get("ha.p") for _ in range(2)]
            published += await publish_priorities(ch, "ha.p", len(PRIORITIES), [9, 0])
            for msg in taken:
                ch.basic_nack(msg.delivery_tag, requeue=True)
            await trio.sleep(TICKTIME / 4)
            leader = mirror_state(c, "ha.p", "n1")
            assert [m[1] for m in leader.ready] == by_priority(published)
            for node in ("n2", "n3"):
                assert mirror_state(c, "ha.p", node).comparable() == leader.comparable(), node
        await promoted_delivers_by_priority(c, "ha.p", published)


async def test_a_batch_sync_carries_priorities_and_the_synced_mirror_delivers_in_order(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch = await c1.channel()
            await ch.queue_declare("two.p", durable=True, arguments={"x-max-priority": 9})
            published = await publish_priorities(ch, "two.p", 0, PRIORITIES)
            await set_policy(c, "ha-two", r"^two\.", {"ha-mode": "exactly", "ha-params": 2,
                                                       "ha-sync-batch-size": 3})
            await replicas_settled(c, "two.p", ["n2"], synced=[])
            # newer messages reach the mirror by replication, the older by the sync
            published += await publish_priorities(ch, "two.p", len(PRIORITIES), [9, 0, 4])
            assert [m[1] for m in mirror_state(c, "two.p", "n2").ready] == [body(10, 9), body(12, 4), body(11, 0)]
            r = await ctl(c, "n1", "sync_queue", queue="two.p")
            assert r["started"], r
            await replicas_settled(c, "two.p", ["n2"], synced=["n2"])
            leader = mirror_state(c, "two.p", "n1")
            assert mirror_state(c, "two.p", "n2").comparable() == leader.comparable()
            assert [m[1] for m in leader.ready] == by_priority(published)
        await promoted_delivers_by_priority(c, "two.p", published)


async def sac_queue(c, queue: str) -> None:
    await set_policy(c, "ha-all", r"^ha\.", {"ha-mode": "all"})
    async with c.connect("n1") as c1:
        await (await c1.channel()).queue_declare(queue, durable=True,
                                                 arguments={"x-single-active-consumer": True})
    await replicas_settled(c, queue, ["n2", "n3"], synced=["n2", "n3"])


async def consumer_on(c, node: str, queue: str, prefetch: int, task_status=trio.TASK_STATUS_IGNORED):
    """A manual-ack consumer on a connection to `node`, kept until that node dies."""
    try:
        async with c.connect(node) as conn:
            ch = await conn.channel()
            await ch.basic_qos(prefetch_count=prefetch)
            task_status.started(await ch.basic_consume(queue))
            await trio.sleep_forever()
    except ConnectionLost:
        pass


async def test_the_next_single_active_consumer_takes_over_when_the_active_ones_node_dies(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await sac_queue(c, "ha.sac")
        async with c.connect("n3") as c3, c.connect("n1") as c1, trio.open_nursery() as nursery:
            first = await nursery.start(consumer_on, c, "n2", "ha.sac", 2)
            second = await (await c3.channel()).basic_consume("ha.sac", auto_ack=True)
            assert await publish_confirmed(await c1.channel(), "ha.sac", [b"%d" % i for i in range(5)])
            with trio.fail_after(TICKTIME):
                assert [(await first.__anext__()).body for _ in range(2)] == [b"0", b"1"]
            await trio.sleep(TICKTIME / 4)
            assert second._recv.statistics().current_buffer_used == 0  # the waiting one got nothing
            c.kill("n2")
            got = []
            with trio.fail_after(TICKTIME * 3):
                while len(got) < 5:
                    msg = await second.__anext__()
                    got.append((msg.body, msg.redelivered))
            assert got == [(b"0", True), (b"1", True), (b"2", False), (b"3", False), (b"4", False)]


async def test_a_promoted_leader_keeps_the_active_consumer(tmp_path, autojump_clock):
    """The leader's node dies; the consumers on the others re-register with the promoted
    mirror, which knew their order: the one active before stays active."""
    async with sim_cluster(tmp_path) as c:
        await sac_queue(c, "ha.keep")
        async with c.connect("n3") as c3, c.connect("n2") as c2:
            ch3, ch2 = await c3.channel(), await c2.channel()
            active = await ch3.basic_consume("ha.keep", auto_ack=True)
            waiting = await ch2.basic_consume("ha.keep", auto_ack=True)
            await trio.sleep(TICKTIME / 4)
            c.kill("n1")
            with trio.fail_after(TICKTIME * 3):
                await c.wait_for(lambda: qdef(c, "ha.keep", "n2").leader == "n2")
            await trio.sleep(TICKTIME)  # the sessions have re-registered
            assert await publish_confirmed(ch2, "ha.keep", [b"a", b"b"])
            with trio.fail_after(TICKTIME):
                assert [(await active.__anext__()).body for _ in range(2)] == [b"a", b"b"]
            await trio.sleep(TICKTIME / 4)
            assert waiting._recv.statistics().current_buffer_used == 0
            assert [k[1] for k in mirror_state(c, "ha.keep", "n2").consumers] == [active.tag, waiting.tag]
