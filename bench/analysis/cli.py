"""The analysis command line: `python -m bench.analysis [INPUT] [--out DIR] [--master local[*]]`
(`warren-bench analyse`, or `analyze`, hands its arguments to `main(argv)`).

Reads the benchmark logs under INPUT (default `results/`: every run under it; or one run's folder;
or any URI Spark reads, e.g. hdfs://... or s3a://...) and writes into OUT (default INPUT/report/):
summary/latency/throughput_timeseries/failover_timeseries/faults/sync/compare as CSV files and
Parquet datasets, PNG charts, and report.md / report.html. Prints the report's path and the
headline table.

An INPUT without logs is an error (exit 2) that writes nothing: a local INPUT is checked before
Spark starts (missing, or neither a publish.jsonl nor a scenario.json where a run's scenarios keep
them: idle-connection, declare and rpc scenarios have a scenario.json alone); any other URI once
Spark has looked.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

LAYOUT = ("RUN_ID/SCENARIO/TARGET/publish.jsonl under a results folder, SCENARIO/TARGET/publish.jsonl under a "
          "run folder; or scenario.json alone, for scenarios without messages")
# a scenario folder holding one of these has something to analyse
LOG_FILES = ("publish.jsonl", "scenario.json")


class NoLogs(Exception):
    """INPUT holds no benchmark logs: nothing to analyse, nothing written."""


def parse_args(argv: list[str] | None = None, prog: str = "python -m bench.analysis") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Analyse warren benchmark logs with Spark.")
    ap.add_argument("input", nargs="?", default="results",
                    help="results folder, one run folder, or any path Spark reads (default: results)")
    ap.add_argument("--out", help="where the report goes (default: INPUT/report)")
    ap.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    ap.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    return ap.parse_args(argv)


def check_local_input(input_path: str) -> None:
    """Raise NoLogs when INPUT is a local path (no URI scheme) without logs to analyse."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", input_path) and not input_path.startswith("file:"):
        return  # hdfs://, s3a://, ...: Spark finds out
    from bench.analysis.job import _expand_braces, _relative, to_uri
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    path = Path(url2pathname(urlparse(to_uri(input_path)).path))
    if not path.exists():
        raise NoLogs(f"{input_path}: no such file or directory")
    if not path.is_dir():
        raise NoLogs(f"{input_path} is not a folder: give a results folder or one run's folder")
    if not any(next(path.glob(p), None) for name in LOG_FILES for p in _expand_braces(_relative(name))):
        raise NoLogs(f"no benchmark logs under {input_path} (expected {LAYOUT}); "
                     "`warren-bench run` writes them, `python -m bench.analysis.synth DIR` makes a synthetic run")


def output_of(input_uri: str, out: str | None) -> str:
    from bench.analysis.job import to_uri

    return to_uri(out) if out else f"{input_uri}/report"


def run(input_path: str, out: str | None = None, master: str = "local[*]", charts: bool = True,
        spark=None):
    """The whole job: analyse, write the report's files, then the Parquet copies of the tables.
    Returns (results, output URI). Uses the given session, or makes and stops its own."""
    from bench.analysis import job, report

    own = spark is None
    if own:
        spark = job.spark_session(master)
    try:
        res = job.analyse(spark, input_path)
        if not res.tables["summary"]:
            raise NoLogs(f"no benchmark logs under {input_path} (expected {LAYOUT})")
        dest = output_of(res.input, out)
        for name, data in report.render(res, with_charts=charts).items():
            job.put_file(spark, f"{dest}/{name}", data)
        job.write_parquet(spark, dest)
    finally:
        if own:
            spark.stop()
    return res, dest


def main(argv: list[str] | None = None, prog: str = "python -m bench.analysis") -> int:
    args = parse_args(argv, prog)
    try:
        check_local_input(args.input)
    except NoLogs as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        import pyspark  # noqa: F401
    except ImportError:
        print(f"{prog}: error: the analysis needs PySpark: pip install 'warren[analysis]' (or pip "
              "install pyspark matplotlib); Spark also needs Java 17 on PATH", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        res, dest = run(args.input, args.out, args.master, charts=not args.no_charts)
    except NoLogs as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from bench.analysis.report import fmt

    summary = res.tables["summary"]
    print(f"{len(summary)} scenario/target pairs from {res.input}")
    for s in summary:
        print(f"  {s['run_id']} {s['scenario']:<20} {s['target']:<9} "
              f"{fmt(s['deliver_per_s']):>9} msg/s  delivery p99 {fmt(s['delivery_p99_ms'])} ms  "
              f"lost {fmt(s['lost'])}  max gap {fmt(s['max_gap_s'])} s")
    print(f"report: {dest}/report.html ({time.monotonic() - started:.0f} s)")
    return 0
