"""No confirm stall after a full cluster restart: the mirrors a restarted node starts are wired to
their leader at once, whatever order the nodes catch up on the metadata in.

A node that restarts catches up on many metadata changes at once. Among them its mirror of a
queue may leave the mirror list and come back (the cluster re-planned while it was away), so the
node stops its replica and starts a new one in one go; the queue's leader, which may have
applied the same changes at once, saw no change for that node and sent its start once. That
start reached the replica being stopped, which followed and answered it; the new replica never
heard of a start and ignored every batch, so every confirm waited for a mirror that would never
acknowledge, until the leader gave up on it after net_ticktime (a second `make demo`: 10 s at
1,000 msgs/s). broker/router.py `_take_back_mirror_input` hands the new replica the start, and
mirroring/replica.py `_on_rep_not_following` has a replica that follows nobody say so to a
leader that streams to it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing

from bench.chaos.checker import STALL_LIMIT, Publish, confirm_stalls
from broker.control import ctl_call
from broker.simulation import PEER_PORT, SimCluster, deterministic, traced

pytestmark = pytest.mark.timeout(120)

QUEUE = "demo.orders"
# seeds of `restart_then_publish` that stalled for net_ticktime before the fix
STALLED_SEEDS = (23,)


def longest_confirm_stall(pubs: list[Publish], end: float) -> float:
    """The longest time with publishes outstanding and no confirm (the chaos checker's measure)."""
    return max((b - a for a, b, _ in confirm_stalls(pubs, {}, end)), default=0.0)


async def publish_and_consume(c: SimCluster, count: int, via: str, consume_via: str,
                              pubs: list | None = None) -> None:
    """`count` publishes with confirms through `via` (recorded in `pubs`), then consume them
    with manual acks through `consume_via`."""
    async with c.connect(via) as conn:
        ch = await conn.channel()
        await ch.queue_declare(QUEUE, durable=True)
        await ch.confirm_delivery()
        if pubs is not None:
            def confirmed(first, last, ok, reason):
                for seq in range(first, last + 1):
                    pubs[seq - 1].outcome, pubs[seq - 1].t_conf = "ack" if ok else "nack", trio.current_time()
            ch.on_confirm = confirmed
        for i in range(count):
            await ch.basic_publish("", QUEUE, b"y" * 1000)
            if pubs is not None:
                pubs.append(Publish(i, 0, via, trio.current_time()))
        await ch.wait_for_confirms(timeout=60)
    async with c.connect(consume_via) as conn:
        ch = await conn.channel()
        await ch.basic_qos(500)
        consumer = await ch.basic_consume(QUEUE)
        got = 0
        async for msg in consumer:
            got += 1
            ch.basic_ack(msg.delivery_tag)
            if got == count:
                break


async def restart_then_publish(seed: int) -> float:
    """A mirrored queue used, the whole cluster stopped (stop_app, then the process) and started
    again in a seeded order, then a publisher with confirms: the longest confirm stall."""
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        c = SimCluster(nursery, Path("/nonexistent"), seed=seed, net_ticktime=10.0)
        await c.form()
        await ctl_call(c.net.host("n1"), "n1", PEER_PORT, "t", b"s", "set_policy",
                       dict(name="ha", pattern="^demo", definition='{"ha-mode":"all"}'))
        await publish_and_consume(c, 1000, "n1", "n3")
        order = list(c.names)
        rng.shuffle(order)
        for name in order:
            await c.nodes[name].stop_app()
            c.kill(name)
        if seed % 2:
            for a, b in (("n1", "n2"), ("n1", "n3"), ("n2", "n3")):
                c.net.delay(a, b, rng.uniform(0.0002, 0.003))
        rng.shuffle(order)
        for name in order:
            await c.restart(name)
            await trio.sleep(rng.uniform(0, 0.1))
        await c.wait_for(lambda: all(c.nodes[n].running == set(c.names) for n in c.names))
        await trio.sleep(rng.uniform(0, 0.6))
        pubs: list = []
        await publish_and_consume(c, 1000, "n1", "n3", pubs)
        end = trio.current_time()
        nursery.cancel_scope.cancel()
    return longest_confirm_stall(pubs, end)


def run(seed: int) -> tuple[float, list]:
    trace: list = []
    with traced(trace), deterministic(seed):
        stall = trio.run(restart_then_publish, seed, clock=trio.testing.MockClock(autojump_threshold=0))
    return stall, trace


@pytest.mark.parametrize("seed", STALLED_SEEDS)
def test_no_confirm_stall_after_a_full_restart(seed):
    """Seed 23: n1 catches up on the metadata in one go, stops its mirror of the queue and
    starts a new one; the leader's start went to the one stopped. Before the fix the confirms
    waited 10.6 s, until the leader dropped the silent mirror."""
    stall, trace = run(seed)
    dropped = [dict(fields) for _, event, fields in trace if "asking to drop the mirror" in event]
    assert stall < STALL_LIMIT, f"confirms stalled {stall:.1f} s after the restart: {dropped}"
    assert not dropped, "a mirror of the restarted cluster was dropped: " + repr(dropped)


def test_a_replica_that_follows_nobody_tells_the_leader_streaming_to_it():
    """The mirror's side of the rule: a replica in WAITING that gets a batch of the epoch its
    metadata names asks its leader to start it again (RMirrorReset: the leader drops it through
    the metadata and the planner adds it back, started afresh), once a second at most; an
    older leader's batch, or one for a queue that does not list it, gets no answer."""
    from mirroring import replica as rp
    from mirroring.policy import ha_settings
    from wire import messages as m

    assign = rp.Assign("n1", 2, ["n3", "n2"], [], ha_settings(None, False))
    r = rp.Replica("q", rp.ReplicaConfig(node="n2", pid="<n2.1.0>"), assign, now=0.0)
    assert r.state is rp.State.WAITING

    def resets(now, epoch=2, seq=1):
        r.handle(m.RRep("q", epoch, seq, []), now)
        out, _ = r.take_output()
        return [(o.node, o.msg) for o in out if isinstance(o, rp.Send)]

    assert resets(0.0, epoch=1) == []  # an older epoch's leader: not ours
    assert resets(0.1) == [("n1", m.RMirrorReset("q", 2, "n2"))]
    assert resets(0.2, seq=2) == []  # said a moment ago
    assert resets(1.2, seq=3) == [("n1", m.RMirrorReset("q", 2, "n2"))]
    r.assign_now(rp.Assign("n1", 2, ["n3"], [], ha_settings(None, False)), 1.3)
    assert r.state is rp.State.STOPPED
