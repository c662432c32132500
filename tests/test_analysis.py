"""The Spark analysis job (`bench/analysis/`) on generated and hand-crafted logs.

One Spark session for the whole file: a module fixture writes a results folder (two synthetic
runs, one of them sampled, plus crafted scenarios for lost/duplicate/gap cases), runs
`python -m bench.analysis`'s `run()` once over it, and the tests read its tables and files.
Expected values are computed here independently, from the same JSON lines, with numpy and plain
Python. Needs pyspark and Java; skipped with the reason otherwise.

Marker: ``spark`` ("runs a local PySpark job; needs pyspark and Java 17").
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (it comes with matplotlib)")

from bench.analysis import synth
from bench.analysis.cli import NoLogs, check_local_input, output_of, parse_args
from bench.analysis.job import WINDOW_AFTER, WINDOW_BEFORE, _expand_braces, to_uri

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

T0 = 1_770_000_000.0
RUN_A = "20260101-000000-aaaaaa"
RUN_B = "20260101-010000-bbbbbb"
REL = 1e-9


def _need_spark():
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark matplotlib)")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java (17) on PATH and there is none")


# --- crafted logs ---------------------------------------------------------------------------------

def _meta(scenario: str, drain: bool, t_start: float, t_end: float) -> dict:
    return {"run_id": RUN_A, "scenario": scenario, "target": "warren",
            "workload": {"name": scenario, "drain": drain, "message_size": 10},
            "t_start": t_start, "t_end": t_end, "nodes": ["n1", "n2"], "sampled": False}


def _pub(mid: int, t: float, conf: str | None = "ack") -> dict:
    return {"id": mid, "p": 0, "q": "q", "size": 10, "t_pub": t,
            "t_conf": None if conf is None else t + 0.001, "conf": conf}


def _del(mid: int, t: float, red: bool = False) -> dict:
    return {"id": mid, "c": 0, "q": "q", "t_del": t, "red": red, "node": "n1"}


# A timeline: deliveries every 0.1 s for 10 s, a 5 s pause well before the fault (outside its
# window), deliveries again, the fault at +20.05, nothing until +23.05, then deliveries again.
TIMELINE = ([T0 + k * 0.1 for k in range(101)] + [T0 + 15 + k * 0.1 for k in range(51)]
            + [T0 + 23.05 + k * 0.1 for k in range(20)])
FAULT_AT = T0 + 20.05


def write_crafted(run_dir: Path) -> None:
    """`crafted`: drains, one lost id, duplicates, a nack and an unconfirmed id that are not lost,
    the timeline and a kill; no intervals.jsonl. `crafted-open`: does not drain (lost is null),
    and a sigstop after which nothing more is delivered (an open gap)."""
    pubs = [_pub(1, T0 - 1), _pub(2, T0 - 1), _pub(3, T0 - 1), _pub(4, T0 - 1, "nack"),
            _pub(5, T0 - 1, None), _pub(6, T0 - 1)]
    dels = [_del(1, T0 - 0.9), _del(3, T0 - 0.9), _del(3, T0 - 0.5, red=True),
            _del(6, T0 - 0.8), _del(6, T0 - 0.7, red=True), _del(6, T0 - 0.6, red=True)]
    for i, t in enumerate(TIMELINE):
        pubs.append(_pub(100 + i, t - 0.002))
        dels.append(_del(100 + i, t))
    fault = {"t": FAULT_AT, "action": "kill", "node": "n1", "queue": None, "detail": {}}
    # the scenario runs on quietly for 15 s after its last delivery: not a failover gap
    synth.write_scenario(run_dir / "crafted" / "warren", _meta("crafted", True, T0 - 1, T0 + 40),
                         pubs, dels, None, [fault])

    pubs = [_pub(1, T0), _pub(2, T0)] + [_pub(10 + k, T0 + k * 0.05) for k in range(100)]
    dels = [_del(1, T0 + 0.01)] + [_del(10 + k, T0 + k * 0.05) for k in range(100)]
    events = [{"t": T0 + 6, "action": "sigstop", "node": "n2", "queue": None, "detail": {}},
              # a manual sync: a progress line with null rates (mirrors not yet in sync), no seconds
              {"t": T0 + 7, "action": "sync_queue", "node": None, "queue": "q", "detail": {}},
              {"t": T0 + 8, "action": "sync_progress", "node": "n2", "queue": "q",
               "detail": {"messages": 10, "bytes": 100, "rate_msgs": None, "rate_bytes": None}},
              {"t": T0 + 8.5, "action": "sync_progress", "node": "n2", "queue": "q",
               "detail": {"messages": 30, "bytes": 300, "rate_msgs": 40.0, "rate_bytes": 400.0}},
              {"t": T0 + 9, "action": "sync_done", "node": "n2", "queue": "q",
               "detail": {"messages": 50, "bytes": 500}}]
    synth.write_scenario(run_dir / "crafted-open" / "warren",
                         _meta("crafted-open", False, T0, T0 + 12), pubs, dels, None, events)


def write_chaos(run_dir: Path) -> dict:
    """A chaos schedule's folder as `warren-bench chaos` writes it (bench/chaos/logs.py), from a
    crafted history: 40 confirmed messages, 3 never delivered (2 confirmed before a kill whose
    loss the spec allows, 1 after), one stranded, 5 unanswered on a live connection."""
    from bench.chaos import checker as ck
    from bench.chaos import logs
    from bench.chaos.schedule import generate

    pubs = [ck.Publish(i, 0, "n1", T0 + i * 0.1, "ack", T0 + i * 0.1 + 0.01, "", "chaos.q") for i in range(40)]
    pubs += [ck.Publish(100 + i, 0, "n1", T0 + 4.5, None, None, "", "chaos.q") for i in range(5)]
    dels = [ck.Delivery(i, 0, "n2", T0 + i * 0.1 + 0.02, False, "chaos.q") for i in range(40) if i not in (3, 4, 30, 35)]
    dels.append(ck.Delivery(35, 1, "n3", T0 + 9.0, False, "chaos.q"))  # in the second drain: stranded
    h = ck.History(publishes=pubs, deliveries=dels,
                   subscriptions=[ck.Subscription(0, "chaos.q", T0 - 0.5, T0 + 8.0),
                                  ck.Subscription(1, "chaos.q", T0 + 8.5, T0 + 9.5)],
                   faults=[ck.Fault(T0 + 1.0, "kill", "n1", {}, T0 + 2.0, "every replica of the queue was killed")],
                   phases=[ck.Phase(T0 - 0.5, "load"), ck.Phase(T0 + 5, "drain1"), ck.Phase(T0 + 8.0, "drain1_end"),
                           ck.Phase(T0 + 8.5, "drain2"), ck.Phase(T0 + 10, "end")])
    v = ck.check(h)
    sched = generate(4242, ["kill"], min_faults=1, max_faults=1)
    logs.write(run_dir / "chaos-4242" / "warren", run_id=RUN_A, scenario="chaos-4242",
               schedule=sched.as_dict(), history=h, verdict=v, t_start=T0 - 0.5, t_end=T0 + 10,
               nodes=["n1", "n2", "n3"], replay=sched.replay_command())
    return v.as_dict() | {"replay": sched.replay_command()}


@pytest.fixture(scope="module")
def session():
    """The file's one Spark session."""
    _need_spark()
    from bench.analysis.job import spark_session

    # small inputs: the JVM's quick compiler only (C1) and its serial collector save about a
    # third of the file's CPU, which `make test`'s other workers get instead
    spark = spark_session("local[2]", java_options=QUICK_JVM)
    yield spark
    spark.stop()


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, session):
    """A results folder with two runs, analysed with the default output folder."""
    from bench.analysis.cli import run

    results = tmp_path_factory.mktemp("results")
    synth.make_run(results, seed=3, messages=1500, rate=600.0, outage=1.0, run_id=RUN_A, t0=T0 + 1000)
    write_crafted(results / RUN_A)
    chaos = write_chaos(results / RUN_A)
    synth.make_run(results, seed=4, messages=1200, rate=600.0, run_id=RUN_B, t0=T0 + 5000,
                   targets=("warren",), sampled_every=10)
    res, dest = run(str(results), spark=session)
    res.crafted_chaos = chaos
    return results, res, dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory, session):
    """One run's folder given as INPUT, with --out elsewhere, holding only publish.jsonl,
    deliver.jsonl and scenario.json: no intervals, no faults, no run.json, no RabbitMQ."""
    from bench.analysis.cli import run

    root = tmp_path_factory.mktemp("bare")
    run_dir = root / "20260102-000000-cccccc"
    meta = {**_meta("bare", True, T0, T0 + 2), "run_id": run_dir.name}
    pubs = [_pub(i, T0 + i * 0.01) for i in range(100)]
    dels = [_del(i, T0 + i * 0.01 + 0.005) for i in range(100) if i != 7]
    synth.write_scenario(run_dir / "bare" / "warren", meta, pubs, dels)
    res, dest = run(str(run_dir), out=str(root / "out"), spark=session)
    return root, res, dest


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _summary(res, run_id, scenario, target="warren") -> dict:
    [row] = [s for s in res.tables["summary"]
             if (s["run_id"], s["scenario"], s["target"]) == (run_id, scenario, target)]
    return row


def _faults(res, scenario) -> list[dict]:
    return [f for f in res.tables["faults"] if f["scenario"] == scenario]


# --- percentiles and counts against numpy ------------------------------------------------------

@pytest.mark.parametrize("scenario,target", [("steady", "warren"), ("failover", "rabbitmq")])
def test_latency_percentiles_match_numpy(analysed, scenario, target):
    results, res, _ = analysed
    folder = results / RUN_A / scenario / target
    pubs = {m["id"]: m for m in _lines(folder / "publish.jsonl")}
    first: dict[int, float] = {}
    for d in _lines(folder / "deliver.jsonl"):
        first[d["id"]] = min(d["t_del"], first.get(d["id"], math.inf))
    expected = {
        "confirm": np.array([(m["t_conf"] - m["t_pub"]) * 1000.0 for m in pubs.values() if m["t_conf"] is not None]),
        "delivery": np.array([(t - pubs[i]["t_pub"]) * 1000.0 for i, t in first.items() if i in pubs]),
    }
    rows = {r["kind"]: r for r in res.tables["latency"]
            if (r["run_id"], r["scenario"], r["target"]) == (RUN_A, scenario, target)}
    assert set(rows) == {"confirm", "delivery"}
    for kind, values in expected.items():
        row = rows[kind]
        p50, p95, p99, p999 = np.percentile(values, [50, 95, 99, 99.9])
        assert row["n"] == len(values)
        assert row["p50_ms"] == pytest.approx(p50, rel=REL)
        assert row["p95_ms"] == pytest.approx(p95, rel=REL)
        assert row["p99_ms"] == pytest.approx(p99, rel=REL)
        assert row["p999_ms"] == pytest.approx(p999, rel=REL)
        assert row["max_ms"] == pytest.approx(values.max(), rel=REL)
        assert row["min_ms"] == pytest.approx(values.min(), rel=REL)
        assert row["mean_ms"] == pytest.approx(values.mean(), rel=1e-9)
    s = _summary(res, RUN_A, scenario, target)
    assert s["delivery_p99_ms"] == rows["delivery"]["p99_ms"]
    assert s["confirm_p50_ms"] == rows["confirm"]["p50_ms"]


def test_counts_and_throughput_match_the_logs(analysed):
    results, res, _ = analysed
    folder = results / RUN_A / "failover" / "warren"
    pubs, dels = _lines(folder / "publish.jsonl"), _lines(folder / "deliver.jsonl")
    meta = json.loads((folder / "scenario.json").read_text())
    inter = _lines(folder / "intervals.jsonl")
    ids = np.array([d["id"] for d in dels])
    _, per_id = np.unique(ids, return_counts=True)
    s = _summary(res, RUN_A, "failover")
    assert s["published"] == len(pubs)
    assert s["confirmed"] == sum(m["conf"] == "ack" for m in pubs)
    assert s["deliveries"] == len(dels)
    assert s["delivered_ids"] == len(per_id)
    assert s["redelivered"] == sum(d["red"] for d in dels) > 0
    assert s["dup_ids"] == int((per_id > 1).sum()) > 0
    assert s["dup_extra"] == int((per_id - 1).sum())
    assert s["lost"] == 0 and s["drain"] is True
    duration = meta["t_end"] - meta["t_start"]
    delivered = sum(r["n"] for r in inter if r["role"] == "deliver")
    confirmed = sum(r["n"] for r in inter if r["role"] == "confirm")
    assert s["duration_s"] == pytest.approx(duration)
    assert s["deliver_per_s"] == pytest.approx(delivered / duration)
    assert s["confirm_per_s"] == pytest.approx(confirmed / duration)
    assert s["deliver_per_s_peak"] == max(r["n"] for r in inter if r["role"] == "deliver")
    series = [r for r in res.tables["throughput_timeseries"]
              if (r["run_id"], r["scenario"], r["target"]) == (RUN_A, "failover", "warren")]
    assert len(series) == len(inter)
    assert min(r["second"] for r in series) == pytest.approx(min(r["t"] for r in inter) - meta["t_start"])


# --- lost and duplicates on crafted logs ------------------------------------------------------

def test_lost_and_duplicates_on_crafted_logs(analysed):
    _, res, _ = analysed
    s = _summary(res, RUN_A, "crafted")
    assert s["lost"] == 1  # id 2; the nacked id 4 and the unconfirmed id 5 are not lost
    assert s["nacked"] == 1 and s["unconfirmed"] == 1
    assert s["dup_ids"] == 2  # ids 3 and 6
    assert s["dup_extra"] == 3  # one extra for id 3, two for id 6
    assert s["redelivered"] == 3
    assert s["published"] == 6 + len(TIMELINE)
    assert s["deliveries"] == 6 + len(TIMELINE)
    assert s["delivered_ids"] == 3 + len(TIMELINE)
    # no intervals.jsonl: throughput falls back to the message lines
    assert s["deliver_per_s"] == pytest.approx((6 + len(TIMELINE)) / 41.0)  # T0-1 .. T0+40
    assert not [r for r in res.tables["throughput_timeseries"] if r["scenario"] == "crafted"]


def test_lost_is_null_when_the_workload_does_not_drain(analysed):
    _, res, _ = analysed
    s = _summary(res, RUN_A, "crafted-open")
    assert s["drain"] is False
    assert s["lost"] is None  # id 2 was acked and never delivered, but nothing drained the queue
    assert s["confirmed"] == 102


# --- failover gaps ---------------------------------------------------------------------------------

def test_failover_gap_on_a_crafted_timeline(analysed):
    _, res, _ = analysed
    [f] = _faults(res, "crafted")
    assert f["action"] == "kill" and f["node"] == "n1"
    # the 5 s pause at +10..+15 ends before the window (fault - 1 s) and does not count
    assert f["gap_s"] == pytest.approx(23.05 - 20.0, abs=1e-6)
    assert f["gap_start_s"] == pytest.approx(20.0 - 20.05, abs=1e-6)
    assert f["first_delivery_after_s"] == pytest.approx(23.05 - 20.05, abs=1e-6)
    assert f["gap_open"] is False
    assert f["second"] == pytest.approx(21.05)
    assert f["deliveries_in_window"] == 10 + 20  # +19.1 .. +20.0, then +23.05 .. +24.95
    assert _summary(res, RUN_A, "crafted")["max_gap_s"] == pytest.approx(3.05, abs=1e-6)


def test_failover_gap_when_nothing_is_delivered_after_the_fault(analysed):
    _, res, _ = analysed
    stop, sync = _faults(res, "crafted-open")
    assert (stop["action"], sync["action"]) == ("sigstop", "sync_queue")
    f = stop
    assert f["gap_open"] is True
    assert f["first_delivery_after_s"] is None
    assert f["gap_s"] == pytest.approx(12 - 4.95, abs=1e-6)  # last delivery to the scenario's end


def _reference_gap(times: list[float], tf: float, t_end: float) -> tuple[float, float | None]:
    """The gap definition, written out plainly: pauses overlapping [tf-1, tf+30], plus the open
    pause to the end when nothing follows the fault."""
    times = sorted(times)
    pauses = list(itertools.pairwise(times))
    if times[-1] < tf:
        pauses.append((times[-1], t_end))
    inside = [b - a for a, b in pauses if b >= tf - WINDOW_BEFORE and a <= tf + WINDOW_AFTER]
    after = [t for t in times if t > tf]
    return max(inside), (after[0] - tf if after else None)


@pytest.mark.parametrize("target", ["warren", "rabbitmq"])
def test_failover_gap_on_the_synthetic_run(analysed, target):
    results, res, _ = analysed
    folder = results / RUN_A / "failover" / target
    [kill] = [e for e in _lines(folder / "faults.jsonl") if e["action"] == "kill"]
    meta = json.loads((folder / "scenario.json").read_text())
    gap, first = _reference_gap([d["t_del"] for d in _lines(folder / "deliver.jsonl")], kill["t"], meta["t_end"])
    [f] = [f for f in _faults(res, "failover") if f["target"] == target and f["run_id"] == RUN_A]
    assert f["gap_s"] == pytest.approx(gap, abs=1e-9)
    assert f["first_delivery_after_s"] == pytest.approx(first, abs=1e-9)
    assert f["gap_s"] >= 1.0  # the synthetic outage lasts 1 s


def test_sync_rate_from_progress_lines(analysed):
    results, res, _ = analysed
    events = _lines(results / RUN_A / "failover" / "warren" / "faults.jsonl")
    progress = [e for e in events if e["action"] == "sync_progress"]
    [done] = [e for e in events if e["action"] == "sync_done"]
    [row] = [s for s in res.tables["sync"] if (s["run_id"], s["scenario"], s["target"]) == (RUN_A, "failover", "warren")]
    assert row["messages"] == done["detail"]["messages"]
    assert row["msgs_per_s"] == pytest.approx(done["detail"]["messages"] / done["detail"]["seconds"])
    assert row["t_done"] - row["t_begin"] == pytest.approx(done["t"] - progress[0]["t"])
    assert row["reported_rate_mean"] == pytest.approx(np.mean([e["detail"]["rate_msgs"] for e in progress]))
    assert row["progress_lines"] == len(progress)


def test_sync_rate_without_seconds_and_with_null_rates(analysed):
    _, res, _ = analysed
    [row] = [s for s in res.tables["sync"] if s["scenario"] == "crafted-open"]
    assert row["queue"] == "q" and row["messages"] == 50
    assert row["msgs_per_s"] == pytest.approx(50 / 2.0)  # sync_queue at +7 to sync_done at +9
    assert row["bytes_per_s"] == pytest.approx(500 / 2.0)
    assert row["reported_rate_mean"] == 40.0 and row["progress_lines"] == 2
    assert _summary(res, RUN_A, "crafted-open")["sync_msgs_per_s"] == pytest.approx(25.0)


# --- sampled runs, missing files, the comparison ---------------------------------------------------

def test_sampled_run_takes_throughput_from_intervals(analysed):
    results, res, _ = analysed
    folder = results / RUN_B / "steady" / "warren"
    meta = json.loads((folder / "scenario.json").read_text())
    delivered = sum(r["n"] for r in _lines(folder / "intervals.jsonl") if r["role"] == "deliver")
    s = _summary(res, RUN_B, "steady")
    assert s["sampled"] is True and s["sample_every"] == 10
    assert s["deliveries"] == len(_lines(folder / "deliver.jsonl")) < delivered
    assert s["deliver_per_s"] == pytest.approx(delivered / (meta["t_end"] - meta["t_start"]))
    assert s["lost"] == 0  # publishes and deliveries are sampled by the same ids
    assert any("Sampled" in n for n in res.notes)


def test_compare_pairs_targets_of_the_same_run_only(analysed):
    _, res, _ = analysed
    pairs = {(c["run_id"], c["scenario"]) for c in res.tables["compare"]}
    assert pairs == {(RUN_A, "steady"), (RUN_A, "failover")}  # RUN_B and the crafted ones: warren only
    for c in res.tables["compare"]:
        w = _summary(res, RUN_A, c["scenario"], "warren")
        r = _summary(res, RUN_A, c["scenario"], "rabbitmq")
        assert c["throughput_ratio"] == pytest.approx(w["deliver_per_s"] / r["deliver_per_s"])
        assert c["p99_ratio"] == pytest.approx(w["delivery_p99_ms"] / r["delivery_p99_ms"])
    steady = next(c for c in res.tables["compare"] if c["scenario"] == "steady")
    assert steady["p99_ratio"] > 1  # the generator makes RabbitMQ's latencies 0.7x warren's


# --- files --------------------------------------------------------------------------------------

def test_report_files_exist_and_name_the_scenarios(analysed, session):
    results, res, dest = analysed
    out = results / "report"
    assert dest == to_uri(str(results)) + "/report"
    for table in ("summary", "latency", "throughput_timeseries", "failover_timeseries", "faults", "sync",
                  "compare", "chaos"):
        assert (out / f"{table}.csv").is_file()
        assert list((out / f"{table}.parquet").glob("part-*.parquet")), table
    back = {(r["run_id"], r["scenario"], r["target"]): r.asDict()
            for r in session.read.parquet(str(out / "summary.parquet")).collect()}
    assert back == {(s["run_id"], s["scenario"], s["target"]): s for s in res.tables["summary"]}
    header, *rows = (out / "summary.csv").read_text().splitlines()
    assert header.startswith("run_id,scenario,target,") and len(rows) == len(res.tables["summary"]) == 9
    for png in (f"latency-{RUN_A}.png", f"compare-{RUN_A}.png", f"throughput-{RUN_A}-failover.png",
                f"throughput-{RUN_B}-steady.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert not (out / f"compare-{RUN_B}.png").exists()
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for name in ("steady", "failover", "crafted", "crafted-open", RUN_A, RUN_B):
        assert name in md and name in page
    assert md.index("## Headline") < md.index("## warren / RabbitMQ") < md.index("## Failover") < md.index("## Charts")
    assert f"](throughput-{RUN_A}-failover.png)" in md and f'src="compare-{RUN_A}.png"' in page


def test_chaos_section_from_the_verdicts(analysed):
    """The chaos table holds the checker's verdict of each schedule, next to this job's own lost
    count from the message lines (the checker's lost plus what the spec allowed)."""
    results, res, _ = analysed
    v = res.crafted_chaos
    assert (v["lost"], sum(v["lost_allowed"].values()), v["stranded"], v["stuck"]) == (1, 2, 1, 5)
    [row] = res.tables["chaos"]
    assert (row["run_id"], row["scenario"], row["target"], row["seed"], row["kinds"]) == \
        (RUN_A, "chaos-4242", "warren", 4242, "kill")
    assert row["ok"] is False
    assert (row["lost"], row["lost_allowed"], row["stranded"], row["stuck"]) == (1, 2, 1, 5)
    assert row["lost_in_logs"] == 3 == row["lost"] + row["lost_allowed"]
    assert row["published"] == 45 and row["confirmed"] == 40
    assert row["longest_gap_s"] == pytest.approx(v["longest_gap_s"])
    assert row["recovery_s"] == pytest.approx(max(r["first_delivery_after_s"] for r in v["recovery"]))
    assert row["replay"] == v["replay"] == "warren-bench chaos --seed 4242 --kinds kill --faults 1 --replay"
    md = (results / "report" / "report.md").read_text()
    assert "## Chaos" in md and "1 chaos schedule(s), 1 with a failed verdict" in md and v["replay"] in md
    assert md.index("## Failover") < md.index("## Chaos") < md.index("## Charts")
    chaos_csv = (results / "report" / "chaos.csv").read_text().splitlines()
    assert chaos_csv[0].startswith("run_id,scenario,target,seed,kinds,ok,") and len(chaos_csv) == 2


def test_a_run_folder_without_optional_files(bare):
    root, res, dest = bare
    assert dest == to_uri(str(root / "out"))
    [s] = res.tables["summary"]
    assert (s["run_id"], s["scenario"], s["target"]) == ("20260102-000000-cccccc", "bare", "warren")
    assert s["lost"] == 1 and s["deliveries"] == 99
    assert s["deliver_per_s"] == pytest.approx(99 / 2.0)  # from the lines: no intervals.jsonl
    assert s["faults"] == 0 and s["max_gap_s"] is None
    for table in ("faults", "sync", "compare", "throughput_timeseries", "failover_timeseries", "chaos"):
        assert res.tables[table] == [], table
    assert res.runs == []
    md = (root / "out" / "report.md").read_text()
    assert "No fault actions" in md and "No scenario has both targets" in md and "bare" in md
    assert not list((root / "out").glob("compare-*.png"))
    assert not (root / "20260102-000000-cccccc" / "report").exists()


# --- no Spark needed -----------------------------------------------------------------------------

def test_cli_defaults_and_paths(tmp_path):
    # a local folder is checked before Spark starts: scenario.json alone counts as logs
    (tmp_path / "run" / "rpc-1000" / "warren-native").mkdir(parents=True)
    with pytest.raises(NoLogs, match="no benchmark logs under"):
        check_local_input(str(tmp_path / "run"))
    (tmp_path / "run" / "rpc-1000" / "warren-native" / "scenario.json").write_text("{}")
    check_local_input(str(tmp_path / "run"))
    check_local_input(str(tmp_path))  # as a results folder: RUN_ID/SCENARIO/TARGET
    args = parse_args([])
    assert (args.input, args.out, args.master) == ("results", None, "local[*]")
    assert output_of("hdfs://nn/bench/results", None) == "hdfs://nn/bench/results/report"
    assert to_uri("s3a://bucket/results/") == "s3a://bucket/results"
    assert to_uri("/tmp/x/") == "file:///tmp/x"
    assert _expand_braces("{*/*/*,*/*}/publish.jsonl") == ["*/*/*/publish.jsonl", "*/*/publish.jsonl"]


# --- throughput over time: partial seconds and the fine buckets around faults ----------------------

def test_partial_seconds_are_rates_over_their_part_inside_the_scenario(analysed):
    results, res, _ = analysed
    meta = json.loads((results / RUN_A / "steady" / "warren" / "scenario.json").read_text())
    series = sorted((r for r in res.tables["throughput_timeseries"]
                     if (r["run_id"], r["scenario"], r["target"], r["role"]) == (RUN_A, "steady", "warren", "deliver")),
                    key=lambda r: r["t"])
    last = series[-1]
    assert last["t"] < meta["t_end"] < last["t"] + 1  # the run ends inside its last second
    assert last["end_s"] == pytest.approx(meta["t_end"] - meta["t_start"])
    assert last["per_s"] == pytest.approx(last["n"] / (meta["t_end"] - last["t"]))
    whole = [r for r in series[1:-1]]
    assert all(r["per_s"] == r["n"] and r["end_s"] - r["start_s"] == pytest.approx(1.0) for r in whole)


@pytest.mark.parametrize("run_id, every", [(RUN_A, 1), (RUN_B, 10)])
def test_fine_buckets_around_a_fault_show_the_sub_second_outage(analysed, run_id, every):
    from bench.analysis.job import FINE_AFTER, FINE_BEFORE, FINE_BUCKET

    results, res, _ = analysed
    folder = results / run_id / "failover" / "warren"
    meta = json.loads((folder / "scenario.json").read_text())
    [kill] = [e for e in _lines(folder / "faults.jsonl") if e["action"] == "kill"]
    dels = np.array([d["t_del"] for d in _lines(folder / "deliver.jsonl")])
    fine = sorted((r for r in res.tables["failover_timeseries"]
                   if (r["run_id"], r["scenario"], r["target"], r["role"]) == (run_id, "failover", "warren", "deliver")),
                  key=lambda r: r["start_s"])
    ts = meta["t_start"]
    lo, hi = max(kill["t"] - FINE_BEFORE, ts), min(kill["t"] + FINE_AFTER, meta["t_end"])
    assert len(fine) == math.ceil((hi - lo) / FINE_BUCKET - 1e-9)
    assert fine[0]["start_s"] == pytest.approx(lo - ts) and fine[-1]["end_s"] == pytest.approx(hi - ts)
    assert all(r["fault_s"] == pytest.approx(kill["t"] - ts) for r in fine)
    for r in fine:  # every bucket, empty ones included, counted from the message lines (x sampling)
        a, b = ts + r["start_s"], ts + r["end_s"]
        assert r["n"] == every * int(((dels >= a) & (dels < b)).sum()), r
        assert r["per_s"] == pytest.approx(r["n"] / (b - a))
    # the synthetic outage (1 s in run A, 0.8 s in run B) is a run of empty buckets ...
    empty = [r for r in fine if r["n"] == 0]
    assert len(empty) >= 7
    assert all(kill["t"] - ts - FINE_BUCKET <= r["start_s"] <= kill["t"] - ts + 1.0 for r in empty)
    # ... which the per-second series does not show
    seconds = [r for r in res.tables["throughput_timeseries"]
               if (r["run_id"], r["scenario"], r["target"], r["role"]) == (run_id, "failover", "warren", "deliver")]
    assert min(r["n"] for r in seconds) > 0
    confirms = [r for r in res.tables["failover_timeseries"]
                if (r["run_id"], r["scenario"], r["target"], r["role"]) == (run_id, "failover", "warren", "confirm")]
    assert len(confirms) == len(fine)


@pytest.fixture(scope="module")
def openloop(tmp_path_factory, session):
    """An open-loop run (t_int on every publish line, a warmup) on warren-native and RabbitMQ,
    an idle-connection, a declare and an rpc scenario (scenario.json alone); returns the results,
    the expected latencies and the report folder. The three scenarios without messages are also
    analysed alone, from a run folder of their own (`res.only_meta`)."""
    from bench.analysis.cli import run

    root = tmp_path_factory.mktemp("openloop")
    run_dir = root / "20260103-000000-dddddd"
    expect = {}
    for target, stall in (("warren-native", 0.2), ("rabbitmq", 0.05)):
        meta = {**_meta("paced", True, T0, T0 + 2), "run_id": run_dir.name, "target": target,
                "t_measure": T0 + 0.1}
        pubs, dels = [], []
        for i in range(100):
            t_int = T0 + i * 0.01
            t_pub = t_int + (stall if 50 <= i < 60 else 0.0005)  # ten messages held back
            pubs.append({**_pub(i, t_pub), "t_int": t_int})
            dels.append(_del(i, t_pub + 0.003))
        synth.write_scenario(run_dir / "paced" / target, meta, pubs, dels)
        inside = [p for p in pubs if p["t_int"] >= T0 + 0.1]  # the first 10 are warmup
        expect[target] = {
            "confirm": np.array([(p["t_conf"] - p["t_int"]) * 1000 for p in inside]),
            "delivery": np.array([(p["t_pub"] + 0.003 - p["t_int"]) * 1000 for p in inside]),
            "send_lag": np.array([(p["t_pub"] - p["t_int"]) * 1000 for p in inside]),
            "confirm_sent": np.array([(p["t_conf"] - p["t_pub"]) * 1000 for p in inside])}
    idle = {**_meta("idle-10k", False, T0, T0 + 12), "run_id": run_dir.name, "target": "rabbitmq",
            "idle": {"node": "rabbit-1@localhost", "connections": 10000, "opened": 10000,
                     "rss_before_mib": 100.0, "rss_held_mib": 1000.0, "rss_after_mib": 200.0,
                     "kib_per_connection": 92.2}}
    (run_dir / "idle-10k" / "rabbitmq").mkdir(parents=True)
    (run_dir / "idle-10k" / "rabbitmq" / "scenario.json").write_text(json.dumps(idle))
    declare = {**_meta("declare-250", False, T0, T0 + 3), "run_id": run_dir.name, "target": "warren-amqp",
               "declare": {"queues": 250, "connections": 3, "declared": 250, "deleted": 249,
                           "declare_s": 0.41, "delete_s": 0.39, "declares_per_s": 609.8,
                           "deletes_per_s": 638.5, "declare_p50_ms": 4.5, "declare_p99_ms": 12.25,
                           "declare_max_ms": 20.0, "delete_p50_ms": 4.0, "delete_p99_ms": 11.0,
                           "delete_max_ms": 15.5, "errors": 1, "left_after": 1,
                           "per_connection": [{"node": "n1", "declared": 84, "deleted": 83}]}}
    (run_dir / "declare-250" / "warren-amqp").mkdir(parents=True)
    (run_dir / "declare-250" / "warren-amqp" / "scenario.json").write_text(json.dumps(declare))
    rpc = {**_meta("rpc-1000", False, T0, T0 + 9), "run_id": run_dir.name, "target": "warren-native",
           "rpc": {"clients": 1000, "procs": 2, "per_proc": [500, 500], "at_once": 64, "opened": 999,
                   "failed": 1, "held_s": 1.75, "p50_ms": 30.5, "p99_ms": 120.25, "max_ms": 140.0,
                   "queues_listed_held": 999, "names_listed_held": 999, "closed_s": 0.2, "gone_s": 0.95,
                   "still_listed_s": 0.4, "left_after": 0, "listings": 2, "errors": 1,
                   "node_cpu_s": {"n1": 1.0, "n2": 0.75, "n3": 0.5}, "node_cpu_total_s": 2.25}}
    (run_dir / "rpc-1000" / "warren-native").mkdir(parents=True)
    (run_dir / "rpc-1000" / "warren-native" / "scenario.json").write_text(json.dumps(rpc))
    res, _ = run(str(run_dir), out=str(root / "out"), spark=session)
    # a run folder whose scenarios have a scenario.json and no message lines at all
    only_meta = root / "20260104-000000-eeeeee"
    for scenario in ("idle-10k", "declare-250", "rpc-1000"):
        shutil.copytree(run_dir / scenario, only_meta / scenario)
    check_local_input(str(only_meta))
    res.only_meta, _ = run(str(only_meta), out=str(root / "out-meta"), spark=session)
    return res, expect, root / "out"


def test_open_loop_latency_is_measured_from_the_intended_time_after_warmup(openloop):
    res, expect, _ = openloop
    for target, kinds in expect.items():
        for kind, values in kinds.items():
            [row] = [r for r in res.tables["latency"] if (r["scenario"], r["target"], r["kind"]) ==
                     ("paced", target, kind)]
            assert row["n"] == 90
            for name, q in (("p50_ms", 50), ("p99_ms", 99), ("p999_ms", 99.9)):
                assert row[name] == pytest.approx(np.percentile(values, q), rel=1e-6), (target, kind, name)
        [s] = [s for s in res.tables["summary"] if (s["scenario"], s["target"]) == ("paced", target)]
        assert s["open_loop"] is True and s["published"] == 100
        assert s["confirm_p999_ms"] == pytest.approx(np.percentile(kinds["confirm"], 99.9), rel=1e-6)
        assert s["send_lag_p99_ms"] == pytest.approx(np.percentile(kinds["send_lag"], 99), rel=1e-6)
        assert s["confirm_sent_p99_ms"] == pytest.approx(np.percentile(kinds["confirm_sent"], 99), rel=1e-6)
    # the held-back messages count from when they were meant to go: p99 sees the 200 ms stall
    assert [r for r in res.tables["latency"] if r["target"] == "warren-native" and r["kind"] == "confirm"][0][
        "p99_ms"] > 200


def test_compare_names_the_warren_target_and_idle_declare_and_rpc_rows_come_through(openloop):
    res, _, out = openloop
    [c] = res.tables["compare"]
    assert (c["scenario"], c["warren_target"]) == ("paced", "warren-native")
    assert c["confirm_p99_ratio"] > 1
    # warren-native's generator held its messages back longer; from the actual send both brokers
    # confirm in the same 1 ms
    assert c["confirm_sent_p99_ratio"] == pytest.approx(1.0)
    [idle] = res.tables["idle"]
    assert (idle["target"], idle["node"], idle["opened"], idle["kib_per_connection"]) == (
        "rabbitmq", "rabbit-1@localhost", 10000, 92.2)
    [d] = res.tables["declare"]
    assert (d["scenario"], d["target"], d["queues"], d["declared"], d["deleted"], d["left_after"]) == (
        "declare-250", "warren-amqp", 250, 250, 249, 1)
    assert (d["declare_s"], d["declare_p99_ms"], d["delete_max_ms"], d["errors"]) == (0.41, 12.25, 15.5, 1)
    assert "per_connection" not in d
    [r] = res.tables["rpc"]
    assert (r["scenario"], r["target"], r["clients"], r["procs"], r["opened"], r["queues_listed_held"]) == (
        "rpc-1000", "warren-native", 1000, 2, 999, 999)
    assert (r["held_s"], r["p99_ms"], r["gone_s"], r["still_listed_s"], r["left_after"], r["errors"],
            r["node_cpu_total_s"]) == (1.75, 120.25, 0.95, 0.4, 0, 1, 2.25)
    assert "per_proc" not in r and "node_cpu_s" not in r
    md = (out / "report.md").read_text()
    assert "## Declaring and deleting queues" in md and "| declare-250 | warren-amqp | 250 | 250 |" in md
    assert (out / "declare.csv").read_text().splitlines()[0].startswith("run_id,scenario,target,queues,")
    assert "## RPC clients holding exclusive reply queues" in md
    assert "| rpc-1000 | warren-native | 1,000 | 2 | 999 | 1.75 |" in md
    assert (out / "rpc.csv").read_text().splitlines()[0].startswith("run_id,scenario,target,clients,procs,")
    assert md.index("## Declaring and deleting queues") < md.index("## RPC clients") < md.index("## Charts")


def test_a_folder_of_scenarios_without_messages_is_analysed(openloop):
    """Idle, declare and rpc scenarios alone (a scenario.json each, no publish.jsonl) are logs
    to analyse, not an empty folder."""
    res, _, _ = openloop
    only = res.only_meta
    assert [(d["scenario"], d["queues"]) for d in only.tables["declare"]] == [("declare-250", 250)]
    assert [(r["scenario"], r["opened"]) for r in only.tables["rpc"]] == [("rpc-1000", 999)]
    assert [(i["scenario"], i["opened"]) for i in only.tables["idle"]] == [("idle-10k", 10000)]
    assert sorted(s["scenario"] for s in only.tables["summary"]) == ["declare-250", "idle-10k", "rpc-1000"]
    assert only.tables["latency"] == [] and only.tables["compare"] == []
