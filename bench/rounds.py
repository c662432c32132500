"""Rounds of one benchmark, side by side: `warren-bench run --repeat N` runs the same scenarios
and targets N times, one round after the other, and this module turns the rounds' summary
lines (the `summaries` of each round's run.json) into one table per scenario.

Why rounds: on a small shared machine a single run's p99 moves with the machine more than with
the broker, so a claim such as "warren's confirm p99 is at most half of
RabbitMQ's in the same run" is read over several rounds: each round's ratio (both brokers
measured minutes apart, in that round), and their median. The table says which rounds met a
bound, not only the median.
"""

from __future__ import annotations

import statistics

REFERENCE = "rabbitmq"  # what each warren target's latency is divided by, when it ran


def latency_table(rounds: list[list[dict]]) -> dict[str, dict]:
    """Per scenario: {"targets": [...], "rounds": [{target: {confirm_p50, confirm_p99,
    delivery_p99, ratio}}...], "ratios": {target: [its rounds' ratios]},
    "medians": {target: {"confirm_p99": ..., "ratio": ...}}}. Summaries without latency
    figures (declare, idle, rpc, chaos scenarios) are left out; a round where a target did not
    run has no entry for it, and no ratio."""
    out: dict[str, dict] = {}
    for k, summaries in enumerate(rounds):
        for s in summaries:
            lat = s.get("latency") or {}
            conf, deliv = lat.get("confirm"), lat.get("delivery")
            if not conf and not deliv:
                continue
            sc = out.setdefault(s["scenario"], {"targets": [], "rounds": [{} for _ in rounds]})
            if s["target"] not in sc["targets"]:
                sc["targets"].append(s["target"])
            sc["rounds"][k][s["target"]] = {
                "confirm_p50": (conf or {}).get("p50_ms"), "confirm_p99": (conf or {}).get("p99_ms"),
                "delivery_p99": (deliv or {}).get("p99_ms")}
    for sc in out.values():
        sc["ratios"] = {}
        for t in sc["targets"]:
            if t == REFERENCE or REFERENCE not in sc["targets"]:
                continue
            ratios = []
            for r in sc["rounds"]:
                mine, ref = r.get(t, {}).get("confirm_p99"), r.get(REFERENCE, {}).get("confirm_p99")
                if mine is not None and ref:
                    r[t]["ratio"] = round(mine / ref, 3)
                    ratios.append(r[t]["ratio"])
            sc["ratios"][t] = ratios
        sc["medians"] = {}
        for t in sc["targets"]:
            p99s = [r[t]["confirm_p99"] for r in sc["rounds"] if r.get(t, {}).get("confirm_p99") is not None]
            med = {"confirm_p99": round(statistics.median(p99s), 3) if p99s else None}
            if sc["ratios"].get(t):
                med["ratio"] = round(statistics.median(sc["ratios"][t]), 3)
            sc["medians"][t] = med
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(table: dict[str, dict]) -> list[str]:
    """The table as lines: per scenario, one line per round (each target's confirm p50 / p99
    and delivery p99, ms, then each warren target's confirm p99 over RabbitMQ's), then the
    medians and how many rounds were at 0.5 or below."""
    lines: list[str] = []
    for name, sc in table.items():
        targets = sc["targets"]
        lines.append(f"{name}: confirm p50 / p99, delivery p99 (ms), per round")
        for k, r in enumerate(sc["rounds"], 1):
            cells = [f"{t} {_ms(r[t]['confirm_p50'])} / {_ms(r[t]['confirm_p99'])}, {_ms(r[t]['delivery_p99'])}"
                     if t in r else f"{t} -" for t in targets]
            ratios = [f"{t} {r[t]['ratio']:.2f}" for t in sc["ratios"] if "ratio" in r.get(t, {})]
            tail = f"  | confirm p99 over {REFERENCE}'s: " + ", ".join(ratios) if ratios else ""
            lines.append(f"  round {k}: " + "; ".join(cells) + tail)
        meds = []
        for t in targets:
            med = sc["medians"][t]
            text = f"{t} confirm p99 {_ms(med['confirm_p99'])}"
            if "ratio" in med:
                at_half = sum(1 for x in sc["ratios"][t] if x <= 0.5)
                text += f" (ratio {med['ratio']:.2f}; {at_half} of {len(sc['ratios'][t])} rounds at 0.5 or below)"
            meds.append(text)
        lines.append("  median: " + "; ".join(meds))
    return lines
