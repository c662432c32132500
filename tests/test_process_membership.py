"""Removing a node and bringing it back, as a RabbitMQ operator does it, on real `warren-server`
processes: `forget_cluster_node` of a stopped node, the node restarted with its old state (which
the cluster refuses, and says why where the operator looks), then `stop_app`, `reset`,
`join_cluster` and `start_app` on it, after which it serves clients again."""

from __future__ import annotations

import time

import pytest
from cluster_procs import running_cluster

import broker.client as client
from broker.client import BlockingConnection
from broker.client.errors import AMQPConnectionError

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout:g} s (last: {last!r})")


def test_a_forgotten_node_restarted_without_reset_is_refused_with_why_then_rejoins_after_reset(
        request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        c.kill9("n3")
        c.wait_running("n1", {"n1", "n2"})
        c.ctl_ok("n1", "forget_cluster_node", "n3")
        assert sorted(c.cluster_status("n1")["members"]) == ["n1", "n2"]

        c.restart("n3")  # its old state: it still lists n1 and n2, who no longer list it
        refused = _wait(lambda: (st := c.call("n3", "cluster_status"))["refused_by"].keys() >= {"n1", "n2"} and st,
                        15, "n3 told by n1 and n2 why they refuse it")
        for peer in ("n1", "n2"):
            reason = refused["refused_by"][peer]
            assert "node n3 is not a member of cluster" in reason, reason
            assert "stop_app and reset" in reason and "join_cluster" in reason, reason
        printed = c.ctl_ok("n3", "cluster_status")
        assert "Link refused by n1: node n3 is not a member" in printed, printed
        # a client of n3 is told why it is refused
        _wait(lambda: c.call("n3", "cluster_status")["paused"], 15, "n3 paused")
        with pytest.raises(AMQPConnectionError) as err:
            BlockingConnection(client.ConnectionParameters(c.client_addr("n3"))).channel()
        assert "cannot reach a majority" in str(err.value) and "n1 refuses its link" in str(err.value), err.value
        # the members do not dial it, and do not count it running
        time.sleep(1.0)
        for member in ("n1", "n2"):
            st = c.cluster_status(member)
            assert st["running_nodes"] == ["n1", "n2"] and sorted(st["members"]) == ["n1", "n2"], st

        c.ctl_ok("n3", "stop_app")
        c.ctl_ok("n3", "reset")
        c.ctl_ok("n3", "join_cluster", "n1")
        c.ctl_ok("n3", "start_app")
        c.wait_running("n1", {"n1", "n2", "n3"})
        st = c.cluster_status("n3")
        assert st["refused_by"] == {} and sorted(st["members"]) == ["n1", "n2", "n3"], st

        # it serves clients again: a confirmed publish through it is consumed through n1
        with BlockingConnection(client.ConnectionParameters(c.client_addr("n3"))) as conn:
            ch = conn.channel()
            ch.queue_declare("back", durable=True)
            ch.confirm_delivery()
            ch.basic_publish("", "back", b"after the rejoin")
        with BlockingConnection(client.ConnectionParameters(c.client_addr("n1"))) as conn:
            _, _, body = conn.channel().basic_get("back", auto_ack=True)
            assert body == b"after the rejoin"
