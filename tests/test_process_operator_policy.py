"""warrenctl's operator policy commands and `--managed-ha`, on real `warren-server` processes."""

from __future__ import annotations

import time

import pytest

from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

SYSTEM = "ha-all-AWS-OWNED-DO-NOT-DELETE"


def _wait(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_set_list_and_clear_operator_policies(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 2) as c:
        r = c.ctl("n1", "set_operator_policy", "--priority", "3", "--apply-to", "queues",
                  "cap", "^orders", '{"max-length": 100, "message-ttl": 60000}')
        assert r.returncode == 0, r.stderr
        assert 'Setting operator policy override "cap" for pattern "^orders"' in r.stderr
        rows = c.ctl_json("n2", "list_operator_policies")
        assert rows == [{"vhost": "/", "name": "cap", "pattern": "^orders", "apply-to": "queues",
                         "definition": {"max-length": 100, "message-ttl": 60000},
                         "priority": 3}]
        table = c.ctl_ok("n2", "list_operator_policies").splitlines()
        assert table[-1].split("\t")[:2] == ["/", "cap"]
        # RabbitMQ 3.10's operator policies carry no ha-* key
        bad = c.ctl("n1", "set_operator_policy", "ha", ".*", '{"ha-mode": "all"}')
        assert bad.returncode != 0
        assert "'ha-mode' are not recognised policy settings" in bad.stderr
        c.ctl_ok("n1", "set_policy", "lim", "^orders", '{"max-length": 500}')
        r = c.ctl("n1", "clear_operator_policy", "cap")
        assert r.returncode == 0 and 'Clearing operator policy "cap"' in r.stderr
        assert c.ctl_json("n1", "list_operator_policies") == []
        gone = c.ctl("n1", "clear_operator_policy", "cap")
        assert gone.returncode != 0 and "operator policy 'cap' not found" in gone.stderr
        # without --managed-ha, policies are as the user set them
        assert [p["set_by"] for p in c.ctl_json("n1", "list_policies")] == ["user"]


def test_managed_ha_keeps_the_system_policy_and_rewrites_users_policies(request,
                                                                         tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 2, server_args=["--managed-ha"]) as c:
        def policies():
            return {p["name"]: p for p in c.ctl_json("n1", "list_policies")}

        system = _wait(lambda: policies().get(SYSTEM), what="the system policy")
        assert (system["definition"], system["set_by"], system["pattern"]) == (
            {"ha-mode": "all", "ha-sync-mode": "automatic"}, "managed-ha", ".*")
        c.ctl_ok("n2", "set_policy", "ttl", "^t", '{"message-ttl": 1000}')
        c.ctl_ok("n2", "set_policy", "two", "^two", '{"ha-mode": "exactly", "ha-params": 2}')
        listed = policies()
        assert listed["ttl"]["definition"] == {"message-ttl": 1000, "ha-mode": "all",
                                               "ha-sync-mode": "automatic"}
        assert listed["two"]["definition"] == {"ha-mode": "all", "ha-sync-mode": "automatic"}
        assert listed["ttl"]["set_by"] == listed["two"]["set_by"] == "user+managed-ha"
        # the table shows who set each policy in its last column
        rows = [line.split("\t") for line in c.ctl_ok("n1", "list_policies").splitlines()
                if line.startswith("/\t")]
        assert {row[1]: row[-1] for row in rows} == {
            SYSTEM: "managed-ha", "ttl": "user+managed-ha", "two": "user+managed-ha"}
        # cleared, the system policy comes back
        c.ctl_ok("n1", "clear_policy", SYSTEM)
        assert _wait(lambda: policies().get(SYSTEM), what="the system policy back") == system
        # the log's leader said what it did
        logs = "".join(c.log_path(n).read_text() for n in c.names)
        assert "policy set by the managed HA" in logs
