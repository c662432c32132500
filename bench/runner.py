"""`warren-bench run`: runs scenarios against targets and writes the logs of bench/LOGS.md.

This module owns the run: the results folder and `run.json`, the order of targets and scenarios,
per scenario the set-up (policy, queues, waiting for mirrors), the worker processes (producers in
one group of processes, consumers in another, see `bench.worker`), the fault schedule, the drain,
the merge of the workers' part files into `publish.jsonl`/`deliver.jsonl`/`intervals.jsonl`, and
the one-line summary per scenario. Faults run in a thread of their own so the progress line and
the drain check keep their pace while a `warrenctl` call takes its time. Three kinds of scenario
carry no messages and have their own runs: idle connections (`run_idle`: a node's memory),
declare scenarios (`run_declare`: the time to declare and delete many queues) and rpc scenarios
(`run_rpc`: many clients that each hold an exclusive reply queue).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import declaring, rpc_clients
from bench import worker as workermod
from bench.records import LATENCY_KINDS
from bench.runinfo import new_meta, new_run_id, write_meta
from bench.targets import (
    NullTarget,
    RabbitTarget,
    Target,
    TargetError,
    Unsupported,
    WarrenTarget,
    amqp_client_available,
    rabbitmq_available,
)
from bench.shared import CONFIRMED, DELIVERED, FIRST, PUBLISHED, Shared
from bench.workload import Scenario, load, resolve, select

TARGETS = ("warren-native", "warren-amqp", "rabbitmq", "null", "floor")
ALIASES = {"warren": ["warren-native"], "both": ["warren-native", "rabbitmq"],
           "all": ["warren-native", "warren-amqp", "rabbitmq"]}
AMQP_TARGETS = ("warren-amqp", "rabbitmq", "null", "floor")
SERVER_NAMED = "amq.gen-"  # the prefix of the queues warren and RabbitMQ name themselves
IDLE_PER_PROC = 5000  # idle connections per worker process when the scenario gives no procs


def parse_targets(text: str) -> list[str]:
    """`--target`: comma-separated names of TARGETS or ALIASES, in order, without repeats."""
    out: list[str] = []
    for part in (x.strip() for x in text.split(",")):
        names = ALIASES.get(part, [part])
        for n in names:
            if n not in TARGETS:
                raise ValueError(f"unknown target {part!r} (known: {', '.join(TARGETS)}; "
                                 f"or {', '.join(ALIASES)})")
            if n not in out:
                out.append(n)
    return out


class Progress:
    """One status line rewritten in place on a terminal; silent otherwise."""

    def __init__(self, stream=sys.stderr, enabled: bool | None = None):
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self.width = 0

    def show(self, text: str) -> None:
        if self.enabled:
            pad = max(0, self.width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self.width = len(text)

    def done(self) -> None:
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


class FaultLog:
    def __init__(self):
        self.lines: list[dict] = []
        self.lock = threading.Lock()

    def add(self, t: float, action: str, node: str | None, queue: str | None, detail: dict) -> None:
        with self.lock:
            self.lines.append({"t": t, "action": action, "node": node, "queue": queue, "detail": detail})


class FaultRunner(threading.Thread):
    """Carries out a scenario's fault schedule, in order, at t0 + at."""

    def __init__(self, target: Target, sc: Scenario, t0: float, log: FaultLog, stop: threading.Event):
        super().__init__(daemon=True)
        self.target, self.sc, self.t0, self.log, self.stop = target, sc, t0, log, stop
        self.taken_down: dict[str, str] = {}  # kind of fault -> node, for sigcont/start_app/restart of "leader"
        self.errors: list[str] = []
        self.syncs: list[threading.Thread] = []

    def _queue(self, f) -> str:
        q = f["queue"]
        return self.sc.queue_names()[q] if isinstance(q, int) else q

    def _node(self, f, queue: str) -> str:
        if f["target"] != "leader":
            name = f["target"]
            m = re.fullmatch(r"n(\d+)", name)
            if name not in self.target.nodes and m and 0 < int(m.group(1)) <= len(self.target.nodes):
                return self.target.nodes[int(m.group(1)) - 1]  # nI: the I-th node of any target
            return name
        undo = {"sigcont": "sigstop", "start_app": "stop_app", "restart": "kill"}.get(f["action"])
        if undo and undo in self.taken_down:
            return self.taken_down.pop(undo)
        return self.target.leader(queue)

    def run(self) -> None:
        for f in self.sc.faults:
            queue = self._queue(f)
            node = None
            try:
                # find the node first (list_queues may take seconds), then act on time
                if f["action"] not in ("add_node", "sync_queue"):
                    node = self._node(f, queue)
                wait = self.t0 + f["at"] - time.time()
                if wait > 0 and self.stop.wait(wait):
                    return
                if f["action"] == "add_node":
                    t = time.time()
                    detail = self.target.add_node()
                    node = detail.get("node")
                elif f["action"] == "sync_queue":
                    self._sync(queue)
                    continue
                else:
                    t = time.time()
                    detail = self._act(f["action"], node)
            except (TargetError, OSError) as exc:
                t = time.time()
                detail = {"error": str(exc)}
                self.errors.append(f"{f['action']} at {f['at']:g}s: {exc}")
            self.log.add(t, f["action"], node, queue, detail)

    def _act(self, action: str, node: str) -> dict:
        tg = self.target
        if action == "kill":
            self.taken_down["kill"] = node
            return tg.kill(node)
        if action == "sigstop":
            self.taken_down["sigstop"] = node
            return tg.signal(node, signal.SIGSTOP)
        if action == "sigcont":
            return tg.signal(node, signal.SIGCONT)
        if action == "stop_app":
            self.taken_down["stop_app"] = node
            out = tg.ctl(node, "stop_app")
            tg.down.add(node)
            return {"output": out.strip()[-200:]}
        if action == "start_app":
            out = tg.ctl(node, "start_app")
            tg.down.discard(node)
            return {"output": out.strip()[-200:]}
        if action == "restart":
            return tg.restart(node)
        raise TargetError(f"unknown action {action}")

    def _sync(self, queue: str) -> None:
        """sync_queue in its own thread, with progress lines from list_queues while it runs."""
        size = self.sc.message_size
        try:
            before = self.target.queues().get(queue, {})
        except TargetError as exc:
            before = {"error": str(exc)}
        msgs = int(before.get("messages") or 0)
        t = time.time()  # the rate includes starting the ctl command (about a second)
        self.log.add(t, "sync_queue", None, queue, {"messages": msgs, "bytes": msgs * size})
        done = threading.Event()
        result: dict = {}

        def call():
            try:
                result["output"] = self.target.sync_queue(queue).strip()[-200:]
            except (TargetError, OSError) as exc:
                result["error"] = str(exc)
                self.errors.append(f"sync_queue {queue}: {exc}")
            done.set()

        def watch():
            threading.Thread(target=call, daemon=True).start()
            while not done.wait(0.5):
                try:
                    mirrors, synced = self.target.mirrors(queue)
                except TargetError:
                    continue
                el = time.time() - t
                self.log.add(time.time(), "sync_progress", None, queue,
                             {"messages": msgs, "bytes": msgs * size, "mirrors": mirrors, "synchronised": synced,
                              "rate_msgs": msgs / el if set(mirrors) <= set(synced) else None,
                              "rate_bytes": msgs * size / el if set(mirrors) <= set(synced) else None})
            el = max(time.time() - t, 1e-6)
            ok = "error" not in result
            self.log.add(time.time(), "sync_done", None, queue,
                         {"messages": msgs, "bytes": msgs * size, "seconds": round(el, 3),
                          "rate_msgs": msgs / el if ok else None, "rate_bytes": msgs * size / el if ok else None,
                          **result})

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        self.syncs.append(th)


def _split(items: list[int], parts: int) -> list[list[int]]:
    parts = max(1, min(parts, len(items))) if items else 0
    return [items[k::parts] for k in range(parts)]


def _assign(sc: Scenario) -> dict[int, list[int]]:
    """Queues of each consumer: queue q goes to consumer q % consumers; with fewer queues than
    consumers, consumer c shares queue c % queues."""
    return {c: sc.consumer_queues(c) for c in range(sc.consumers)}


def _merge(folder: Path, stem: str) -> int:
    parts = sorted(folder.glob(f"{stem}.part*"))
    n = 0
    with open(folder / f"{stem}.jsonl", "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            p.unlink()
    return n


def _merge_intervals(folder: Path) -> dict:
    counts: dict = {}
    for p in sorted(folder.glob("intervals.*.part*")):
        for line in p.read_text().splitlines():
            d = json.loads(line)
            c = counts.setdefault((d["t"], d["role"]), [0, 0])
            c[0] += d["n"]
            c[1] += d["bytes"]
        p.unlink()
    with open(folder / "intervals.jsonl", "w") as f:
        f.writelines(json.dumps({"t": t, "role": role, "n": n, "bytes": b}) + "\n" for (t, role), (n, b) in sorted(counts.items()))
    return counts


class Runner:
    def __init__(self, out: Path, procs: int = 1, progress: Progress | None = None, say=print):
        self.out = out
        self.procs = procs
        self.progress = progress or Progress()
        self.say = say
        self.ctx = multiprocessing.get_context("spawn")
        self.summaries: list[dict] = []
        self.interrupted = False

    # --- the run ------------------------------------------------------------------------------
    def make_target(self, tname: str, warren_nodes, rabbit_dir, amqp_addresses) -> Target:
        if tname == "warren-native":
            return WarrenTarget(warren_nodes, protocol="native")
        if tname == "warren-amqp":
            return WarrenTarget(warren_nodes, protocol="amqp", amqp_addresses=amqp_addresses)
        if tname == "rabbitmq":
            return RabbitTarget(dir=rabbit_dir)
        if tname == "null":
            return NullTarget()
        if tname == "floor":
            return NullTarget(mirrors=2)
        raise ValueError(tname)

    def run(self, workload_args: list[str], targets: list[str], warren_nodes: list[str] | None = None,
            rabbit_dir: Path | None = None, run_id: str | None = None,
            amqp_addresses: list[str] | None = None, only: list[str] | None = None) -> Path:
        files = [resolve(a) for a in workload_args]
        # every file is checked before anything starts
        scenarios = select([s for f in files for s in load(f)], only)
        run_id = run_id or new_run_id()
        folder = self.out / run_id
        folder.mkdir(parents=True, exist_ok=True)
        meta = new_meta(run_id, [str(f) for f in files], [])
        targets = [ALIASES["warren"][0] if t == "warren" else t for t in targets]
        for tname in list(targets):
            why = rabbitmq_available() if tname == "rabbitmq" else (
                amqp_client_available() if tname in AMQP_TARGETS else None)
            if why:
                self.say(f"{tname} target skipped: {why}")
                meta["skipped"].append({"target": tname, "reason": why})
                targets.remove(tname)
        meta["targets"] = targets
        write_meta(folder, meta)
        chaos = [s for s in scenarios if s.chaos is not None]
        scenarios = [s for s in scenarios if s.chaos is None]
        try:
            for sc in chaos:
                if self.interrupted:
                    break
                self.run_chaos(folder, run_id, sc, targets, meta)
            for tname in (targets if scenarios else []):
                target: Target = self.make_target(tname, warren_nodes, rabbit_dir, amqp_addresses)
                if tname.startswith("warren") and warren_nodes:
                    self.say(f"[{tname}] using {', '.join(warren_nodes)}")
                elif tname == "rabbitmq" and rabbit_dir:
                    self.say(f"[rabbitmq] using the cluster in {rabbit_dir}")
                else:
                    self.say(f"[{tname}] starting a 3-node cluster ...")
                try:
                    target.start()
                except Unsupported as exc:
                    self.say(f"{tname} target skipped: {exc}")
                    meta["skipped"].append({"target": tname, "reason": str(exc)})
                    write_meta(folder, meta)
                    continue
                meta[f"{tname}_version"] = target.version()
                write_meta(folder, meta)
                try:
                    for sc in scenarios:
                        if self.interrupted:
                            break
                        dirty = self.run_scenario(folder, run_id, target, sc, meta)
                        if dirty and (sc is not scenarios[-1] or not getattr(target, "owned", False)):
                            self._heal(target, sc)
                finally:
                    target.stop()
        except KeyboardInterrupt:
            self.interrupted = True
            self.say("interrupted")
        finally:
            meta["finished_at"] = time.time()
            meta["summaries"] = self.summaries
            write_meta(folder, meta)
        return folder

    def run_chaos(self, folder: Path, run_id: str, sc: Scenario, targets: list[str], meta: dict) -> None:
        """A chaos scenario: its seeded schedules (bench/chaos), each on a fresh local warren
        cluster, in a child process; folders chaos-SEED/warren/ with a verdict.json each."""
        if not any(t.startswith("warren") for t in targets):
            meta["skipped"].append({"target": ",".join(targets), "scenario": sc.name,
                                    "reason": "chaos schedules run on warren only"})
            self.say(f"[rabbitmq] {sc.name}: skipped (chaos schedules run on warren only)")
            return
        from bench.chaos import real
        cfg = sc.chaos
        schedules = real.schedules_for(cfg["seed"], cfg["schedules"], cfg["kinds"], tuple(cfg["faults"]),
                                       cfg["scale"])
        if cfg["rate"]:
            for s in schedules:
                s.rate = cfg["rate"]
        opts = real.Options(out=self.out, run_id=run_id, net_ticktime=cfg["net_ticktime"])
        if cfg["scale"] < 1.0:
            opts.drain_quiet, opts.drain2_quiet, opts.confirm_timeout, opts.heal_timeout = 2.0, 1.5, 5.0, 10.0
        self.say(f"[warren] {sc.name}: {len(schedules)} chaos schedule(s) from seed {cfg['seed']}")
        try:
            out = real.run_in_child(schedules, opts, folder, run_id)
        except KeyboardInterrupt:
            self.interrupted = True
            return
        meta["skipped"].extend(out["skipped"])
        for line in out["summaries"]:
            self.summaries.append({"target": "warren", **line, "workload": sc.name})
            self.say(f"[warren] {line['scenario']} ({', '.join(line['kinds'])}): "
                     f"{'OK' if line['ok'] else 'FAIL'} lost {line['lost']} stranded {line['stranded']} "
                     f"stuck {line['stuck']}; replay: {line['replay']}")
        write_meta(folder, meta)

    def _heal(self, target: Target, sc: Scenario) -> None:
        """After faults: a cluster we started is started afresh; a given one gets its nodes back."""
        if getattr(target, "owned", False):
            self.say(f"[{target.name}] restarting the cluster after the faults of {sc.name}")
            target.stop()
            target.start()
            return
        for node in target.nodes:
            pid = target.pid(node)
            if pid:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for node in sorted(target.down):
            self.say(f"[{target.name}] restarting {node} after the faults of {sc.name}")
            try:
                target.restart(node)
            except (TargetError, OSError) as exc:
                self.say(f"  could not restart {node}: {exc}")

    # --- one scenario on one target ---------------------------------------------------------------
    def run_scenario(self, folder: Path, run_id: str, target: Target, sc: Scenario, meta: dict) -> bool:
        """Returns True when the cluster may be left damaged (faults ran)."""
        if sc.idle:
            return self.run_idle(folder, run_id, target, sc, meta)
        if sc.declaring:
            return self.run_declare(folder, run_id, target, sc, meta)
        if sc.rpc:
            return self.run_rpc(folder, run_id, target, sc, meta)
        tname = target.name
        policy = sc.effective_policy
        policy_name = f"bench-{sc.name}"
        queues = sc.queue_names()
        addresses = target.addresses()
        gen = _gen_module(tname)
        try:
            if sc.needs == "sync" and tname.startswith("warren"):
                _probe_sync(target)  # before the policy, so a skipped scenario leaves nothing behind
            if policy is not None:
                target.set_policy(policy_name, "^" + re.escape(f"bench.{sc.name}."), policy)
        except Unsupported as exc:
            self.say(f"[{tname}] {sc.name}: skipped: {exc}")
            meta["skipped"].append({"target": tname, "scenario": sc.name, "reason": str(exc)})
            return False
        sdir = folder / sc.name / tname
        sdir.mkdir(parents=True, exist_ok=True)
        nn = len(addresses)
        qnodes = [sc.queue_node(q, nn) for q in range(sc.queues)]
        gen.declare(addresses, queues, sc.durable, delete=True, qnodes=qnodes)
        gen.declare(addresses, queues, sc.durable, qnodes=qnodes)
        mirror_wait = self._wait_mirrors(target, sc, queues) if policy is not None else None

        shared = Shared(self.ctx)
        procs = sc.procs or self.procs
        prod_groups = _split(list(range(sc.producers)), procs)
        cons_groups = _split(list(range(sc.consumers)), procs)
        per = sc.messages // sc.producers
        limits = {p: (per + (1 if p < sc.messages % sc.producers else 0)) if sc.messages else 0
                  for p in range(sc.producers)}
        pqueues = {p: sc.producer_queues(p) for p in range(sc.producers)}
        assign = _assign(sc)
        spread = sc.leaders == "spread"
        # which node each connection goes to: its first queue's node when leaders are spread,
        # else producer p on node p, consumer c on node c + 1 (round the nodes)
        pnode = {p: qnodes[pqueues[p][0]] if spread else p % nn for p in range(sc.producers)}
        cnode = {c: (qnodes[assign[c][0]] if spread and assign[c] else (c + 1) % nn)
                 for c in range(sc.consumers)}
        base = {"target": tname, "nodes": addresses, "node_names": dict(zip(addresses, target.nodes)),
                "queues": queues, "scenario": sc.as_dict(), "out_dir": str(sdir), "limits": limits,
                "rate": sc.producer_rate / sc.producers, "rate_total": sc.producer_rate,
                "producers": sc.producers, "pqueues": pqueues, "pnode": pnode, "cnode": cnode,
                "assign": assign, "confirm_timeout": 15.0}
        procs = []
        for k, idx in enumerate(prod_groups):
            procs.append(self.ctx.Process(target=workermod.main, daemon=True,
                                          args=(base | {"role": "producer", "part": k, "indices": idx}, shared)))
        n_prod = len(procs)
        for k, idx in enumerate(cons_groups):
            procs.append(self.ctx.Process(target=workermod.main, daemon=True,
                                          args=(base | {"role": "consumer", "part": k, "indices": idx}, shared)))
        cpu_before = target.cpu()
        runq_before = target.runq()
        for p in procs:
            p.start()
        deadline = time.time() + 120 + (sc.producers + sc.consumers) / 20
        while shared.ready.value < len(procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.time() > deadline:
                for p in procs:
                    p.kill()
                shared.stop_publish.set()
                shared.stop.set()
                raise TargetError(f"{sc.name}: a worker failed to connect (see its error above)")
            time.sleep(0.02)
        t0 = time.time() + 0.2
        shared.start_at.value = t0
        if not sc.consume_after_publish:
            shared.consume.set()
        shared.start.set()

        faults = FaultLog()
        fault_stop = threading.Event()
        fr = FaultRunner(target, sc, t0, faults, fault_stop)
        fr.start()
        dirty = bool(sc.faults)
        t_pub_end = None
        last_count, last_change = -1, time.time()
        planned = sc.warmup + sc.duration if not sc.messages else None
        prev = (time.time(), [0, 0, 0, 0])
        rates = [0.0, 0.0, 0.0]
        try:
            while True:
                time.sleep(0.1)
                now = time.time()
                c = shared.snapshot()
                if now - prev[0] >= 1.0:
                    rates = [(c[i] - prev[1][i]) / (now - prev[0]) for i in (PUBLISHED, CONFIRMED, DELIVERED)]
                    prev = (now, c)
                el = now - t0
                phase = "publish" if t_pub_end is None else "drain"
                total = f"/{planned:.0f}s" if planned else "s"
                self.progress.show(f"[{tname}] {sc.name} {phase} {el:5.1f}{total}  pub {c[PUBLISHED]:,} "
                                   f"({rates[0]:,.0f}/s)  conf {c[CONFIRMED]:,} ({rates[1]:,.0f}/s)  "
                                   f"del {c[DELIVERED]:,} ({rates[2]:,.0f}/s)")
                if t_pub_end is None:
                    if shared.finished.value >= n_prod or all(p.exitcode is not None for p in procs[:n_prod]):
                        t_pub_end = now
                        shared.consume.set()
                        last_change = now
                    continue
                if c[DELIVERED] != last_count:
                    last_count, last_change = c[DELIVERED], now
                faults_done = not fr.is_alive() and not any(t.is_alive() for t in fr.syncs)
                if not faults_done and now < t_pub_end + 600:
                    continue  # the schedule runs to its end (a sync may outlast the load)
                if not procs[n_prod:] or not sc.drain:
                    break
                if c[FIRST] >= c[PUBLISHED] or now - last_change > sc.drain_timeout:
                    break
                if any(p.exitcode not in (None, 0) for p in procs[n_prod:]):
                    break
        except KeyboardInterrupt:
            self.interrupted = True
            shared.stop_publish.set()
        finally:
            t_end = time.time()
            shared.stop_publish.set()
            shared.stop.set()
            fault_stop.set()
            self.progress.done()
        for p in procs:
            p.join(120)
            if p.exitcode is None:
                p.kill()
        fr.join(5)
        for th in fr.syncs:
            th.join(5)
        cpu_after = target.cpu()
        runq_after = target.runq()
        failed = [p for p in procs if p.exitcode != 0]

        _merge(sdir, "publish")
        _merge(sdir, "deliver")
        counts = _merge_intervals(sdir)
        with open(sdir / "faults.jsonl", "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in sorted(faults.lines, key=lambda d: d["t"]))
        usage = []
        for p in sorted(sdir.glob("usage.*.part*")):
            usage.append(json.loads(p.read_text()))
            p.unlink()
        node_cpu = {n: round(cpu_after[n] - cpu_before[n], 2) for n in cpu_after
                    if cpu_after.get(n) is not None and cpu_before.get(n) is not None}
        wall = t_end - t0
        info = {"run_id": run_id, "scenario": sc.name, "target": tname, "workload": sc.as_dict(),
                "t_start": t0, "t_end": t_end, "nodes": list(target.nodes), "sampled": sc.sampled,
                "t_measure": t0 + sc.warmup, "t_publish_end": t_pub_end, "policy": policy,
                "mirror_wait": mirror_wait, "generator": usage, "node_cpu_s": node_cpu,
                "node_runq": {n: [round(runq_after[n][0] - runq_before[n][0], 4),
                                  runq_after[n][1] - runq_before[n][1]]
                              for n in runq_after if n in runq_before},
                "errors": fr.errors + [f"worker {p.name} exit code {p.exitcode}" for p in failed]
                + [e for u in usage for e in u.get("errors", [])]}
        (sdir / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
        summary = _summary(info, counts, wall)
        summary["latency"] = latency_summary(sdir, info["t_measure"])
        info["latency"] = summary["latency"]
        (sdir / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
        self.summaries.append(summary)
        self.say(_summary_line(summary))
        for e in info["errors"]:
            self.say(f"  error: {e}")
        # leave the cluster as we found it
        try:
            alive = [a for a, n in zip(target.addresses(), target.nodes) if n not in target.down]
            gen.declare(alive, queues, sc.durable, delete=True)
            if policy is not None:
                target.clear_policy(policy_name)
        except Exception as exc:  # noqa: BLE001 - any client's error; a damaged cluster is restarted by the caller anyway
            self.say(f"  cleanup: {exc}")
            dirty = True
        return dirty

    # --- an idle-connection scenario -------------------------------------------------------------
    def run_idle(self, folder: Path, run_id: str, target: Target, sc: Scenario, meta: dict) -> bool:
        """Open sc.idle_connections connections to one node, hold them, read the node's memory."""
        tname = target.name
        sdir = folder / sc.name / tname
        sdir.mkdir(parents=True, exist_ok=True)
        addresses = target.addresses()
        k = sc.idle_node % len(addresses)
        node = target.nodes[k]
        counts = connections_per_proc(sc.idle_connections, sc.procs, IDLE_PER_PROC)
        shared = Shared(self.ctx)
        base = {"target": tname, "nodes": addresses, "scenario": sc.as_dict(), "out_dir": str(sdir),
                "idle_node": k, "role": "idle"}
        rss_before = target.rss()
        cpu_before = target.cpu()
        t0 = time.time()
        workers = [self.ctx.Process(target=workermod.main, daemon=True,
                                    args=(base | {"part": i, "connections": n, "indices": []}, shared))
                   for i, n in enumerate(counts)]
        for w in workers:
            w.start()
        deadline = time.time() + 120 + sc.idle_connections / 50
        while shared.ready.value < len(workers) and time.time() < deadline:
            if all(w.exitcode is not None for w in workers):
                break
            self.progress.show(f"[{tname}] {sc.name} opening {sc.idle_connections:,} connections "
                               f"{time.time() - t0:5.1f}s  {node} RSS {target.rss().get(node)} MiB")
            time.sleep(0.5)
        t_open = time.time()
        samples = []
        while time.time() < t_open + sc.idle_seconds and not self.interrupted:
            samples.append({"t": round(time.time(), 3), "rss_mib": target.rss().get(node)})
            self.progress.show(f"[{tname}] {sc.name} holding {time.time() - t_open:4.1f}/{sc.idle_seconds:g}s  "
                               f"{node} RSS {samples[-1]['rss_mib']} MiB")
            time.sleep(1.0)
        rss_held = target.rss()
        cpu_held = target.cpu()
        shared.stop.set()
        _join(workers, 120)
        self.progress.done()
        time.sleep(2)
        rss_after = target.rss()
        t_end = time.time()
        usage = _take_usage(sdir)
        opened = sum(u.get("idle", {}).get("opened", 0) for u in usage)
        before, held = rss_before.get(node), rss_held.get(node)
        idle = {"node": node, "connections": sc.idle_connections, "opened": opened,
                "alive_at_end": sum(u.get("idle", {}).get("alive_at_end", 0) for u in usage),
                "open_s": max((u.get("idle", {}).get("open_s", 0) for u in usage), default=None),
                "rss_before_mib": before, "rss_held_mib": held, "rss_after_mib": rss_after.get(node),
                "kib_per_connection": round((held - before) * 1024 / opened, 1)
                if opened and held is not None and before is not None else None,
                "rss_all_nodes_held_mib": rss_held,
                "node_cpu_s_while_held": _cpu_between(cpu_before, cpu_held),
                "samples": samples}
        errors = [e for u in usage for e in u.get("errors", [])] + [
            f"worker {w.name} exit code {w.exitcode}" for w in workers if w.exitcode != 0]
        info = {"run_id": run_id, "scenario": sc.name, "target": tname, "workload": sc.as_dict(),
                "t_start": t0, "t_end": t_end, "nodes": list(target.nodes), "sampled": False,
                "t_measure": t_open, "t_publish_end": None, "policy": None, "generator": usage,
                "idle": idle, "errors": errors}
        (sdir / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
        summary = {"target": tname, "scenario": sc.name, "idle": {k2: v for k2, v in idle.items()
                                                                   if k2 != "samples"}}
        self.summaries.append(summary)
        self.say(f"[{tname}] {sc.name}: {opened:,} of {sc.idle_connections:,} connections open on {node} "
                 f"(in {idle['open_s']} s); {node} RSS {before} MiB before, {held} MiB held, "
                 f"{idle['rss_after_mib']} MiB after closing; {idle['kib_per_connection']} KiB per connection")
        for e in errors[:5]:
            self.say(f"  error: {e}")
        return False

    # --- a declare scenario ------------------------------------------------------------------------
    def run_declare(self, folder: Path, run_id: str, target: Target, sc: Scenario, meta: dict) -> bool:
        """Declare sc.declare_queues queues, then delete them, and time both phases and every call.

        One worker process (bench/worker.py, role `declare`) holds one connection and channel per
        node, each a task of that process (see `declaring` and the generators' `run_declare`):
        queue i through node i % nodes, each connection's share one call after another, all
        starting together; after the last declare, each connection deletes what it declared."""
        tname = target.name
        sdir = folder / sc.name / tname
        sdir.mkdir(parents=True, exist_ok=True)
        addresses = target.addresses()
        names = sc.declare_names()
        total = len(names)
        gen = _gen_module(tname)
        errors: list[str] = []
        left_before = self._scenario_queues(target, sc)
        if left_before:  # an interrupted run's queues: a declare of an existing queue is no declare
            self.say(f"  {sc.name}: deleting {len(left_before)} queue(s) a previous run left")
            gen.declare(addresses, left_before, False, delete=True)
        shared = Shared(self.ctx)
        spec = {"target": tname, "nodes": addresses, "scenario": sc.as_dict(), "out_dir": str(sdir),
                "role": "declare", "part": 0, "indices": [],
                "shares": declaring.shares(names, len(addresses))}
        cpu_before = target.cpu()
        t_start = time.time()
        w = self.ctx.Process(target=workermod.main, daemon=True, args=(spec, shared))
        w.start()
        try:
            t0 = self._start_together(shared, [w], f"[{tname}] {sc.name} connecting")
            # generous: a broker whose declare costs O(queues) takes tens of seconds for 1,000
            limit = time.time() + 300 + total * 0.2
            while w.exitcode is None:
                c = shared.snapshot()
                self.progress.show(f"[{tname}] {sc.name} {max(0.0, time.time() - t0):5.1f}s  declared "
                                   f"{c[0]:,}/{total:,}  deleted {c[1]:,}/{total:,}")
                if time.time() > limit and not shared.stop.is_set():
                    errors.append(f"stopped after {limit - t0:.0f} s: the calls took too long")
                    shared.stop.set()
                w.join(0.1)
        except KeyboardInterrupt:
            self.interrupted = True
            shared.stop.set()
        finally:
            cpu_after, t_end, usage = self._end_workers(shared, [w], target, sdir)
        result = next((u.pop("declare") for u in usage if "declare" in u), None)
        left = self._scenario_queues(target, sc)
        node_cpu = _cpu_between(cpu_before, cpu_after)
        errors += [e for u in usage for e in u.get("errors", [])]
        if w.exitcode != 0:
            errors.append(f"worker {w.name} exit code {w.exitcode}")
        declare = _declare_summary(result, total, list(target.nodes), left, node_cpu, w.exitcode != 0)
        info = {"run_id": run_id, "scenario": sc.name, "target": tname, "workload": sc.as_dict(),
                "t_start": t_start, "t_end": t_end, "nodes": list(target.nodes), "sampled": False,
                "t_measure": (result or {}).get("t0") or t0, "t_publish_end": None, "policy": None,
                "generator": usage, "declare": declare, "errors": errors}
        (sdir / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
        self.summaries.append({"target": tname, "scenario": sc.name, "declare": declare})
        self.say(_declare_line(tname, sc.name, declare))
        for e in errors[:5]:
            self.say(f"  error: {e}")
        if left or (left is None and declare["declared"] != declare["deleted"]):
            try:  # leave the cluster as we found it
                gen.declare(addresses, left or names, False, delete=True)
            except Exception as exc:  # noqa: BLE001 - any client's error: say it, the run goes on
                self.say(f"  cleanup: {exc}")
        return False

    # --- an rpc scenario ---------------------------------------------------------------------------
    def run_rpc(self, folder: Path, run_id: str, target: Target, sc: Scenario, meta: dict) -> bool:
        """sc.rpc_clients RPC clients, each holding an exclusive queue the broker names: the time
        until all hold one, and the time from their closing until the broker lists none of them.

        The clients (client i to node i % nodes) are spread over worker processes
        (bench/worker.py, role `rpc`; the generators' `run_rpc`, book-keeping in `rpc_clients`),
        a run of consecutive client numbers each, all starting together. Once every process says
        its clients hold their queues, the target's queues are listed, the workers are told to
        close their connections, and the listing is read again and again until none of the
        clients' queues is in it."""
        tname = target.name
        sdir = folder / sc.name / tname
        sdir.mkdir(parents=True, exist_ok=True)
        total = sc.rpc_clients
        counts = connections_per_proc(total, sc.procs, rpc_clients.PER_PROC)
        errors: list[str] = []
        # server-named queues listed before the clients begin are not theirs (normally none)
        known = {q for q in _listed(target) or () if q.startswith(SERVER_NAMED)}
        shared = Shared(self.ctx)
        base = {"target": tname, "nodes": target.addresses(), "scenario": sc.as_dict(), "out_dir": str(sdir),
                "role": "rpc", "indices": [], "at_once": rpc_clients.AT_ONCE}
        workers = [self.ctx.Process(target=workermod.main, daemon=True,
                                    args=(base | {"part": p, "first": sum(counts[:p]), "clients": n}, shared))
                   for p, n in enumerate(counts)]
        cpu_before = target.cpu()
        t_start = time.time()
        t0 = t_held = t_close = None
        listing: set[str] | None = None
        ours: set[str] = set()
        gone: dict = {}
        cpu_held: dict = {}
        for w in workers:
            w.start()
        try:
            t0 = self._start_together(shared, workers, f"[{tname}] {sc.name} starting {len(workers)} processes")
            limit = t0 + 120 + total / 20
            # a worker ends only when told to stop: one that ended early failed, and its clients with it
            while shared.held.value + sum(w.exitcode is not None for w in workers) < len(workers):
                c = shared.snapshot()
                self.progress.show(f"[{tname}] {sc.name} {max(0.0, time.time() - t0):5.1f}s  holding "
                                   f"{c[0]:,}/{total:,}  failed {c[1]:,}")
                if time.time() > limit:
                    errors.append(f"gave up after {limit - t0:.0f} s: {c[0]:,} of {total:,} clients held "
                                  f"their queue")
                    break
                time.sleep(0.05)
            t_held = time.time()
            cpu_held = target.cpu()
            listing = _listed(target)
            for p in range(len(workers)):
                names = rpc_clients.names_file(sdir, p)
                if names.exists():
                    ours.update(json.loads(names.read_text()))
                    names.unlink()
            # the clients' queues: the names they were given, and any new server-named queue listed
            ours |= {q for q in listing or () if q.startswith(SERVER_NAMED)} - known
            t_close = time.time()
            shared.stop.set()
            gone = self._wait_gone(target, sc, ours, t_close, timeout=60 + total / 50)
            if gone["left_after"]:
                errors.append(f"{gone['left_after']:,} of the clients' queues still listed "
                              f"{gone['waited_s']:.0f} s after the clients closed")
        except KeyboardInterrupt:
            self.interrupted = True
            shared.stop.set()
        finally:
            cpu_after, t_end, usage = self._end_workers(shared, workers, target, sdir)
            for late in sdir.glob("rpc.names.part*"):  # a worker that held its queues after we gave up
                late.unlink()
        results = [u.pop("rpc") for u in usage if "rpc" in u]
        errors += [f"worker {w.name} exit code {w.exitcode}" for w in workers if w.exitcode != 0]
        problems = len(errors)  # the runner's own: gave up waiting, queues left, a worker failed
        errors += [e for u in usage for e in u.get("errors", [])]
        seen = {"t0": t0, "t_held": t_held, "t_close": t_close, "known": known, "ours": ours,
                "listing": listing, **gone}
        rpc = _rpc_summary(results, total, counts, seen, _cpu_between(cpu_before, cpu_held),
                           _cpu_between(cpu_before, cpu_after), problems)
        info = {"run_id": run_id, "scenario": sc.name, "target": tname, "workload": sc.as_dict(),
                "t_start": t_start, "t_end": t_end, "nodes": list(target.nodes), "sampled": False,
                "t_measure": t0, "t_publish_end": None, "policy": None, "generator": usage, "rpc": rpc,
                "errors": errors}
        (sdir / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
        self.summaries.append({"target": tname, "scenario": sc.name, "rpc": rpc})
        self.say(_rpc_line(tname, sc.name, rpc))
        for e in errors[:5]:
            self.say(f"  error: {e}")
        return False

    def _start_together(self, shared: Shared, workers: list, label: str) -> float:
        """Wait (2 minutes at most) until every worker waits for the start, then give them all
        the same start time, 0.2 s ahead; returns it."""
        t = time.time()
        while shared.ready.value < len(workers) and time.time() < t + 120 and any(
                w.exitcode is None for w in workers):
            self.progress.show(f"{label} {time.time() - t:4.1f}s")
            time.sleep(0.05)
        t0 = time.time() + 0.2
        shared.start_at.value = t0
        shared.start.set()
        return t0

    def _end_workers(self, shared: Shared, workers: list, target: Target, sdir: Path) -> tuple:
        """Let the workers end (a worker still waiting for the start is let go; see `_join`),
        then read the nodes' CPU: (cpu, time, the workers' usage files)."""
        shared.start.set()
        _join(workers)
        self.progress.done()
        return target.cpu(), time.time(), _take_usage(sdir)

    def _wait_gone(self, target: Target, sc: Scenario, queues: set[str], t_close: float,
                   timeout: float) -> dict:
        """Read the target's queues until none of `queues` is listed (or `timeout` s after
        t_close): `gone_s`, from t_close to the end of the first listing without them (null if
        none came), `still_listed_s`, from t_close to the start of the last listing that still
        showed some (null if the first showed none): they went between the two; `left_after`,
        how many the last listing showed (null: the target could not list its queues)."""
        out = {"gone_s": None, "still_listed_s": None, "left_after": None, "listings": 0, "waited_s": 0.0}
        while True:
            t = time.time()
            listed = _listed(target)
            out["listings"] += 1
            out["waited_s"] = time.time() - t_close
            if listed is None:
                return out
            out["left_after"] = left = len(queues & listed)
            if not left:
                out["gone_s"] = round(out["waited_s"], 3)
                return out
            out["still_listed_s"] = round(t - t_close, 3)
            if out["waited_s"] > timeout:
                return out
            self.progress.show(f"[{target.name}] {sc.name} {out['waited_s']:5.1f}s after the close: "
                               f"{left:,} queues still listed")
            time.sleep(0.05)

    def _scenario_queues(self, target: Target, sc: Scenario) -> list[str] | None:
        """The queues named bench.SCENARIO.* the target lists now; None when it cannot list them."""
        prefix = f"bench.{sc.name}."
        listed = _listed(target)
        return None if listed is None else sorted(q for q in listed if q.startswith(prefix))

    def _wait_mirrors(self, target: Target, sc: Scenario, queues: list[str], timeout: float = 30) -> dict:
        pol = sc.effective_policy or {}
        mode = pol.get("ha-mode")
        want = len(target.nodes) - 1 if mode == "all" else (
            int(pol.get("ha-params", 1)) - 1 if mode == "exactly" else len(pol.get("ha-params") or []) - 1)
        if not target.lists_mirrors:  # the null brokers: nothing to wait for
            return {"mirrors": want, "seconds": None}
        t = time.time()
        while time.time() - t < timeout:
            try:
                rows = target.queues()
            except TargetError:
                rows = {}
            ok = all(len(rows.get(q, {}).get("synchronised_mirror_pids" if target.name.startswith("warren")
                                              else "synchronised_slave_pids") or []) >= want for q in queues)
            if ok and rows:
                return {"mirrors": want, "seconds": round(time.time() - t, 2)}
            time.sleep(0.3)
        self.say(f"  warning: {sc.name}: mirrors not all synchronised after {timeout:g} s; running anyway")
        return {"mirrors": want, "seconds": None}


def _listed(target: Target) -> set[str] | None:
    """The names of the queues the target lists now; None when it cannot list them."""
    try:
        return set(target.queues())
    except (TargetError, OSError, ValueError):
        return None


def connections_per_proc(total: int, procs: int | None, per_proc: int) -> list[int]:
    """How many of `total` connections each worker process holds: `procs` processes (None: as
    few as keep each at per_proc or under), the remainder one more each for the first ones."""
    procs = max(1, min(procs or -(-total // per_proc), total))
    return [total // procs + (1 if i < total % procs else 0) for i in range(procs)]


def _take_usage(sdir: Path) -> list[dict]:
    """The usage files the workers left in the scenario folder (read, then removed)."""
    usage = []
    for part in sorted(sdir.glob("usage.*.part*")):
        usage.append(json.loads(part.read_text()))
        part.unlink()
    return usage


def _cpu_between(before: dict, after: dict) -> dict:
    """Each node's CPU seconds between two `Target.cpu()` readings (nodes read both times)."""
    return {n: round(after[n] - before[n], 2) for n in after
            if after.get(n) is not None and before.get(n) is not None}


def _join(workers: list, timeout: float = 60) -> None:
    """Wait for the worker processes to end; kill those still running after `timeout` s."""
    end = time.time() + timeout
    for w in workers:
        w.join(max(0.0, end - time.time()))
        if w.exitcode is None:
            w.kill()
            w.join(5)


def _gen_module(tname: str):
    return workermod.gen_module(tname)


def _probe_sync(target: Target) -> None:
    out = subprocess.run(["warrenctl", "sync_queue", "--help"], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise Unsupported("this warren has no sync_queue command yet (the sync feature has not landed)")


def _summary(info: dict, counts: dict, wall: float) -> dict:
    """Steady rates over the measured window (after warmup, whole seconds only)."""
    lo = info["t_measure"]
    rates = {}
    for role in ("publish", "confirm", "deliver"):
        secs = [(t, v[0]) for (t, r), v in counts.items() if r == role]
        last = max((t for t, _ in secs), default=0)  # the last second is partial
        inside = [n for t, n in secs if t >= lo and t < last]
        total = sum(n for _, n in secs)
        rates[role] = round(sum(inside) / len(inside)) if inside else (round(total / wall) if wall > 0 else 0)
        rates[role + "_total"] = total
    gen_cpu = max((u["cpu_s"] / u["wall_s"] for u in info["generator"] if u["wall_s"] > 0), default=None)
    node_cpu = max((v / wall for v in info["node_cpu_s"].values()), default=None) if wall > 0 else None
    # CPU microseconds per message: on a machine shared with other work, a process gets what the
    # scheduler gives it, so compare costs, not utilisation. The side costing more per message
    # (given an equal share of the cores) limits the run.
    per_role = {"producer": rates["publish_total"], "consumer": rates["deliver_total"]}
    gen_us = {}
    for u in info["generator"]:
        n = per_role.get(u["role"]) or 0
        if n:
            gen_us[u["role"]] = gen_us.get(u["role"], 0) + u["cpu_s"] * 1e6 / n
    n_msgs = max(rates["publish_total"], 1)
    node_us = max((v * 1e6 / n_msgs for v in info["node_cpu_s"].values()), default=None)
    return {"target": info["target"], "scenario": info["scenario"], **rates,
            "generator_cpu_max": round(gen_cpu, 2) if gen_cpu is not None else None,
            "node_cpu_max": round(node_cpu, 2) if node_cpu is not None else None,
            "generator_us_per_msg": {k: round(v, 1) for k, v in gen_us.items()},
            "busiest_node_us_per_msg": round(node_us, 1) if node_us is not None else None,
            **_runq_summary(info, n_msgs)}


def _runq_summary(info: dict, n_msgs: int) -> dict:
    """Time the run's processes (nodes and generators) spent runnable but waiting for a CPU, per
    message and per time slice: when it is a sizeable part of a latency, the cores were busy
    and the figure measures the machine's load as much as the broker (bench/README.md, "Waiting
    for a CPU"). Empty when the kernel keeps no per-task schedstat or a process went
    unmeasured."""
    parts = list((info.get("node_runq") or {}).values())
    gens = [u.get("runq") for u in info["generator"]]
    if not parts or len(parts) != len(info["node_cpu_s"]) or not gens or None in gens:
        return {}
    wait = sum(p[0] for p in parts + gens)
    slices = sum(p[1] for p in parts + gens)
    return {"runq_wait_us_per_msg": round(wait * 1e6 / n_msgs, 1),
            "runq_wait_us_per_slice": round(wait * 1e6 / slices, 1) if slices else None}


def _percentiles(values: list[float]) -> dict:
    """p50/p99/p99.9/max (ms) with the interpolation of numpy's default and of Spark's percentile."""
    if not values:
        return {"n": 0}
    values.sort()

    def pct(q: float) -> float:
        k = (len(values) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {"n": len(values), "p50_ms": round(pct(0.5), 3), "p99_ms": round(pct(0.99), 3),
            "p999_ms": round(pct(0.999), 3), "max_ms": round(values[-1], 3)}


def latency_summary(sdir: Path, t_measure: float, max_lines: int = 3_000_000) -> dict:
    """Latency percentiles over the measured window for the summary line, from the merged logs:
    publish->confirm and publish->first delivery measured from the intended send time when the
    lines carry one (open loop: coordinated omission corrected), else from t_pub; and the
    generator's own lag (t_pub - t_int), and publish->confirm from the actual send (t_conf -
    t_pub, `confirm_sent`: without that lag). The Spark job computes the same from the same
    lines."""
    pub: dict[int, float] = {}
    conf, lag, sent = [], [], []
    try:
        with open(sdir / "publish.jsonl") as f:
            for i, line in enumerate(f):
                if i >= max_lines:
                    return {"skipped": f"more than {max_lines:,} lines"}
                d = json.loads(line)
                t0 = d.get("t_int") or d["t_pub"]
                if t0 < t_measure:
                    continue
                pub[d["id"]] = t0
                acked = d.get("conf") == "ack" and d.get("t_conf")
                if acked:
                    conf.append((d["t_conf"] - t0) * 1000)
                if d.get("t_int"):
                    lag.append((d["t_pub"] - d["t_int"]) * 1000)
                    if acked:
                        sent.append((d["t_conf"] - d["t_pub"]) * 1000)
        first: dict[int, float] = {}
        with open(sdir / "deliver.jsonl") as f:
            for line in f:
                d = json.loads(line)
                if d["id"] in pub and (d["id"] not in first or d["t_del"] < first[d["id"]]):
                    first[d["id"]] = d["t_del"]
    except OSError:
        return {}
    out = {"confirm": _percentiles(conf),
           "delivery": _percentiles([(t - pub[i]) * 1000 for i, t in first.items()])}
    if lag:
        out["send_lag"] = _percentiles(lag)
    if sent:
        out["confirm_sent"] = _percentiles(sent)
    return out


def _declare_summary(res: dict | None, queues: int, nodes: list[str], left: list[str] | None,
                     node_cpu: dict, worker_failed: bool) -> dict:
    """The `declare` object of scenario.json from the worker's `declaring.Phases.result()`: per
    phase the seconds from the first call's start to the last one's end (both times kept,
    `t_declare_first` ... `t_delete_last`), calls per second, and the per-call latency of the
    calls that succeeded."""
    res = res or {}
    out: dict = {"queues": queues, "connections": res.get("connections", len(nodes))}
    ok = res.get("ok") or {}
    out["declared"] = sum(ok.get("declare") or [])
    out["deleted"] = sum(ok.get("delete") or [])
    for phase, done, rate in (("declare", "declared", "declares_per_s"), ("delete", "deleted", "deletes_per_s")):
        first, last = (res.get("first") or {}).get(phase), (res.get("last") or {}).get(phase)
        secs = last - first if first is not None and last is not None else None
        out[f"{phase}_s"] = round(secs, 3) if secs is not None else None
        out[rate] = round(out[done] / secs, 1) if secs and out[done] else None
        out[f"t_{phase}_first"], out[f"t_{phase}_last"] = first, last
        pct = _percentiles(list((res.get("ms") or {}).get(phase) or []))
        for key in ("p50_ms", "p99_ms", "max_ms"):
            out[f"{phase}_{key}"] = pct.get(key)
    failed = res.get("failed") or {}
    out["errors"] = (failed.get("declare", 0) + failed.get("delete", 0) + res.get("lost_connections", 0)
                     + (1 if worker_failed else 0))
    out["left_after"] = len(left) if left is not None else None
    out["per_connection"] = [{"node": nodes[k] if k < len(nodes) else k, "declared": d, "deleted": x}
                             for k, (d, x) in enumerate(zip(ok.get("declare") or [], ok.get("delete") or []))]
    out["node_cpu_s"] = node_cpu
    return out


def _num(v, form: str = ".3g") -> str:
    """A number in a summary line: 3 significant digits, whole numbers from 100 on; ? for none."""
    return "?" if v is None else format(v, ",.0f" if form == ".3g" and abs(v) >= 100 else form)


def _declare_line(tname: str, scenario: str, d: dict) -> str:
    n = _num

    def phase(p: str, done: str, rate: str) -> str:
        return (f"{done} {d[done]:,} in {n(d[f'{p}_s'])} s ({n(d[rate], ',.0f')}/s; per call p50/p99/max "
                f"{n(d[f'{p}_p50_ms'])}/{n(d[f'{p}_p99_ms'])}/{n(d[f'{p}_max_ms'])} ms)")

    return (f"[{tname}] {scenario}: {d['queues']:,} queues through {d['connections']} connections: "
            f"{phase('declare', 'declared', 'declares_per_s')}, {phase('delete', 'deleted', 'deletes_per_s')}; "
            f"{d['errors']} error(s), {n(d['left_after'], 'd')} left after")


def _rpc_summary(results: list[dict], clients: int, counts: list[int], seen: dict, cpu_held: dict,
                 cpu_all: dict, problems: int) -> dict:
    """The `rpc` object of scenario.json from the workers' `rpc_clients.Holders.result()` and
    what the runner saw (`seen`: its start time t0, t_held when every worker said its clients
    held their queue, the listing then, t_close when it told them to close, and `_wait_gone`'s
    answer). `errors` counts the clients that failed and the runner's `problems`."""
    firsts = [r["t_first"] for r in results if r.get("t_first") is not None]
    lasts = [r["t_last"] for r in results if r.get("t_last") is not None]
    closed = [r["t_closed"] for r in results if r.get("t_closed") is not None]
    pct = _percentiles([x for r in results for x in r.get("ms") or []])
    listing, t_close = seen.get("listing"), seen.get("t_close")
    out = {"clients": clients, "procs": len(counts), "per_proc": counts, "at_once": rpc_clients.AT_ONCE,
           "opened": sum(r.get("opened", 0) for r in results),
           "failed": sum(r.get("failed", 0) for r in results),
           "held_s": round(max(lasts) - min(firsts), 3) if firsts and lasts else None,
           "t_first_connect": min(firsts, default=None), "t_last_declare_ok": max(lasts, default=None),
           "t_start": seen.get("t0"), "t_all_held": seen.get("t_held"), "t_close": t_close}
    for key in ("p50_ms", "p99_ms", "max_ms"):
        out[key] = pct.get(key)
    out["queues_listed_held"] = (len({q for q in listing if q.startswith(SERVER_NAMED)} - seen["known"])
                                 if listing is not None else None)
    out["names_listed_held"] = len(seen["ours"] & listing) if listing is not None else None
    out["server_named_before"] = len(seen["known"])
    out["closed_s"] = round(max(closed) - t_close, 3) if closed and t_close is not None else None
    for key in ("gone_s", "still_listed_s", "left_after", "listings"):
        out[key] = seen.get(key)
    out["errors"] = out["failed"] + problems
    out["node_cpu_s"] = cpu_all
    out["node_cpu_s_until_held"] = cpu_held
    out["node_cpu_total_s"] = round(sum(cpu_all.values()), 2) if cpu_all else None
    return out


def _rpc_line(tname: str, scenario: str, r: dict) -> str:
    n = _num
    gone = (f"none listed {n(r['gone_s'])} s after the close order" if r["gone_s"] is not None
            else f"{n(r['left_after'], ',')} still listed after the close")
    held_cpu = sum(r["node_cpu_s_until_held"].values()) if r.get("node_cpu_s_until_held") else None
    return (f"[{tname}] {scenario}: {r['opened']:,} of {r['clients']:,} clients ({r['procs']} processes) "
            f"held an exclusive queue after {n(r['held_s'])} s (connect+declare per client p50/p99/max "
            f"{n(r['p50_ms'])}/{n(r['p99_ms'])}/{n(r['max_ms'])} ms), {n(r['queues_listed_held'], ',')} "
            f"listed; {gone}; {r['errors']} error(s); nodes' CPU {n(r['node_cpu_total_s'])} s "
            f"({n(held_cpu)} s until all held)")


def _summary_line(s: dict) -> str:
    lat = s.get("latency") or {}
    extra = ""
    for kind in LATENCY_KINDS:
        v = lat.get(kind) or {}
        if v.get("n"):
            extra += f"; {kind} p50/p99/p99.9 {v['p50_ms']:g}/{v['p99_ms']:g}/{v['p999_ms']:g} ms"
    return (f"[{s['target']}] {s['scenario']}: publish {s['publish']:,}/s  confirm {s['confirm']:,}/s  "
            f"deliver {s['deliver']:,}/s  (totals {s['publish_total']:,}/{s['confirm_total']:,}/"
            f"{s['deliver_total']:,}; CPU per message: generator "
            f"{', '.join(f'{k} {v:g} us' for k, v in s['generator_us_per_msg'].items()) or '?'}, "
            f"busiest node {s['busiest_node_us_per_msg'] if s['busiest_node_us_per_msg'] is not None else '?'} us; "
            f"busiest generator process {_pct(s['generator_cpu_max'])} of a core, "
            f"busiest node {_pct(s['node_cpu_max'])}{_runq_text(s)}){extra}")


def _runq_text(s: dict) -> str:
    if s.get("runq_wait_us_per_msg") is None:
        return ""
    return (f"; waiting for a CPU {s['runq_wait_us_per_msg']:g} us per message over all processes, "
            f"{s['runq_wait_us_per_slice']:g} us per time slice")


def _pct(x) -> str:
    return "?" if x is None else f"{x:.0%}"
