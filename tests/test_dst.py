"""Deterministic simulation: one seed decides a whole-cluster run, faults included, so a run
replays exactly (the same trace of events), and two seeds differ."""

from __future__ import annotations

import trio
import trio.testing

from broker.simulation import deterministic, sim_cluster, trace_digest, traced


async def scenario(tmp_path):
    async with sim_cluster(tmp_path) as c:
        from broker.control import ctl_call
        await ctl_call(c.net.host("n1"), "n1", 25672, "t", b"s", "set_policy", dict(
            name="ha", pattern="^ha", definition='{"ha-mode":"all","ha-sync-mode":"automatic"}'))
        async with c.client("c1", ["n1", "n2", "n3"]) as pub, c.client("c2", ["n3", "n2"]) as sub:
            ch = await pub.channel()
            await ch.queue_declare("ha.q", durable=True)
            await ch.confirm_delivery()
            sch = await sub.channel()
            await sch.basic_qos(prefetch_count=20)
            consumer = await sch.basic_consume("ha.q")
            got = []

            async def consume():
                async for msg in consumer:
                    got.append(msg.body)
                    sch.basic_ack(msg.delivery_tag)

            async with trio.open_nursery() as n:
                n.start_soon(consume)
                for i in range(300):
                    await ch.basic_publish("", "ha.q", b"%d" % i)
                    if i == 100:
                        c.kill("n1")
                    if i == 200:
                        await c.restart("n1")
                    await trio.sleep(0.01)
                await ch.wait_for_confirms(timeout=60)
                await trio.sleep(5)
                n.cancel_scope.cancel()
            return len(got)


def run(seed: int, tmp_path) -> tuple[str, int]:
    trace: list = []
    with traced(trace), deterministic(seed):
        delivered = trio.run(scenario, tmp_path, clock=trio.testing.MockClock(autojump_threshold=0))
    return trace_digest(trace), delivered


def test_the_same_seed_replays_the_same_trace(tmp_path):
    a = run(7, tmp_path / "a")
    b = run(7, tmp_path / "b")
    c = run(8, tmp_path / "c")
    assert a == b, "one seed, two different runs"
    assert a[0] != c[0]
    assert a[1] > 250  # (what the kill costs is the fault explorer's business)
