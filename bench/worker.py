"""Load-generator processes: what a producer or consumer process is given and how it reports.

This module owns the contract between the runner (the parent) and its worker processes: the
`Shared` state (counters, start/stop signals), the worker `spec`, the process entry point, and the
part files each worker leaves in the scenario folder for the runner to merge. The load itself is
driven by `bench.gen_warren` (trio, warren's own client: target warren-native) or `bench.gen_amqp`
(asyncio and pamqp: targets rabbitmq, warren-amqp and null).

Each worker adds its progress into `Shared.counters` a few times a second (never per message):
[published, confirmed (ack), delivered, first deliveries (not redelivered)].
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from bench.records import CONF_ACK, interval_lines, per_second, write_lines

PUBLISHED, CONFIRMED, DELIVERED, FIRST = range(4)


class Shared:
    """State shared by the runner and its workers (built from one multiprocessing context)."""

    def __init__(self, ctx):
        self.counters = ctx.Array("q", 4)
        self.ready = ctx.Value("i", 0)
        self.finished = ctx.Value("i", 0)  # producer processes that stopped publishing
        self.start_at = ctx.Value("d", 0.0)
        self.start = ctx.Event()
        self.consume = ctx.Event()       # consumers may start consuming
        self.stop_publish = ctx.Event()  # producers stop early (interrupt)
        self.stop = ctx.Event()          # consumers stop

    def add(self, deltas: list[int]) -> None:
        with self.counters.get_lock():
            for i, d in enumerate(deltas):
                if d:
                    self.counters[i] += d

    def snapshot(self) -> list[int]:
        with self.counters.get_lock():
            return list(self.counters)

    def wait_start(self) -> float:
        with self.ready.get_lock():
            self.ready.value += 1
        self.start.wait()
        return self.start_at.value


def rotate(nodes: list, k: int) -> list:
    k %= len(nodes)
    return nodes[k:] + nodes[:k]


def gen_module(target: str):
    """The load module that drives `target`."""
    if target in ("warren-native", "warren"):
        from bench import gen_warren as gen
    else:
        from bench import gen_amqp as gen
    return gen


def main(spec: dict, shared: Shared) -> None:
    """Entry point of a worker process."""
    t_cpu = os.times()
    spec["errors"] = []
    t_wall = time.time()
    gen = gen_module(spec["target"])
    if spec["role"] == "idle":
        result = gen.run_idle(spec, shared)
        cpu = os.times()
        usage = {"role": "idle", "part": spec["part"], "pid": os.getpid(),
                 "cpu_s": round((cpu.user - t_cpu.user) + (cpu.system - t_cpu.system), 3),
                 "wall_s": round(time.time() - t_wall, 3),
                 "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                 "errors": result.pop("errors", [])[:20], "idle": result}
        (Path(spec["out_dir"]) / f"usage.idle.part{spec['part']}").write_text(json.dumps(usage))
        return
    if spec["role"] == "producer":
        records = gen.run_producers(spec, shared)
        for r in records:
            if r.unknown:
                spec["errors"].append(f"producer {r.producer}: {r.unknown} confirm(s) for sequences never "
                                      f"published, e.g. {r.unknown_ranges[:3]} with {len(r.t_pub)} published")
        with shared.finished.get_lock():
            shared.finished.value += 1
    else:
        records = gen.run_consumers(spec, shared)
    cpu = os.times()
    usage = {"role": spec["role"], "part": spec["part"], "pid": os.getpid(),
             "cpu_s": round((cpu.user - t_cpu.user) + (cpu.system - t_cpu.system), 3),
             "wall_s": round(time.time() - t_wall, 3),
             "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "errors": spec["errors"][:20]}
    write_parts(spec, records, usage)


def write_parts(spec: dict, records: list, usage: dict) -> None:
    out = Path(spec["out_dir"])
    sc = spec["scenario"]
    sample = sc["sample_every"] if sc["log"] == "interval" else 1
    role, part = spec["role"], spec["part"]
    counts: dict = {}
    size = sc["message_size"]
    if role == "producer":
        write_lines(out / f"publish.part{part}", (r.lines(sample) for r in records))
        for r in records:
            per_second(r.t_pub, size, counts, "publish")
            r.grow_confirms()
            per_second((t for t, c in zip(r.t_conf, r.conf) if c == CONF_ACK), size, counts, "confirm")
    else:
        write_lines(out / f"deliver.part{part}", (r.lines(sample) for r in records))
        for r in records:
            per_second(r.t_del, size, counts, "deliver")
    write_lines(out / f"intervals.{role}.part{part}", [interval_lines(counts)])
    (out / f"usage.{role}.part{part}").write_text(json.dumps(usage))
