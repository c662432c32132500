"""Turn the job's result tables into what people read: CSV files, PNG charts, and one report in
Markdown and HTML. No Spark here: the input is `job.Results` (small lists of dicts) and the output
is a mapping of file name to bytes, which the caller writes wherever the report goes.

The report is built once as a list of blocks (heading, paragraph, table, image) and rendered
twice, so the Markdown and the HTML always say the same thing. Order: the runs, a headline table,
warren/RabbitMQ ratios, failover gaps, sync rates, then the charts and the definitions.
"""

from __future__ import annotations

import csv
import html
import io
import re
import time

from bench.analysis.job import FINE_BUCKET, TABLES, Results

ROLE_STYLE = {"deliver": "-", "confirm": "--", "publish": ":"}
TARGET_COLOR = {"warren": "tab:blue", "warren-native": "tab:blue", "warren-amqp": "tab:green",
                "rabbitmq": "tab:orange", "null": "tab:gray", "floor": "tab:brown"}


# --- formatting ---------------------------------------------------------------------------------

def fmt(v, digits: int = 3) -> str:
    """Numbers for people: a few significant digits, thousands separators, '-' for nothing."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != 0 and abs(v) < 10 ** -(digits):
            return f"{v:.{digits}g}"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}" if abs(v) < 1 else f"{v:,.{max(0, digits - len(str(int(abs(v)))))}f}"
    return str(v)


def slug(*parts: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9._-]+", "_", str(p)) for p in parts)


def to_csv(table: str, rows: list[dict]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = [c for c, _ in TABLES[table]]
    w.writerow(cols)
    for r in rows:
        w.writerow(["" if r[c] is None else r[c] for c in cols])
    return buf.getvalue().encode()


# --- charts -------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def rate_segments(coarse: list[dict], fine: list[dict]) -> list[tuple[float, float, float]]:
    """One role's rate over time as (start_s, end_s, msgs/s) segments, in order: the fine buckets
    around faults where there are some, the per-second rates elsewhere (cut where a fine window
    begins or ends), and 0 where no bucket says anything (a second without a line had no events).
    A bucket only partly inside the scenario keeps its true rate over that part."""
    windows: list[tuple[float, float]] = []
    segs: list[tuple[float, float, float]] = []
    by_fault: dict = {}
    for r in fine:
        if r.get("start_s") is not None:
            by_fault.setdefault(r.get("fault_s"), []).append(r)
    for _, rows in sorted(by_fault.items(), key=lambda kv: min(r["start_s"] for r in kv[1])):
        # two faults close together: the earlier one's buckets keep the time they share
        kept = [r for r in rows if all(r["end_s"] <= lo or r["start_s"] >= hi for lo, hi in windows)]
        if kept:
            windows.append((min(r["start_s"] for r in kept), max(r["end_s"] for r in kept)))
            segs += [(r["start_s"], r["end_s"], r["per_s"]) for r in kept]
    for r in coarse:
        if r.get("start_s") is None or r.get("per_s") is None:
            continue
        parts = [(r["start_s"], r["end_s"])]
        for w_lo, w_hi in windows:
            parts = [p for a, b in parts for p in ((a, min(b, w_lo)), (max(a, w_hi), b)) if p[1] > p[0]]
        segs += [(a, b, r["per_s"]) for a, b in parts]
    segs.sort()
    out: list[tuple[float, float, float]] = []
    for a, b, v in segs:
        if out and a > out[-1][1] + 1e-9:
            out.append((out[-1][1], a, 0.0))
        out.append((a, b, v))
    # a sliver of a bucket at either end (the scenario began or ended just after a bucket
    # boundary) holds a handful of events: its rate is noise, so it joins its neighbour
    for end in (-1, 0):
        if len(out) >= 2:
            i, j = (len(out) - 1, len(out) - 2) if end == -1 else (0, 1)
            (a1, b1, v1), (a2, b2, v2) = out[i], out[j]
            if b1 - a1 < (b2 - a2) / 2:
                merged = (min(a1, a2), max(b1, b2),
                          (v1 * (b1 - a1) + v2 * (b2 - a2)) / ((b1 - a1) + (b2 - a2)))
                out[min(i, j):max(i, j) + 1] = [merged]
    return out


def _steps(segs: list[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """x and y for drawstyle steps-post: each segment's value holds until its end."""
    xs = [a for a, _, _ in segs] + [segs[-1][1]]
    ys = [v for _, _, v in segs] + [segs[-1][2]]
    return xs, ys


def throughput_figure(run_id: str, scenario: str, series: list[dict], faults: list[dict],
                      fine: list[dict] | None = None):
    """Messages per second over the scenario, one panel per target: deliveries and confirms as
    steps, per second, and per FINE_BUCKET around each fault (shaded); each fault a red line
    labelled in a band kept free above the curves."""
    plt = _plt()
    fine = fine or []
    targets = sorted({r["target"] for r in series} | {r["target"] for r in fine})
    fig, axes = plt.subplots(len(targets), 1, figsize=(9, 1.2 + 2.4 * len(targets)), sharex=True,
                             squeeze=False)
    for ax, target in zip(axes[:, 0], targets):
        top = 0.0
        for role in ("deliver", "confirm"):
            segs = rate_segments([r for r in series if r["target"] == target and r["role"] == role],
                                 [r for r in fine if r["target"] == target and r["role"] == role])
            if segs:
                xs, ys = _steps(segs)
                ax.plot(xs, ys, ROLE_STYLE[role], drawstyle="steps-post", color=TARGET_COLOR.get(target),
                        label=role)
                top = max(top, max(ys))
        spans = {}
        for r in fine:
            if r["target"] == target:
                lo, hi = spans.get(r["fault_s"], (r["start_s"], r["end_s"]))
                spans[r["fault_s"]] = (min(lo, r["start_s"]), max(hi, r["end_s"]))
        for i, (lo, hi) in enumerate(sorted(spans.values())):
            ax.axvspan(lo, hi, color="grey", alpha=0.12, lw=0,
                       label=f"{FINE_BUCKET:g} s buckets" if i == 0 else None)
        # the curves stay below 80% of the height; the fault labels go in the band above
        ax.set_ylim(0, (top or 1.0) * 1.25)
        for f in faults:
            if f["target"] != target or f["second"] is None:
                continue
            ax.axvline(f["second"], color="tab:red", alpha=0.7, lw=1)
            ax.annotate(f" {f['action']} {f['node'] or ''}", (f["second"], 0.98),
                        xycoords=("data", "axes fraction"), va="top", ha="left", fontsize=7,
                        color="tab:red")
        ax.set_ylabel(f"{target}\nmessages / s")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1, 0].set_xlabel("seconds since scenario start")
    axes[0, 0].set_title(f"{scenario}: throughput ({run_id})")
    return fig


def throughput_chart(run_id: str, scenario: str, series: list[dict], faults: list[dict],
                     fine: list[dict] | None = None) -> bytes:
    return _png(throughput_figure(run_id, scenario, series, faults, fine))


def latency_chart(run_id: str, latency: list[dict]) -> bytes:
    """p50..p99.9 and max per scenario and target, confirm and delivery side by side, log scale."""
    plt = _plt()
    kinds = ["confirm", "delivery"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    cols = [("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99"), ("p999_ms", "p99.9"), ("max_ms", "max")]
    groups = sorted({(r["scenario"], r["target"]) for r in latency})
    for ax, kind in zip(axes, kinds):
        rows = {(r["scenario"], r["target"]): r for r in latency if r["kind"] == kind}
        width = 0.8 / max(1, len(cols))
        for j, (col, label) in enumerate(cols):
            xs = [i + j * width for i, _ in enumerate(groups)]
            ys = [(rows.get(g) or {}).get(col) or 0 for g in groups]
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{s}\n{t}" for s, t in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"publish -> {kind}")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("ms (log scale)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"latency percentiles ({run_id})")
    return _png(fig)


def compare_chart(run_id: str, compare: list[dict]) -> bytes:
    """warren beside RabbitMQ: delivered msgs/s and delivery p99 per scenario, ratio on top."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = [("deliver_per_s", "throughput_ratio", "delivered msgs/s (higher is better)"),
              ("delivery_p99_ms", "p99_ratio", "delivery p99 ms (lower is better)")]
    names = [c["scenario"] + (f"\n{c['warren_target']}" if c.get("warren_target") else "") for c in compare]
    for ax, (col, ratio, title) in zip(axes, panels):
        xs = range(len(names))
        w = [c[f"warren_{col}"] or 0 for c in compare]
        r = [c[f"rabbitmq_{col}"] or 0 for c in compare]
        ax.bar([x - 0.2 for x in xs], w, 0.4, label="warren", color=TARGET_COLOR["warren"])
        ax.bar([x + 0.2 for x in xs], r, 0.4, label="rabbitmq", color=TARGET_COLOR["rabbitmq"])
        for x, c in zip(xs, compare):
            if c[ratio] is not None:
                ax.annotate(f"x{c[ratio]:.2f}", (x, max(w[x], r[x])), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, fontsize=8, rotation=20)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        if col == "delivery_p99_ms" and any(w + r):
            ax.set_yscale("log")
    fig.suptitle(f"warren vs RabbitMQ, ratio = warren / RabbitMQ ({run_id})")
    return _png(fig)


# --- the report ---------------------------------------------------------------------------------

def _table(headers: list[str], rows: list[list]) -> tuple:
    return ("table", headers, [[fmt(v) for v in r] for r in rows])


def blocks(res: Results, charts: dict[str, list[tuple[str, str]]]) -> list[tuple]:
    """The report's content, render-neutral. charts: run_id -> [(file name, caption)]."""
    t = res.tables
    out: list[tuple] = [("h1", "warren benchmark report")]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out.append(("p", (f"Input: {res.input}. Generated {stamp} by `python -m bench.analysis`. Latencies "
                      "in milliseconds, throughput in messages per second over the scenario's duration.")))
    if res.runs:
        out.append(_table(["run", "commit", "warren", "RabbitMQ", "machine", "targets"], [
            [r.get("run_id"), str(r.get("git_commit") or "")[:10], r.get("warren_version"),
             r.get("rabbitmq_version"),
             "{cpus} cpus, {mem_gib} GiB, {platform}".format(**{k: (r.get("machine") or {}).get(k, "?")
                                                               for k in ("cpus", "mem_gib", "platform")}),
             ", ".join(r.get("targets") or [])] for r in res.runs]))
    if not t["summary"]:
        out.append(("p", "No scenarios found: is INPUT a results folder or a run folder?"))
        return out

    out.append(("h2", "Headline"))
    out.append(_table(
        ["run", "scenario", "target", "delivered/s", "confirmed/s", "confirm p50", "confirm p99",
         "confirm p99.9", "delivery p50", "delivery p99", "delivery p99.9", "open loop",
         "send lag p99", "confirm p99 from send", "redelivered", "dup ids", "lost", "max gap s"],
        [[s["run_id"], s["scenario"], s["target"], s["deliver_per_s"], s["confirm_per_s"],
          s["confirm_p50_ms"], s["confirm_p99_ms"], s["confirm_p999_ms"], s["delivery_p50_ms"],
          s["delivery_p99_ms"], s["delivery_p999_ms"], s["open_loop"], s["send_lag_p99_ms"],
          s["confirm_sent_p99_ms"], s["redelivered"], s["dup_ids"], s["lost"], s["max_gap_s"]]
         for s in t["summary"]]))
    out.append(("p", ("Latency is measured from each message's intended send time where the scenario has "
                      "a rate (open loop: coordinated omission corrected), else from when it was "
                      "published, over the measured window (after warmup); send lag is how late the "
                      "generator itself sent (t_pub - t_int), and confirm p99 from send leaves it "
                      "out (t_conf - t_pub: the broker's and the client's part).")))

    out.append(("h2", "warren / RabbitMQ"))
    if t["compare"]:
        out.append(("p", ("Ratios are warren divided by RabbitMQ: above 1 means warren delivers more "
                          "per second (throughput) or waits longer (p99). The last compares confirm "
                          "p99s from the actual send, each generator's own lateness left out.")))
        out.append(_table(
            ["run", "scenario", "warren target", "warren/s", "RabbitMQ/s", "throughput ratio", "warren p99",
             "RabbitMQ p99", "p99 ratio", "confirm p99 ratio", "confirm p99 ratio from send"],
            [[c["run_id"], c["scenario"], c.get("warren_target"), c["warren_deliver_per_s"], c["rabbitmq_deliver_per_s"],
              c["throughput_ratio"], c["warren_delivery_p99_ms"], c["rabbitmq_delivery_p99_ms"],
              c["p99_ratio"], c["confirm_p99_ratio"], c.get("confirm_sent_p99_ratio")]
             for c in t["compare"]]))
    else:
        out.append(("p", "No scenario has both targets: these logs hold warren only (or RabbitMQ only)."))

    out.append(("h2", "Failover"))
    if t["faults"]:
        out.append(("p", ("gap: the longest pause between consecutive deliveries overlapping 1 s before "
                          "to 30 s after the action (open: nothing was delivered after it); first "
                          "delivery: seconds from the action to the next delivery.")))
        out.append(_table(
            ["run", "scenario", "target", "at s", "action", "node", "queue", "gap s", "open",
             "first delivery s"],
            [[f["run_id"], f["scenario"], f["target"], f["second"], f["action"], f["node"], f["queue"],
              f["gap_s"], f["gap_open"], f["first_delivery_after_s"]] for f in t["faults"]]))
    else:
        out.append(("p", "No fault actions in these logs."))

    if t.get("chaos"):
        bad = [c for c in t["chaos"] if not c["ok"]]
        out.append(("h2", "Chaos"))
        out.append(("p", (f"{len(t['chaos'])} chaos schedule(s), {len(bad)} with a failed verdict. "
                          "lost: confirmed and never delivered where the spec does not allow it "
                          "(lost allowed: where it does); stranded: first delivered to a second, "
                          "fresh consumer; stuck: publishes never confirmed nor nacked on a live "
                          "connection; gap: longest time without a delivery while messages waited; "
                          "recovery: longest time from a fault to the next delivery. Each row's "
                          "replay command runs the schedule again.")))
        out.append(_table(
            ["run", "seed", "kinds", "verdict", "published", "confirmed", "lost", "lost allowed",
             "lost (logs)", "dup unflagged", "stranded", "stuck", "anomalies", "gap s", "recovery s",
             "replay"],
            [[c["run_id"], str(c["seed"]), c["kinds"], "OK" if c["ok"] else "FAIL", c["published"],
              c["confirmed"], c["lost"], c["lost_allowed"], c["lost_in_logs"],
              c["duplicates_unflagged"], c["stranded"], c["stuck"], c["anomalies"],
              c["longest_gap_s"], c["recovery_s"], c["replay"]] for c in t["chaos"]]))

    if t["sync"]:
        out.append(("h2", "Sync"))
        out.append(_table(
            ["run", "scenario", "target", "queue", "messages", "msgs/s", "MB/s", "reported mean msgs/s",
             "reported peak msgs/s"],
            [[s["run_id"], s["scenario"], s["target"], s["queue"], s["messages"], s["msgs_per_s"],
              s["bytes_per_s"] / 1e6 if s["bytes_per_s"] is not None else None,
              s["reported_rate_mean"], s["reported_rate_peak"]] for s in t["sync"]]))

    if t.get("idle"):
        out.append(("h2", "Idle connections"))
        out.append(_table(
            ["run", "scenario", "target", "node", "connections", "opened", "RSS before MiB",
             "RSS held MiB", "RSS after MiB", "KiB per connection"],
            [[r["run_id"], r["scenario"], r["target"], r["node"], r["connections"], r["opened"],
              r["rss_before_mib"], r["rss_held_mib"], r["rss_after_mib"], r["kib_per_connection"]]
             for r in t["idle"]]))

    if t.get("declare"):
        out.append(("h2", "Declaring and deleting queues"))
        out.append(_table(
            ["run", "scenario", "target", "queues", "declared", "declare s", "declares/s",
             "declare p50 ms", "declare p99 ms", "declare max ms", "deleted", "delete s", "deletes/s",
             "delete p50 ms", "delete p99 ms", "delete max ms", "errors", "left after"],
            [[r["run_id"], r["scenario"], r["target"], r["queues"], r["declared"], r["declare_s"],
              r["declares_per_s"], r["declare_p50_ms"], r["declare_p99_ms"], r["declare_max_ms"],
              r["deleted"], r["delete_s"], r["deletes_per_s"], r["delete_p50_ms"], r["delete_p99_ms"],
              r["delete_max_ms"], r["errors"], r["left_after"]] for r in t["declare"]]))

    if t.get("rpc"):
        out.append(("h2", "RPC clients holding exclusive reply queues"))
        out.append(("p", ("held s: from the first client's connect to the last declare-ok; p50/p99/max: "
                          "one client's connect, channel and declare; listed: the clients' queues the "
                          "broker listed while they held them; closed s: until the clients had closed "
                          "their connections; gone s: from the close order until a listing showed none "
                          "of the queues, still listed s: until the start of the last listing that "
                          "showed some.")))
        out.append(_table(
            ["run", "scenario", "target", "clients", "procs", "opened", "held s", "p50 ms", "p99 ms",
             "max ms", "listed", "closed s", "gone s", "still listed s", "left after", "errors",
             "node CPU s"],
            [[r["run_id"], r["scenario"], r["target"], r["clients"], r["procs"], r["opened"], r["held_s"],
              r["p50_ms"], r["p99_ms"], r["max_ms"], r["queues_listed_held"], r["closed_s"], r["gone_s"],
              r["still_listed_s"], r["left_after"], r["errors"], r["node_cpu_total_s"]] for r in t["rpc"]]))

    out.append(("h2", "Charts"))
    for run_id, items in sorted(charts.items()):
        for name, caption in items:
            out.append(("img", name, caption))

    out.append(("h2", "Notes"))
    for n in res.notes:
        out.append(("p", n))
    out.append(("p", (f"Throughput charts: messages per second in 1 s buckets, and in {FINE_BUCKET:g} s "
                      "buckets (shaded) around each fault, where a sub-second outage shows.")))
    out.append(("p", ("Tables: summary, latency, throughput_timeseries, failover_timeseries, faults, "
                      "sync, idle, declare, rpc, compare, chaos, each as NAME.csv and NAME.parquet beside "
                      "this report.")))
    return out


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(bs: list[tuple]) -> str:
    lines = []
    for b in bs:
        kind = b[0]
        if kind == "h1":
            lines += [f"# {b[1]}", ""]
        elif kind == "h2":
            lines += [f"## {b[1]}", ""]
        elif kind == "p":
            lines += [b[1], ""]
        elif kind == "table":
            headers, rows = b[1], b[2]
            lines.append("| " + " | ".join(headers) + " |")
            lines.append("|" + "|".join("---" for _ in headers) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
            lines.append("")
        elif kind == "img":
            lines += [f"![{b[2]}]({b[1]})", ""]
    return "\n".join(lines)


def to_html(bs: list[tuple]) -> str:
    e = html.escape
    body = []
    for b in bs:
        kind = b[0]
        if kind in ("h1", "h2"):
            body.append(f"<{kind}>{e(b[1])}</{kind}>")
        elif kind == "p":
            text = re.sub(r"`([^`]+)`", r"<code>\1</code>", e(b[1]))
            body.append(f"<p>{text}</p>")
        elif kind == "table":
            head = "".join(f"<th>{e(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            body.append(f'<figure><img src="{e(b[1])}" alt="{e(b[2])}"><figcaption>{e(b[2])}</figcaption></figure>')
    style = ("body{font-family:sans-serif;max-width:75em;margin:1em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;"
             "text-align:right}th{background:#f3f3f3}td:nth-child(-n+3){text-align:left}"
             "img{max-width:100%}")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>warren benchmark report</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def render(res: Results, with_charts: bool = True) -> dict[str, bytes]:
    """Every file of the report except the Parquet datasets: name -> bytes."""
    files: dict[str, bytes] = {f"{name}.csv": to_csv(name, rows) for name, rows in res.tables.items()}
    charts: dict[str, list[tuple[str, str]]] = {}
    t = res.tables
    if with_charts:
        for run_id in sorted({s["run_id"] for s in t["summary"]}):
            items = charts.setdefault(run_id, [])
            lat = [r for r in t["latency"] if r["run_id"] == run_id]
            if lat:
                name = f"latency-{slug(run_id)}.png"
                files[name] = latency_chart(run_id, lat)
                items.append((name, f"Latency percentiles per scenario, run {run_id}"))
            cmp_rows = [c for c in t["compare"] if c["run_id"] == run_id]
            if cmp_rows:
                name = f"compare-{slug(run_id)}.png"
                files[name] = compare_chart(run_id, cmp_rows)
                items.append((name, f"warren vs RabbitMQ, run {run_id}"))
            for scenario in sorted({s["scenario"] for s in t["summary"] if s["run_id"] == run_id}):
                ser = [r for r in t["throughput_timeseries"]
                       if r["run_id"] == run_id and r["scenario"] == scenario]
                if not ser:
                    continue
                flt = [f for f in t["faults"] if f["run_id"] == run_id and f["scenario"] == scenario]
                fine = [r for r in t["failover_timeseries"]
                        if r["run_id"] == run_id and r["scenario"] == scenario]
                name = f"throughput-{slug(run_id, scenario)}.png"
                files[name] = throughput_chart(run_id, scenario, ser, flt, fine)
                items.append((name, f"Throughput over time, {scenario}, run {run_id}"))
    bs = blocks(res, charts)
    files["report.md"] = to_markdown(bs).encode()
    files["report.html"] = to_html(bs).encode()
    return files
