"""`warrenctl rolling_restart`: maintenance one node at a time, as a managed cluster has it.

Each member in turn (join order, or the `--nodes` given): refused if stopping it would leave
fewer than two nodes running, or if it holds the only synchronised replica of a mirrored queue
(the node-is-mirror-sync-critical check, mirroring/maintenance.py) unless `--force`; then a
controlled shutdown of its app (`stop_app`: queues handed over, clients disconnected), an
optional pause, `start_app`, and a wait until every mirrored queue has all its mirrors back and
synchronised, printing what it waits for about once a second. The report at the end gives per
node how long its app was down, how long until its queues were synchronised again, the longest
time one queue was blocked by a blocking sync (`ha-sync-mode: automatic` or `manual`; a
`background` sync blocks nothing) and, given a client log (`--client-log`: one delivery a line,
its first field the Unix time it arrived), the longest gap between deliveries around that node's
maintenance.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field

from mirroring.records import qualify, shown

POLL_SECONDS = 0.2
PRINT_EVERY = 1.0


class RollingError(Exception):
    """The rolling restart cannot go on: the text says why."""


@dataclass
class NodeReport:
    node: str
    down_s: float = 0.0  # stop_app asked .. start_app answered
    synced_after_s: float = 0.0  # start_app answered .. every mirrored queue synchronised
    blocked_s: float = 0.0  # the longest blocking sync of one queue in that time
    queues_blocked: list = field(default_factory=list)
    blocking_syncs: dict = field(default_factory=dict)  # queue -> seconds of each blocking sync
    longest_gap_s: float | None = None  # from the client log, if one was given
    window: tuple = (0.0, 0.0)  # Unix times: stop_app asked .. synchronised (in JSON:
    # stopped_at, synced_at, so that a harness with the clients' logs can find their gaps)


class RollingRestart:
    """One rolling restart. `call(where, command, payload, timeout)` runs a control command on a
    node, `where` being the entry node as the user named it or a member's [host, peer port]
    (raising ProtocolError, OSError or trio.TooSlowError); `say` prints a line."""

    def __init__(self, call, entry: str, *, force=False, pause=0.0, sync_timeout=600.0,
                 timeout=60.0, say=print):
        self.call, self.entry, self.force, self.pause = call, entry, force, pause
        self.sync_timeout, self.timeout, self.say = sync_timeout, timeout, say
        self.reports: list[NodeReport] = []
        self.members: dict[str, list] = {}  # name -> [host, peer port]

    def at(self, name: str):
        return self.members.get(name, name)

    def status(self, avoid: str | None = None, least_mirrors: dict | None = None) -> dict:
        """maintenance_status from a running member (other than `avoid` when one answers)."""
        last = None
        for name in self._observers(avoid):
            try:
                return self.call(self.at(name), "maintenance_status", {"least_mirrors": least_mirrors or {}},
                                 self.timeout)
            except Exception as exc:  # that one is down or stopping: ask the next
                last = exc
        raise RollingError(f"no member answers maintenance_status: {getattr(last, 'text', last)}")

    def _observers(self, avoid):
        known = list(self.members) or [self.entry]
        return [n for n in known if n != avoid] + ([avoid] if avoid in known else [])

    def run(self, nodes: list[str] | None = None) -> list[NodeReport]:
        first = self.call(self.entry, "maintenance_status", {}, self.timeout)
        self.members = dict(first["members"])
        order = nodes or self.members
        unknown = [n for n in order if n not in self.members]
        if unknown:
            raise RollingError(f"not members of the cluster: {', '.join(unknown)} "
                               f"(members: {', '.join(self.members)})")
        for name in order:
            self.reports.append(self.restart_one(name))
        return self.reports

    def restart_one(self, name: str) -> NodeReport:
        st = self.status(avoid=name)
        running = st["running_nodes"]
        if name not in running:
            raise RollingError(f"node {name} is not running (running: {', '.join(running)})")
        if len(running) - 1 < 2:
            raise RollingError(f"stopping {name} would leave fewer than two nodes running "
                               f"(running: {', '.join(running)})")
        critical = self.call(self.at(name), "node_is_mirror_sync_critical", {}, self.timeout)["queues"]
        if critical and not self.force:
            raise RollingError(
                f"node {name} holds the only synchronised replica of {len(critical)} mirrored "
                f"queue(s): {', '.join(critical)}; stopping it would take them down. Synchronise "
                f"them (warrenctl sync_queue) or pass --force")
        if critical:
            self.say(f"--force: stopping {name} although it is sync-critical for {', '.join(critical)}")
        least = {queue_key(q): len(q["mirrors"]) for q in st["queues"] if q["mirrored"]}
        syncs_before = {queue_label(q): q["last_sync"] for q in st["queues"]}
        report = NodeReport(name)
        self.say(f"Restarting node {name} ({len(running)} running) ...")
        started = time.time()
        self.call(self.at(name), "stop_app", {}, self.timeout)
        self.say(f"  {name}: app stopped (controlled shutdown) after {time.time() - started:.2f} s")
        if self.pause:
            time.sleep(self.pause)
        self._start(name)
        up = time.time()
        report.down_s = up - started
        self.say(f"  {name}: app started, down {report.down_s:.2f} s; waiting for the mirrors")
        seen: dict[str, list[float]] = {}
        final = self.wait_synchronised(name, least, seen)
        done = time.time()
        report.synced_after_s, report.window = done - up, (started, done)
        for q in final["queues"]:
            label = queue_label(q)
            last = q["last_sync"]
            if last == syncs_before.get(label) or (last or {}).get("mode") != "blocking":
                last = None
            syncs = blocking_syncs(seen.get(label, []), last)
            if syncs:
                report.blocking_syncs[label] = syncs
                report.queues_blocked.append(label)
                report.blocked_s = max(report.blocked_s, sum(syncs))
        self.say(f"  {name}: every mirrored queue synchronised {report.synced_after_s:.2f} s after "
                 f"its start; longest blocking sync {report.blocked_s:.2f} s "
                 f"({len(report.queues_blocked)} queue(s) blocked)")
        return report

    def _start(self, name: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.call(self.at(name), "start_app", {}, self.timeout)
                return
            except Exception as exc:  # e.g. its stop still finishing
                if time.monotonic() >= deadline:
                    raise RollingError(f"node {name} did not start again: "
                                       f"{getattr(exc, 'text', exc)}") from None
                time.sleep(0.5)

    def wait_synchronised(self, name: str, least: dict, seen: dict) -> dict:
        """Poll until `name` runs again in the cluster's view and no mirrored queue waits;
        `seen` gets, per queue, the longest elapsed time seen of each blocking sync."""
        deadline = time.monotonic() + self.sync_timeout
        printed = 0.0
        while True:
            st = self.status(avoid=name, least_mirrors=least)
            note_blocking_syncs(st, seen)
            waiting = (st["waiting"] if name in st["running_nodes"]
                       else [{"name": None, "why": f"{name} not running yet"}])
            if not waiting:
                return st
            if time.monotonic() - printed >= PRINT_EVERY:
                printed = time.monotonic()
                self.say("  waiting for " + waiting_line(st, waiting))
            if time.monotonic() >= deadline:
                raise RollingError(f"after {self.sync_timeout:g} s (--sync-timeout) still waiting "
                                   f"for {waiting_line(st, waiting)}")
            time.sleep(POLL_SECONDS)


def note_blocking_syncs(st: dict, seen: dict) -> None:
    """Per queue, the elapsed time of each blocking sync seen running: a sync whose elapsed time
    went down since the last look is a new one."""
    for q in st["queues"]:
        sync = q.get("sync")
        if not sync or q["sync_mode"] == "background":
            continue
        spans = seen.setdefault(queue_label(q), [])
        if spans and sync["elapsed"] >= spans[-1]:
            spans[-1] = sync["elapsed"]
        else:
            spans.append(sync["elapsed"])


def blocking_syncs(spans: list[float], last: dict | None) -> list[float]:
    """The seconds of each blocking sync of a queue: those seen running (`spans`), the last one
    with its final figure (`last`, the leader's record of its last blocking sync, when it ended
    during the wait). Their sum is how long the queue was blocked."""
    final = [float(last["elapsed"])] if last else []
    if not spans:
        return final
    return spans[:-1] + [max(spans[-1:] + final)]


def queue_key(q: dict) -> str:
    """The key of a queue of maintenance_status (records.qualify): what the node reads back."""
    return qualify(q["vhost"], q["name"])


def queue_label(q: dict) -> str:
    """A queue of maintenance_status as a report shows it: its name, with its vhost outside /."""
    return shown(queue_key(q))


def waiting_line(st: dict, waiting: list) -> str:
    """What a wait is for: each queue with why, messages left to sync and the sync's rate."""
    by_label = {queue_label(q): q for q in st["queues"]}
    parts = []
    for w in sorted(waiting, key=lambda w: (w.get("vhost", ""), w["name"] or "")):
        why = w["why"]
        if w["name"] is None:
            parts.append(why)
            continue
        qname = queue_label(w)
        q = by_label[qname]
        sync = q.get("sync")
        if sync:
            left = sync["total_messages"] - sync["messages"]
            parts.append(f"{qname} (syncing for {sync['elapsed']:.1f} s: {left:,} of "
                         f"{sync['total_messages']:,} messages left to send, "
                         f"{sync['rate_msgs']:,.0f} msgs/s)")
        else:
            parts.append(f"{qname} ({why}; {q['messages']:,} messages)")
    return f"{len(waiting)} queue(s): " + ", ".join(parts)


def delivery_times(path: str) -> list[float]:
    """The Unix times of a client log: the first field of each line that has a number there."""
    times = []
    with open(path) as f:
        for line in f:
            first = line.split(None, 1)[:1]
            try:
                times.append(float(first[0]))
            except (IndexError, ValueError):
                continue
    return sorted(times)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time without a delivery overlapping [start, end] (`times` sorted)."""
    best = 0.0
    for a, b in zip(times, times[1:]):
        if b >= start and a <= end:
            best = max(best, b - a)
    return best


def report_rows(reports: list[NodeReport], client_log: str | None) -> list[dict]:
    times = delivery_times(client_log) if client_log else None
    rows = []
    for r in reports:
        if times is not None:
            r.longest_gap_s = longest_gap(times, *r.window)
        row = asdict(r)
        row["stopped_at"], row["synced_at"] = row.pop("window")
        rows.append(row)
    return rows


def print_report(rows: list[dict], formatter: str, out=sys.stdout) -> None:
    if formatter == "json":
        print(json.dumps(rows), file=out)
        return
    print("node\tdown_s\tsynced_after_s\tblocked_s\tqueues_blocked\tlongest_gap_s", file=out)
    for r in rows:
        gap = "" if r["longest_gap_s"] is None else f"{r['longest_gap_s']:.2f}"
        print(f"{r['node']}\t{r['down_s']:.2f}\t{r['synced_after_s']:.2f}\t{r['blocked_s']:.2f}\t"
              f"{len(r['queues_blocked'])}\t{gap}", file=out)
