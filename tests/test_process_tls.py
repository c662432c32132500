"""TLS on a cluster of real `warren-server` processes (tests/cluster_procs.py) started with the
certificates `python -m broker.tls certs` makes and `--tls-verify-peer
--tls-fail-if-no-peer-cert`: pika over AMQPS and the native client over TLS; clients without a
certificate, or with an expired one, refused; a node whose certificate comes from another CA, or
has expired, refused on the peer port; and a kill -9 of a mirrored queue's leader with TLS clients
connected to it losing no confirmed message."""

from __future__ import annotations

import json
import subprocess
import time

import pika
import pytest
import trio
from cluster_procs import free_port, running_cluster

from broker.client import aio
from broker.client.blocking import BlockingConnection, ConnectionParameters
from broker.client.errors import AMQPError
from broker.control import ctl_call
from broker.localcluster import executable
from broker.network import TcpNetwork
from broker.tls import client_context, make_ca, make_cert, make_certs
from wire.errors import ProtocolError

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

REQUIRE_CERTS = ["--tls-verify-peer", "--tls-fail-if-no-peer-cert"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, nodes=4)
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    ca = (x509.load_pem_x509_certificate((d / "ca.pem").read_bytes()),
          load_pem_private_key((d / "ca.key").read_bytes(), None))
    make_cert(d, "expired-client", ca, expired=True)
    make_cert(d, "expired-node", ca, ["127.0.0.1", "localhost"], expired=True)
    other = make_ca(d / "other", "another warren CA")
    make_cert(d / "other", "n4", other, ["127.0.0.1", "localhost", "n4"])
    return d


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory, certs):
    with running_cluster(request, tmp_path_factory, 3, net_ticktime=3.0, tls=certs,
                         server_args=REQUIRE_CERTS, http=True) as c:
        yield c


def ctx(certs, stem="client"):
    return client_context(str(certs / f"{stem}.pem"), str(certs / f"{stem}.key"), str(certs / "ca.pem"))


def pika_params(cluster, name, context):
    return pika.ConnectionParameters("127.0.0.1", cluster.amqps_port(name),
                                     ssl_options=pika.SSLOptions(context, "localhost"),
                                     connection_attempts=1, socket_timeout=5)


def test_pika_over_amqps_and_plain_amqp_side_by_side(cluster, certs):
    conn = pika.BlockingConnection(pika_params(cluster, "n2", ctx(certs)))
    ch = conn.channel()
    ch.queue_declare("tls.pika")
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", "tls.pika", f"m{i}".encode())
    got = [ch.basic_get("tls.pika", auto_ack=True)[2] for _ in range(50)]
    conn.close()
    assert got == [f"m{i}".encode() for i in range(50)]
    # the plain AMQP port stays open beside AMQPS, as RabbitMQ's 5672 beside 5671
    plain = pika.BlockingConnection(pika.URLParameters(cluster.amqp_url("n2")))
    assert plain.channel().queue_declare("tls.pika", passive=True).method.message_count == 0
    plain.close()


def test_native_client_over_tls(cluster, certs):
    conn = BlockingConnection(ConnectionParameters(cluster.all_client_addrs(), ssl_context=ctx(certs)))
    ch = conn.channel()
    ch.queue_declare("tls.native")
    ch.confirm_delivery()
    body = bytes(range(256)) * 4000  # a million bytes: many TLS records each way
    ch.basic_publish("", "tls.native", body)
    assert ch.basic_get("tls.native", auto_ack=True)[2] == body
    conn.close()


def test_the_management_api_is_https_and_requires_a_client_certificate(cluster, certs):
    import httpx
    url = f"https://localhost:{cluster.http_ports['n1']}/api/overview"
    r = httpx.get(url, auth=("guest", "guest"), verify=ctx(certs), timeout=10)
    assert r.status_code == 200 and r.json()["node"] == "n1", r.text
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, auth=("guest", "guest"), verify=client_context(ca=str(certs / "ca.pem")), timeout=10)


def test_the_client_port_speaks_only_tls(cluster):
    with pytest.raises(AMQPError):
        BlockingConnection(ConnectionParameters(cluster.client_addr("n1")))


@pytest.mark.parametrize("context", ["no certificate", "expired certificate"])
def test_a_client_without_a_valid_certificate_is_refused_where_one_is_required(cluster, certs, context):
    context = (client_context(ca=str(certs / "ca.pem")) if context == "no certificate"
               else ctx(certs, "expired-client"))
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika_params(cluster, "n1", context))
    with pytest.raises(AMQPError, match="alert certificate (required|expired)"):
        BlockingConnection(ConnectionParameters(cluster.client_addr("n1"), ssl_context=context))


def _ctl(cluster, name, context, command="cluster_status"):
    secret = cluster.env["WARREN_SECRET"].encode()
    return trio.run(ctl_call, TcpNetwork(dial_tls=context), "127.0.0.1", cluster.peer_port(name),
                    "tls-test", secret, command, {}, 10.0)


def test_the_peer_port_refuses_a_certificate_of_another_ca_or_an_expired_one(cluster, certs):
    assert "n1" in _ctl(cluster, "n1", ctx(certs))["running_nodes"]  # the right certificate: in
    foreign = client_context(str(certs / "other" / "n4.pem"), str(certs / "other" / "n4.key"),
                             str(certs / "ca.pem"))
    for context in (foreign, ctx(certs, "expired-node"), client_context(ca=str(certs / "ca.pem"))):
        with pytest.raises((OSError, ProtocolError, trio.BrokenResourceError)):
            _ctl(cluster, "n1", context)
    # warrenctl without a certificate is refused too, and says it could not talk to the node
    env = {k: v for k, v in cluster.env.items() if not k.startswith("WARREN_TLS_")}
    plain = cluster.ctl("n1", "cluster_status", env=env)
    assert plain.returncode != 0 and "--tls-cert" in plain.stderr, plain.stderr


def test_a_node_whose_certificate_comes_from_another_ca_cannot_join(cluster, certs, tmp_path):
    """n4 trusts the cluster's CA, but its own certificate is another CA's: n1 refuses its link."""
    log = open(tmp_path / "n4.log", "wb")
    env = dict(cluster.env, WARREN_HOME=str(tmp_path / "home"))
    proc = subprocess.Popen(
        [executable("warren-server"), "--name", "n4", "--client-port", str(free_port()),
         "--peer-port", str(free_port()), "--amqp-port", str(free_port()), "--amqps-port", str(free_port()),
         "--net-ticktime", "3", "--cluster-seed", f"127.0.0.1:{cluster.peer_port('n1')}",
         "--tls-cert", str(certs / "other" / "n4.pem"), "--tls-key", str(certs / "other" / "n4.key"),
         "--tls-ca", str(certs / "ca.pem")],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 8
        text = ""
        while time.monotonic() < deadline and "waiting for cluster seed" not in text:
            time.sleep(0.2)
            text = (tmp_path / "n4.log").read_text()
        assert "waiting for cluster seed" in text, text
        time.sleep(2)
        assert "n4" not in cluster.cluster_status("n1")["members"]
        assert "unknown ca" in text, text  # n1's refusal, as n4 logs it
        n1_log = cluster.log_path("n1").read_text()
        assert "TLS handshake refused" in n1_log and "unable to get local issuer certificate" in n1_log
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_kill9_of_the_leader_with_tls_clients_on_it_loses_no_confirmed_message(cluster, certs):
    """A mirrored queue led by n3, a publisher (confirms) and a consumer over TLS connected to
    n3, every node in their lists; kill -9 of n3 mid-stream: the clients reconnect over TLS to
    the survivors, and every confirmed id is delivered."""
    c, q = cluster, "tls.failover"
    c.ctl_ok("n1", "set_policy", "tls-ha", "^tls\\.failover$",
             json.dumps({"ha-mode": "all", "ha-sync-mode": "automatic"}))
    addrs = [c.client_addr("n3"), c.client_addr("n1"), c.client_addr("n2")]
    confirmed: set[int] = set()
    delivered: set[int] = set()

    async def main():
        async with aio.open_connection(addrs, ssl_context=ctx(certs), max_retry_delay=0.5) as pub, \
                aio.open_connection(addrs, ssl_context=ctx(certs), max_retry_delay=0.5) as sub:
            ch = await pub.channel()
            await ch.queue_declare(q, durable=True)  # client-local: n3 leads
            deadline = trio.current_time() + 15
            while True:
                row = next((r for r in await trio.to_thread.run_sync(c.ctl_json, "n1", "list_queues", "name",
                                                                      "pid", "synchronised_mirror_pids")
                            if r["name"] == q), None)
                if row and len(row["synchronised_mirror_pids"]) == 2:
                    break
                assert trio.current_time() < deadline, f"the mirrors never synchronised: {row}"
                await trio.sleep(0.2)
            assert row["pid"].strip("<>").startswith("n3"), row
            await ch.confirm_delivery()
            ids: dict[int, int] = {}

            def on_confirm(first, last, ok, reason):
                if ok:
                    confirmed.update(ids[s] for s in range(first, last + 1) if s in ids)
            ch.on_confirm = on_confirm

            sub_ch = await sub.channel()
            await sub_ch.basic_qos(200)
            consumer = await sub_ch.basic_consume(q)

            async def consume():
                async for msg in consumer:
                    delivered.add(int.from_bytes(msg.body[:8], "big"))
                    sub_ch.basic_ack(msg.delivery_tag)

            async def publish():
                for i in range(4000):
                    try:
                        seq = await ch.basic_publish("", q, i.to_bytes(8, "big") + b"x" * 200)
                    except Exception:  # noqa: BLE001  (mid-reconnect: the id is simply not confirmed)
                        await trio.sleep(0.05)
                        continue
                    if seq is not None:
                        ids[seq] = i
                    await trio.sleep(0.001)

            async with trio.open_nursery() as n:
                n.start_soon(consume)
                pub_done = trio.Event()

                async def publish_then_note():
                    await publish()
                    pub_done.set()
                n.start_soon(publish_then_note)
                await trio.sleep(1.5)
                await trio.to_thread.run_sync(c.kill9, "n3")
                with trio.move_on_after(60):
                    await pub_done.wait()
                with trio.move_on_after(20):
                    try:
                        await ch.wait_for_confirms()
                    except Exception:  # noqa: BLE001
                        pass
                with trio.move_on_after(20):
                    while not confirmed <= delivered:
                        await trio.sleep(0.1)
                n.cancel_scope.cancel()
            assert pub.reconnects and sub.reconnects, "the clients never reconnected: the test did not test"

    trio.run(main)
    assert len(confirmed) > 1000, f"only {len(confirmed)} publishes confirmed"
    lost = sorted(confirmed - delivered)
    assert not lost, f"{len(lost)} confirmed messages never delivered, e.g. {lost[:10]}"
