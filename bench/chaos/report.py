"""A campaign's summary from its folder: `warren-bench chaos --summarize RUN_FOLDER`.

This module owns the figures the README quotes for a campaign, recomputed from the files every
schedule left (bench/LOGS.md layout, read by bench/chaos/logs.py), so they can be checked again
without running anything:

- schedules, verdicts (the failed ones by seed), how often each fault kind was drawn;
- totals: published, confirmed, delivered, confirmed messages lost (a bug) and lost where the
  spec allows it (by schedule and reason), stranded, stuck, repeats without `redelivered`;
- the longest confirm stall with every node up and linked and no fault in force, with what it
  waited for (bench/chaos/checker.py);
- the failover gap of every kill -9 of the queue's leader that left a majority running: the
  longest pause between two consecutive deliveries (to any consumer) that starts within the
  GAP_WINDOW seconds after the kill, or, when the schedule's next fault comes sooner, that ends
  before it; its median, p99 and worst, with seeds. A kill made while another fault held a node
  away leaves no majority, so nothing can be promoted until that node is back: such pauses are
  listed apart.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter
from pathlib import Path


GAP_WINDOW = 5.0


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of `values`."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


HOLDS = ("kill", "sigterm", "stop_app", "pause", "forget", "partition", "rolling_restart", "full_restart")


def _held_until(fault: dict) -> float:
    """Until when a fault keeps its node(s) from the cluster (its undo, or its end)."""
    detail = fault.get("detail") or {}
    if detail.get("undone_at") is not None:
        return fault["t"] + detail["undone_at"]
    return fault.get("t_end") or fault["t"]


def leader_kill_gaps(folder: Path) -> list[tuple[float, float, bool]]:
    """(gap seconds, seconds from the kill to the gap's start, whether a majority was left) for
    each kill -9 of the queue's leader in one schedule's folder. Without a majority (another
    fault held a node of the three away at that moment) nothing can be promoted until it comes
    back, so that pause is the outage's length rather than a failover's."""
    faults = [json.loads(line) for line in (folder / "faults.jsonl").read_text().splitlines() if line.strip()]
    times = []
    with open(folder / "deliver.jsonl", encoding="utf-8") as f:
        for line in f:
            times.append(json.loads(line)["t_del"])
    times.sort()
    out = []
    for i, fault in enumerate(faults):
        before = fault.get("detail", {}).get("before") or {}
        if fault["action"] != "kill" or fault.get("node") != before.get("leader"):
            continue
        t = fault["t"]
        majority = not any(g is not fault and g["action"] in HOLDS and g["t"] <= t < _held_until(g)
                           for g in faults)
        end = min([t + GAP_WINDOW] + [g["t"] for g in faults[i + 1:] if g["t"] > t])
        cut = end < t + GAP_WINDOW  # by the next fault
        lo = max(bisect.bisect_left(times, t) - 1, 0)  # the last delivery before the kill
        hi = bisect.bisect_right(times, end)
        window = times[lo:hi + 1]
        gaps = [(b - a, a - t) for a, b in zip(window, window[1:])
                # a pause the next fault may have caused or prolonged is that fault's
                if not (cut and b > end)]
        if gaps:
            out.append((*max(gaps), majority))
    return out


def summarize(run: Path, recheck: bool = True) -> str:
    """The campaign summary of a run folder (`RUN_ID/`, holding `chaos-SEED/warren/` folders).
    With `recheck` every verdict is computed again from the logs by today's checker."""
    from .real import check_folder  # the campaign's checker options
    folders = sorted(run.glob("chaos-*/warren"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not folders:
        raise FileNotFoundError(f"no chaos schedules under {run}")
    kinds: Counter = Counter()
    tot: Counter = Counter()
    failed, allowed, gaps, outages, stalls = [], [], [], [], []
    for folder in folders:
        saved = json.loads((folder / "verdict.json").read_text())
        seed = saved["seed"]
        v = check_folder(folder).as_dict() if recheck else saved
        kinds.update(a["kind"] for a in saved["schedule"]["actions"])
        for key in ("published", "confirmed", "delivered", "lost", "stranded", "stuck", "duplicates",
                    "duplicates_unflagged", "redelivered"):
            tot[key] += v[key]
        if not v["ok"]:
            failed.append((seed, "; ".join(v["reasons"])[:200]))
        if v["lost_allowed"]:
            allowed.append((seed, v["lost_allowed"]))
        if v.get("confirm_stall_s") is not None:
            stalls.append((v["confirm_stall_s"], seed, v.get("confirm_stall_why", "")))
        for g, at, majority in leader_kill_gaps(folder):
            (gaps if majority else outages).append((g, at, seed))
    lines = [f"{len(folders)} schedules (seeds {folders[0].parent.name[6:]}..{folders[-1].parent.name[6:]}): "
             f"{len(folders) - len(failed)} OK, {len(failed)} failed",
             "faults drawn: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
             f"published {tot['published']:,}, confirmed {tot['confirmed']:,}, delivered {tot['delivered']:,}; "
             f"confirmed and lost: {tot['lost']:,}; stranded {tot['stranded']:,}; stuck {tot['stuck']:,}; "
             f"repeats {tot['duplicates']:,} (without redelivered: {tot['duplicates_unflagged']:,})",
             f"loss the spec allows: {sum(sum(a.values()) for _, a in allowed):,} messages in "
             f"{len(allowed)} schedule(s)"]
    lines += [f"  seed {seed}: {a}" for seed, a in allowed]
    if gaps:
        g = [x[0] for x in gaps]
        worst = sorted(gaps, reverse=True)[:3]
        lines.append(f"failover gap after kill -9 of the leader ({len(gaps)} kills): median "
                     f"{percentile(g, 50) * 1000:.0f} ms, p99 {percentile(g, 99) * 1000:.0f} ms, worst "
                     + ", ".join(f"{x * 1000:.0f} ms (seed {s})" for x, _, s in worst))
    if outages:
        lines.append(f"kill -9 of the leader with another node already away (no majority left: nothing "
                     f"can be promoted until it is back; {len(outages)} kills): pauses "
                     + ", ".join(f"{x * 1000:.0f} ms (seed {s})" for x, _, s in sorted(outages, reverse=True)))
    if stalls:
        x, seed, why = max(stalls)
        lines.append(f"longest confirm stall with every node up and linked and no fault in force: "
                     f"{x * 1000:.0f} ms (seed {seed}{': ' + why if why else ''})")
    lines += [f"FAIL seed {seed}: {why}" for seed, why in failed]
    return "\n".join(lines)
