"""Synthetic benchmark runs in the `bench/LOGS.md` format, for tests and for trying the analysis
without a cluster.

    python -m bench.analysis.synth results/ [--seed 7] [--messages 5000]
    python -m bench.analysis results/

Everything here is deterministic for a given seed. The numbers are invented but shaped like a
real run: one producer at a fixed rate, confirm and delivery latencies drawn from log-normal
distributions (RabbitMQ a little faster than warren, so the report shows a ratio), and, in the
``failover`` scenario, a leader kill after which deliveries stop for a while, the messages that
were in flight come back with ``red: true``, and a mirror reports its sync progress.

`write_scenario` is the low-level writer the tests also use for hand-crafted logs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

ID_SHIFT = 40  # message id = producer index * 2**40 + sequence (LOGS.md)


def _dump_lines(path: Path, rows) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def intervals_from(publishes: list[dict], deliveries: list[dict], size: int) -> list[dict]:
    """Per-second counts for each role, computed from full (unsampled) message lines."""
    buckets: dict[tuple[str, float], int] = {}

    def add(role: str, t: float | None) -> None:
        if t is not None:
            key = (role, float(math.floor(t)))
            buckets[key] = buckets.get(key, 0) + 1

    for m in publishes:
        add("publish", m["t_pub"])
        add("confirm", m["t_conf"])
    for d in deliveries:
        add("deliver", d["t_del"])
    return [{"t": t, "role": role, "n": n, "bytes": n * size}
            for (role, t), n in sorted(buckets.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def write_scenario(folder: Path, meta: dict, publishes: list[dict] | None = None,
                   deliveries: list[dict] | None = None, intervals: list[dict] | None = None,
                   faults: list[dict] | None = None) -> Path:
    """Write one SCENARIO/TARGET folder. A file whose argument is None is not written at all,
    which is how tests model optional files that are missing."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scenario.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")
    for name, rows in (("publish", publishes), ("deliver", deliveries),
                       ("intervals", intervals), ("faults", faults)):
        if rows is not None:
            _dump_lines(folder / f"{name}.jsonl", rows)
    return folder


def _simulate(rng: random.Random, *, messages: int, rate: float, t0: float, lat_scale: float,
              fault_at: float | None, outage: float) -> tuple[list, list, list]:
    """One producer, one consumer. Returns (publishes, deliveries, faults) with full detail."""
    publishes, deliveries, faults = [], [], []
    fault_t = None if fault_at is None else t0 + fault_at
    resume = None if fault_t is None else fault_t + outage
    for seq in range(messages):
        mid = seq  # producer 0
        t_pub = t0 + seq / rate + rng.uniform(0, 0.2 / rate)
        conf_lat = rng.lognormvariate(math.log(0.002 * lat_scale), 0.5)
        del_lat = rng.lognormvariate(math.log(0.004 * lat_scale), 0.6)
        t_conf, t_del = t_pub + conf_lat, t_pub + del_lat
        conf = "ack"
        if resume is not None:
            if fault_t <= t_conf < resume:  # confirms wait for the new leader
                t_conf = resume + conf_lat
            if t_del >= fault_t and t_del < resume:
                t_del = resume + del_lat
            elif fault_t - 0.05 <= t_del < fault_t:
                # delivered but not yet acked when the leader died: comes back redelivered
                deliveries.append({"id": mid, "c": 0, "q": "bench.q.0", "t_del": t_del,
                                   "red": False, "node": "n1"})
                t_del = resume + del_lat + 0.001
                deliveries.append({"id": mid, "c": 0, "q": "bench.q.0", "t_del": t_del,
                                   "red": True, "node": "n2"})
                publishes.append({"id": mid, "p": 0, "q": "bench.q.0", "size": 0,
                                  "t_pub": t_pub, "t_conf": t_conf, "conf": conf})
                continue
        node = "n1" if resume is None or t_del < fault_t else "n2"
        publishes.append({"id": mid, "p": 0, "q": "bench.q.0", "size": 0,
                          "t_pub": t_pub, "t_conf": t_conf, "conf": conf})
        deliveries.append({"id": mid, "c": 0, "q": "bench.q.0", "t_del": t_del,
                           "red": False, "node": node})
    if fault_t is not None:
        faults.append({"t": fault_t, "action": "kill", "node": "n1", "queue": None, "detail": {}})
        backlog, t = 2000, resume + 0.5
        for k in range(1, 5):
            done = backlog * k // 4
            faults.append({"t": t + 0.5 * k, "action": "sync_progress", "node": "n3",
                           "queue": "bench.q.0", "detail": {
                               "messages": done, "bytes": done * 1024,
                               "rate_msgs": backlog / 4 / 0.5, "rate_bytes": backlog / 4 / 0.5 * 1024}})
        faults.append({"t": t + 2.5, "action": "sync_done", "node": "n3", "queue": "bench.q.0",
                       "detail": {"messages": backlog, "bytes": backlog * 1024, "seconds": 2.2}})
    deliveries.sort(key=lambda d: d["t_del"])
    return publishes, deliveries, faults


def make_run(root: Path, *, seed: int = 1, messages: int = 5000, rate: float = 500.0, outage: float = 0.8,
             targets: tuple[str, ...] = ("warren", "rabbitmq"), sampled_every: int = 1,
             run_id: str | None = None, t0: float = 1_760_000_000.0) -> Path:
    """Write a run with two scenarios, ``steady`` (no faults file) and ``failover`` (a kill of the
    leader's node halfway, nothing delivered for ``outage`` seconds, then sync progress). With
    ``sampled_every > 1`` the message lines hold one message in that many (by sequence, as the runner samples) and scenario.json says so."""
    rng = random.Random(seed)
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S", time.gmtime(t0)) + f"-{rng.getrandbits(24):06x}"
    run_dir = Path(root) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    size = 1024
    duration = messages / rate
    scenarios = {"steady": None, "failover": duration / 2}
    t = t0
    for name, fault_at in scenarios.items():
        for target in targets:
            scale = 1.0 if target == "warren" else 0.7
            pubs, dels, faults = _simulate(rng, messages=messages, rate=rate, t0=t,
                                           lat_scale=scale, fault_at=fault_at, outage=outage)
            for m in pubs:
                m["size"] = size
            t_end = max(d["t_del"] for d in dels) + 0.01
            inter = intervals_from(pubs, dels, size)
            if sampled_every > 1:
                pubs = [m for m in pubs if (m["id"] % (1 << ID_SHIFT)) % sampled_every == 0]
                dels = [d for d in dels if (d["id"] % (1 << ID_SHIFT)) % sampled_every == 0]
            workload = {"name": name, "message_size": size, "producers": 1, "consumers": 1,
                        "queues": 1, "producer_rate": rate, "drain": True,
                        "log": "interval" if sampled_every > 1 else "per-message",
                        "sample_every": sampled_every,
                        "faults": [] if fault_at is None else
                        [{"at": fault_at, "action": "kill", "target": "leader", "queue": None}]}
            meta = {"run_id": run_id, "scenario": name, "target": target, "workload": workload,
                    "t_start": t, "t_end": t_end, "nodes": ["n1", "n2", "n3"],
                    "sampled": sampled_every > 1}
            write_scenario(run_dir / name / target, meta, pubs, dels, inter,
                           faults if fault_at is not None else None)
            t = t_end + 1.0
    run = {"run_id": run_id, "started_at": t0, "finished_at": t, "git_commit": "synthetic",
           "python": "3.11", "warren_version": "0.1.0",
           "rabbitmq_version": "3.10 (synthetic)" if "rabbitmq" in targets else None,
           "machine": {"cpus": 2, "mem_gib": 4, "platform": "synthetic"},
           "workloads": ["synthetic.yaml"], "targets": list(targets)}
    (run_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
    return run_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.analysis.synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default="results", help="results folder to write a run into")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--messages", type=int, default=5000, help="messages per scenario and target")
    ap.add_argument("--rate", type=float, default=500.0, help="publish rate, msgs/s")
    ap.add_argument("--outage", type=float, default=0.8, help="seconds without deliveries after the kill")
    ap.add_argument("--sample-every", type=int, default=1, help="keep 1 message line in N")
    ap.add_argument("--warren-only", action="store_true", help="no rabbitmq target")
    args = ap.parse_args(argv)
    targets = ("warren",) if args.warren_only else ("warren", "rabbitmq")
    out = make_run(Path(args.root), seed=args.seed, messages=args.messages, rate=args.rate,
                   outage=args.outage, targets=targets, sampled_every=args.sample_every,
                   t0=1_760_000_000.0 + args.seed * 1000)
    print(out)


if __name__ == "__main__":
    main()
