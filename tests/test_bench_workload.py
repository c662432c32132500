"""The workload schema: shipped suites load, and every error names the file and the bad field."""

import pytest

from bench.workload import WORKLOAD_DIR, WorkloadError, load, parse, select


def error_of(data, origin="workloads/x.yaml") -> str:
    with pytest.raises(WorkloadError) as info:
        parse(data, origin)
    return str(info.value)


def test_negative_producers_named_with_file_and_index():
    data = {"scenarios": [{"name": "a"}, {"name": "b"}, {"name": "c", "producers": -1}]}
    assert error_of(data) == "workloads/x.yaml: scenarios[2].producers: must be a positive integer, got -1"


@pytest.mark.parametrize("field, value, expect", [
    ("message_size", 4, "scenarios[0].message_size: must be"),
    ("message_size", "1 GB", "scenarios[0].message_size: must be a size"),
    ("ack", "sometimes", "scenarios[0].ack: must be one of manual, multiple, auto, got 'sometimes'"),
    ("confirms", "yes", "scenarios[0].confirms: must be true or false"),
    ("producer_rate", -5, "scenarios[0].producer_rate: must be a number >= 0"),
    ("policy", {"ha-params": 2}, "scenarios[0].policy: needs an 'ha-mode' key"),
    ("log", "verbose", "scenarios[0].log: must be one of per-message, interval"),
    ("faults", [{"at": 5, "action": "explode"}], "scenarios[0].faults[0].action: must be one of kill,"),
    ("faults", [{"at": -1, "action": "kill"}], "scenarios[0].faults[0].at: must be a number >= 0"),
    ("faults", [{"at": 1, "action": "kill", "when": 2}], "scenarios[0].faults[0].when: unknown key"),
    ("faults", [{"at": 1, "action": "kill", "queue": 3}], "scenarios[0].faults[0].queue: index 3"),
])
def test_field_errors(field, value, expect):
    msg = error_of({"scenarios": [{"name": "s", field: value}]})
    assert msg.startswith("workloads/x.yaml: "), msg
    assert expect in msg, msg


def test_unknown_field_suggests_the_near_one():
    msg = error_of({"scenarios": [{"name": "s", "prefech": 10}]})
    assert "scenarios[0].prefech: unknown field (did you mean 'prefetch'?)" in msg


def test_matrix_errors_name_the_axis_entry():
    msg = error_of({"matrix": {"name": "m-{message_size}", "message_size": [128, 2]}})
    assert "matrix.message_size[1]: must be" in msg
    msg = error_of({"matrix": {"name": "m-{nope}", "message_size": [128]}})
    assert "matrix.name: template refers to 'nope'" in msg


def test_defaults_errors_and_duplicate_names():
    assert "defaults.queues: must be a positive integer, got 0" in error_of(
        {"defaults": {"queues": 0}, "scenarios": [{"name": "a"}]})
    assert "two scenarios have this name" in error_of({"scenarios": [{"name": "a"}, {"name": "a"}]})


def test_matrix_expands_and_replicas_become_a_policy():
    scs = parse({"defaults": {"duration": 2},
                 "matrix": {"name": "t-r{replicas}-{message_size}", "replicas": [1, 3],
                            "message_size": [128, "1 KiB"]}}, "m.yaml")
    assert [s.name for s in scs] == ["t-r1-128", "t-r1-1024", "t-r3-128", "t-r3-1024"]
    assert scs[0].effective_policy is None
    assert scs[3].effective_policy == {"ha-mode": "exactly", "ha-params": 3, "ha-sync-mode": "automatic"}
    assert scs[3].message_size == 1024 and scs[3].duration == 2.0


def test_single_scenario_at_top_level_and_faults_sorted():
    [s] = parse({"name": "one", "faults": [{"at": 9, "action": "sigcont"}, {"at": 3, "action": "sigstop"}]})
    assert [f["action"] for f in s.faults] == ["sigstop", "sigcont"]
    assert s.faults[0]["target"] == "leader" and s.faults[0]["queue"] == 0


def test_bad_yaml_names_the_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("scenarios: [\n")
    with pytest.raises(WorkloadError, match="broken.yaml: not valid YAML"):
        load(p)


@pytest.mark.parametrize("path", sorted(WORKLOAD_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_workloads_load(path):
    assert load(path)


def test_chaos_field_defaults_checks_and_the_shipped_suite():
    [sc] = parse({"name": "c", "chaos": {"schedules": 3, "kinds": ["kill", "pause"], "faults": "2-3"}})
    assert sc.chaos == {"schedules": 3, "seed": 1, "kinds": ["kill", "pause"], "faults": [2, 3],
                        "scale": 1.0, "net_ticktime": 3.0, "rate": None}
    assert "chaos.kinds: must be fault kinds" in error_of({"name": "c", "chaos": {"kinds": ["meteor"]}})
    assert "chaos: unknown key 'when'" in error_of({"name": "c", "chaos": {"when": 1}})
    assert "chaos.faults: must be N or MIN-MAX" in error_of({"name": "c", "chaos": {"faults": "3-1"}})
    [shipped] = load(WORKLOAD_DIR / "chaos.yaml")
    assert shipped.chaos["schedules"] == 10 and shipped.chaos["seed"] == 1


def test_select_keeps_the_files_order_and_rejects_unknown_names():
    scenarios = parse({"defaults": {"duration": 1},
                       "scenarios": [{"name": "a"}, {"name": "b"}, {"name": "c"}]})
    assert [s.name for s in select(scenarios, ["c", "a"])] == ["a", "c"]
    assert select(scenarios, None) == scenarios
    with pytest.raises(WorkloadError, match=r"no scenario named x, y in these workloads \(they define: a, b, c\)"):
        select(scenarios, ["a", "x", "y"])


def test_declare_field_parses_and_the_shipped_suite():
    [sc] = parse({"name": "d", "declare_queues": 40})
    assert sc.declaring and not sc.idle and sc.declare_queues == 40
    assert sc.declare_names()[:2] == ["bench.d.0", "bench.d.1"] and len(sc.declare_names()) == 40
    [plain] = parse({"name": "p"})
    assert plain.declare_queues == 0 and not plain.declaring
    assert "scenarios[0].declare_queues: must be an integer >= 0, got -3" in error_of(
        {"scenarios": [{"name": "d", "declare_queues": -3}]})
    assert [(s.name, s.declare_queues) for s in load(WORKLOAD_DIR / "declare.yaml")] == [
        ("declare-250", 250), ("declare-1000", 1000)]


def test_rpc_field_parses_and_the_shipped_suite():
    from bench.rpc_clients import PER_PROC
    from bench.runner import connections_per_proc

    [sc] = parse({"name": "r", "rpc_clients": 40, "procs": 2})
    assert sc.rpc and not sc.declaring and not sc.idle and (sc.rpc_clients, sc.procs) == (40, 2)
    [plain] = parse({"name": "p"})
    assert plain.rpc_clients == 0 and not plain.rpc
    assert "scenarios[0].rpc_clients: must be an integer >= 0, got -1" in error_of(
        {"scenarios": [{"name": "r", "rpc_clients": -1}]})
    assert [(s.name, s.rpc_clients, s.procs) for s in load(WORKLOAD_DIR / "rpc.yaml")] == [
        ("rpc-1000", 1000, None), ("rpc-3000", 3000, None)]
    # no procs: as few processes as keep each at PER_PROC (500) clients or fewer
    assert connections_per_proc(3000, None, PER_PROC) == [500] * 6
    assert connections_per_proc(1001, None, PER_PROC) == [334, 334, 333]
    assert connections_per_proc(40, 2, PER_PROC) == [20, 20] and connections_per_proc(3, 5, PER_PROC) == [1, 1, 1]


# {a}: the kind's article and name, {field}: the field that makes the kind
@pytest.mark.parametrize("kind_field, a", [("declare_queues", "a declare"), ("rpc_clients", "an rpc")])
@pytest.mark.parametrize("extra, expect", [
    ({"faults": [{"at": 1, "action": "kill"}]}, "scenarios[0].faults: {a} scenario takes no faults"),
    ({"producers": 2}, "scenarios[0].producers: {a} scenario runs no producers or consumers "
                       "({field} is its only load); drop producers"),
    ({"consumers": 0}, "scenarios[0].consumers: {a} scenario runs no producers or consumers"),
    ({"queues": 10}, "scenarios[0].queues: {a} scenario runs no producers or consumers"),
    ({"producer_rate": 100}, "scenarios[0].producer_rate: {a} scenario runs no producers"),
    ({"messages": 100}, "scenarios[0].messages: {a} scenario runs no producers"),
    ({"idle_connections": 5}, "scenarios[0].idle_connections: a scenario is an idle-connection one or "
                              "{a} one, not both"),
    ({"replicas": 3}, "scenarios[0].replicas: {a} scenario sets no policy"),
    ({"policy": {"ha-mode": "all"}}, "scenarios[0].policy: {a} scenario sets no policy"),
    ({"durable": True}, "scenarios[0].durable: {a} scenario declares non-durable queues"),
    ({"chaos": {"schedules": 1}}, "scenarios[0].chaos: {a} scenario is not a chaos campaign"),
])
def test_declare_and_rpc_scenarios_refuse_load_faults_and_policy(kind_field, a, extra, expect):
    msg = error_of({"scenarios": [{"name": "d", kind_field: 10, **extra}]})
    assert msg.startswith("workloads/x.yaml: "), msg
    assert expect.format(a=a, field=kind_field) in msg, msg


def test_a_scenario_is_a_declare_or_an_rpc_one_not_both():
    msg = error_of({"scenarios": [{"name": "r", "rpc_clients": 10, "declare_queues": 5}]})
    assert msg == ("workloads/x.yaml: scenarios[0].declare_queues: a scenario is a declare one or an rpc "
                   "one, not both")
    msg = error_of({"defaults": {"declare_queues": 5}, "scenarios": [{"name": "r", "rpc_clients": 10}]})
    assert "scenarios[0].declare_queues: a scenario is a declare one or an rpc one, not both" in msg
    [ok] = parse({"name": "r", "rpc_clients": 10, "procs": 3})  # procs spreads the clients
    assert ok.procs == 3


def test_declare_and_rpc_scenarios_refuse_load_fields_from_the_defaults_too():
    msg = error_of({"defaults": {"producers": 3}, "scenarios": [{"name": "d", "declare_queues": 10}]})
    assert "scenarios[0].producers: a declare scenario runs no producers or consumers" in msg
    msg = error_of({"defaults": {"consumers": 3}, "scenarios": [{"name": "r", "rpc_clients": 10}]})
    assert "scenarios[0].consumers: an rpc scenario runs no producers or consumers (rpc_clients is" in msg
