"""`warren-bench run` against a real local 3-node warren cluster writes the logs of bench/LOGS.md."""

import json
import math

import pytest

from bench.records import CONF_ACK, CONF_NONE, DeliverRecord, PublishRecord, make_id
from bench.runner import Progress, Runner

PUBLISH_KEYS = {"id": int, "p": int, "q": str, "size": int, "t_pub": float}
DELIVER_KEYS = {"id": int, "c": int, "q": str, "t_del": float, "red": bool, "node": str}
ACTIONS = {"kill", "sigstop", "sigcont", "stop_app", "start_app", "restart", "add_node", "sync_queue",
           "sync_progress", "sync_done"}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_types(row, keys):
    for k, t in keys.items():
        assert isinstance(row[k], t), (k, row)


def test_sampled_lines_match_between_publish_and_deliver():
    pub = PublishRecord(1, ["q0"], 16)
    for s in range(10):
        pub.t_pub.append(100.0 + s)
        pub.q.append(0)
    pub.confirm(0, 4, CONF_ACK, 200.0)
    pub.confirm(5, 5, CONF_NONE, 201.0)  # connection lost: resolved, but no confirm came
    dl = DeliverRecord(0, ["q0"])
    for s in reversed(range(10)):
        dl.ids.append(make_id(1, s))
        dl.t_del.append(300.0)
        dl.q.append(0)
        dl.red.append(False)
        dl.node.append(dl.node_index("n1"))
    pubs = [json.loads(x) for x in pub.lines(3)]
    dels = [json.loads(x) for x in dl.lines(3)]
    assert [p["id"] for p in pubs] == [make_id(1, s) for s in (0, 3, 6, 9)]
    assert sorted(d["id"] for d in dels) == [p["id"] for p in pubs]
    assert pubs[0]["conf"] == "ack" and pubs[0]["t_conf"] == 200.0
    assert pubs[2]["conf"] is None and pubs[2]["t_conf"] is None
    assert pub.confirm(9, 12, CONF_ACK, 202.0) == 1 and pub.unknown == 3  # 10..12 never published
    full = [json.loads(x) for x in pub.lines(1)]
    assert full[5]["conf"] is None and full[5]["t_conf"] is None and full[4]["conf"] == "ack"


@pytest.mark.process
def test_runner_writes_well_formed_logs(tmp_path):
    workload = tmp_path / "tiny.yaml"
    workload.write_text("""
defaults: {message_size: 64, confirms: true, confirm_window: 200, prefetch: 100, drain: true,
           drain_timeout: 5}
scenarios:
  - name: tiny
    producers: 2
    consumers: 2
    queues: 2
    producer_rate: 1500
    duration: 1.5
    faults:
      - {at: 0.5, action: sigstop, target: leader, queue: 1}
      - {at: 0.8, action: sigcont, target: leader, queue: 1}
  - name: tiny-sampled
    producer_rate: 1000
    duration: 1
    log: interval
    sample_every: 10
    ack: auto
  - {name: tiny-idle, idle_connections: 40, idle_node: 1, idle_seconds: 0.3}
""")
    said = []
    runner = Runner(tmp_path / "results", progress=Progress(enabled=False), say=said.append)
    folder = runner.run([str(workload)], ["warren"], run_id="r1")  # "warren" is warren-native
    assert folder == tmp_path / "results" / "r1"

    run = json.loads((folder / "run.json").read_text())
    for key in ("run_id", "started_at", "finished_at", "git_commit", "python", "warren_version",
                "rabbitmq_version", "machine", "workloads", "targets"):
        assert key in run, key
    assert run["run_id"] == "r1" and run["targets"] == ["warren-native"]
    assert run["finished_at"] >= run["started_at"]
    assert set(run["machine"]) >= {"cpus", "mem_gib", "platform"}

    d = folder / "tiny" / "warren-native"
    sc = json.loads((d / "scenario.json").read_text())
    assert sc["scenario"] == "tiny" and sc["target"] == "warren-native" and sc["sampled"] is False
    assert sc["nodes"] == ["n1", "n2", "n3"] and sc["t_end"] > sc["t_start"]
    assert sc["workload"]["producer_rate"] == 1500 and sc["errors"] == []
    from bench.targets import proc_runq
    if proc_runq() is not None:  # the kernel keeps per-task schedstat: the wait for a CPU is told
        assert sorted(sc["node_runq"]) == ["n1", "n2", "n3"]
        assert all(wait >= 0 and slices > 0 for wait, slices in sc["node_runq"].values())
        assert all(u["runq"][1] > 0 for u in sc["generator"])
        line = next(x for x in said if "] tiny:" in x)
        assert "waiting for a CPU" in line and "us per time slice" in line, line

    pubs = read_jsonl(d / "publish.jsonl")
    dels = read_jsonl(d / "deliver.jsonl")
    for p in pubs:
        check_types(p, PUBLISH_KEYS)
        assert p["size"] == 64 and p["q"] == f"bench.tiny.{p['p']}"  # producer p: queue p
        assert isinstance(p["t_int"], float) and p["t_pub"] >= p["t_int"] - 1e-6  # open loop
        assert p["conf"] == "ack" and isinstance(p["t_conf"], float) and p["t_conf"] >= p["t_pub"]
    for x in dels:
        check_types(x, DELIVER_KEYS)
        assert x["node"] in ("n1", "n2", "n3")
    ids = [p["id"] for p in pubs]
    assert len(ids) == len(set(ids))
    assert {p["id"] >> 40 for p in pubs} == {0, 1}  # ids carry the producer index
    assert len(pubs) == 2250  # 1500 msgs/s for 1.5 s: exactly what the schedule owed
    assert sorted(x["id"] for x in dels) == sorted(ids)  # drained: every id delivered once

    intervals = read_jsonl(d / "intervals.jsonl")
    assert {i["role"] for i in intervals} == {"publish", "confirm", "deliver"}
    assert sum(i["n"] for i in intervals if i["role"] == "publish") == len(pubs)
    assert all(i["bytes"] == i["n"] * 64 and i["t"] == math.floor(i["t"]) for i in intervals)

    faults = read_jsonl(d / "faults.jsonl")
    assert [f["action"] for f in faults] == ["sigstop", "sigcont"]
    assert all(f["action"] in ACTIONS and f["queue"] == "bench.tiny.1" for f in faults)
    assert faults[0]["node"] == faults[1]["node"] in ("n1", "n2", "n3")
    assert faults[0]["t"] < faults[1]["t"]

    d2 = folder / "tiny-sampled" / "warren-native"
    sc2 = json.loads((d2 / "scenario.json").read_text())
    assert sc2["sampled"] is True
    pubs2 = read_jsonl(d2 / "publish.jsonl")
    total = sum(i["n"] for i in read_jsonl(d2 / "intervals.jsonl") if i["role"] == "publish")
    assert total >= 900 and len(pubs2) == math.ceil(total / 10)
    assert sorted(x["id"] for x in read_jsonl(d2 / "deliver.jsonl")) == sorted(p["id"] for p in pubs2)
    assert any("tiny:" in line for line in said)

    idle = json.loads((folder / "tiny-idle" / "warren-native" / "scenario.json").read_text())
    assert idle["idle"]["opened"] == 40 and idle["idle"]["node"] == "n2" and idle["errors"] == []
    assert idle["idle"]["rss_held_mib"] > 0


def _skip_unless_amqp(target: str) -> None:
    if target == "warren-amqp":
        pytest.importorskip("pamqp")
        from bench.targets import warren_amqp_support
        if warren_amqp_support() is not None:
            pytest.skip(str(warren_amqp_support()))


class ListsQueuesBeforeStop(Runner):
    """A runner that reads, with warrenctl, the queues each target's cluster lists just before
    it stops it: `listed[target name]`."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.listed: dict[str, list[str]] = {}

    def make_target(self, *args):
        tg = super().make_target(*args)
        stop = tg.stop

        def list_then_stop():
            out = tg.ctl(tg.nodes[0], "list_queues", "name", "--formatter", "json")
            self.listed[tg.name] = [r["name"] for r in json.loads(out)]
            stop()
        tg.stop = list_then_stop
        return tg


def _run_one(tmp_path, target: str, name: str, fields: str):
    """Run the one scenario `{name: NAME, FIELDS}` on `target` with a ListsQueuesBeforeStop
    runner; returns its scenario.json, its folder, the runner and what it said."""
    _skip_unless_amqp(target)
    workload = tmp_path / f"{name}.yaml"
    workload.write_text(f"scenarios:\n  - {{name: {name}, {fields}}}\n")
    said = []
    runner = ListsQueuesBeforeStop(tmp_path / "results", progress=Progress(enabled=False), say=said.append)
    sdir = runner.run([str(workload)], [target], run_id=name) / name / target
    return json.loads((sdir / "scenario.json").read_text()), sdir, runner, said


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["warren-native", "warren-amqp"])
def test_declare_scenario_declares_then_deletes_every_queue(tmp_path, target):
    """A declare scenario on a real 3-node cluster: 30 queues, 10 through each node's connection,
    all declared, then all deleted; what the cluster lists afterwards is read with warrenctl
    before the runner stops it."""
    sc, _, runner, said = _run_one(tmp_path, target, "tiny-declare", "declare_queues: 30")
    listed = runner.listed
    d = sc["declare"]
    assert sc["errors"] == [] and d["errors"] == 0
    assert (d["queues"], d["connections"], d["declared"], d["deleted"], d["left_after"]) == (30, 3, 30, 30, 0)
    assert [(c["node"], c["declared"], c["deleted"]) for c in d["per_connection"]] == [
        ("n1", 10, 10), ("n2", 10, 10), ("n3", 10, 10)]
    for phase, rate in (("declare", "declares_per_s"), ("delete", "deletes_per_s")):
        assert d[f"{phase}_s"] > 0 and d[rate] > 0
        assert 0 < d[f"{phase}_p50_ms"] <= d[f"{phase}_p99_ms"] <= d[f"{phase}_max_ms"]
        # ten calls one after another on each connection: the phase outlasts ten medians' worth
        assert d[f"{phase}_s"] * 1000 >= 10 * d[f"{phase}_p50_ms"] * 0.5
    assert sc["t_start"] < d["t_declare_first"] < d["t_declare_last"] <= d["t_delete_first"] < d["t_delete_last"]
    assert not any(q.startswith("bench.tiny-declare.") for q in listed[target])
    assert [s["declare"]["declared"] for s in runner.summaries] == [30]
    assert any(f"[{target}] tiny-declare: 30 queues through 3 connections: declared 30 in" in line
               and "0 error(s), 0 left after" in line for line in said), said
    assert not any("cleanup" in line for line in said)


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["warren-native", "warren-amqp"])
def test_rpc_scenario_holds_one_exclusive_queue_per_client_until_they_close(tmp_path, target):
    """An rpc scenario on a real 3-node cluster: 40 clients over 2 processes, each holding an
    exclusive queue the broker named; all 40 listed while held, none once they closed. What the
    cluster lists after the run is read with warrenctl before the runner stops it."""
    sc, sdir, runner, said = _run_one(tmp_path, target, "tiny-rpc", "rpc_clients: 40, procs: 2")
    listed = runner.listed
    r = sc["rpc"]
    assert sc["errors"] == [] and r["errors"] == 0 and r["failed"] == 0
    assert (r["clients"], r["procs"], r["per_proc"], r["at_once"], r["opened"]) == (40, 2, [20, 20], 64, 40)
    # every client's queue was listed while held, and none was left once they closed
    assert (r["queues_listed_held"], r["names_listed_held"], r["server_named_before"]) == (40, 40, 0)
    assert r["left_after"] == 0 and r["gone_s"] > 0 and r["listings"] >= 1
    assert r["still_listed_s"] is None or 0 <= r["still_listed_s"] < r["gone_s"]
    assert 0 <= r["closed_s"] <= r["gone_s"]
    assert 0 < r["held_s"] and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    # one client's wait lies inside the whole (held_s is rounded to the ms)
    assert r["max_ms"] <= r["held_s"] * 1000 + 0.5
    assert (sc["t_start"] < r["t_start"] <= r["t_first_connect"] < r["t_last_declare_ok"] <= r["t_all_held"]
            <= r["t_close"] < sc["t_end"])
    assert set(r["node_cpu_s"]) == {"n1", "n2", "n3"} and r["node_cpu_total_s"] > 0
    usage = sorted((u["role"], u["part"]) for u in sc["generator"])
    assert usage == [("rpc", 0), ("rpc", 1)]
    assert not any(q.startswith("amq.gen-") for q in listed[target])
    assert not list(sdir.glob("rpc.names.*"))
    assert [s["rpc"]["opened"] for s in runner.summaries] == [40]
    assert any(f"[{target}] tiny-rpc: 40 of 40 clients (2 processes) held an exclusive queue after" in line
               and "40 listed; none listed " in line and " s after the close order; 0 error(s)" in line
               for line in said), said
