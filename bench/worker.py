"""Load-generator processes: what a producer or consumer process is given and how it reports.

This module owns the worker side of the contract between the runner (the parent) and its worker
processes: the worker `spec`, the process entry point, and the part files each worker leaves in
the scenario folder for the runner to merge (the state they share is bench/shared.py's). The load itself is
driven by `bench.gen_warren` (trio, warren's own client: target warren-native) or `bench.gen_amqp`
(asyncio and pamqp: targets rabbitmq, warren-amqp and null). An idle-connection, declare or
rpc worker (role `idle`, `declare` or `rpc`) writes no message records, only its usage file
with the generator's result in it; the idle and rpc ones, holding many connections, first raise
their open-file limit to its hard limit.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from bench.records import CONF_ACK, interval_lines, per_second, write_lines
from bench.shared import Shared
from bench.targets import proc_runq

NO_MESSAGE_ROLES = ("idle", "declare", "rpc")

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
    runq_start = proc_runq()
    spec["errors"] = []
    t_wall = time.time()
    gen = gen_module(spec["target"])
    if spec["role"] in NO_MESSAGE_ROLES:  # no message records: the result is the usage's
        role = spec["role"]
        if role in ("idle", "rpc"):
            raise_open_files()
        result = getattr(gen, f"run_{role}")(spec, shared)
        cpu = os.times()
        usage = {"role": role, "part": spec["part"], "pid": os.getpid(),
                 "cpu_s": round((cpu.user - t_cpu.user) + (cpu.system - t_cpu.system), 3),
                 "wall_s": round(time.time() - t_wall, 3),
                 "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                 "errors": result.pop("errors", [])[:20], role: result}
        (Path(spec["out_dir"]) / f"usage.{role}.part{spec['part']}").write_text(json.dumps(usage))
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
    runq = proc_runq()
    usage = {"role": spec["role"], "part": spec["part"], "pid": os.getpid(),
             "cpu_s": round((cpu.user - t_cpu.user) + (cpu.system - t_cpu.system), 3),
             "runq": None if runq is None or runq_start is None else
             [round(runq[0] - runq_start[0], 4), runq[1] - runq_start[1]],
             "wall_s": round(time.time() - t_wall, 3),
             "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "errors": spec["errors"][:20]}
    write_parts(spec, records, usage)


def raise_open_files() -> None:
    """Lift this process's soft limit of open files to the hard one (a connection is a file)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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
