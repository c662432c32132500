"""The management HTTP API (broker/management) against real warren-server processes, with httpx:
RabbitMQ's paths, shapes and errors, any node answering for the whole cluster, the same policy
validation as warrenctl, sync and cancel, a kill -9 of a queue's leader while the API is polled
through a surviving node, and `/metrics` parsed by prometheus_client (a scrape of a node with
1,000 queues in under 100 ms). Also the option's sources, the auth function on its own, and one
HTTP connection's objects freed as it ends (in-process, over real TCP)."""

from __future__ import annotations

import base64
import statistics
import time

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from broker import config as configmod
from broker.client.aio import open_connection

from cluster_procs import publish, running_cluster, wait_until

pytestmark = [pytest.mark.timeout(240)]
SYNC_LIMIT = 300_000  # bytes/s: a sync of ~1.5 MB takes ~5 s, long enough to watch and cancel


# --- the option and the auth check, no process ------------------------------------------------------

def test_http_port_from_flag_env_and_toml(tmp_path):
    assert configmod.load({"secret": "s"}, env={}).http_port is None  # off unless set
    assert configmod.load({"secret": "s", "http_port": 15672}, env={}).http_port == 15672
    assert configmod.load({"secret": "s"}, env={"WARREN_HTTP_PORT": "15673"}).http_port == 15673
    toml = tmp_path / "n.toml"
    toml.write_text("http_port = 15674\n")
    assert configmod.load({"secret": "s", "config": str(toml)}, env={}).http_port == 15674
    toml.write_text('http_port = "x"\n')
    with pytest.raises(configmod.ConfigError, match="http_port must be an integer"):
        configmod.load({"secret": "s", "config": str(toml)}, env={})
    with pytest.raises(configmod.ConfigError, match="http_port 70000 is not a TCP port"):
        configmod.load({"secret": "s", "http_port": 70000}, env={})


def _request(user: str | None, password: str, client_host: str):
    from starlette.requests import Request
    headers = []
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode())
        headers.append((b"authorization", b"Basic " + token))
    return Request({"type": "http", "method": "GET", "path": "/api/overview", "headers": headers,
                    "client": (client_host, 50000), "query_string": b""})


def _fake_management(users: dict, tags: dict | None = None):
    """A stand-in for the management's node: its metadata holds `users` (seeded as a first boot
    seeds them), then each user's `tags`."""
    from broker.cluster import fresh_state
    from mirroring import changes as c
    from mirroring.metadata import Metadata

    md = Metadata.from_snapshot(fresh_state("n1", ["n1", 1], ["n1", 2], users).snap_data)
    for user, user_tags in (tags or {}).items():
        md.apply(c.UserUpdate(c.User(user, md.users[user].password_hash, user_tags)))

    class Fake:
        class node:
            config = configmod.NodeConfig(users=users, secret=b"s")
            app_running = True
    Fake.node.md = md
    return Fake


def test_basic_auth_users_and_the_loopback_rule():
    from broker.management.app import ApiError, authenticate

    fake = _fake_management({"guest": "guest", "ops": "pw"})
    assert authenticate(fake, _request("guest", "guest", "127.0.0.1")) == ("guest", "guest")
    assert authenticate(fake, _request("ops", "pw", "10.1.2.3")) == ("ops", "pw")
    for user, password, host, reason in (("guest", "guest", "10.1.2.3", "User can only log in via localhost"),
                                         ("ops", "nope", "127.0.0.1", "Login failed"),
                                         (None, "", "127.0.0.1", "Login failed")):
        with pytest.raises(ApiError) as err:
            authenticate(fake, _request(user, password, host))
        assert (err.value.status, err.value.error, err.value.reason) == (401, "not_authorised", reason)


def test_each_path_needs_its_tag_and_administrator_implies_every_other():
    from broker.management.app import ApiError, authenticate

    users = {"admin": "a", "mon": "m", "pol": "p", "mgmt": "g", "none": "n"}
    fake = _fake_management(users, {"mon": ("monitoring",), "pol": ("policymaker",),
                                    "mgmt": ("management",), "none": ()})
    allowed = {"admin": {"administrator", "policymaker", "monitoring", "management"},
               "mon": {"monitoring", "management"}, "pol": {"policymaker", "management"},
               "mgmt": {"management"}, "none": set()}
    reasons = {"management": "Not management user", "administrator": "Not administrator user",
               "monitoring": "Not monitor user", "policymaker": "Not policymaker user"}
    for user, password in users.items():
        for need, reason in reasons.items():
            request = _request(user, password, "10.0.0.1")
            if need in allowed[user]:
                assert authenticate(fake, request, need) == (user, password)
            else:
                with pytest.raises(ApiError) as err:
                    authenticate(fake, request, need)
                assert (err.value.status, err.value.error, err.value.reason) == \
                    (401, "not_authorised", reason), (user, need)


# --- a process cluster ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3, net_ticktime=4, http=True,
                         server_args=["--mirroring-sync-max-throughput", str(SYNC_LIMIT)]) as c:
        yield c


def api(c, node: str, auth=("guest", "guest")) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{c.http_ports[node]}", auth=auth, timeout=20)


@pytest.mark.process
def test_overview_nodes_errors_and_auth(cluster):
    c = cluster
    with api(c, "n2") as http:
        overview = http.get("/api/overview").json()
        assert overview["node"] == "n2" and overview["cluster_name"] == "warren@n1"
        assert {"queue_totals", "object_totals", "message_stats", "listeners"} <= set(overview)
        nodes = http.get("/api/nodes").json()
        assert [(n["name"], n["running"]) for n in nodes] == [("n1", True), ("n2", True), ("n3", True)]
        assert http.get("/api/nodes/n3").json()["name"] == "n3"
        # RabbitMQ's errors
        assert http.get("/api/nodes/n9").status_code == 404
        missing = http.get("/api/queues/%2F/no.such.queue")
        assert (missing.status_code, missing.json()) == (404, {"error": "Object Not Found",
                                                                "reason": "Not Found"})
        assert http.get("/api/queues/other-vhost").status_code == 404
        wrong = http.post("/api/queues/%2F/no.such.queue")
        assert wrong.status_code == 405 and wrong.json()["error"] == "Method Not Allowed"
        bad = http.put("/api/queues/%2F/x", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"] == "bad_request"
        bad = http.put("/api/queues/%2F/x", json={"arguments": [[]]})  # found by make fuzz
        assert (bad.status_code, bad.json()["reason"]) == (400, "arguments must be a JSON object")
    with api(c, "n1", auth=None) as anonymous:
        refused = anonymous.get("/api/overview")
        assert refused.status_code == 401 and refused.json() == {"error": "not_authorised",
                                                                 "reason": "Login failed"}
    with api(c, "n1", auth=("guest", "wrong")) as wrong_password:
        assert wrong_password.get("/api/queues").status_code == 401


@pytest.mark.process
def test_users_and_permissions_through_the_api_for_administrators_only(cluster):
    with api(cluster, "n1") as admin:
        assert admin.put("/api/users/carol", json={"password": "cpw", "tags": ""}).status_code == 201
        assert admin.put("/api/permissions/%2F/carol",
                         json={"configure": "^carol", "write": ".*", "read": ".*"}).status_code == 201
        row = admin.get("/api/users/carol").json()
        assert row == {"name": "carol", "tags": [], "hashing_algorithm": "rabbit_password_hashing_sha256",
                       "limits": {}}
        assert all("password_hash" not in u and "cpw" not in str(u) for u in admin.get("/api/users").json())
        assert admin.get("/api/users/carol/permissions").json() == [
            {"user": "carol", "vhost": "/", "configure": "^carol", "write": ".*", "read": ".*"}]
        assert {"user": "carol", "vhost": "/", "configure": "^carol", "write": ".*", "read": ".*"} \
            in admin.get("/api/permissions").json()
        assert admin.get("/api/users/nobody").status_code == 404
        assert admin.put("/api/permissions/nowhere/carol",
                         json={"configure": "", "write": "", "read": ""}).status_code == 404
    with api(cluster, "n2", auth=("carol", "cpw")) as carol:  # replicated; no tag: no access
        wait_until(lambda: carol.get("/api/overview").status_code == 401, what="carol on n2")
        assert carol.get("/api/overview").json() == {"error": "not_authorised",
                                                     "reason": "Not management user"}
    with api(cluster, "n1") as admin:
        assert admin.put("/api/users/carol", json={"tags": "management"}).status_code == 204
    with api(cluster, "n1", auth=("carol", "cpw")) as carol:  # the password was kept
        assert carol.get("/api/overview").status_code == 200
        assert carol.get("/api/users").json() == {"error": "not_authorised",
                                                  "reason": "Not administrator user"}
        assert carol.get("/api/nodes").json()["reason"] == "Not monitor user"
        assert carol.put("/api/policies/%2F/p", json={"pattern": "x", "definition": {}}
                         ).json()["reason"] == "Not policymaker user"
        assert carol.get("/api/whoami").json() == {"name": "carol", "tags": ["management"]}
    with api(cluster, "n1") as admin:
        assert admin.delete("/api/permissions/%2F/carol").status_code == 204
        assert admin.delete("/api/users/carol").status_code == 204
        assert admin.get("/api/users/carol").status_code == 404


def test_queue_lifecycle_publish_get_and_listings(cluster):
    c = cluster
    with api(c, "n1") as http:
        assert http.put("/api/queues/%2F/api.q", json={"durable": True}).status_code == 201
        assert http.put("/api/queues/%2F/api.q", json={"durable": True}).status_code == 204
        routed = http.post("/api/exchanges/%2F/amq.default/publish",
                           json={"routing_key": "api.q", "payload": "hello", "payload_encoding": "string",
                                 "properties": {}})
        assert routed.json() == {"routed": True}
        nowhere = http.post("/api/exchanges/%2F/amq.default/publish",
                            json={"routing_key": "nobody", "payload": "x", "payload_encoding": "string",
                                  "properties": {}})
        assert nowhere.json() == {"routed": False}
    with api(c, "n3") as other:  # any node answers for the whole cluster
        row = other.get("/api/queues/%2F/api.q").json()
        assert (row["name"], row["vhost"], row["node"], row["messages"], row["messages_ready"]) == \
            ("api.q", "/", "n1", 1, 1)
        for key in ("slave_nodes", "synchronised_slave_nodes", "messages_unacknowledged", "consumers",
                    "policy", "effective_policy_definition", "state", "message_stats"):
            assert key in row, key
        assert row["message_stats"]["publish"] == 1
        got = other.post("/api/queues/%2F/api.q/get", json={"count": 5, "ackmode": "ack_requeue_true",
                                                             "encoding": "auto"}).json()
        assert [(m["payload"], m["payload_encoding"], m["redelivered"]) for m in got] == \
            [("hello", "string", False)]
        again = other.post("/api/queues/%2F/api.q/get", json={"count": 1, "ackmode": "ack_requeue_false",
                                                               "encoding": "auto"}).json()
        assert again[0]["redelivered"] is True  # it was requeued
        for bad in ('{"count": 1, "truncate": Infinity}', '{"count": -Infinity}', '{"count": NaN}',
                    '{"count": "x"}'):
            answer = other.post("/api/queues/%2F/api.q/get", content=bad,
                                headers={"content-type": "application/json"})
            assert (answer.status_code, answer.json()["reason"]) == \
                (400, "count and truncate must be integers"), (bad, answer.text)
        assert other.get("/api/queues/%2F/api.q").json()["messages"] == 0
        assert any(q["name"] == "api.q" for q in other.get("/api/queues/%2F").json())
        assert any(x["name"] == "amq.direct" for x in other.get("/api/exchanges").json())
        assert {"source": "", "vhost": "/", "destination": "api.q", "destination_type": "queue",
                "routing_key": "api.q", "arguments": {}, "properties_key": "api.q"} in \
            other.get("/api/bindings").json()
        for path in ("/api/connections", "/api/channels", "/api/consumers", "/api/policies"):
            assert isinstance(other.get(path).json(), list), path
        assert other.get("/api/health/checks/alarms").json() == {"status": "ok"}
        assert other.get("/api/aliveness-test/%2F").json() == {"status": "ok"}
        # purge and delete
        http_publish = other.post("/api/exchanges/%2F/amq.default/publish",
                                  json={"routing_key": "api.q", "payload": base64.b64encode(b"\x00\x01").decode(),
                                        "payload_encoding": "base64", "properties": {}})
        assert http_publish.json() == {"routed": True}
        assert other.delete("/api/queues/%2F/api.q/contents").status_code == 204
        assert other.get("/api/queues/%2F/api.q").json()["messages"] == 0
        assert other.delete("/api/queues/%2F/api.q").status_code == 204
        wait_until(lambda: other.get("/api/queues/%2F/api.q").status_code == 404, what="the delete")


@pytest.mark.process
def test_vhosts_through_the_api(cluster):
    """PUT/DELETE /api/vhosts/{name}; queues, exchanges and policies per vhost: the same queue
    name in two vhosts is two queues, mirrored by its own vhost's policy."""
    c = cluster
    with api(c, "n2") as http:
        assert http.put("/api/vhosts/tenant", json={"description": "a tenant"}).status_code == 201
        assert http.put("/api/vhosts/tenant", json={"description": "a tenant"}).status_code == 204
        assert {"name": "tenant", "description": "a tenant", "tracing": False} in \
            http.get("/api/vhosts").json()
        # as RabbitMQ's management plugin: the creating user gets full permissions in it
        assert http.get("/api/permissions/tenant/guest").json() == {
            "user": "guest", "vhost": "tenant", "configure": ".*", "write": ".*", "read": ".*"}
        for vhost in ("%2F", "tenant"):
            assert http.put(f"/api/queues/{vhost}/vh.q", json={"durable": True}).status_code == 201
        routed = http.post("/api/exchanges/tenant/amq.default/publish",
                           json={"routing_key": "vh.q", "payload": "t", "payload_encoding": "string",
                                 "properties": {}})
        assert routed.json() == {"routed": True}
        assert http.put("/api/policies/tenant/vh-ha", json={
            "pattern": "^vh\\.", "definition": {"ha-mode": "all"}}).status_code == 201
        wait_until(lambda: len(http.get("/api/queues/tenant/vh.q").json()["slave_nodes"]) == 2,
                   what="the tenant's queue mirrored")
        root_q, tenant_q = (http.get(f"/api/queues/{v}/vh.q").json() for v in ("%2F", "tenant"))
        assert (root_q["vhost"], root_q["messages"], root_q["slave_nodes"]) == ("/", 0, [])
        assert (tenant_q["vhost"], tenant_q["messages"], tenant_q["policy"]) == ("tenant", 1, "vh-ha")
        assert [p["name"] for p in http.get("/api/policies/tenant").json()] == ["vh-ha"]
        assert all(p["vhost"] == "/" for p in http.get("/api/policies/%2F").json())
        assert [q["name"] for q in http.get("/api/queues/tenant").json()] == ["vh.q"]
        # what the web UI reads: both queues, each named by name and vhost (its cards' keys)
        view = http.get("/api/warren/cluster", params={"filter": "vh.q"}).json()
        assert [(x["vhost"], x["name"]) for x in view["queues"]] == [("/", "vh.q"), ("tenant", "vh.q")]
        events = http.get("/api/warren/events", params={"queue": "vh.q", "vhost": "tenant"}).json()
        assert [e["text"] for e in events if e["kind"] == "queue_declared"] == [
            "queue vh.q (vhost tenant) declared, leader on n2"]
        assert all((e["queue"], e["vhost"]) == ("vh.q", "tenant") for e in events)
        assert http.get("/api/exchanges/tenant/amq.topic").json()["vhost"] == "tenant"
        assert http.get("/api/queues/nowhere").status_code == 404
        assert http.delete("/api/vhosts/tenant").status_code == 204
        wait_until(lambda: http.get("/api/queues/tenant/vh.q").status_code == 404, what="the delete")
        assert "tenant" not in [v["name"] for v in http.get("/api/vhosts").json()]
        assert http.get("/api/queues/%2F/vh.q").status_code == 200
        assert http.delete("/api/queues/%2F/vh.q").status_code == 204


@pytest.mark.process
def test_policy_validation_mirrors_and_sync_through_the_api(cluster):
    c = cluster
    publish(c, "n1", "ha.api", 1500)  # ~1.5 MB: ~5 s of sync at SYNC_LIMIT
    with api(c, "n2") as http:
        bad = http.put("/api/policies/%2F/ha-api", json={"pattern": "^ha\\.", "definition": {"ha-mode": "bogus"}})
        cli = c.ctl("n1", "set_policy", "ha-api", "^ha\\.", '{"ha-mode":"bogus"}')
        assert bad.status_code == 400 and cli.returncode != 0
        assert bad.json()["reason"] in cli.stderr  # the same message as warrenctl's
        assert http.put("/api/policies/%2F/ha-api", json={"pattern": "^ha\\.", "definition":
                        {"ha-mode": "exactly", "ha-params": 2}, "priority": 1}).status_code == 201
        assert http.get("/api/policies/%2F/ha-api").json()["definition"] == {"ha-mode": "exactly", "ha-params": 2}
        row = wait_until(lambda: (r := http.get("/api/queues/%2F/ha.api").json())["slave_nodes"] and r,
                         what="a mirror")
        assert row["policy"] == "ha-api" and row["synchronised_slave_nodes"] == []
        critical = http.get("/api/health/checks/node-is-mirror-sync-critical")
        assert critical.status_code == 200  # asked of n2, which leads nothing
        with api(c, "n1") as leader_node:
            sick = leader_node.get("/api/health/checks/node-is-mirror-sync-critical")
            assert sick.status_code == 503 and sick.json()["queues"][0]["name"] == "ha.api"
        # a sync, watched, cancelled
        assert http.post("/api/queues/%2F/ha.api/actions", json={"action": "sync"}).status_code == 204
        progress = wait_until(lambda: http.get("/api/queues/%2F/ha.api").json()["sync_progress"],
                              what="sync progress")
        assert progress["total_messages"] == 1500
        assert http.post("/api/queues/%2F/ha.api/actions", json={"action": "cancel_sync"}).status_code == 204
        wait_until(lambda: http.get("/api/queues/%2F/ha.api").json()["state"] == "running", what="cancelled")
        assert http.get("/api/queues/%2F/ha.api").json()["synchronised_slave_nodes"] == []
        kinds = [e["kind"] for e in http.get("/api/warren/events", params={"queue": "ha.api"}).json()]
        assert {"mirror_added", "sync_started", "sync_finished"} <= set(kinds), kinds
        assert http.post("/api/queues/%2F/ha.api/actions", json={"action": "dance"}).status_code == 400
        # synchronised in the end (an unlimited sync would be instant; this one takes ~5 s)
        http.post("/api/queues/%2F/ha.api/actions", json={"action": "sync"})
        wait_until(lambda: http.get("/api/queues/%2F/ha.api").json()["synchronised_slave_nodes"],
                   timeout=60, what="a synchronised mirror")
        assert http.delete("/api/policies/%2F/nope").status_code == 404


@pytest.mark.process
def test_metrics_parse_and_name_like_rabbitmq_prometheus(cluster):
    c = cluster
    text = httpx.get(f"http://127.0.0.1:{c.http_ports['n1']}/metrics", timeout=20).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("rabbitmq_queue_messages_ready", "rabbitmq_queue_messages_unacked",
                 "rabbitmq_queue_consumers", "rabbitmq_queue_messages_published",
                 "rabbitmq_connections", "rabbitmq_channels", "rabbitmq_process_resident_memory_bytes",
                 "rabbitmq_alarms_memory_used_watermark", "warren_queue_mirrors",
                 "warren_queue_synchronised_mirrors", "warren_promotions", "warren_node_running"):
        assert name in families, name
    ready = {s.labels["queue"]: s.value for s in families["rabbitmq_queue_messages_ready"].samples}
    assert ready.get("ha.api") == 1500
    mirrors = {s.labels["queue"]: s.value for s in families["warren_queue_mirrors"].samples}
    assert mirrors["ha.api"] == 1


@pytest.mark.process
def test_kill9_of_a_leader_while_polling_a_surviving_node(cluster):
    """The leader's node dies; polled through n2, the API keeps answering, shows n1 not running,
    the synchronised mirror promoted, and the timeline with the delivery gap."""
    c = cluster
    with api(c, "n2") as http:
        row = http.get("/api/queues/%2F/ha.api").json()
        assert row["node"] == "n1" and row["synchronised_slave_nodes"]
        mirror = row["synchronised_slave_nodes"][0]
        seen = []
        c.kill9("n1")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = http.get("/api/queues/%2F/ha.api")
            assert r.status_code == 200, r.text  # never an error while the cluster fails over
            seen.append(r.json()["node"])
            if seen[-1] == mirror:
                break
            time.sleep(0.05)
        assert seen[-1] == mirror, seen
        assert http.get("/api/queues/%2F/ha.api").json()["messages"] == 1500
        nodes = {n["name"]: n["running"] for n in http.get("/api/nodes").json()}
        assert nodes == {"n1": False, "n2": True, "n3": True}
        events = http.get("/api/warren/events", params={"queue": "ha.api"}).json()
        promoted = [e for e in events if e["kind"] == "promoted"]
        assert promoted and promoted[-1]["node"] == mirror and promoted[-1]["previous"] == "n1"
        assert promoted[-1]["gap"] is not None and 0 <= promoted[-1]["gap"] < 10
        downs = http.get("/api/warren/events").json()
        assert any(e["kind"] == "node_down" and e["node"] == "n1" for e in downs)
        metrics = httpx.get(f"http://127.0.0.1:{c.http_ports['n2']}/metrics", timeout=20).text
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        assert families["warren_promotions"].samples[0].value >= 1
        assert "warren_last_failover_gap_seconds" in families
        running = {s.labels["node"]: s.value for s in families["warren_node_running"].samples}
        assert running == {"n1": 0, "n2": 1, "n3": 1}


@pytest.mark.process
def test_scrape_of_a_node_with_1000_queues_under_100_ms(cluster):
    c = cluster
    names = [f"many.{i:04d}" for i in range(1000)]

    async def declare():
        async with open_connection([c.client_addr("n3")]) as conn:
            ch = await conn.channel()
            for name in names:
                await ch.queue_declare(name, durable=True)
    trio.run(declare)
    url = f"http://127.0.0.1:{c.http_ports['n3']}/metrics"
    with httpx.Client(timeout=20) as http:
        text = http.get(url).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        queues = {s.labels["queue"] for s in families["rabbitmq_queue_messages_ready"].samples}
        assert set(names) <= queues
        times = []
        for _ in range(7):
            started = time.perf_counter()
            assert http.get(url).status_code == 200
            times.append(time.perf_counter() - started)
    assert statistics.median(times) < 0.100, times
    # the web UI's view takes only the queues it shows
    with api(c, "n2") as http:
        view = http.get("/api/warren/cluster", params={"filter": "many.09", "limit": 5}).json()
        assert [q["name"] for q in view["queues"]] == [f"many.09{i:02d}" for i in range(5)]
        assert view["matching"] == 100 and view["queue_count"] >= 1000
        assert view["queues"][0]["node"] == "n3" and view["queues"][0]["state"] == "running"


def test_queue_labels_are_escaped_for_the_parser():
    from broker.management.metrics import queue_families
    from mirroring.metadata import Metadata
    name = 'odd "name"\\with\nnewline'
    rows = [(name, 1, 2, 3, 4, 5, 6, 7, 0, {"messages": 5, "total_messages": 10, "rate_bytes": 9.5,
                                            "eta": 1.0})]
    families = {f.name: f for f in text_string_to_metric_families(queue_families(Metadata("c"), rows))}
    [sample] = families["rabbitmq_queue_messages_ready"].samples
    assert sample.labels == {"queue": name, "vhost": "/"} and sample.value == 1
    assert families["rabbitmq_queue_messages"].samples[0].value == 3
    assert families["warren_queue_sync_progress_ratio"].samples[0].value == 0.5


def test_a_scrape_writes_again_only_the_queues_whose_counts_changed():
    """The per-queue lines kept between scrapes: the text is the same as written afresh, a queue
    whose counts changed gets new lines, an unchanged one keeps its own, a gone one is dropped."""
    from broker.management.metrics import queue_families
    from mirroring.metadata import Metadata
    md = Metadata("c")
    rows = [("a", 1, 0, 0, 1024, 1, 0, 0, 0, None), ("b", 0, 0, 1, 0, 5, 5, 5, 0, None)]
    written = {}
    assert queue_families(md, rows, written) == queue_families(md, rows)
    kept = written["b"][1]
    rows[0] = ("a", 2, 0, 0, 2048, 2, 0, 0, 0, None)
    text = queue_families(md, rows, written)
    assert text == queue_families(md, rows)
    assert 'rabbitmq_queue_messages_ready{queue="a",vhost="/"} 2\n' in text
    assert written["b"][1] is kept
    queue_families(md, rows[1:], written)
    assert set(written) == {"b"}


async def test_timeline_follows_the_metadata_as_it_is_applied():
    """Fed each applied change, the ring records a declare, a mirror added and synchronised, a
    node down and the promotion with its delivery gap (from the link's break), a deletion."""
    from broker.management.events import Timeline
    from mirroring.changes import MemberAdd, NodeDown, NodeUp, QueueDeclare, QueueDelete, QueuesUpdate
    from mirroring.metadata import Metadata
    from mirroring.records import Placement, QueueDef, QueueUpdate
    md = Metadata()
    timeline = Timeline(None)

    def apply(change):
        md.apply(change)
        timeline.meta_changed(change, md)

    for name in ("n1", "n2", "n3"):
        apply(MemberAdd(name, ("h", 1), ("h", 2)))
    apply(NodeUp("n1", 7))
    apply(QueueDeclare(QueueDef("q", True, False, False, {}, "n1")))
    apply(QueuesUpdate((QueueUpdate("q", Placement("n1", ("n2",), (), 1)),)))
    apply(QueuesUpdate((QueueUpdate("q", Placement("n1", ("n2",), ("n2",), 1)),)))
    timeline.link_down("n1")
    await trio.sleep(0.05)
    apply(NodeDown("n1", 7, "failure", (QueueUpdate("q", Placement("n2", ("n3",), (), 2)),)))
    apply(QueueDelete("q"))
    kinds = [(e["kind"], e["node"]) for e in timeline.since(queue="q")]
    assert kinds == [("queue_declared", "n1"), ("mirror_added", "n2"), ("mirror_synchronised", "n2"),
                     ("promoted", "n2"), ("mirror_added", "n3"), (("queue_deleted", None))]
    [promoted] = [e for e in timeline.since() if e["kind"] == "promoted"]
    assert 0.05 <= promoted["gap"] < 5 and promoted["previous"] == "n1"
    assert timeline.promotions == 1 and timeline.last_gap == promoted["gap"]
    assert [e["kind"] for e in timeline.since() if e["queue"] is None] == ["node_up", "node_down"]
    # a snapshot replaces the state silently; the ring stays bounded
    timeline.meta_changed(None, md)
    small = Timeline(None, size=3)
    for i in range(10):
        small.add("policy", f"p{i}")
    assert [e["text"] for e in small.since()] == ["p7", "p8", "p9"]


def test_json_answers_hold_what_json_cannot():
    """Queue arguments and message headers may hold bytes (AMQP's field tables): shown as text."""
    from broker.management.responses import ApiJSON
    assert ApiJSON({"headers": {"h": b"v\xff"}, "ids": (1, 2)}).body == '{"headers":{"h":"v\ufffd"},"ids":[1,2]}'.encode()


@pytest.mark.process
def test_the_api_answers_while_the_app_is_stopped(cluster):
    """The HTTP port lives with the process, like the peer port: with its app stopped a node
    still answers, every node shown as not running, its queues as down, and its is-in-service
    check (a load balancer's) 503 until the app runs again. Starting the app again
    (it replays its log, a thousand declarations and more) is as quick as without the API: the
    timeline follows the replay in memory (reading the saved state per change took 6 s)."""
    c = cluster
    with api(c, "n3") as http:
        ready = http.get("/api/health/checks/is-in-service")
        assert (ready.status_code, ready.json()) == (200, {"status": "ok"})
    c.ctl_ok("n3", "stop_app")
    with api(c, "n3") as http:
        out = http.get("/api/health/checks/is-in-service")
        assert (out.status_code, out.json()) == (503, {"status": "failed", "reason":
                                                       "node n3 is not running (its app is stopped)"})
        assert {n["name"]: n["running"] for n in http.get("/api/nodes").json()}["n3"] is False
        states = {q["state"] for q in http.get("/api/queues").json()}
        assert states == {"down"}
        assert http.get("/api/overview").status_code == 200
        assert "rabbitmq_queues 0.0" in httpx.get(f"http://127.0.0.1:{c.http_ports['n3']}/metrics").text
        started = time.monotonic()
        c.call("n3", "start_app", timeout=30)
        assert time.monotonic() - started < 3
        wait_until(lambda: {n["name"]: n["running"] for n in http.get("/api/nodes").json()}
                   == {"n1": False, "n2": True, "n3": True}, what="n3 running again")
        assert http.get("/api/health/checks/is-in-service").status_code == 200


# --- one HTTP connection's objects, freed as it ends -----------------------------------------------

async def test_an_ended_http_connection_is_freed_without_waiting_for_a_collection():
    """hypercorn's server for one connection and its protocol refer to each other; the node's
    handler (broker/management `connection_server`) empties the server as the connection ends,
    so with the collector off nothing of hypercorn's is left for it after five requests over
    real TCP (a flood of short connections would otherwise hold tens of MB until a full
    collection)."""
    import gc
    from functools import partial

    from hypercorn.config import Config as HypercornConfig
    from hypercorn.utils import wrap_app

    from broker.log import get as get_logger
    from broker.management import connection_server

    async def hello(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = HypercornConfig()
    config.accesslog = config.errorlog = None
    serve_one = connection_server(wrap_app(hello, config.wsgi_max_body_size, None), config, get_logger("test"))
    ended = trio.Semaphore(0, max_value=100)

    async def counted(stream):
        try:
            await serve_one(stream)
        finally:
            ended.release()

    async def request(port: int) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := await stream.receive_some():
                answer += chunk
        return answer

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, counted, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        assert (await request(port)).endswith(b"ok")  # first-use imports and caches aside
        await ended.acquire()
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                assert (await request(port)).startswith(b"HTTP/1.1 200")
            for _ in range(5):
                await ended.acquire()
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = sorted({type(o).__qualname__ for o in gc.garbage
                           if (type(o).__module__ or "").startswith("hypercorn")})
            gc.garbage.clear()
        finally:
            gc.set_debug(0)
            gc.enable()
        nursery.cancel_scope.cancel()
    assert left == [], f"an ended HTTP connection left these in reference cycles: {left}"
