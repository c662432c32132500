"""The RabbitMQ target on a tiny workload through the AMQP generator (only where rabbitmq-server
and pamqp are installed).

Starting a 3-node RabbitMQ cluster takes tens of seconds, so this test uses a one-node cluster
(BENCH_RABBITMQ_DIR may name one already started with bench/rabbitmq/cluster.sh to save that).
"""

import json
import os
from pathlib import Path

import pytest

from bench.runner import Progress, Runner
from bench.targets import RabbitTarget, _port_open, rabbitmq_available

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(rabbitmq_available() is not None, reason=str(rabbitmq_available()))]


@pytest.mark.timeout(300)
def test_rabbitmq_run_writes_the_same_logs(tmp_path, monkeypatch):
    given = os.environ.get("BENCH_RABBITMQ_DIR")
    started = None
    if not given:
        if _port_open("127.0.0.1", RabbitTarget.AMQP_BASE + 1):
            pytest.skip("a RabbitMQ bench cluster already runs on 5701 (set BENCH_RABBITMQ_DIR to use it)")
        started = RabbitTarget(size=1)
        started.start()
        rdir = started.dir
    else:
        rdir = Path(given)
    try:
        workload = tmp_path / "tiny.yaml"
        workload.write_text("name: tiny-rabbit\nmessage_size: 100\nproducer_rate: 1000\nduration: 1\n"
                            "confirms: true\nprefetch: 50\ndrain_timeout: 5\n")
        runner = Runner(tmp_path / "results", progress=Progress(enabled=False), say=lambda s: None)
        folder = runner.run([str(workload)], ["rabbitmq"], rabbit_dir=rdir, run_id="rr")
        run = json.loads((folder / "run.json").read_text())
        assert run["targets"] == ["rabbitmq"] and run["rabbitmq_version"].startswith("3.")
        d = folder / "tiny-rabbit" / "rabbitmq"
        sc = json.loads((d / "scenario.json").read_text())
        assert sc["target"] == "rabbitmq" and sc["nodes"][0] == "rabbit-1@localhost" and sc["errors"] == []
        pubs = [json.loads(x) for x in (d / "publish.jsonl").read_text().splitlines()]
        dels = [json.loads(x) for x in (d / "deliver.jsonl").read_text().splitlines()]
        assert len(pubs) == 1000  # 1000 msgs/s for 1 s, on the open-loop schedule
        assert all(p["t_pub"] >= p["t_int"] - 1e-6 for p in pubs)
        assert all(p["conf"] == "ack" and p["t_conf"] >= p["t_pub"] for p in pubs)
        assert sorted(x["id"] for x in dels) == sorted(p["id"] for p in pubs)
        assert {x["node"] for x in dels} <= set(sc["nodes"])
    finally:
        if started is not None:
            started.stop()
