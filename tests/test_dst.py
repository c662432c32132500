"""Deterministic simulation: one seed decides a whole-cluster run, faults included, so a run
replays exactly (the same trace of events), and two seeds differ."""

from __future__ import annotations

import pytest
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


def test_a_chaos_schedule_replays_exactly_on_the_simulation():
    """The fault explorer's schedules too: one seed, one trace, one verdict."""
    from bench.chaos.sim import run_seed
    a, b = run_seed(4), run_seed(4)
    assert a.digest == b.digest
    assert a.verdict.line() == b.verdict.line()


# Seeds 1-43 draw every fault kind of the simulation at least once (cancel_sync first at 26,
# policy at 43), and the test checks it still does; a wider sweep is `make dst`. About 20 s of
# CPU (0.4 s a schedule); the timeout only guards a hang
SWEEP = range(1, 44)


@pytest.mark.process  # two worker processes
@pytest.mark.timeout(600)
def test_schedules_of_every_fault_kind_lose_nothing_confirmed(capsys):
    """Seeded schedules of every fault kind, judged by the same checker as the real-process
    campaign: no confirmed message lost where the spec does not allow it, no repeat without the
    redelivered flag, no stranded message or consumer, no stuck publisher. A failure prints
    `warren-bench dst --seed N --replay`; a bug found this way becomes a regression seed."""
    from bench.chaos.sim import SIM_KINDS, explore, sim_schedule
    drawn = {k for seed in SWEEP for k in sim_schedule(seed).fault_kinds()}
    assert drawn == set(SIM_KINDS), f"seeds {SWEEP.start}-{SWEEP.stop - 1} never draw {set(SIM_KINDS) - drawn}"
    results = explore(SWEEP.start, len(SWEEP), procs=2)
    out = capsys.readouterr().out
    failed = [r for r in results if not r["ok"]]
    assert len(results) == len(SWEEP) and not failed, out


def test_a_crashed_simulation_is_a_failed_schedule_with_its_seed(monkeypatch, capsys):
    """An exception out of the simulated cluster fails that seed (with its replay command and
    where it was raised) and the other seeds still run, rather than ending the whole explorer
    with a traceback that names no seed."""
    from bench.chaos import sim
    real = sim.run_seed

    def crash_on_3(seed, *args, **kwargs):
        if seed == 3:
            raise ExceptionGroup("nursery", [trio.BrokenResourceError("connection is broken")])
        return real(seed, *args, **kwargs)

    monkeypatch.setattr(sim, "run_seed", crash_on_3)
    results = sim.explore(2, 3)
    out = capsys.readouterr().out
    assert [r["ok"] for r in results] == [True, False, True], out
    assert "FAIL seed 3" in out and "BrokenResourceError: connection is broken" in out, out
    assert "warren-bench dst --seed 3 --replay" in out, out


def test_schedules_cross_between_the_simulation_and_real_processes():
    """A real campaign's schedule runs on the simulation (`warren-bench dst --from-chaos`) and a
    simulated one without simulation-only faults on real processes (`warren-bench chaos`): the
    commands each side prints draw the very same faults, whatever order the kinds were given in."""
    import shlex

    from bench.chaos.real import schedules_for
    from bench.chaos.schedule import KINDS, generate
    from bench.chaos.sim import SIM_KINDS, SimResult, sim_schedule

    def parse(cmd: str) -> dict:
        words = shlex.split(cmd)
        opts = {w[2:]: v for w, v in zip(words, words[1:] + [""]) if w.startswith("--")}
        lo, _, hi = opts.get("faults", "1-3").partition("-")
        kinds = opts["kinds"].split(",") if opts.get("kinds") else None
        return {"seed": int(opts["seed"]), "kinds": kinds, "faults": (int(lo), int(hi or lo)),
                "scale": float(opts["scale"]) if "scale" in opts else None,
                "rate": int(opts["rate"]) if "rate" in opts else None}

    crossed = 0
    for seed in range(300, 340):
        kinds = list(KINDS) if seed % 2 else ["pause", "kill", "policy"]
        real = generate(seed, kinds)
        assert generate(seed, kinds[::-1]).actions == real.actions
        a = parse(real.simulation_command())
        assert "--from-chaos" in real.simulation_command()
        simulated = sim_schedule(a["seed"], a["kinds"] or list(KINDS), a["faults"], a["scale"] or 1.0, a["rate"])
        assert simulated.actions == real.actions and simulated.policy == real.policy
        assert simulated.rate == real.rate and simulated.leader == real.leader

        s = sim_schedule(seed, list(SIM_KINDS)[::-1])
        cmd = SimResult(seed, s, None, "", 0.0).real_replay()
        if any(k not in KINDS for k in s.fault_kinds()):
            assert cmd is None
            continue
        crossed += 1
        b = parse(cmd)
        back = schedules_for(b["seed"], 1, b["kinds"], b["faults"], b["scale"] or 1.0)[0]
        assert back.actions == s.actions and back.policy == s.policy and back.leader == s.leader
        assert (b["rate"] or back.rate) == s.rate
    assert crossed > 5, crossed


def test_handshake_nonces_come_from_the_seed_in_a_simulation(tmp_path):
    """One seed decides every byte a simulated node sends, its handshake challenges included;
    a real node's are fresh random bytes."""
    import random

    from broker.config import NodeConfig
    from broker.network import SimNetwork
    from broker.node import Node

    cfg = NodeConfig(name="n1", host="n1", advertise_host="n1", secret=b"s", data_dir=str(tmp_path)).validate()

    def nonces(rng):
        node = Node(cfg, SimNetwork(1).host("n1"), persist=False, rng=rng)
        return [node.new_nonce() for _ in range(3)]
    a, b = nonces(random.Random("7/n1/1")), nonces(random.Random("7/n1/1"))
    assert a == b and len(set(a)) == 3 and len(a[0]) == 16
    assert nonces(random.Random("8/n1/1")) != a
    assert nonces(None) != nonces(None)
