"""One short chaos schedule per fault kind, run the way a user runs the campaign:
`warren-bench chaos --smoke` (two processes side by side, each with half of the kinds, to keep
the file short), then the logs it wrote are read back.

What always has to hold (the tooling): every kind ran to a verdict on a cluster of real
processes under load, the logs follow bench/LOGS.md and give back the same verdict when the
checker reads them again, every fault was carried out (a partition is skipped, with the reason,
only where network namespaces cannot be made), and each schedule printed the command that
replays it.

Whether the broker kept its promises is each kind's verdict, and a failed verdict fails its
test, with the checker's reasons and the command that replays the schedule: this is how
`make test` catches a reliability regression on every change.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.chaos.checker import check
from bench.chaos.logs import load_history
from bench.chaos.real import Options
from bench.chaos.real import _checker_options as checker_options
from bench.chaos.schedule import KINDS

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

SEED = 7100
GROUPS = [KINDS[0::2], KINDS[1::2]]


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "warren-bench"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "bench.cli"]


@pytest.fixture(scope="module")
def smoke():
    # not tmp_path: pytest prunes /tmp/pytest-of-<user> of other sessions running at the same time
    out = Path(tempfile.mkdtemp(prefix="warren-chaos-smoke-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    procs = []
    t = time.monotonic()
    for i, kinds in enumerate(GROUPS):
        cmd = _cli() + ["chaos", "--smoke", "--seed", str(SEED), "--kinds", ",".join(kinds), "--rate", "1000",
                        "--out", str(out), "--run-id", f"smoke-{i}"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=280)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            pytest.fail(f"warren-bench chaos --smoke did not finish in 280 s:\n{so[-3000:]}\n{se[-3000:]}")
        outputs.append((p.returncode, so, se))
    took = time.monotonic() - t
    print(f"\nchaos smoke: {len(KINDS)} schedules in {took:.0f} s")
    for code, so, se in outputs:
        print(so)
    verdicts = {}
    for run in sorted(out.iterdir()):
        for folder in sorted(run.glob("chaos-*/warren")):
            v = json.loads((folder / "verdict.json").read_text())
            verdicts[v["schedule"]["kinds"][0]] = (folder, v)
    yield {"outputs": outputs, "verdicts": verdicts, "seconds": took}
    if all(v["ok"] for _, v in verdicts.values()):
        shutil.rmtree(out, ignore_errors=True)
    else:
        print(f"\nchaos smoke: logs of the failed verdicts (node logs included) kept in {out}")


def test_every_kind_ran_and_the_processes_ended_normally(smoke):
    for code, so, se in smoke["outputs"]:
        assert code in (0, 1), f"warren-bench chaos exited {code}:\n{so[-2000:]}\n{se[-3000:]}"
        assert "Traceback" not in se, se[-3000:]
    assert sorted(smoke["verdicts"]) == sorted(KINDS), sorted(smoke["verdicts"])


@pytest.mark.parametrize("kind", KINDS)
def test_smoke_schedule(smoke, kind):
    folder, v = smoke["verdicts"][kind]
    output = "".join(so for _, so, _ in smoke["outputs"])
    # the tooling
    assert v["replay"] in output, f"the replay command {v['replay']!r} was not printed"
    assert v["replay"].startswith(f"warren-bench chaos --seed {v['seed']} --kinds {kind} ")
    assert not [a for a in v["anomalies"] if a.startswith("the driver stopped")], v["anomalies"]
    assert v["published"] > 500 and v["delivered"] > 0, (v["published"], v["delivered"])
    faults = [json.loads(line) for line in (folder / "faults.jsonl").read_text().splitlines()]
    assert [f["action"] for f in faults] == [kind]
    detail = faults[0]["detail"]
    assert "error" not in detail, detail["error"]
    if "skipped" in detail:
        assert kind == "partition" and "namespaces" in detail["skipped"], detail
    assert detail["t_end"] is not None
    for name in ("scenario.json", "publish.jsonl", "deliver.jsonl", "intervals.jsonl", "history.json"):
        assert (folder / name).stat().st_size > 0, name
    # judged again with the campaign's own options (the smoke runs with the defaults)
    again = check(load_history(folder), **checker_options(Options())).as_dict()
    for key in ("ok", "published", "confirmed", "delivered", "lost", "duplicates_unflagged", "stranded", "stuck"):
        assert again[key] == v[key], (key, again[key], v[key])
    # the broker
    assert v["ok"], f"{kind}: {'; '.join(v['reasons'])[:600]} (replay: {v['replay']})"
