"""A microbenchmark of one queue's hot path, leader and mirror, with no I/O: nanoseconds per
message of each step a delivery's life takes in mirroring/queue.py.

    python -m bench.queue_micro [--batch 100] [--rounds 3000] [--spill] [--ack-each]

Per round the leader `QueueState` takes a publish batch, dispatches it to one consumer and has
it acknowledged (each step recording its effects), and a mirror `QueueState` applies the three
effect batches. Best of five runs, per message: `publish`, `dispatch`, `settle` on the leader,
`m_enq`, `m_del`, `m_settle` on the mirror, and `ch_ack`: the consumer's channel recording the
delivery's tags and turning the consumer's ack of them into message ids (broker/session.py).
The mirror ends equal to its leader (checked). `--spill` keeps every unacknowledged delivery
in its table (queue: id -> entry; channel: tag -> (queue, id)) instead of as a run, as before
the runs: the same command measures both forms. `--ack-each` has the consumer acknowledge one
message at a time (one settle per id on the leader, one ESettle effect per id for the mirror, one
tag per ack on the channel), as a consumer without `multiple` does, instead of the whole delivery
in one call. This is a figure for comparing two versions on one machine, not a throughput: the
benchmarks of `warren-bench run` are.
"""

from __future__ import annotations

import argparse
import time

from broker.session import Channel, Session
from mirroring.queue import QueueState
from wire.messages import ACK

STEPS = ("publish", "dispatch", "settle", "m_enq", "m_del", "m_settle", "ch_ack")


def run_once(batch: int, rounds: int, spill: bool = False, ack_each: bool = False) -> dict[str, float]:
    leader, mirror = QueueState("q"), QueueState("q")
    leader.effects = []
    owner = ("n2", 5, 1)
    leader.add_consumer(owner, "c", False, 100_000)
    mirror.apply_effects(leader.effects)
    leader.effects = []
    ch = Channel(1)
    body = b"x" * 1024
    spent = dict.fromkeys(STEPS, 0.0)
    clock = time.perf_counter

    def effects() -> list:
        out, leader.effects = leader.effects, []
        return out

    for r in range(rounds):
        t0 = clock()
        leader.publish([body] * batch, None, ["n1", 7], r + 1)
        t1 = clock()
        enq = effects()
        t2 = clock()
        out = leader.dispatch()
        if spill:
            leader.unacked  # noqa: B018 (reading it moves the runs into the table)
        t3 = clock()
        ids = [m[0] for _, msgs in out for m in msgs]
        deliver = effects()
        t4 = clock()
        if ack_each:
            for mid in ids:
                leader.settle(owner, ACK, [mid])
        else:
            leader.settle(owner, ACK, ids)
        t5 = clock()
        settle = effects()
        t6 = clock()
        mirror.apply_effects(enq)
        t7 = clock()
        mirror.apply_effects(deliver)
        if spill:
            mirror.unacked  # noqa: B018
        t8 = clock()
        mirror.apply_effects(settle)
        t9 = clock()
        first = ch.next_tag
        ch.next_tag += len(ids)
        tags = list(range(first, ch.next_tag))
        t10 = clock()
        ch.record_delivery(first, "q", ids)
        if spill:
            ch.tags  # noqa: B018
        if ack_each:
            acked = [Session._settle(None, ch, [t], 0)["q"][0] for t in tags]
        else:
            acked = Session._settle(None, ch, tags, 0)["q"]
        if acked != ids:
            raise AssertionError("the channel did not settle what it delivered")
        t11 = clock()
        for step, took in zip(STEPS, (t1 - t0, t3 - t2, t5 - t4, t7 - t6, t8 - t7, t9 - t8, t11 - t10)):
            spent[step] += took
    if mirror.comparable() != leader.comparable():
        raise AssertionError("the mirror does not equal its leader")
    return {step: s / (rounds * batch) * 1e9 for step, s in spent.items()}


def run(batch: int = 100, rounds: int = 3000, repeat: int = 5, spill: bool = False,
        ack_each: bool = False) -> dict[str, float]:
    """Best of `repeat` runs, ns per message for each step."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        for step, ns in run_once(batch, rounds, spill, ack_each).items():
            best[step] = min(best.get(step, ns), ns)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.queue_micro", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=100, help="messages per publish batch")
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--spill", action="store_true",
                   help="unacknowledged deliveries in their tables, not as runs (the old form)")
    p.add_argument("--ack-each", action="store_true",
                   help="one ack per message (no `multiple`), instead of one for the whole delivery")
    args = p.parse_args(argv)
    best = run(args.batch, args.rounds, spill=args.spill, ack_each=args.ack_each)
    mirror = best["m_enq"] + best["m_del"] + best["m_settle"]
    how = (" (spilled)" if args.spill else "") + (" (one ack per message)" if args.ack_each else "")
    print(f"batch {args.batch}{how}, ns per message: "
          + "  ".join(f"{step} {ns:.0f}" for step, ns in best.items()) + f"  mirror total {mirror:.0f}")


if __name__ == "__main__":
    main()
