"""Fuzzing a real node's peer port and management HTTP port with hypothesis (the AMQP and client
ports have theirs: test_amqp_fuzz.py, test_native_fuzz.py; here the client port only as far as
`warren-bench fuzz` must still log in and draw its inputs there). The inputs are `warren-bench
fuzz`'s (bench/fuzz_inputs.py), drawn from hypothesis' random: on the peer port before the
cluster secret is proven and after (as warrenctl, and as a node the cluster does not list); on
the HTTP port without credentials and with them. Whatever comes, the node closes the
connection once the sender stops (no hang), nothing is logged as a failure inside the node, it
keeps running, and a well-behaved client on the same node publishes and gets its messages."""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import broker.client as client
from bench import fuzz
from broker.client import BlockingConnection
from broker.localcluster import ControlError

from cluster_procs import SECRET, running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1, http=True) as c:
        yield c


@pytest.fixture(scope="module")
def ports(cluster):
    return {"amqp": cluster.amqp_port("n1"), "client": cluster.client_port("n1"),
            "peer": cluster.peer_port("n1"), "http": cluster.http_ports["n1"]}


@pytest.fixture(scope="module")
def bystander(cluster):
    conn = BlockingConnection(client.ConnectionParameters(cluster.client_addr("n1")))
    ch = conn.channel()
    ch.queue_declare("wellbehaved-port-fuzz")
    ch.confirm_delivery()
    yield ch
    conn.close()


def send_one(ports, kind: str, data: bytes) -> fuzz.Fuzz:
    """One input as `warren-bench fuzz` sends it (the cluster's secret for the peer logins)."""
    f = fuzz.Fuzz(ports, 0, 1, 1)
    f.secret = SECRET.encode()
    trio.run(f.one, kind, data, "hypothesis")
    return f


def check(f: fuzz.Fuzz, kind: str, bystander) -> None:
    assert f.hangs == [], f"the node left a {kind} connection open after the sender stopped"
    assert f.errors[kind] == 0, f"could not connect (or log in) for {kind}"
    bystander.basic_publish("", "wellbehaved-port-fuzz", b"ping")
    assert bystander.basic_get("wellbehaved-port-fuzz", auto_ack=True)[2] == b"ping"


SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.sampled_from(["peer", "peer-ctl", "peer-link"]), st.randoms(use_true_random=False))
def test_the_peer_port_survives_anything(ports, bystander, kind, r):
    data = fuzz.KINDS[kind][2](r)
    check(send_one(ports, kind, data), kind, bystander)


@SETTINGS.__class__(SETTINGS, max_examples=10)  # some answers end only at hypercorn's 5 s keep-alive
@given(st.sampled_from(["http", "http-auth"]), st.randoms(use_true_random=False))
def test_the_http_port_survives_anything(ports, bystander, kind, r):
    data = fuzz.KINDS[kind][2](r)
    check(send_one(ports, kind, data), kind, bystander)


@SETTINGS.__class__(SETTINGS, max_examples=10)
@given(st.sampled_from(["client", "client-open"]), st.randoms(use_true_random=False))
def test_the_bench_logs_in_on_the_client_port(ports, bystander, kind, r):
    data = fuzz.KINDS[kind][2](r)
    check(send_one(ports, kind, data), kind, bystander)


@pytest.mark.parametrize("command", ["delete_queue", "purge_queue", "sync_queue", "sync_status"])
@pytest.mark.parametrize("queue", [5, None, True, 0.5])
def test_a_control_command_refuses_a_queue_that_is_not_a_name(cluster, command, queue):
    with pytest.raises(ControlError, match="bad arguments.*'queue' must be a string"):
        cluster.call("n1", command, {"queue": queue})


def test_nothing_went_wrong_inside_the_node(cluster, bystander):
    text = cluster.log_path("n1").read_text(errors="replace")
    assert "Traceback" not in text and "connection failed" not in text and "request failed" not in text
    assert cluster.alive("n1")
