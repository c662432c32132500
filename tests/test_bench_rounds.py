"""`warren-bench run --repeat N` (bench/rounds.py): rounds of the same run side by side, with each
warren target's confirm p99 over RabbitMQ's per round and the medians."""

from __future__ import annotations

import json

import pytest

from bench.rounds import format_table, latency_table


def _summary(target, scenario, p50, p99, dp99):
    return {"target": target, "scenario": scenario,
            "latency": {"confirm": {"p50_ms": p50, "p99_ms": p99},
                        "delivery": {"p99_ms": dp99}}}


def test_rounds_give_each_rounds_ratio_to_rabbitmq_and_the_medians():
    rounds = [
        [_summary("warren-native", "lat", 0.8, 2.0, 1.5), _summary("rabbitmq", "lat", 1.0, 4.0, 3.0),
         {"target": "warren-native", "scenario": "decl", "declare": {"queues": 10}}],
        [_summary("warren-native", "lat", 0.9, 3.0, 1.6), _summary("rabbitmq", "lat", 1.1, 4.0, 2.0)],
        [_summary("warren-native", "lat", 0.7, 1.0, 1.1)],  # rabbitmq did not run this round
    ]
    table = latency_table(rounds)
    assert list(table) == ["lat"]  # a scenario without latency figures is left out
    sc = table["lat"]
    assert sc["targets"] == ["warren-native", "rabbitmq"]
    assert sc["ratios"] == {"warren-native": [0.5, 0.75]}  # no ratio for the third round
    assert sc["rounds"][0]["warren-native"] == {"confirm_p50": 0.8, "confirm_p99": 2.0,
                                                "delivery_p99": 1.5, "ratio": 0.5}
    assert "ratio" not in sc["rounds"][2]["warren-native"]
    assert sc["medians"]["warren-native"] == {"confirm_p99": 2.0, "ratio": 0.625}
    assert sc["medians"]["rabbitmq"] == {"confirm_p99": 4.0}
    lines = format_table(table)
    assert lines[0] == "lat: confirm p50 / p99, delivery p99 (ms), per round"
    assert lines[1] == ("  round 1: warren-native 0.80 / 2.00, 1.50; rabbitmq 1.00 / 4.00, 3.00"
                        "  | confirm p99 over rabbitmq's: warren-native 0.50")
    assert lines[3] == "  round 3: warren-native 0.70 / 1.00, 1.10; rabbitmq -"
    assert lines[4] == ("  median: warren-native confirm p99 2.00 (ratio 0.62; 1 of 2 rounds at 0.5 "
                        "or below); rabbitmq confirm p99 4.00")


def test_rounds_without_rabbitmq_have_no_ratio():
    table = latency_table([[_summary("warren-native", "lat", 0.5, 1.0, 0.9)],
                           [_summary("warren-native", "lat", 0.5, 3.0, 0.9)]])
    assert table["lat"]["ratios"] == {}
    assert table["lat"]["medians"] == {"warren-native": {"confirm_p99": 2.0}}


@pytest.mark.timeout(120)
def test_run_repeat_runs_each_round_in_its_own_folder_and_compares_them(tmp_path, capsys):
    from bench.cli import main
    workload = tmp_path / "w.yaml"
    workload.write_text("""
defaults: {message_size: 64, duration: 0.5, producer_rate: 200, drain_timeout: 5}
scenarios: [{name: tiny}]
""")
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(workload), "--target", "null", "--repeat", "0", "--out", str(out)])
    assert exit_.value.code == 2
    assert "--repeat: at least 1" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_:
        main(["run", str(workload), "--target", "null", "--repeat", "2", "--out", str(out),
              "--run-id", "base", "--quiet"])
    assert exit_.value.code == 0
    said = capsys.readouterr().out
    for k in (1, 2):
        run = json.loads((out / f"base-r{k}" / "run.json").read_text())
        assert run["run_id"] == f"base-r{k}" and run["summaries"][0]["scenario"] == "tiny"
        assert f"  round {k}: null " in said
    table = json.loads((out / "base-rounds.json").read_text())
    assert [sorted(r) for r in table["tiny"]["rounds"]] == [["null"], ["null"]]
    assert all(r["null"]["confirm_p99"] > 0 for r in table["tiny"]["rounds"])
    assert "  median: null confirm p99 " in said
