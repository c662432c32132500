"""`warren-bench`: benchmark commands (not tests). This module owns the command line only.

    warren-bench run WORKLOAD... [--target TARGET[,TARGET...]] [--nodes n1,n2,n3] [--out results]

targets: warren-native (warren's own client), warren-amqp (warren's AMQP 0-9-1 port), rabbitmq,
null (the null AMQP broker: what the generator alone can do), floor (a mirrored null broker on
trio: what Python and trio alone cost a mirrored confirm); warren = warren-native,
both = warren-native,rabbitmq, all = warren-native,warren-amqp,rabbitmq.

runs workload files (or shipped suites by name: smoke, throughput, latency, failover, scale, sync,
declare, rpc) and writes the logs of bench/LOGS.md under results/RUN_ID/; see bench/README.md.

    warren-bench analyse [RESULTS]     the Spark job of bench/analysis over those logs
                                       (`analyze` works too)

    warren-bench chaos [--schedules N] [--seed S] [--kinds k1,k2] [--replay] [--out results]

runs seeded fault schedules (bench/chaos) against fresh local clusters and prints, per schedule,
the checker's verdict and the one command that replays it; `--smoke` runs one short schedule
per fault kind, `--check FOLDER` recomputes the verdict of a chaos folder from its logs.

    warren-bench fuzz [--inputs 100000] [--seed 1] [--concurrency 8] [--out results/fuzz.json]

starts one node and sends it random inputs (bench/fuzz.py) over every port, before and after
logging in, while a well-behaved client publishes and consumes; prints the verdict (crashes,
connections left hanging, file descriptors and RSS before and after, the client's rounds).

    warren-bench throughput [--seconds 10] [--size 1024] [--window 2000] [--prefetch 1000]
                            [--user U --password P] [--queue-prefix perf.]

starts a one-node cluster of real processes (or uses `--nodes HOST:PORT`), runs one publisher
with pipelined confirms (at most --window unconfirmed) and one consumer with manual acks on one
non-mirrored queue, both at once, and prints msgs/s for each.

A problem the user can fix (no node at --nodes, a cluster that does not start, a bad workload)
is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import trio

from broker import localcluster
from broker.client.aio import open_connection


async def throughput(nodes: list[str], seconds: float, size: int, window: int, prefetch: int,
                     user: str = "guest", password: str = "guest", prefix: str = "bench.") -> dict:
    body = b"x" * size
    queue = f"{prefix}{os.getpid()}"
    stats = {"published": 0, "confirmed": 0, "consumed": 0}
    login = {"user": user, "password": password}
    async with open_connection(nodes, **login) as pconn, open_connection(nodes, **login) as cconn:
        pch = await pconn.channel()
        await pch.queue_declare(queue)
        await pch.confirm_delivery()
        room = trio.Semaphore(window)

        def on_confirm(first, last, ok, reason):
            n = last - first + 1
            stats["confirmed"] += n
            for _ in range(n):
                room.release()

        pch.on_confirm = on_confirm
        cch = await cconn.channel()
        await cch.basic_qos(prefetch)
        consumer = await cch.basic_consume(queue)
        deadline = trio.current_time() + seconds

        async def publish():
            while trio.current_time() < deadline:
                for _ in range(100):
                    await room.acquire()
                    pch.publish_nowait(queue, body)
                stats["published"] += 100

        async def consume():
            async for msg in consumer:
                stats["consumed"] += 1
                cch.basic_ack(msg.delivery_tag)

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            n.start_soon(consume)
            await publish()
            with trio.move_on_after(10):
                await pch.wait_for_confirms()
            while stats["consumed"] < stats["published"] and trio.current_time() < deadline + 10:
                await trio.sleep(0.05)
            elapsed = time.perf_counter() - t0
            n.cancel_scope.cancel()
        await cch.queue_delete(queue)
    return {
        "size": size, "seconds": round(elapsed, 2), **stats,
        "publish_confirm_msgs_per_s": round(stats["confirmed"] / elapsed),
        "consume_ack_msgs_per_s": round(stats["consumed"] / elapsed),
    }


def _run(args) -> int:
    from bench.rpc_clients import PER_PROC
    from bench.rounds import format_table, latency_table
    from bench.runinfo import new_run_id
    from bench.runner import Progress, Runner, connections_per_proc
    from bench.targets import TargetError
    from bench.workload import WorkloadError, load, resolve
    try:
        if args.command == "check":
            for w in args.workloads:
                for sc in load(resolve(w)):
                    if sc.idle:
                        print(f"{w}: {sc.name}: {sc.idle_connections:,} idle connections on node "
                              f"{sc.idle_node}, held {sc.idle_seconds:g} s")
                        continue
                    if sc.declaring:
                        print(f"{w}: {sc.name}: declare then delete {sc.declare_queues:,} queues, one "
                              f"connection per node")
                        continue
                    if sc.rpc:
                        counts = connections_per_proc(sc.rpc_clients, sc.procs, PER_PROC)
                        print(f"{w}: {sc.name}: {sc.rpc_clients:,} rpc clients, each holding an exclusive "
                              f"server-named queue, over {len(counts)} processes of up to {max(counts):,}")
                        continue
                    if sc.chaos is not None:
                        print(f"{w}: {sc.name}: chaos {json.dumps(sc.chaos)}")
                        continue
                    print(f"{w}: {sc.name}: {sc.producers}p/{sc.consumers}c x {sc.queues}q, "
                          f"{sc.message_size} B, rate {sc.producer_rate:g}, policy {json.dumps(sc.effective_policy)}, "
                          f"{len(sc.faults)} fault(s)")
            return 0
        from bench.runner import parse_targets
        try:
            targets = parse_targets(args.target)
        except ValueError as exc:
            print(f"error: --target: {exc}", file=sys.stderr)
            return 2
        if args.repeat < 1:
            print("error: --repeat: at least 1", file=sys.stderr)
            return 2
        progress = Progress(enabled=False if args.quiet else (True if args.progress else None))
        base = args.run_id or new_run_id()
        rounds = []
        for k in range(1, args.repeat + 1):
            runner = Runner(args.out, procs=args.procs, progress=progress)
            if args.repeat > 1:
                print(f"round {k} of {args.repeat}")
            folder = runner.run(args.workloads, targets, args.nodes.split(",") if args.nodes else None,
                                args.rabbitmq_dir, base if args.repeat == 1 else f"{base}-r{k}",
                                amqp_addresses=args.amqp_addresses.split(",") if args.amqp_addresses else None,
                                only=args.scenario.split(",") if args.scenario else None)
            print(f"results in {folder}")
            rounds.append(runner.summaries)
            if runner.interrupted:
                return 130
        if args.repeat > 1:
            table = latency_table(rounds)
            for line in format_table(table):
                print(line)
            path = args.out / f"{base}-rounds.json"
            path.write_text(json.dumps(table, indent=1) + "\n")
            print(f"rounds compared in {path}")
        return 0
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


DESCRIPTION = """Benchmarks of warren (and RabbitMQ): run workload suites and write their logs,
analyse those logs with Spark, or take a quick measure of throughput, batch sync or memory per
queued message."""

EPILOG = """examples:
  warren-bench throughput --seconds 10               one node started for the purpose
  warren-bench run smoke --target warren --out results
  warren-bench run latency --scenario latency-r3-2000 --target all,floor --repeat 3
  warren-bench analyse results                       (or analyze; = python -m bench.analysis)
  warren-bench sync --messages 100000 --batch-sizes 1,100,4096
  warren-bench sync-load --messages 100000 --rate 2000
  warren-bench memory --messages 200000              memory per queued 1 KiB message
  warren-bench chaos --schedules 20                  seeded faults on real processes, judged
  warren-bench chaos --seed 1234 --replay            one schedule again, verbosely
  warren-bench dst --seeds 1000 --procs 2            the same schedules on the simulation
See bench/README.md for the workload files and bench/LOGS.md for the logs."""


def _throughput(args) -> int:
    from broker.client.errors import AMQPError

    try:
        if args.nodes:
            nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
            result = trio.run(throughput, nodes, args.seconds, args.size, args.window, args.prefetch,
                              args.user, args.password, args.queue_prefix)
        else:
            home = Path(tempfile.mkdtemp(prefix="warren-bench-"))
            # Free ports: a `make cluster` (of this clone or another) on 5691.. may be running.
            with localcluster.LocalCluster(home, 1, free_ports=True) as cluster:
                result = trio.run(throughput, cluster.all_client_addrs(), args.seconds, args.size,
                                  args.window, args.prefetch, args.user, args.password,
                                  args.queue_prefix)
    except BaseException as exc:  # noqa: BLE001 - one line for what the user can fix, else re-raise
        leaf = exc
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if isinstance(leaf, (AMQPError, ValueError, RuntimeError, TimeoutError, OSError)):
            where = f" (--nodes {args.nodes})" if args.nodes else ""
            print(f"warren-bench throughput: error{where}: {leaf}", file=sys.stderr)
            return 1
        raise
    print(json.dumps(result))
    return 0

def add_chaos_arguments(p: argparse.ArgumentParser) -> None:
    from bench.chaos.schedule import KINDS
    p.add_argument("--schedules", type=int, default=10, help="how many schedules (seeds S, S+1, ...)")
    p.add_argument("--seed", type=int, help="the first schedule's seed (default: random, printed)")
    p.add_argument("--kinds", help=f"fault kinds to draw from, comma-separated (default all: {','.join(KINDS)})")
    p.add_argument("--faults", default="1-3", help="faults per schedule, N or MIN-MAX (default 1-3)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every fault duration and gap")
    p.add_argument("--rate", type=int, help="msgs/s over all publishers (default: the schedule's, 2000)")
    p.add_argument("--workload", choices=("plain", "retry"), default="plain",
                   help="plain (default): one queue, every delivery acknowledged; retry: a retry loop "
                        "(the queue dead-letters what consumers reject once to a retry queue with a TTL)")
    p.add_argument("--priorities", type=int, default=0, metavar="N",
                   help="the workload on a priority queue (x-max-priority N), messages of priorities "
                        "0..N, judged for their order too (default 0: a plain queue)")
    p.add_argument("--replay", action="store_true",
                   help="run exactly the schedule of --seed, verbosely, keeping the node logs")
    p.add_argument("--smoke", action="store_true", help="one short schedule per fault kind")
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default ./results)")
    p.add_argument("--run-id", help="name of the run folder (default YYYYmmdd-HHMMSS-hex)")
    p.add_argument("--net-ticktime", type=float, default=3.0, help="every node's net_ticktime (default 3)")
    p.add_argument("--no-netns", action="store_true",
                   help="run on 127.0.0.1 without network namespaces (partition faults are skipped)")
    p.add_argument("--keep-logs", action="store_true", help="copy the node logs even for OK schedules")
    p.add_argument("--log-level", help="the nodes' log level (warren-server --log-level), e.g. debug")
    p.add_argument("--summarize", metavar="RUN_FOLDER",
                   help="the campaign's figures from a run folder's logs, every verdict checked again")
    p.add_argument("--careful-publishers", action="store_true",
                   help="after a reconnection, publish only once the client says it has recovered its "
                        "channels (default: publish as soon as it is connected, as most applications do)")
    p.add_argument("-v", "--verbose", action="store_true", help="say what the driver does")
    p.add_argument("--check", type=Path, metavar="FOLDER",
                   help="recompute the verdict of RUN_ID/chaos-SEED/warren from its logs and print it")


def chaos(args) -> int:
    """`warren-bench chaos`: exit 0 when every schedule's verdict is OK, 1 otherwise."""
    import random

    from bench.chaos import real
    from bench.chaos.schedule import one_of_each
    if args.summarize:
        from bench.chaos.report import summarize
        try:
            print(summarize(Path(args.summarize)))
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.check:
        v = real.check_folder(args.check)
        print(v.line())
        for r in v.reasons:
            print(f"    - {r}")
        return 0 if v.ok else 1
    try:
        lo, _, hi = args.faults.partition("-")
        faults = (int(lo), int(hi or lo))
        kinds = args.kinds.split(",") if args.kinds else None
        seed = args.seed if args.seed is not None else random.randrange(1, 1_000_000)
        if args.smoke:
            schedules = one_of_each(seed, scale=args.scale if args.scale != 1.0 else 0.4)
            if kinds:
                schedules = [s for s in schedules if s.kinds[0] in kinds]
            for s in schedules:
                s.workload = args.workload
                s.max_priority = args.priorities
        else:
            count = 1 if args.replay else args.schedules
            schedules = real.schedules_for(seed, count, kinds, faults, args.scale, args.workload,
                                           args.priorities)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.seed is None and not args.smoke:
        print(f"[chaos] seeds {seed}..{seed + len(schedules) - 1} (give --seed {seed} to run them again)")
    opts = real.Options(out=args.out, run_id=args.run_id, net_ticktime=args.net_ticktime,
                        netns=False if args.no_netns else None, verbose=args.verbose or args.replay,
                        keep_logs=args.keep_logs or args.replay,
                        server_args=("--log-level", args.log_level) if args.log_level else (),
                        careful_publishers=args.careful_publishers)
    if args.smoke or (schedules and schedules[0].scale < 1.0):
        # short schedules: shorter quiet periods end the drains (a healthy broker confirms and
        # delivers within milliseconds; these still leave it seconds)
        opts.drain_quiet, opts.drain2_quiet, opts.confirm_timeout, opts.heal_timeout = 2.0, 1.5, 5.0, 10.0
    if args.rate:
        for s in schedules:
            s.rate = args.rate
    _, results = real.run_campaign(schedules, opts)
    return 0 if results and all(v.ok for _, v in results) and len(results) == len(schedules) else 1


def dst(args, argv) -> int:
    """`warren-bench dst`: exit 0 when every schedule's verdict is OK, 1 otherwise."""
    from bench.chaos import sim
    sim.ensure_fixed_hashing([sys.argv[0], *argv])
    try:
        lo, _, hi = args.faults.partition("-")
        faults = (int(lo), int(hi or lo))
        kinds = args.kinds.split(",") if args.kinds else None
        bad = [k for k in kinds or () if k not in sim.SIM_KINDS]
        if bad:
            raise ValueError(f"unknown fault kind(s) {bad}; known: {', '.join(sim.SIM_KINDS)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.from_chaos:  # the real campaign's schedule: its kinds, scale and rate
        kinds = kinds or [k for k in sim.KINDS]
        scale = args.scale if args.scale is not None else 1.0
        rate = args.rate or None
    else:
        scale = args.scale if args.scale is not None else sim.DEFAULT_SCALE
        rate = args.rate or sim.SIM_RATE
    if args.replay:
        r = sim.run_seed(args.seed, kinds, faults, scale, rate, keep_trace=args.trace,
                         say=lambda text: print(f"  {text}"), workload=args.workload,
                         priorities=args.priorities)
        print(r.schedule.describe())
        print(r.line())
        for reason in r.verdict.reasons:
            print(f"    - {reason}")
        if r.real_replay():
            print(f"on real processes: {r.real_replay()}")
        print(f"trace digest {r.digest} ({len(r.trace) if args.trace else 'run with --trace for the'} events)")
        for t, event, fields in r.trace:
            print(f"{t:10.4f} {event} {dict(fields)}")
        return 0 if r.verdict.ok else 1
    results = sim.explore(args.seed, args.seeds, kinds, faults, scale, rate, args.procs,
                          workload=args.workload, priorities=args.priorities)
    return 0 if all(r["ok"] for r in results) else 1


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="warren-bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    t = sub.add_parser("throughput", help="one non-mirrored queue: publish with confirms, consume with acks")
    t.add_argument("--seconds", type=float, default=10.0)
    t.add_argument("--size", type=int, default=1024)
    t.add_argument("--window", type=int, default=2000, help="max unconfirmed publishes")
    t.add_argument("--prefetch", type=int, default=1000)
    t.add_argument("--nodes", help="use running nodes (HOST:CLIENT_PORT,...) instead of starting one")
    t.add_argument("--user", default="guest", help="log in as this user (default guest)")
    t.add_argument("--password", default="guest", help="its password (default guest)")
    t.add_argument("--queue-prefix", dest="queue_prefix", default="bench.",
                   help="the queue's name is this and the bench's pid (default bench.): one the "
                        "user's permissions allow")
    r = sub.add_parser("run", help="run workload files against warren and/or RabbitMQ, write results/RUN_ID/")
    r.add_argument("workloads", nargs="+", metavar="WORKLOAD",
                   help="a YAML file, or a shipped suite name (smoke, throughput, latency, failover, scale, "
                        "sync, declare, rpc)")
    r.add_argument("--target", default="warren-native",
                   help="comma-separated: warren-native, warren-amqp, rabbitmq, null, floor "
                        "(bench/README.md); or warren "
                        "(= warren-native), both (= warren-native,rabbitmq), all (= warren-native,"
                        "warren-amqp,rabbitmq). Default warren-native")
    r.add_argument("--amqp-addresses", help="warren-amqp with --nodes: the nodes' AMQP ports, "
                                            "HOST:PORT,... in the order of --nodes")
    r.add_argument("--nodes", help="use these running warren nodes (names under $WARREN_HOME) instead of "
                                   "starting a local 3-node cluster")
    r.add_argument("--rabbitmq-dir", type=Path,
                   help="use the RabbitMQ cluster started by bench/rabbitmq/cluster.sh start DIR")
    r.add_argument("--out", type=Path, default=Path("results"), help="results folder (default ./results)")
    r.add_argument("--procs", type=int, default=1,
                   help="processes per role: producers are spread over N processes, consumers over N more")
    r.add_argument("--run-id", help="name of the run folder (default YYYYmmdd-HHMMSS-hex)")
    r.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run it all N times, one round after the other, each in a folder RUN_ID-rK; "
                        "then print each round's latency per target side by side, each warren "
                        "target's confirm p99 over RabbitMQ's in that round, and the medians "
                        "(also written to RUN_ID-rounds.json)")
    r.add_argument("--scenario", metavar="NAME[,NAME...]",
                   help="run only these scenarios of the workloads (`warren-bench check` lists them), "
                        "e.g. --scenario latency-r3-2000")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--progress", action="store_true", default=None, help="progress line even when not a tty")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    s = sub.add_parser("sync", help="batch sync of a backlog to a new mirror: msgs/s and MB/s per "
                                    "batch size and throughput limit (bench/sync_bench.py)")
    s.add_argument("--messages", type=int, default=100_000)
    s.add_argument("--size", type=int, default=1024)
    s.add_argument("--batch-sizes", default="1,100,4096", help="comma-separated ha-sync-batch-size values")
    s.add_argument("--max-throughput", default="0",
                   help="comma-separated mirroring_sync_max_throughput values in bytes/s (0: no limit)")
    sl = sub.add_parser("sync-load", help="a batch sync under a steady publisher: confirm latency "
                                          "and rate, blocking (the spec) against background")
    sl.add_argument("--messages", type=int, default=100_000, help="the backlog to synchronise")
    sl.add_argument("--size", type=int, default=1024)
    sl.add_argument("--rate", type=int, default=2000, help="publishes per second during the sync")
    sl.add_argument("--modes", default="blocking,background")
    sl.add_argument("--max-throughput", type=int, default=0,
                    help="mirroring_sync_max_throughput in bytes/s (0: no limit)")
    mem = sub.add_parser("memory", help="memory per queued message on a queue's leader and its mirror "
                                        "(bench/memory_bench.py)")
    mem.add_argument("--messages", type=int, default=200_000, help="messages queued per round")
    mem.add_argument("--size", type=int, default=1024, help="body size in bytes")
    mem.add_argument("--rounds", type=int, default=2, help="rounds of --messages, each measured")
    mem.add_argument("--warmup", type=int, default=2_000,
                     help="messages published and consumed before the baseline")
    ch = sub.add_parser("chaos", help="seeded fault schedules on real processes, judged by the "
                                      "total-queue checker (bench/chaos)")
    add_chaos_arguments(ch)
    d = sub.add_parser("dst", help="the fault explorer: chaos schedules on the deterministic simulation, "
                                   "replayable from one seed (bench/chaos/sim.py)")
    d.add_argument("--seeds", type=int, default=100, help="how many schedules (seeds S, S+1, ...)")
    d.add_argument("--seed", type=int, default=1, help="the first seed (default 1)")
    d.add_argument("--kinds", help="fault kinds to draw from, comma-separated (default all)")
    d.add_argument("--faults", default="1-3", help="faults per schedule, N or MIN-MAX (default 1-3)")
    d.add_argument("--scale", type=float, help="multiply every fault duration and gap (default 0.4)")
    d.add_argument("--rate", type=int, help="msgs/s over all publishers (default 150)")
    d.add_argument("--from-chaos", action="store_true",
                   help="the real campaign's schedules (warren-bench chaos with the same --seed and "
                        "--kinds): its fault kinds only, scale 1, its rate")
    d.add_argument("--priorities", type=int, default=0, metavar="N",
                   help="the workload on a priority queue (x-max-priority N), messages of priorities "
                        "0..N, judged for their order too (default 0: a plain queue)")
    d.add_argument("--procs", type=int, default=1, help="worker processes")
    d.add_argument("--workload", choices=("plain", "retry"), default="plain",
                   help="plain (default) or retry: a retry loop (see warren-bench chaos --workload)")
    d.add_argument("--replay", action="store_true",
                   help="run the schedule of --seed alone and say what happened, with its trace digest")
    d.add_argument("--trace", action="store_true", help="with --replay: print every event of the run")
    fz = sub.add_parser("fuzz", help="random inputs over every port of one node, before and after "
                                     "logging in, beside a well-behaved client: crashes, hangs, fds, memory")
    fz.add_argument("--inputs", type=int, default=100_000)
    fz.add_argument("--seed", type=int, default=1)
    fz.add_argument("--concurrency", type=int, default=8, help="connections at once per kind of input")
    fz.add_argument("--out", type=Path, default=Path("results/fuzz.json"))
    fz.add_argument("--kinds", help="only these kinds of input, k1,k2 (default: all of bench/fuzz.py KINDS)")
    c = sub.add_parser("check", help="validate workload files and list their scenarios")
    c.add_argument("workloads", nargs="+", metavar="WORKLOAD")
    sub.add_parser("analyse", aliases=["analyze"], add_help=False,
                   help="the Spark analysis of a results folder (warren-bench analyse --help)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["analyse"], ["analyze"]):
        from bench.analysis.cli import main as analyse
        sys.exit(analyse(argv[1:], prog=f"warren-bench {argv[0]}"))
    args = p.parse_args(argv)
    if args.command in ("run", "check"):
        sys.exit(_run(args))
    if args.command == "sync-load":
        from bench.sync_bench import run_sync_under_load
        rows = run_sync_under_load(args.messages, args.size, args.rate, args.modes.split(","),
                                   args.max_throughput)
        print(json.dumps(rows))
        return
    if args.command == "memory":
        from bench.memory_bench import run_memory_bench
        print(json.dumps(run_memory_bench(args.messages, args.size, args.rounds, args.warmup)))
        return
    if args.command == "fuzz":
        from bench.fuzz import KINDS, run, verdict
        kinds = args.kinds.split(",") if args.kinds else list(KINDS)
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            sys.exit(f"warren-bench fuzz: unknown kinds {unknown}; known: {', '.join(KINDS)}")
        result = run(args.inputs, args.seed, args.concurrency, args.out, kinds)
        print(json.dumps(result, indent=2))
        sys.exit(0 if verdict(result) else 1)
    if args.command == "chaos":
        sys.exit(chaos(args))
    if args.command == "dst":
        sys.exit(dst(args, argv))
    if args.command == "sync":
        from bench.sync_bench import run_sync_bench
        rows = run_sync_bench(args.messages, args.size, [int(x) for x in args.batch_sizes.split(",")],
                              [int(x) for x in args.max_throughput.split(",")])
        print(json.dumps(rows))
        return
    sys.exit(_throughput(args))


if __name__ == "__main__":
    main()
