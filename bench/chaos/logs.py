"""The files of one chaos schedule in the bench/LOGS.md layout, and reading them back.

This module owns the chaos folder `RUN_ID/chaos-SEED/warren/`: the standard `scenario.json`,
`publish.jsonl`, `deliver.jsonl`, `intervals.jsonl` and `faults.jsonl` (so the Spark job's usual
measures work on it), plus `history.json` (what the checker needs beyond the message lines:
subscriptions, phases, disconnects, faults with their allowances, anomalies, and the node log
events it reads) and `verdict.json`
(the checker's verdict, the schedule and the command that replays it). `load_history` rebuilds
the checker's History from those files, so a verdict can be recomputed offline.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .checker import (BrokerEvent, Delivery, Disconnect, Fault, History, Phase, Publish, Subscription,
                      Verdict)

BLOCK = 20_000


def _num(x) -> str:
    return "null" if x is None else repr(round(x, 6))


def _write_lines(path: Path, lines) -> None:
    with open(path, "w", encoding="utf-8") as f:
        block = []
        for line in lines:
            block.append(line)
            if len(block) >= BLOCK:
                f.write("".join(block))
                block.clear()
        f.write("".join(block))


def _publish_lines(h: History, size: int):
    for p in h.publishes:
        # LOGS.md: a publish the client gave up on with its connection has conf null
        conf = p.outcome if not (p.outcome == "nack" and p.reason == "connection lost") else None
        yield (f'{{"id":{p.id},"p":{p.publisher},"q":{json.dumps(p.queue)},"size":{size},'
               f'"t_pub":{_num(p.t_pub)},"t_conf":{_num(p.t_conf) if conf else "null"},'
               f'"conf":{json.dumps(conf)},"node":{json.dumps(p.node)},'
               f'"reason":{json.dumps(p.reason) if p.reason else "null"}'
               f'{"" if p.priority is None else f",{chr(34)}prio{chr(34)}:{p.priority}"}}}\n')


def _deliver_lines(h: History):
    for d in h.deliveries:
        yield (f'{{"id":{d.id},"c":{d.consumer},"q":{json.dumps(d.queue)},"t_del":{_num(d.t)},'
               f'"red":{"true" if d.redelivered else "false"},"node":{json.dumps(d.node)}}}\n')


def _intervals(h: History, size: int) -> list[str]:
    counts: dict[tuple[float, str], int] = {}
    for p in h.publishes:
        k = (float(int(p.t_pub)), "publish")
        counts[k] = counts.get(k, 0) + 1
        if p.outcome == "ack" and p.t_conf is not None:
            k = (float(int(p.t_conf)), "confirm")
            counts[k] = counts.get(k, 0) + 1
    for d in h.deliveries:
        k = (float(int(d.t)), "deliver")
        counts[k] = counts.get(k, 0) + 1
    return [json.dumps({"t": t, "role": role, "n": n, "bytes": n * size}) + "\n"
            for (t, role), n in sorted(counts.items())]


def write(folder: Path, *, run_id: str, scenario: str, schedule: dict, history: History,
          verdict: Verdict, t_start: float, t_end: float, nodes: list[str], replay: str,
          extra: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    size = int(schedule.get("message_size", 256))
    _write_lines(folder / "publish.jsonl", _publish_lines(history, size))
    _write_lines(folder / "deliver.jsonl", _deliver_lines(history))
    _write_lines(folder / "intervals.jsonl", _intervals(history, size))
    faults = []
    for f in history.faults:
        detail = dict(f.detail)
        detail.update(t_end=f.t_end, loss_allowed=f.loss_allowed)
        faults.append(json.dumps({"t": f.t, "action": f.kind, "node": f.target,
                                  "queue": schedule.get("queue"), "detail": detail}, default=str) + "\n")
    _write_lines(folder / "faults.jsonl", faults)
    side = {"subscriptions": [asdict(s) for s in history.subscriptions],
            "phases": [asdict(p) for p in history.phases],
            "disconnects": [asdict(d) for d in history.disconnects],
            "faults": [asdict(f) for f in history.faults],
            "anomalies": list(history.anomalies), "meta": history.meta,
            "broker_events": [asdict(e) for e in history.broker_events]}
    (folder / "history.json").write_text(json.dumps(side, indent=1, default=str) + "\n")
    workload = {"name": scenario, "message_size": size, "producers": len(schedule.get("publishers", [])),
                "consumers": len(schedule.get("consumers", [])), "queues": 1,
                "producer_rate": schedule.get("rate"), "drain": True, "log": "per-message",
                "sample_every": 1, "prefetch": schedule.get("prefetch"),
                "confirm_window": schedule.get("confirm_window"), "chaos": schedule}
    info = {"run_id": run_id, "scenario": scenario, "target": "warren", "workload": workload,
            "t_start": t_start, "t_end": t_end, "nodes": nodes, "sampled": False,
            "t_measure": t_start, "t_publish_end": history.phase("publish_end"),
            "policy": schedule.get("policy"), "chaos": {"seed": schedule.get("seed"), "replay": replay},
            **(extra or {})}
    (folder / "scenario.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    kinds = [a["kind"] for a in schedule.get("actions", [])]
    body = {"seed": schedule.get("seed"), "kinds": kinds, "replay": replay, "schedule": schedule,
            **verdict.as_dict()}
    (folder / "verdict.json").write_text(json.dumps(body, indent=1, default=str) + "\n")


def load_history(folder: Path) -> History:
    """The History of a chaos folder written by `write`."""
    folder = Path(folder)
    side = json.loads((folder / "history.json").read_text())
    h = History(subscriptions=[Subscription(**s) for s in side["subscriptions"]],
                phases=[Phase(**p) for p in side["phases"]],
                disconnects=[Disconnect(**d) for d in side["disconnects"]],
                faults=[Fault(**f) for f in side["faults"]], anomalies=list(side["anomalies"]),
                meta=dict(side.get("meta") or {}),
                broker_events=[BrokerEvent(**e) for e in side.get("broker_events", ())])
    with open(folder / "publish.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            reason = d.get("reason") or ""
            outcome = d["conf"] if d["conf"] is not None else ("nack" if reason else None)
            h.publishes.append(Publish(d["id"], d["p"], d.get("node"), d["t_pub"], outcome,
                                       d["t_conf"], reason, d["q"], d.get("prio")))
    with open(folder / "deliver.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            h.deliveries.append(Delivery(d["id"], d["c"], d.get("node"), d["t_del"], d["red"], d["q"]))
    return h
