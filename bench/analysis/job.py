"""The Spark side of the analysis: read the logs of one or many runs, compute every measure, and
return small tables (lists of dicts) for `report` to print, while Parquet goes through Spark.

Rules of this module:

- The per-message work (joins of publishes with deliveries, exact percentiles, consecutive
  delivery pauses) runs in Spark, so the same code copes with a laptop run and a million-message
  backlog on a cluster. Only results (a few rows per scenario, one row per second for the time
  series) come back to the driver.
- A scenario is identified by the last three folders of its files' paths, RUN_ID/SCENARIO/TARGET,
  so INPUT may be `results/` (all runs) or one run folder, on any file system Spark reads.
- Every file except publish.jsonl is optional; a missing one leaves its measures null.
- Latencies are in milliseconds; percentiles are exact (Spark's `percentile`, linear interpolation
  between closest ranks, the same rule as numpy's default), never approximations.
- Latency is measured from a message's intended send time `t_int` when its line has one (open
  loop: a stalled broker cannot hide the wait of the messages queued behind the stall, i.e.
  coordinated omission corrected), else from `t_pub`; only messages whose start time is inside
  the measured window (at or after scenario.json's `t_measure`, i.e. after warmup) count. The
  generator's own lag `t_pub - t_int` is the `send_lag` kind, and publish->confirm from the
  actual send `t_conf - t_pub` (the broker's and the client's part, without that lag) is the
  `confirm_sent` kind; both only for open-loop lines.

Definitions (see also bench/LOGS.md):

- lost: `conf == "ack"` and no delivery of that id; null unless the workload drains its queues.
- duplicated: ids delivered more than once (``dup_ids``) and the extra deliveries (``dup_extra``);
  a redelivery after a failover is one of these too.
- failover gap of a fault at time T: the longest pause between consecutive deliveries among the
  pauses that overlap [T - 1 s, T + 30 s]; deliveries on the fault's queue if it names one, else
  on all queues of the scenario. Only if nothing is delivered after T does the pause from the last
  delivery to the end of the scenario count (``gap_open`` true); a quiet end after deliveries
  resumed is not a failover gap. Every action other than
  sync_progress/sync_done gets a row.
- throughput over time: per-second counts from intervals.jsonl (throughput_timeseries), as a rate
  over the part of each second that lies inside the scenario ([t_start, t_end]), so the first
  and last, partial, seconds do not look like drops; and around each fault (FINE_BEFORE before
  to FINE_AFTER after it) deliveries and confirms from the message lines in FINE_BUCKET buckets
  (failover_timeseries), where a sub-second outage shows.
- sync rate of a queue: the highest ``messages`` reported by sync_progress/sync_done divided by
  sync_done's ``seconds`` when it has them, else by the time from the sync's start (its
  sync_queue action, else the first progress line) to sync_done; also the mean and peak of the
  reported ``rate_msgs`` (null rates, before every mirror is synchronised, are left out).
- idle, declare and rpc: one row per idle-connection, declare or rpc scenario, copied from the
  `idle`, `declare` or `rpc` object of its scenario.json (the runner measured them; there are no
  message lines).
- chaos (scenarios written by `warren-bench chaos`, bench/chaos): one row per schedule from its
  verdict.json (the checker's lost, lost_allowed, duplicates, stranded, stuck, longest gap and
  recovery), with this job's own lost count from the message lines beside it.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from bench.records import LATENCY_KINDS

KEY = ["run_id", "scenario", "target"]
# the tables copied from the object of the same name in scenario.json (scenarios without messages)
COPIED = ("idle", "declare", "rpc")
KEY_TYPES = [(k, "STRING") for k in KEY]
PERCENTILES = [("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999)]
WINDOW_BEFORE, WINDOW_AFTER = 1.0, 30.0
FINE_BUCKET, FINE_BEFORE, FINE_AFTER = 0.1, 2.0, 5.0  # seconds: the buckets around each fault
NOT_FAULTS = ("sync_progress", "sync_done")

PUBLISH_SCHEMA = ("id LONG, p LONG, q STRING, size LONG, t_pub DOUBLE, t_int DOUBLE, t_conf DOUBLE, "
                  "conf STRING")
DELIVER_SCHEMA = "id LONG, c LONG, q STRING, t_del DOUBLE, red BOOLEAN, node STRING"
INTERVAL_SCHEMA = "t DOUBLE, role STRING, n LONG, bytes LONG"
# detail is read as its raw JSON text (Spark keeps an object's text in a STRING field)
FAULT_SCHEMA = "t DOUBLE, action STRING, node STRING, queue STRING, detail STRING"
DETAIL_SCHEMA = "messages LONG, bytes LONG, rate_msgs DOUBLE, rate_bytes DOUBLE"

# Output tables: column name -> Spark SQL type. The order is the order of the CSV columns.
TABLES: dict[str, list[tuple[str, str]]] = {
    "summary": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"),
        ("sampled", "BOOLEAN"), ("sample_every", "LONG"), ("drain", "BOOLEAN"),
        ("duration_s", "DOUBLE"), ("published", "LONG"), ("confirmed", "LONG"), ("nacked", "LONG"),
        ("unconfirmed", "LONG"), ("deliveries", "LONG"), ("delivered_ids", "LONG"),
        ("publish_per_s", "DOUBLE"), ("confirm_per_s", "DOUBLE"), ("deliver_per_s", "DOUBLE"),
        ("deliver_per_s_median", "DOUBLE"), ("deliver_per_s_peak", "DOUBLE"),
        ("deliver_mb_per_s", "DOUBLE"),
        ("confirm_p50_ms", "DOUBLE"), ("confirm_p99_ms", "DOUBLE"),
        ("delivery_p50_ms", "DOUBLE"), ("delivery_p99_ms", "DOUBLE"), ("delivery_p999_ms", "DOUBLE"),
        ("confirm_p999_ms", "DOUBLE"), ("open_loop", "BOOLEAN"), ("send_lag_p99_ms", "DOUBLE"),
        ("confirm_sent_p99_ms", "DOUBLE"),
        ("redelivered", "LONG"), ("dup_ids", "LONG"), ("dup_extra", "LONG"), ("lost", "LONG"),
        ("unknown_ids", "LONG"), ("faults", "LONG"), ("max_gap_s", "DOUBLE"),
        ("sync_msgs_per_s", "DOUBLE"),
    ],
    "latency": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("kind", "STRING"),
        ("n", "LONG"), ("min_ms", "DOUBLE"), ("mean_ms", "DOUBLE"), ("p50_ms", "DOUBLE"),
        ("p95_ms", "DOUBLE"), ("p99_ms", "DOUBLE"), ("p999_ms", "DOUBLE"), ("max_ms", "DOUBLE"),
    ],
    "throughput_timeseries": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("role", "STRING"),
        ("t", "DOUBLE"), ("second", "DOUBLE"), ("n", "LONG"), ("bytes", "LONG"),
        ("start_s", "DOUBLE"), ("end_s", "DOUBLE"), ("per_s", "DOUBLE"),
    ],
    "failover_timeseries": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("fault_s", "DOUBLE"),
        ("role", "STRING"), ("start_s", "DOUBLE"), ("end_s", "DOUBLE"), ("n", "LONG"),
        ("per_s", "DOUBLE"),
    ],
    "faults": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("t", "DOUBLE"),
        ("second", "DOUBLE"), ("action", "STRING"), ("node", "STRING"), ("queue", "STRING"),
        ("gap_s", "DOUBLE"), ("gap_start_s", "DOUBLE"), ("gap_open", "BOOLEAN"),
        ("first_delivery_after_s", "DOUBLE"), ("deliveries_in_window", "LONG"),
    ],
    "sync": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("queue", "STRING"),
        ("t_begin", "DOUBLE"), ("t_done", "DOUBLE"), ("messages", "LONG"), ("bytes", "LONG"),
        ("msgs_per_s", "DOUBLE"), ("bytes_per_s", "DOUBLE"), ("reported_rate_mean", "DOUBLE"),
        ("reported_rate_peak", "DOUBLE"), ("progress_lines", "LONG"),
    ],
    "idle": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("node", "STRING"),
        ("connections", "LONG"), ("opened", "LONG"), ("rss_before_mib", "DOUBLE"),
        ("rss_held_mib", "DOUBLE"), ("rss_after_mib", "DOUBLE"), ("kib_per_connection", "DOUBLE"),
    ],
    "declare": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("queues", "LONG"),
        ("connections", "LONG"), ("declared", "LONG"), ("deleted", "LONG"), ("declare_s", "DOUBLE"),
        ("delete_s", "DOUBLE"), ("declares_per_s", "DOUBLE"), ("deletes_per_s", "DOUBLE"),
        ("declare_p50_ms", "DOUBLE"), ("declare_p99_ms", "DOUBLE"), ("declare_max_ms", "DOUBLE"),
        ("delete_p50_ms", "DOUBLE"), ("delete_p99_ms", "DOUBLE"), ("delete_max_ms", "DOUBLE"),
        ("errors", "LONG"), ("left_after", "LONG"),
    ],
    "rpc": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("clients", "LONG"),
        ("procs", "LONG"), ("opened", "LONG"), ("held_s", "DOUBLE"), ("p50_ms", "DOUBLE"),
        ("p99_ms", "DOUBLE"), ("max_ms", "DOUBLE"), ("queues_listed_held", "LONG"), ("closed_s", "DOUBLE"),
        ("gone_s", "DOUBLE"), ("still_listed_s", "DOUBLE"), ("left_after", "LONG"), ("errors", "LONG"),
        ("node_cpu_total_s", "DOUBLE"),
    ],
    "chaos": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("target", "STRING"), ("seed", "LONG"),
        ("kinds", "STRING"), ("ok", "BOOLEAN"), ("published", "LONG"), ("confirmed", "LONG"),
        ("lost", "LONG"), ("lost_allowed", "LONG"), ("lost_in_logs", "LONG"), ("duplicates", "LONG"),
        ("duplicates_unflagged", "LONG"), ("stranded", "LONG"), ("stranded_consumers", "LONG"),
        ("stuck", "LONG"), ("anomalies", "LONG"), ("longest_gap_s", "DOUBLE"), ("recovery_s", "DOUBLE"),
        ("replay", "STRING"),
    ],
    "compare": [
        ("run_id", "STRING"), ("scenario", "STRING"), ("warren_target", "STRING"),
        ("warren_deliver_per_s", "DOUBLE"), ("rabbitmq_deliver_per_s", "DOUBLE"),
        ("throughput_ratio", "DOUBLE"),
        ("warren_delivery_p99_ms", "DOUBLE"), ("rabbitmq_delivery_p99_ms", "DOUBLE"),
        ("p99_ratio", "DOUBLE"),
        ("warren_confirm_p99_ms", "DOUBLE"), ("rabbitmq_confirm_p99_ms", "DOUBLE"),
        ("confirm_p99_ratio", "DOUBLE"), ("confirm_sent_p99_ratio", "DOUBLE"),
    ],
}


@dataclass
class Results:
    """What the job hands to the report: the tables plus the runs' metadata."""
    tables: dict[str, list[dict]]
    runs: list[dict] = field(default_factory=list)
    input: str = ""
    notes: list[str] = field(default_factory=list)


# --- paths -----------------------------------------------------------------------------------

def to_uri(path: str) -> str:
    """A path with a scheme (file:, hdfs:, s3a:, ...) goes to Spark as given; a plain path is a
    local path, made absolute."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) or path.startswith("file:"):
        return path.rstrip("/")
    return Path(path).resolve().as_uri()


def _relative(name: str) -> str:
    # RUN/SCENARIO/TARGET under results/, or SCENARIO/TARGET under one run's folder
    return f"{{*/*/*,*/*}}/{name}"


def _patterns(base: str, name: str) -> str:
    return f"{base}/{_relative(name)}"


# --- the Spark session -------------------------------------------------------------------------

def spark_session(master: str = "local[*]", app_name: str = "warren-bench-analysis",
                  java_options: str = ""):
    """A quiet session: no UI, no progress bar, log level ERROR, loopback address for local runs.
    `java_options` go to the driver's JVM (the tests' tiny inputs run with the quick compiler
    only: the optimising one costs more CPU than it saves there)."""
    local = master.startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    log4j = Path(__file__).with_name("log4j2.properties")
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.session.timeZone", "UTC"))
    if log4j.exists():  # errors only, and no "Setting default log level" banner
        java_options = f"-Dlog4j2.configurationFile={log4j.as_uri()} {java_options}".strip()
    if java_options:
        b = b.config("spark.driver.extraJavaOptions", java_options)
    if local:
        cores = os.cpu_count() or 2
        m = re.match(r"local\[(\d+)", master)
        parts = str(max(2, int(m.group(1)) if m else cores))
        b = (b.config("spark.sql.shuffle.partitions", parts)
             .config("spark.default.parallelism", parts)
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1"))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# --- reading -----------------------------------------------------------------------------------

def _read_json(spark, base: str, name: str, schema: str):
    """The JSON-lines files called `name` of every scenario under base, with the key columns from
    their paths; an empty frame when there are none."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    try:
        df = spark.read.schema(schema).json(_patterns(base, name))
    except AnalysisException as e:  # no file matched the pattern
        if "PATH_NOT_FOUND" not in str(e) and "does not exist" not in str(e):
            raise
        cols = [c.split() for c in schema.split(",")]
        return spark.range(0).select(*[F.lit(None).cast("string").alias(k) for k in KEY],
                                     *[F.lit(None).cast(t).alias(n) for n, t in cols])
    path = F.col("_metadata.file_path")
    parts = r"([^/]+)/([^/]+)/([^/]+)/[^/]+$"
    return df.select(*[F.regexp_extract(path, parts, i + 1).alias(k) for i, k in enumerate(KEY)],
                     *[F.col(c) for c in df.columns])


def _read_whole(spark, base: str, pattern: str) -> list[tuple[str, str]]:
    """(path, text) of every file matching base/pattern; small files only (scenario.json,
    run.json). Local folders are read directly: a Spark job per handful of tiny files costs
    seconds."""
    if base.startswith("file:"):
        root = Path(url2pathname(urlparse(base).path))
        out = []
        for expanded in _expand_braces(pattern):
            out += [(p.as_posix(), p.read_text(encoding="utf-8")) for p in sorted(root.glob(expanded))
                    if p.is_file()]
        return out
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    try:
        df = spark.read.text(f"{base}/{pattern}", wholetext=True)
    except AnalysisException:
        return []
    return [(r[0], r[1]) for r in df.select(F.col("_metadata.file_path"), "value").collect()]


def _expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",")
            for x in _expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def _scenario_meta(spark, base: str) -> dict[tuple, dict]:
    """scenario.json of every scenario, keyed by (run_id, scenario, target) from its path."""
    metas = {}
    for path, text in _read_whole(spark, base, _relative("scenario.json")):
        key = tuple(path.rstrip("/").split("/")[-4:-1])
        try:
            doc = json.loads(text)
        except ValueError:
            continue
        wl = doc.get("workload") or {}
        sample_every = int(wl.get("sample_every") or 1) if doc.get("sampled") else 1
        metas[key] = {"t_start": doc.get("t_start"), "t_end": doc.get("t_end"),
                      "t_measure": doc.get("t_measure"),
                      "sampled": bool(doc.get("sampled")), "sample_every": sample_every,
                      "drain": wl.get("drain"), "message_size": wl.get("message_size"),
                      "nodes": doc.get("nodes"),
                      **{name: doc.get(name) for name in COPIED}}
    return metas


def _runs(spark, base: str) -> list[dict]:
    runs = []
    for pattern in ("run.json", "*/run.json"):
        for _, text in _read_whole(spark, base, pattern):
            try:
                runs.append(json.loads(text))
            except ValueError:
                pass
    return sorted(runs, key=lambda r: str(r.get("run_id")))


# --- computing ----------------------------------------------------------------------------------

def _rows(df) -> list[dict]:
    return [r.asDict() for r in df.collect()]


def _collect_all(*frames) -> list[list[dict]]:
    """Collect several frames at once from driver threads (Spark schedules concurrent jobs)."""
    with ThreadPoolExecutor(max_workers=len(frames)) as pool:
        return list(pool.map(_rows, frames))


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in KEY)


def _per_scenario(spark, pub, dlv, metas: dict):
    """One aggregation per scenario over the per-id join of publishes with deliveries: the counts
    and the latency distributions (one Spark job for all of it)."""
    from pyspark.sql import functions as F

    per_id = dlv.groupBy(*KEY, "id").agg(
        F.min("t_del").alias("t_first"), F.count(F.lit(1)).alias("n_del"),
        F.sum(F.col("red").cast("long")).alias("n_red"))
    joined = pub.withColumn("_pub", F.lit(True)).join(per_id, KEY + ["id"], "full_outer")
    measure = [(*k, m["t_measure"]) for k, m in metas.items() if m.get("t_measure") is not None]
    if measure:
        joined = joined.join(F.broadcast(_literal_frame(spark, [*KEY_TYPES, ("t_measure", "DOUBLE")], measure)),
                             KEY, "left")
    else:
        joined = joined.withColumn("t_measure", F.lit(None).cast("double"))
    is_pub = F.col("_pub").isNotNull()
    ack = F.col("conf") == "ack"
    start = F.coalesce(F.col("t_int"), F.col("t_pub"))  # intended send time when there is one
    inside = F.col("t_measure").isNull() | (start >= F.col("t_measure"))
    conf_ms = F.when(inside, (F.col("t_conf") - start) * 1000.0)  # null when either is null
    del_ms = F.when(inside, (F.col("t_first") - start) * 1000.0)
    lag_ms = F.when(inside, (F.col("t_pub") - F.col("t_int")) * 1000.0)
    sent_ms = F.when(inside & F.col("t_int").isNotNull(), (F.col("t_conf") - F.col("t_pub")) * 1000.0)
    fractions = [p for _, p in PERCENTILES]
    lat = [F.max(F.col("t_int").isNotNull()).alias("open_loop")]
    exprs = {"confirm": conf_ms, "delivery": del_ms, "send_lag": lag_ms, "confirm_sent": sent_ms}
    for kind in LATENCY_KINDS:
        ms = exprs[kind]
        lat += [F.count(ms).alias(f"{kind}_n"), F.min(ms).alias(f"{kind}_min"),
                F.avg(ms).alias(f"{kind}_mean"), F.percentile(ms, fractions).alias(f"{kind}_pct"),
                F.max(ms).alias(f"{kind}_max")]
    return joined.groupBy(*KEY).agg(
        F.sum(is_pub.cast("long")).alias("published"),
        F.sum(ack.cast("long")).alias("confirmed"),
        F.sum((F.col("conf") == "nack").cast("long")).alias("nacked"),
        F.sum((is_pub & F.col("conf").isNull()).cast("long")).alias("unconfirmed"),
        F.sum(F.coalesce("n_del", F.lit(0))).alias("deliveries"),
        F.sum(F.col("t_first").isNotNull().cast("long")).alias("delivered_ids"),
        F.sum(F.coalesce("n_red", F.lit(0))).alias("redelivered"),
        F.sum((F.col("n_del") > 1).cast("long")).alias("dup_ids"),
        F.sum(F.when(F.col("n_del") > 1, F.col("n_del") - 1).otherwise(0)).alias("dup_extra"),
        F.sum((ack & F.col("t_first").isNull()).cast("long")).alias("lost"),
        F.sum((~is_pub).cast("long")).alias("unknown_ids"),
        F.min("t_pub").alias("first_pub"), F.max("t_first").alias("last_first_del"),
        *lat)


def _latency_rows(count_rows: dict) -> list[dict]:
    out = []
    for k, c in sorted(count_rows.items()):
        for kind in LATENCY_KINDS:
            if not c.get(f"{kind}_n"):
                continue
            pct = c[f"{kind}_pct"]
            out.append({**dict(zip(KEY, k)), "kind": kind, "n": c[f"{kind}_n"],
                        "min_ms": c[f"{kind}_min"], "mean_ms": c[f"{kind}_mean"],
                        **{f"{name}_ms": pct[i] for i, (name, _) in enumerate(PERCENTILES)},
                        "max_ms": c[f"{kind}_max"]})
    return out


def _literal_frame(spark, cols: list[tuple[str, str]], rows: list[tuple]):
    """A small frame (a few rows per scenario) built from literals inside the JVM: the obvious
    spark.createDataFrame(list) would start Python worker processes, which costs many seconds on
    a cold, busy machine."""
    from pyspark.sql import functions as F

    structs = [F.struct(*[F.lit(v).cast(t).alias(n) for (n, t), v in zip(cols, row)]) for row in rows]
    return spark.range(1).select(F.inline(F.array(*structs)))


def _gaps(spark, dlv, faults_rows: list[dict], metas: dict):
    """Failover gap and time to first delivery for every fault (see the module docstring)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if not faults_rows:
        return []
    fault_df = _literal_frame(
        spark, [*KEY_TYPES, ("fid", "LONG"), ("tf", "DOUBLE"), ("scope", "STRING")],
        [(*_key(f), i, f["t"], f["queue"] or "*") for i, f in enumerate(faults_rows)])
    queues = sorted({f["queue"] for f in faults_rows if f["queue"]})
    d = dlv.select(*KEY, F.lit("*").alias("scope"), "t_del")
    if queues:
        d = d.unionByName(dlv.where(F.col("q").isin(queues)).select(*KEY, F.col("q").alias("scope"), "t_del"))
    # keep only the scenarios that have faults before the sort
    d = d.join(F.broadcast(fault_df.select(*KEY, "scope").distinct()), KEY + ["scope"], "left_semi")
    w = Window.partitionBy(*KEY, "scope").orderBy("t_del")
    pauses = d.select(*KEY, "scope", F.lag("t_del").over(w).alias("prev"), F.col("t_del").alias("next"),
                      F.lit(False).alias("open"))
    ends = [(*k, v["t_end"]) for k, v in metas.items() if v.get("t_end") is not None]
    if ends:
        end_df = _literal_frame(spark, [*KEY_TYPES, ("t_end", "DOUBLE")], ends)
        last = d.groupBy(*KEY, "scope").agg(F.max("t_del").alias("prev")).join(end_df, KEY)
        pauses = pauses.unionByName(last.where(F.col("t_end") > F.col("prev")).select(
            *KEY, "scope", "prev", F.col("t_end").alias("next"), F.lit(True).alias("open")))
    p, f = pauses.alias("p"), F.broadcast(fault_df).alias("f")
    cond = [F.col(f"p.{k}") == F.col(f"f.{k}") for k in KEY + ["scope"]]
    cond += [F.col("p.next") >= F.col("f.tf") - WINDOW_BEFORE,
             F.col("p.prev").isNull() | (F.col("p.prev") <= F.col("f.tf") + WINDOW_AFTER)]
    length = F.col("p.next") - F.col("p.prev")
    closed = F.when(~F.col("p.open"), length)
    agg = p.join(f, cond).groupBy("f.fid", "f.tf").agg(
        F.max(closed).alias("gap_closed"),
        F.max_by(F.col("p.prev"), closed).alias("from_closed"),
        F.max(F.when(F.col("p.open"), length)).alias("gap_end"),
        F.max(F.when(F.col("p.open"), F.col("p.prev"))).alias("from_end"),
        F.min(F.when((F.col("p.next") > F.col("f.tf")) & ~F.col("p.open"), F.col("p.next"))).alias("first_after"),
        F.sum((~F.col("p.open") & (F.col("p.next") <= F.col("f.tf") + WINDOW_AFTER)).cast("long")).alias("in_window"))
    out = []
    for r in _rows(agg):
        # the quiet stretch from the last delivery to the scenario's end is a failover gap only
        # when nothing at all was delivered after the fault
        is_open = r["first_after"] is None and r["gap_end"] is not None
        out.append({**r, "gap_s": r["gap_end"] if is_open else r["gap_closed"],
                    "gap_from": r["from_end"] if is_open else r["from_closed"], "gap_open": is_open})
    return out


def _fine_windows(faults_rows: list[dict], metas: dict, t_start: dict) -> list[tuple]:
    """(key, fid, lo, hi) of the fine buckets around each fault, clipped to the scenario."""
    wins = []
    for i, f in enumerate(faults_rows):
        m = metas.get(_key(f), {})
        lo, hi = f["t"] - FINE_BEFORE, f["t"] + FINE_AFTER
        start = m.get("t_start") if m.get("t_start") is not None else t_start.get(_key(f))
        if start is not None:
            lo = max(lo, start)
        if m.get("t_end") is not None:
            hi = min(hi, m["t_end"])
        if hi > lo:
            wins.append((_key(f), i, lo, hi))
    return wins


def _fine_counts(spark, pub, dlv, wins: list[tuple]):
    """Deliveries and confirms per FINE_BUCKET of each window: a frame of (fid, role, k, n)."""
    from pyspark.sql import functions as F

    win_df = _literal_frame(spark, [*KEY_TYPES, ("fid", "LONG"), ("lo", "DOUBLE"), ("hi", "DOUBLE")],
                            [(*k, fid, lo, hi) for k, fid, lo, hi in wins])
    events = dlv.select(*KEY, F.lit("deliver").alias("role"), F.col("t_del").alias("t")).unionByName(
        pub.where(F.col("t_conf").isNotNull()).select(*KEY, F.lit("confirm").alias("role"),
                                                      F.col("t_conf").alias("t")))
    inside = events.join(F.broadcast(win_df), KEY).where((F.col("t") >= F.col("lo")) & (F.col("t") < F.col("hi")))
    return inside.groupBy("fid", "role", F.floor((F.col("t") - F.col("lo")) / FINE_BUCKET).alias("k")).agg(
        F.count(F.lit(1)).alias("n"))


def _fine_rows(wins: list[tuple], counts: list[dict], roles: dict, scale: dict, t_start: dict) -> list[dict]:
    """Every bucket of every window (empty ones too: they are the outage), as rates."""
    got = {(r["fid"], r["role"], r["k"]): r["n"] for r in counts}
    out = []
    for key, fid, lo, hi in wins:
        ts = t_start.get(key)
        if ts is None:
            continue
        buckets = max(1, math.ceil((hi - lo) / FINE_BUCKET - 1e-9))
        for role in roles.get(key, ()):
            for k in range(buckets):
                a, b = lo + k * FINE_BUCKET, min(lo + (k + 1) * FINE_BUCKET, hi)
                n = got.get((fid, role, k), 0) * scale.get(key, 1)
                out.append({**dict(zip(KEY, key)), "fault_id": fid, "role": role,
                            "start_s": a - ts, "end_s": b - ts, "n": n, "per_s": n / (b - a)})
    return out


def _sync(events: list[dict]) -> list[dict]:
    """Sync rates per scenario and queue from the (few) sync_queue/sync_progress/sync_done lines."""
    groups: dict[tuple, list[dict]] = {}
    for e in events:
        if e["action"] in ("sync_queue", "sync_progress", "sync_done"):
            groups.setdefault((*_key(e), e["queue"] or "*"), []).append(e)
    out = []
    def first(evs: list[dict], action: str) -> float | None:
        return min((e["t"] for e in evs if e["action"] == action), default=None)

    for (*k, queue), evs in sorted(groups.items()):
        progress = [e for e in evs if e["action"] == "sync_progress"]
        done = first(evs, "sync_done")
        if not progress and done is None:
            continue
        begin = first(evs, "sync_queue")
        if begin is None:
            begin = first(evs, "sync_progress")
        details = [e["detail"] for e in evs]
        messages = max((d["messages"] for d in details if d.get("messages") is not None), default=None)
        nbytes = max((d["bytes"] for d in details if d.get("bytes") is not None), default=None)
        rates = [e["detail"]["rate_msgs"] for e in progress if e["detail"].get("rate_msgs") is not None]
        span = done - begin if done is not None and begin is not None else None
        took = [e["detail"].get("seconds") for e in evs if e["action"] == "sync_done"]
        if took and isinstance(took[0], (int, float)) and took[0] > 0:
            span = float(took[0])  # the runner's own measure of the sync, when it gives one
        ok = span is not None and span > 0
        out.append({**dict(zip(KEY, k)), "queue": queue, "t_begin": begin, "t_done": done,
                    "messages": messages, "bytes": nbytes,
                    "msgs_per_s": messages / span if ok and messages is not None else None,
                    "bytes_per_s": nbytes / span if ok and nbytes is not None else None,
                    "reported_rate_mean": sum(rates) / len(rates) if rates else None,
                    "reported_rate_peak": max(rates) if rates else None,
                    "progress_lines": len(progress)})
    return out


def analyse(spark, input_path: str) -> Results:
    """Run every computation over the logs under input_path and return the result tables."""
    from pyspark.sql import functions as F

    base = to_uri(input_path)
    metas = _scenario_meta(spark, base)
    pub = _read_json(spark, base, "publish.jsonl", PUBLISH_SCHEMA)
    dlv = _read_json(spark, base, "deliver.jsonl", DELIVER_SCHEMA)
    inter = _read_json(spark, base, "intervals.jsonl", INTERVAL_SCHEMA)
    faults = _read_json(spark, base, "faults.jsonl", FAULT_SCHEMA)

    series = inter.groupBy(*KEY, "role", "t").agg(F.sum("n").alias("n"), F.sum("bytes").alias("bytes"))
    # independent Spark jobs run side by side: on small inputs each is mostly waiting
    counts, series, events = _collect_all(_per_scenario(spark, pub, dlv, metas), series, faults)
    count_rows = {_key(r): r for r in counts}
    latency_rows = _latency_rows(count_rows)
    series_rows = sorted(series, key=lambda r: (*_key(r), r["role"], r["t"]))
    events = sorted(events, key=lambda r: (*_key(r), r["t"]))
    for e in events:
        try:
            e["detail"] = json.loads(e["detail"]) if e["detail"] else {}
        except ValueError:
            e["detail"] = {}
        if not isinstance(e["detail"], dict):
            e["detail"] = {}
    fault_rows = [e for e in events if e["action"] not in NOT_FAULTS]
    gap_rows = {r["fid"]: r for r in _gaps(spark, dlv, fault_rows, metas)}
    sync_out = _sync(events)

    series_of: dict[tuple, list[dict]] = {}
    for r in series_rows:
        series_of.setdefault(_key(r), []).append(r)
    keys = sorted(set(count_rows) | set(metas) | set(series_of))
    t_start = {}
    for k in keys:
        m = metas.get(k, {})
        firsts = [r["t"] for r in series_of.get(k, [])]
        c = count_rows.get(k, {})
        t_start[k] = m.get("t_start") or (min(firsts) if firsts else c.get("first_pub"))

    for r in series_rows:
        ts = t_start[_key(r)]
        r["second"] = r["t"] - ts if ts is not None else None
        if ts is not None:
            # the part of this second inside the scenario: the first and last are partial
            t_end = metas.get(_key(r), {}).get("t_end")
            a, b = max(r["t"], ts), r["t"] + 1.0 if t_end is None else min(r["t"] + 1.0, t_end)
            if b > a:
                r.update(start_s=a - ts, end_s=b - ts, per_s=r["n"] / (b - a))
    roles = {}
    for k, c in count_rows.items():
        roles[k] = [role for role, n in (("deliver", c.get("deliveries")),
                                         ("confirm", (c.get("confirmed") or 0) + (c.get("nacked") or 0)))
                    if n]
    wins = _fine_windows(fault_rows, metas, t_start)
    fine_counts = _rows(_fine_counts(spark, pub, dlv, wins)) if wins else []
    fine = _fine_rows(wins, fine_counts, roles, {k: metas.get(k, {}).get("sample_every", 1) for k in keys},
                      t_start)
    for r in fine:
        r["fault_s"] = fault_rows[r.pop("fault_id")]["t"] - t_start[_key(r)]
    faults_out = []
    for i, f in enumerate(fault_rows):
        g = gap_rows.get(i, {})
        ts = t_start.get(_key(f))

        def since(t, f=f):
            return t - f["t"] if t is not None else None

        faults_out.append({**f, "second": f["t"] - ts if ts is not None else None,
                           "gap_s": g.get("gap_s"), "gap_start_s": since(g.get("gap_from")),
                           "gap_open": g.get("gap_open"), "first_delivery_after_s": since(g.get("first_after")),
                           "deliveries_in_window": g.get("in_window", 0)})
    latency = {(*_key(r), r["kind"]): r for r in latency_rows}
    summary = []
    for k in keys:
        m, c = metas.get(k, {}), count_rows.get(k, {})
        ser = series_of.get(k, [])
        totals = {role: sum(r["n"] for r in ser if r["role"] == role) for role in ("publish", "confirm", "deliver")}
        dbytes = sum(r["bytes"] or 0 for r in ser if r["role"] == "deliver")
        per_sec = [r["n"] for r in ser if r["role"] == "deliver"]
        duration = None
        if m.get("t_start") is not None and m.get("t_end") is not None:
            duration = m["t_end"] - m["t_start"]
        elif ser:
            duration = max(r["t"] for r in ser) + 1 - min(r["t"] for r in ser)
        elif c.get("first_pub") is not None and c.get("last_first_del") is not None:
            duration = c["last_first_del"] - c["first_pub"]
        scale = m.get("sample_every", 1)

        def rate(role: str, lines: int | None, ser=ser, totals=totals, scale=scale, duration=duration):
            # intervals.jsonl counts every message; without it, scale the (sampled) lines
            n = totals[role] if any(r["role"] == role for r in ser) else (
                lines * scale if lines is not None else None)
            return n / duration if n is not None and duration else None

        lat_c, lat_d = latency.get((*k, "confirm"), {}), latency.get((*k, "delivery"), {})
        lat_l = latency.get((*k, "send_lag"), {})
        lat_s = latency.get((*k, "confirm_sent"), {})
        kf = [f for f in faults_out if _key(f) == k]
        gaps = [f["gap_s"] for f in kf if f["gap_s"] is not None]
        rates = [s["msgs_per_s"] for s in sync_out if _key(s) == k and s["msgs_per_s"] is not None]
        drain = m.get("drain")
        summary.append({
            "run_id": k[0], "scenario": k[1], "target": k[2],
            "sampled": m.get("sampled", False), "sample_every": scale, "drain": drain,
            "duration_s": duration,
            **{n: c.get(n) for n in ("published", "confirmed", "nacked", "unconfirmed", "deliveries",
                                     "delivered_ids", "redelivered", "dup_ids", "dup_extra", "unknown_ids")},
            "publish_per_s": rate("publish", c.get("published")),
            "confirm_per_s": rate("confirm", (c.get("confirmed") or 0) + (c.get("nacked") or 0) if c else None),
            "deliver_per_s": rate("deliver", c.get("deliveries")),
            "deliver_per_s_median": statistics.median(per_sec) if per_sec else None,
            "deliver_per_s_peak": max(per_sec) if per_sec else None,
            "deliver_mb_per_s": dbytes / duration / 1e6 if duration and dbytes else None,
            "confirm_p50_ms": lat_c.get("p50_ms"), "confirm_p99_ms": lat_c.get("p99_ms"),
            "delivery_p50_ms": lat_d.get("p50_ms"), "delivery_p99_ms": lat_d.get("p99_ms"),
            "delivery_p999_ms": lat_d.get("p999_ms"), "confirm_p999_ms": lat_c.get("p999_ms"),
            "open_loop": c.get("open_loop") if c else None, "send_lag_p99_ms": lat_l.get("p99_ms"),
            "confirm_sent_p99_ms": lat_s.get("p99_ms"),
            "lost": c.get("lost") if drain is True and c else None,
            "faults": len(kf), "max_gap_s": max(gaps) if gaps else None,
            "sync_msgs_per_s": max(rates) if rates else None,
        })

    compare = []
    by_key = {_key(s): s for s in summary}
    warren_targets = sorted({s["target"] for s in summary if str(s["target"]).startswith("warren")})
    pairs = [(run_id, scenario, wt) for run_id, scenario in sorted({(s["run_id"], s["scenario"]) for s in summary})
             for wt in warren_targets]  # one row per warren target beside RabbitMQ
    for run_id, scenario, wt in pairs:
        w, r = by_key.get((run_id, scenario, wt)), by_key.get((run_id, scenario, "rabbitmq"))
        if not (w and r):
            continue

        def ratio(a, b):
            return a / b if a is not None and b else None

        compare.append({
            "run_id": run_id, "scenario": scenario, "warren_target": wt,
            "warren_deliver_per_s": w["deliver_per_s"], "rabbitmq_deliver_per_s": r["deliver_per_s"],
            "throughput_ratio": ratio(w["deliver_per_s"], r["deliver_per_s"]),
            "warren_delivery_p99_ms": w["delivery_p99_ms"], "rabbitmq_delivery_p99_ms": r["delivery_p99_ms"],
            "p99_ratio": ratio(w["delivery_p99_ms"], r["delivery_p99_ms"]),
            "warren_confirm_p99_ms": w["confirm_p99_ms"], "rabbitmq_confirm_p99_ms": r["confirm_p99_ms"],
            "confirm_p99_ratio": ratio(w["confirm_p99_ms"], r["confirm_p99_ms"]),
            "confirm_sent_p99_ratio": ratio(w["confirm_sent_p99_ms"], r["confirm_sent_p99_ms"]),
        })

    chaos = _chaos(spark, base, by_key)

    notes = []
    if any(s["sampled"] for s in summary):
        notes.append("Sampled scenarios: throughput comes from intervals.jsonl (every message); latency, "
                     "duplicate, lost and gap figures come from the 1-in-N sample of message lines.")
    if any(s["drain"] is not True for s in summary):
        notes.append("lost is empty where the workload does not drain its queues (or scenario.json is missing).")
    copied = {name: [{**dict(zip(KEY, k)), **{c: m[name].get(c) for c, _ in TABLES[name][3:]}}
                     for k, m in sorted(metas.items()) if m.get(name)]
              for name in COPIED}
    tables = {"summary": summary, "latency": latency_rows, "throughput_timeseries": series_rows,
              "failover_timeseries": fine, "faults": faults_out, "sync": sync_out, **copied,
              "compare": compare, "chaos": chaos}
    return Results(tables={name: [_shape(name, row) for row in rows] for name, rows in tables.items()},
                   runs=_runs(spark, base), input=base, notes=notes)


def _chaos(spark, base: str, summary_by_key: dict) -> list[dict]:
    """One row per chaos schedule from its verdict.json (bench/chaos wrote the checker's
    verdict there); `lost_in_logs` is this job's own count from the message lines (confirmed,
    never delivered: the checker's lost plus lost_allowed)."""
    out = []
    for path, text in _read_whole(spark, base, _relative("verdict.json")):
        key = tuple(path.rstrip("/").split("/")[-4:-1])
        try:
            v = json.loads(text)
        except ValueError:
            continue
        rec = [r.get("first_delivery_after_s") for r in v.get("recovery") or []]
        rec = [x for x in rec if x is not None]
        out.append({"run_id": key[0], "scenario": key[1], "target": key[2], "seed": v.get("seed"),
                    "kinds": ",".join(v.get("kinds") or []), "ok": v.get("ok"),
                    "published": v.get("published"), "confirmed": v.get("confirmed"),
                    "lost": v.get("lost"), "lost_allowed": sum((v.get("lost_allowed") or {}).values()),
                    "lost_in_logs": (summary_by_key.get(key) or {}).get("lost"),
                    "duplicates": v.get("duplicates"), "duplicates_unflagged": v.get("duplicates_unflagged"),
                    "stranded": v.get("stranded"), "stranded_consumers": len(v.get("stranded_consumers") or []),
                    "stuck": v.get("stuck"), "anomalies": len(v.get("anomalies") or []),
                    "longest_gap_s": v.get("longest_gap_s"), "recovery_s": max(rec) if rec else None,
                    "replay": v.get("replay")})
    return sorted(out, key=lambda r: (r["run_id"], r["seed"] if r["seed"] is not None else -1, r["scenario"]))


def _shape(table: str, row: dict) -> dict:
    """Keep the table's columns in order, with ints and floats as its types say."""
    out = {}
    for name, typ in TABLES[table]:
        v = row.get(name)
        if v is not None:
            v = float(v) if typ == "DOUBLE" else int(v) if typ == "LONG" else bool(v) if typ == "BOOLEAN" else v
        out[name] = v
    return out


def write_parquet(spark, out: str) -> None:
    """One Parquet dataset (a folder) per table, made by Spark from the table's CSV file already
    written under out (so the two always agree, any URI Spark writes works, and no Python worker
    is needed); the small jobs go side by side."""
    def write(name: str) -> None:
        schema = ", ".join(f"`{c}` {t}" for c, t in TABLES[name])
        (spark.read.schema(schema).option("header", True).option("escape", '"')
         .csv(f"{out}/{name}.csv").coalesce(1).write.mode("overwrite").parquet(f"{out}/{name}.parquet"))

    with ThreadPoolExecutor(max_workers=len(TABLES)) as pool:
        list(pool.map(write, TABLES))


def put_file(spark, uri: str, data: bytes) -> None:
    """Write bytes to a file: directly for local paths, else through Hadoop's FileSystem."""
    if uri.startswith("file:"):
        path = Path(url2pathname(urlparse(uri).path))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(uri)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(hpath, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()
