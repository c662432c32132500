"""Failover seen through real AMQP clients on a real 3-node cluster (kill -9 of a mirrored queue's
leader):

* the spec's tutorial (../shared/spec/000_*.txt), its publisher and consumer run as written with
  `import pika`, only the port changed: the consumer, connected to another node, carries on
  after the leader is killed;
* a consumer that asked for `x-cancel-on-ha-failover` gets a basic.cancel;
* the properties of a message (all 14, a headers table of every field type) come back byte for
  byte from the promoted mirror, and a durable queue that was not mirrored answers with
  RabbitMQ's "home node ... is down or inaccessible";
* aio-pika's `connect_robust` over a list of nodes, under load: the publisher (connected to the
  leader's node) reconnects to the next node and publishes again what was not confirmed; the
  consumer resumes; every confirmed message arrives.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pika
import pytest
from pamqp import commands as C

from amqp_raw import RawClient, all_properties
import tutorial_text
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

ENV = dict(os.environ, PYTHONUNBUFFERED="1")
LINE = tutorial_text.LINE


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        c.ctl_ok("n1", "set_policy", "ha-all", "^(my_mirrored|ha\\.)",
                 '{"ha-mode":"all","ha-sync-mode":"automatic"}')
        yield c


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def queue_row(cluster, on, name):
    rows = cluster.ctl_json(on, "list_queues", "name", "pid", "leader", "mirror_pids",
                            "synchronised_mirror_pids", "messages")
    return next((r for r in rows if r["name"] == name), None)


def all_up(cluster):
    """Every node running (a test before may have killed one)."""
    for name in cluster.names:
        if not cluster.alive(name):
            cluster.restart(name)
    cluster.wait_running("n2", set(cluster.names), timeout=30)


def test_spec_tutorial_with_pika_carries_on_after_the_leader_is_killed(cluster, tmp_path):
    all_up(cluster)
    pub_n1 = tmp_path / "publisher_n1.py"
    pub_n3 = tmp_path / "publisher_n3.py"
    con = tmp_path / "consumer.py"
    pub_n1.write_text(tutorial_text.publisher(cluster.amqp_port("n1")))
    pub_n3.write_text(tutorial_text.publisher(cluster.amqp_port("n3")))
    con.write_text(tutorial_text.consumer(cluster.amqp_port("n2")))
    r = subprocess.run([sys.executable, str(pub_n1)], capture_output=True, text=True, timeout=30, env=ENV)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: (queue_row(cluster, "n2", "my_mirrored_queue") or {}).get("synchronised_mirror_pids", [None, None])
             and len(queue_row(cluster, "n2", "my_mirrored_queue")["synchronised_mirror_pids"]) == 2,
             20, "both mirrors to be synchronised")
    assert queue_row(cluster, "n2", "my_mirrored_queue")["leader"] == "n1"
    raw = RawClient(cluster.amqp_port("n1"))
    raw.open_channel()
    raw.method(1, C.Queue.Declare(0, "ha.props", False, True))
    raw.expect(C.Queue.DeclareOk)
    raw.method(1, C.Queue.Declare(0, "solo.durable", False, True))  # no policy: not mirrored
    raw.expect(C.Queue.DeclareOk)
    raw.method(1, C.Queue.Declare(0, "ha.cancel", False, True))
    raw.expect(C.Queue.DeclareOk)
    raw.close()
    cancelled = []
    watcher = pika.BlockingConnection(pika.ConnectionParameters("localhost", cluster.amqp_port("n3")))
    wch = watcher.channel()
    wch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    wtag = wch.basic_consume("ha.cancel", lambda *a: None, arguments={"x-cancel-on-ha-failover": True})
    props = all_properties()
    raw = RawClient(cluster.amqp_port("n2"))
    raw.open_channel()
    raw.method(1, C.Confirm.Select())
    raw.expect(C.Confirm.SelectOk)
    raw.publish(1, "", "ha.props", b"kept", props)
    raw.expect(C.Basic.Ack)  # on every mirror
    raw.close()
    out_path = tmp_path / "consumer.out"
    with open(out_path, "w") as out:
        p = subprocess.Popen([sys.executable, str(con)], stdout=out, stderr=subprocess.STDOUT, env=ENV)
        try:
            wait_for(lambda: out_path.read_text().count(LINE) == 1 or p.poll() is not None, 20,
                     "the consumer to print the first message")
            assert p.poll() is None, out_path.read_text()
            cluster.kill9("n1")
            wait_for(lambda: (queue_row(cluster, "n2", "my_mirrored_queue") or {}).get("leader") in ("n2", "n3"),
                     20, "a mirror to be promoted")
            r = subprocess.run([sys.executable, str(pub_n3)], capture_output=True, text=True, timeout=30, env=ENV)
            assert r.returncode == 0, r.stderr
            wait_for(lambda: out_path.read_text().count(LINE) >= 2 or p.poll() is not None, 20,
                     "the consumer to print the message published after the failover")
            assert p.poll() is None, f"the consumer died: {out_path.read_text()}"
            deadline = time.monotonic() + 20
            while not cancelled and time.monotonic() < deadline:
                watcher.process_data_events(time_limit=0.1)
            assert cancelled == [wtag], "x-cancel-on-ha-failover: the consumer was not cancelled"
            watcher.close()
            raw = RawClient(cluster.amqp_port("n3"))
            raw.open_channel()
            _, got_props, body = raw.get(1, "ha.props")
            assert body == b"kept" and got_props == props
            raw.close()
            conn = pika.BlockingConnection(pika.ConnectionParameters("localhost", cluster.amqp_port("n2")))
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                conn.channel().queue_declare("solo.durable", passive=True)
            assert e.value.reply_code == 404
            assert e.value.reply_text == ("NOT_FOUND - home node 'n1' of durable queue 'solo.durable' "
                                          "in vhost '/' is down or inaccessible")
            conn.close()
        finally:
            p.kill()
            p.wait(10)


class NodesConnection:
    """aio-pika's RobustConnection over a list of nodes: a lost connection is made again to the
    next node of the list (aio-pika takes one URL; this is the class `connect_robust` is given)."""

    @staticmethod
    def make(urls):
        import aio_pika
        from yarl import URL

        class _Connection(aio_pika.RobustConnection):
            NODES = [URL(u) for u in urls]

            def __init__(self, url, loop=None, **kwargs):
                self._node = 0
                super().__init__(url, loop=loop, **kwargs)

            @property
            def url(self):
                return self.NODES[self._node % len(self.NODES)]

            @url.setter
            def url(self, value):
                pass

            async def _on_connection_close(self, closing):
                self._node += 1  # the next attempt goes to the next node
                await super()._on_connection_close(closing)

        return _Connection


async def _aio_pika_failover(cluster, total: int, window: int):
    import aio_pika

    def urls(order):
        return [cluster.amqp_url(n) for n in order]

    consumed: list[int] = []
    redelivered = 0

    consumer_conn = await aio_pika.connect_robust(
        urls(["n2", "n3", "n1"])[0], connection_class=NodesConnection.make(urls(["n2", "n3", "n1"])),
        reconnect_interval=0.3)
    cch = await consumer_conn.channel()
    await cch.set_qos(prefetch_count=200)
    queue = await cch.declare_queue("ha.orders", durable=True)

    async def on_message(message):
        nonlocal redelivered
        consumed.append(int(message.body))
        redelivered += message.redelivered
        await message.ack()

    await queue.consume(on_message)

    pub_conn = await aio_pika.connect_robust(
        urls(["n1", "n2", "n3"])[0], connection_class=NodesConnection.make(urls(["n1", "n2", "n3"])),
        reconnect_interval=0.3)
    pch = await pub_conn.channel(publisher_confirms=True)
    await pch.declare_queue("ha.orders", durable=True)
    confirmed: set[int] = set()
    killed_at = None
    retries = 0

    async def publish(i: int):
        nonlocal retries
        while True:
            try:
                await pch.default_exchange.publish(aio_pika.Message(str(i).encode()),
                                                   routing_key="ha.orders", timeout=5)
                confirmed.add(i)
                return
            except Exception:  # noqa: BLE001 - lost with the connection: publish it again
                retries += 1
                await asyncio.sleep(0.2)

    for start in range(0, total, window):
        await asyncio.gather(*(publish(i) for i in range(start, min(start + window, total))))
        if killed_at is None and start >= total // 3:
            killed_at = len(confirmed)
            await asyncio.get_running_loop().run_in_executor(None, cluster.kill9, "n1")
    deadline = time.monotonic() + 30
    while not confirmed <= set(consumed) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    moved = pub_conn._node  # connections the publisher lost (each moves it to the next node)
    await pub_conn.close()
    await consumer_conn.close()
    return confirmed, consumed, killed_at, retries + moved, redelivered


def test_aio_pika_connect_robust_over_the_nodes_loses_no_confirmed_message(cluster):
    all_up(cluster)
    confirmed, consumed, killed_at, retries, redelivered = asyncio.run(
        _aio_pika_failover(cluster, total=3000, window=100))
    assert killed_at and killed_at < 3000
    assert len(confirmed) == 3000
    missing = confirmed - set(consumed)
    assert not missing, f"{len(missing)} confirmed messages never arrived, e.g. {sorted(missing)[:10]}"
    # a lost publish raised, or the robust connection moved on while its publishes waited
    assert retries > 0, "the publisher never saw its node go (was n1 killed under load?)"
    row = queue_row(cluster, "n2", "ha.orders")
    assert row["leader"] in ("n2", "n3")
