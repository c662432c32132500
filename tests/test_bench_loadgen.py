"""The AMQP load generator end to end through `warren-bench run`: against the null broker (always:
it needs only pamqp), against warren's AMQP port (skipped, with the reason, until warren-server
takes --amqp-port). The null broker is frozen (SIGSTOP) mid-run to show that open-loop latency
is measured from the intended send times."""

import json

import pytest

pytest.importorskip("pamqp")

from bench.runner import Progress, Runner, _percentiles, parse_targets  # noqa: E402
from bench.targets import warren_amqp_support  # noqa: E402


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_target_names_and_aliases():
    assert parse_targets("both") == ["warren-native", "rabbitmq"]
    assert parse_targets("warren,null,warren-native") == ["warren-native", "null"]
    assert parse_targets("all") == ["warren-native", "warren-amqp", "rabbitmq"]
    with pytest.raises(ValueError, match="unknown target 'warren-mqtt'"):
        parse_targets("warren-mqtt")


@pytest.mark.process
@pytest.mark.timeout(120)
def test_open_loop_against_a_frozen_null_broker(tmp_path):
    # 1,000 msgs/s for 2 s with at most 50 unconfirmed; the broker is frozen from 0.6 s to 1.0 s
    workload = tmp_path / "w.yaml"
    workload.write_text("""
defaults: {message_size: 256, drain_timeout: 5}
scenarios:
  - name: stall
    producer_rate: 1000
    duration: 2
    confirm_window: 50
    prefetch: 100
    faults:
      - {at: 0.6, action: sigstop, target: n1}
      - {at: 1.0, action: sigcont, target: n1}
  - {name: multi, producers: 2, consumers: 2, queues: 4, leaders: spread, ack: multiple, duration: 1,
     log: interval, sample_every: 5}
  - {name: idle, idle_connections: 300, idle_seconds: 0.5}
""")
    said = []
    runner = Runner(tmp_path / "results", progress=Progress(enabled=False), say=said.append)
    folder = runner.run([str(workload)], ["null"], run_id="n1")
    d = folder / "stall" / "null"
    sc = json.loads((d / "scenario.json").read_text())
    assert sc["errors"] == [] and sc["target"] == "null"
    pubs = read_jsonl(d / "publish.jsonl")
    assert len(pubs) == 2000  # the schedule owed 2,000 messages: all were sent, none dropped
    t0 = sc["t_start"]
    ints = [p["t_int"] - t0 for p in pubs]
    assert ints == pytest.approx([i / 1000 for i in range(2000)], abs=1e-5)  # fixed before the run
    assert all(p["conf"] == "ack" and p["t_pub"] >= p["t_int"] - 1e-6 for p in pubs)
    faults = {f["action"]: f["t"] - t0 for f in read_jsonl(d / "faults.jsonl")}
    stop, cont = faults["sigstop"], faults["sigcont"]
    assert 0.3 < cont - stop < 0.6
    # the messages meant for the freeze (after the first 50 in flight) were held back by the window
    held = [p for p in pubs if stop + 0.1 < p["t_int"] - t0 < cont - 0.1]
    assert held and all(p["t_conf"] - t0 >= cont - 0.01 for p in held)
    late = [p for p in held if p["t_pub"] - t0 >= cont - 0.01]
    assert len(late) >= len(held) // 2
    # ... so from when they were sent they look fast, from when they were meant to go they are not
    assert min(p["t_conf"] - p["t_int"] for p in late) > 0.09
    assert sorted(p["t_conf"] - p["t_pub"] for p in late)[len(late) // 2] < 0.05
    lat = sc["latency"]
    assert lat["confirm"]["n"] > 1500 and lat["confirm"]["p99_ms"] > 250
    assert lat["send_lag"]["max_ms"] > 250
    # from the actual send (the generator's lag left out), the stall's messages look fast
    inside = [p for p in pubs if p["t_int"] >= sc["t_measure"] and p["conf"] == "ack"]
    assert lat["confirm_sent"] == _percentiles([(p["t_conf"] - p["t_pub"]) * 1000 for p in inside])
    assert lat["confirm_sent"]["p50_ms"] < lat["confirm"]["p50_ms"]
    dels = read_jsonl(d / "deliver.jsonl")
    assert sorted(x["id"] for x in dels) == sorted(p["id"] for p in pubs)

    m = folder / "multi" / "null"
    msc = json.loads((m / "scenario.json").read_text())
    assert msc["errors"] == []
    pubs = read_jsonl(m / "publish.jsonl")
    assert {(p["p"], p["q"]) for p in pubs} == {(0, "bench.multi.0"), (0, "bench.multi.2"),
                                               (1, "bench.multi.1"), (1, "bench.multi.3")}
    assert all("t_int" not in p for p in pubs)  # closed loop: no intended times
    total = sum(i["n"] for i in read_jsonl(m / "intervals.jsonl") if i["role"] == "deliver")
    published = sum(i["n"] for i in read_jsonl(m / "intervals.jsonl") if i["role"] == "publish")
    assert total == published > 1000

    idle = json.loads((folder / "idle" / "null" / "scenario.json").read_text())["idle"]
    assert idle["opened"] == idle["alive_at_end"] == 300 and idle["rss_held_mib"] > 0
    assert any("idle:" in line and "300 of 300" in line for line in said)


@pytest.mark.process
@pytest.mark.timeout(180)
@pytest.mark.skipif(warren_amqp_support() is not None, reason=str(warren_amqp_support()))
def test_warren_amqp_port_smoke(tmp_path):
    workload = tmp_path / "w.yaml"
    workload.write_text("name: amqp-smoke\nmessage_size: 128\nproducer_rate: 1000\nduration: 1\n"
                        "prefetch: 100\ndrain_timeout: 5\n")
    runner = Runner(tmp_path / "results", progress=Progress(enabled=False), say=lambda s: None)
    folder = runner.run([str(workload)], ["warren-amqp"], run_id="wa")
    d = folder / "amqp-smoke" / "warren-amqp"
    sc = json.loads((d / "scenario.json").read_text())
    assert sc["errors"] == [] and sc["nodes"] == ["n1", "n2", "n3"]
    pubs = read_jsonl(d / "publish.jsonl")
    assert len(pubs) == 1000 and all(p["conf"] == "ack" for p in pubs)
    assert sorted(x["id"] for x in read_jsonl(d / "deliver.jsonl")) == sorted(p["id"] for p in pubs)


@pytest.mark.timeout(120)
def test_run_scenario_picks_scenarios_by_name(tmp_path, capsys):
    """`warren-bench run FILE --scenario NAME`: only the named scenario runs; a name the files do
    not define stops the run before anything starts, naming the ones they do."""
    from bench.cli import main
    workload = tmp_path / "w.yaml"
    workload.write_text("""
defaults: {message_size: 64, duration: 0.5, producer_rate: 200, drain_timeout: 5}
scenarios: [{name: first}, {name: second}]
""")
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(workload), "--target", "null", "--scenario", "second,third", "--out", str(out)])
    assert exit_.value.code == 2
    assert "--scenario: no scenario named third in these workloads (they define: first, second)" \
        in capsys.readouterr().err
    assert not out.exists()

    with pytest.raises(SystemExit) as exit_:
        main(["run", str(workload), "--target", "null", "--scenario", "second", "--out", str(out),
              "--run-id", "s1", "--quiet"])
    assert exit_.value.code == 0
    assert sorted(p.name for p in (out / "s1").iterdir() if p.is_dir()) == ["second"]
    pubs = read_jsonl(out / "s1" / "second" / "null" / "publish.jsonl")
    assert len(pubs) == 100  # 200 msgs/s for 0.5 s
