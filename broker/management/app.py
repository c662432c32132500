"""The routes: RabbitMQ's management API (paths, JSON shapes, field names, errors), warren's own
`/api/warren/...` for the web UI, `/metrics`, and the UI's static files.

Paths keep their percent-encoding while routed (`RawPathRouting`), so the default vhost is `%2F`
in a path as in RabbitMQ's API; each handler decodes its parameters. Errors are RabbitMQ's JSON,
`{"error": ..., "reason": ...}`, with 400, 401, 404 or 405. Every `/api/` path needs HTTP basic
auth against the node's users (`authenticate`); `/metrics` and the UI's files do not.

Commands share the code of `warrenctl` (broker/control.py): setting a policy is
`cmd_set_policy`, so the validation and its messages are the same; sync, cancel, purge and
delete go to the queue's leader as `warrenctl sync_queue` does. Publishing, getting messages and
declaring a queue go through a client connection this node opens to its own client port, as the
user the request authenticated as.
"""

from __future__ import annotations

import base64
import binascii
import time
from contextlib import asynccontextmanager
from importlib import resources
from urllib.parse import unquote

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mirroring.access import Access, implied_tags, refused
from wire.errors import ACCESS_REFUSED, NOT_FOUND, ProtocolError

from .. import control
from ..client.errors import AMQPConnectionError, ChannelClosedByBroker, ConnectionClosedByBroker
from ..log import clip
from ..native import check_login
from . import state
from .metrics import render_metrics
from .responses import ApiError, _body, _json, _no_content, bad_request, from_protocol_error, not_found
from .users import UserRoutes

VHOST = state.VHOST
PRODUCT = "warren"
RABBITMQ_VERSION = "3.13.7"  # the management API this one follows
CLIENT_TIMEOUT = 10.0
UI_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
            "style.css": "text/css; charset=utf-8"}


# what a user without the tag a path needs is told (RabbitMQ's reasons)
NOT_AUTHORISED = {"management": "Not management user", "administrator": "Not administrator user",
                  "monitoring": "Not monitor user", "policymaker": "Not policymaker user"}


# --- authentication --------------------------------------------------------------------------------

def authenticate(management, request: Request, need: str = "management") -> tuple[str, str]:
    """The (user, password) of a request's HTTP basic auth, checked against the node's users and
    the loopback rule; `need` is the tag the path asks for (administrator, monitoring,
    management). Raises a 401 ApiError."""
    header = request.headers.get("authorization", "")
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded:
        raise ApiError(401, "not_authorised", "Login failed")
    try:
        user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        user, sep, password = "", "", ""
    if not sep:
        raise ApiError(401, "not_authorised", "Login failed")
    node = management.node
    md = state.metadata(node)
    peer = request.client.host if request.client else ""
    try:
        check_login(md, node.config, user, password, peer)
    except ProtocolError as exc:
        reason = "Login failed" if "wrong user name" in exc.text else "User can only log in via localhost"
        raise ApiError(401, "not_authorised", reason) from None
    if need not in user_tags(md, user):
        raise ApiError(401, "not_authorised", NOT_AUTHORISED[need])
    return user, password


def user_tags(md, user: str) -> set[str]:
    """The management access a user's tags give it (administrator implies every other)."""
    record = md.users.get(user)
    return implied_tags(record.tags) if record is not None else set()


# --- JSON shapes -----------------------------------------------------------------------------------

def _vhost(request: Request, node) -> str:
    """The vhost a path names; 404 when the cluster has none of that name."""
    vhost = unquote(request.path_params["vhost"])
    if not state.has_vhost(state.metadata(node), vhost):
        raise not_found()
    return vhost


def _vhost_or_all(request: Request, node) -> str | None:
    """The vhost a listing's path names, or None (every vhost) when it names none."""
    return _vhost(request, node) if "vhost" in request.path_params else None


def _name(request: Request, key: str = "name") -> str:
    return unquote(request.path_params[key])


def message_stats(rates: dict, st: dict | None) -> dict:
    st = st or {}
    pub, dg, ack = st.get("published", 0), st.get("delivered", 0), st.get("acked", 0)
    return {"publish": pub, "publish_details": {"rate": rates["published"]},
            "deliver_get": dg, "deliver_get_details": {"rate": rates["delivered"]},
            "deliver": dg, "deliver_details": {"rate": rates["delivered"]},
            "ack": ack, "ack_details": {"rate": rates["acked"]}}


def queue_json(management, md, q: state.QueueView, leader: dict | None, mirrors: dict,
               running: set) -> dict:
    node = management.node
    policy_name, definition = state.policy_of(md, q)
    rates = management.rates.rates(q.key, trio.current_time())
    synced = list(leader["synced"]) if leader and "synced" in leader else list(q.synced)
    sync = leader.get("sync") if leader else None
    if leader is not None:
        status = "syncing" if sync else "running"
    else:
        status = "running" if q.leader in running else "down"
    st = leader or {}
    return {
        "name": q.name, "vhost": q.vhost, "type": "classic", "durable": q.durable,
        "auto_delete": q.auto_delete, "exclusive": q.exclusive, "arguments": q.arguments,
        "node": q.leader,
        "slave_nodes": list(q.mirrors), "synchronised_slave_nodes": [n for n in q.mirrors if n in synced],
        # the names RabbitMQ 3.11.4+ uses beside the old ones
        "mirror_nodes": list(q.mirrors), "synchronised_mirror_nodes": [n for n in q.mirrors if n in synced],
        "running_mirror_nodes": [n for n in q.mirrors if n in mirrors],
        "policy": policy_name or None, "effective_policy_definition": definition,
        "state": status,
        "messages": st.get("messages", 0), "messages_ready": st.get("messages_ready", 0),
        "messages_unacknowledged": st.get("messages_unacknowledged", 0),
        "message_bytes_ready": st.get("ready_bytes", 0),
        "consumers": st.get("consumers", 0),
        "exclusive_consumer_tag": None,
        "message_stats": message_stats(rates, leader),
        "sync_progress": sync,
        "epoch": q.epoch,
        "leader_running": q.leader in running,
        "statistics_node": node.name,
    }


def nodes_json(management, md) -> list[dict]:
    node = management.node
    running = node.running
    memory = node.memory.status()
    alarms = set(memory.get("alarms") or ())
    leader = node.cluster.leader
    paused = state.paused_nodes(node)
    out = []
    for name in state.members(md):
        linked = name in running
        row = {"name": name, "type": "disc", "running": linked and name not in paused,
               "mem_alarm": name in alarms, "disk_free_alarm": False, "partitions": [],
               "being_drained": False, "metadata_leader": name == leader,
               "down_reason": None if linked else state.down_reason(md, name),
               "paused": name in paused}
        if name == node.name:
            row.update(mem_used=memory.get("memory_used"), mem_limit=memory.get("memory_limit"),
                       uptime=int((trio.current_time() - management.started_at) * 1000))
        out.append(row)
    if node.name not in [r["name"] for r in out]:  # not clustered (yet), or the app is stopped
        out.append({"name": node.name, "type": "disc", "running": node.app_running,
                    "mem_alarm": False, "disk_free_alarm": False, "partitions": [],
                    "being_drained": False, "metadata_leader": False, "down_reason": None,
                    "paused": bool(node.cluster.paused)})
    return out


def out_of_service(node) -> str | None:
    """Why this node takes no clients now (its app stopped or stopping, or paused), or None."""
    if not node.app_running:
        return f"node {node.name} is not running (its app is stopped)"
    if node.stopping:
        return f"node {node.name} is stopping (stop_app or shutdown)"
    if node.cluster.paused:
        return node.paused_reason()
    return None


QUEUES_PER_STEP = 100  # queue JSON made between two checkpoints: the node's loop serves meanwhile


async def all_queues(management, names=None, vhost: str | None = None) -> tuple:
    """(metadata, [queue JSON]) of every queue (of `vhost`, or only those whose keys are
    `names`), with its leader's counts."""
    node = management.node
    md = state.metadata(node)
    views = (state.queues(md, vhost) if names is None
             else [q for n in names if (q := state.queue(md, n))])
    wanted = None if names is None else {q.leader for q in views} | {m for q in views for m in q.mirrors}
    leaders, mirrors = await state.replica_stats(node, wanted)
    management.observe(leaders)
    running = node.running
    out = []
    for i, q in enumerate(views, 1):
        out.append(queue_json(management, md, q, leaders.get(q.key), mirrors.get(q.key, {}), running))
        if i % QUEUES_PER_STEP == 0:
            await trio.sleep(0)  # a thousand queues are 0.1 s of work: not in one step
    return md, out


# --- the internal client -----------------------------------------------------------------------------

@asynccontextmanager
async def client_channel(management, credentials: tuple[str, str], vhost: str = VHOST):
    """A channel of a client connection to this node's own client port, as the request's user,
    in `vhost`."""
    from ..client.aio import open_connection
    node = management.node
    host = node.config.host
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if not node.app_running:
        raise bad_request(f"node {node.name} is not running (its app is stopped)")
    try:
        with trio.fail_after(CLIENT_TIMEOUT):
            async with open_connection([(host, node.client_port)], user=credentials[0],
                                       password=credentials[1], client_name="warren management",
                                       reconnect=False, vhost=vhost) as conn:
                yield await conn.channel()
    except (ChannelClosedByBroker, ConnectionClosedByBroker) as exc:
        code, text = exc.reply_code, exc.reply_text
        if code == ACCESS_REFUSED:  # the user's permissions (mirroring/access.py)
            raise ApiError(401, "not_authorised", text) from None
        raise (not_found(text) if code == NOT_FOUND else bad_request(text)) from None
    except (AMQPConnectionError, OSError, trio.TooSlowError) as exc:
        raise bad_request(f"could not reach node {node.name}'s client port: {exc}") from None


# --- handlers ----------------------------------------------------------------------------------------

class Handlers:
    def __init__(self, management):
        self.m = management
        self.node = management.node

    def auth(self, request: Request, need: str = "management") -> tuple[str, str]:
        return authenticate(self.m, request, need)

    def permit(self, user: str, what: str, kind: str, name: str, vhost: str) -> None:
        """The user's permissions in `vhost` allow `what` on the resource (as on a client
        port: mirroring/access.py); 401 with RabbitMQ's refusal text otherwise."""
        md = state.metadata(self.node)
        if not Access(user, vhost, md.access_version, md.access(user, vhost)).allowed(what, kind, name):
            raise ApiError(401, "not_authorised", refused(kind, name, vhost, user).text)

    async def control(self, command: str, args: dict):
        try:
            return await control.COMMANDS[command](self.node, args)
        except ProtocolError as exc:
            raise from_protocol_error(exc) from None
        except trio.TooSlowError:
            raise bad_request(f"{command}: timed out waiting for the cluster") from None

    # --- cluster ---------------------------------------------------------------------------
    async def overview(self, request: Request):
        self.auth(request)
        node = self.node
        md, queues = await all_queues(self.m)
        sessions = node.clients()
        totals = {k: sum(q[k] for q in queues) for k in ("messages", "messages_ready",
                                                            "messages_unacknowledged")}
        stats = {"publish": 0, "deliver_get": 0, "ack": 0}
        rates = {"publish": 0.0, "deliver_get": 0.0, "ack": 0.0}
        for q in queues:
            ms = q["message_stats"]
            for k in stats:
                stats[k] += ms[k]
                rates[k] += ms[k + "_details"]["rate"]
        host = node.config.advertise_host
        return _json({
            "management_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION,
            "product_name": PRODUCT, "product_version": _version(),
            "cluster_name": state.cluster_name(md), "node": node.name,
            "statistics_db_node": node.name,
            "queue_totals": totals,
            "message_stats": {**stats, **{k + "_details": {"rate": round(v, 1)} for k, v in rates.items()}},
            "object_totals": {"queues": len(queues), "exchanges": len(state.exchanges(md)),
                              "connections": len(sessions),
                              "channels": sum(len(s.channels) for s in sessions),
                              "consumers": sum(q["consumers"] for q in queues)},
            "listeners": [{"node": node.name, "protocol": proto, "ip_address": host, "port": port}
                          for proto, port in (("warren", node.client_port), ("amqp", node.amqp_port),
                                              ("clustering", node.peer_port),
                                              ("http", node.http_port))],
            "contexts": [{"node": node.name, "description": "warren management", "path": "/",
                          "port": str(node.http_port)}],
            "exchange_types": [{"name": t} for t in ("direct", "fanout", "topic", "headers")],
        })

    async def nodes(self, request: Request):
        self.auth(request, "monitoring")
        return _json(nodes_json(self.m, state.metadata(self.node)))

    async def one_node(self, request: Request):
        self.auth(request, "monitoring")
        name = _name(request)
        for row in nodes_json(self.m, state.metadata(self.node)):
            if row["name"] == name:
                return _json(row)
        raise not_found()

    async def vhosts(self, request: Request):
        self.auth(request)
        return _json(state.vhosts(state.metadata(self.node)))

    async def vhost(self, request: Request):
        """GET, PUT (create, or change its description and tracing flag) or DELETE (with
        everything in it) a vhost; the changes need the administrator tag, as RabbitMQ's. As
        RabbitMQ's management plugin, a PUT that creates the vhost gives the user who sent it
        full permissions (".*" to configure, write and read) in it."""
        user, _ = self.auth(request, "administrator" if request.method != "GET" else "management")
        name = _name(request)
        md = state.metadata(self.node)
        if request.method == "GET":
            for row in state.vhosts(md):
                if row["name"] == name:
                    return _json(row)
            raise not_found()
        if request.method == "DELETE":
            if not state.has_vhost(md, name):
                raise not_found()
            await self.control("delete_vhost", {"name": name})
            return _no_content()
        body = await _body(request)
        existed = state.has_vhost(md, name)
        await self.control("add_vhost", {"name": name, "description": str(body.get("description", "")),
                                         "tracing": bool(body.get("tracing", False))})
        if existed:
            return _no_content(204)
        if user in state.metadata(self.node).users:
            await self.control("set_permissions", {"vhost": name, "user": user, "configure": ".*",
                                                   "write": ".*", "read": ".*"})
        return _no_content(201)

    async def whoami(self, request: Request):
        user, _ = self.auth(request)
        record = state.metadata(self.node).users.get(user)
        return _json({"name": user, "tags": list(record.tags) if record else []})

    # --- queues ----------------------------------------------------------------------------
    async def queues(self, request: Request):
        self.auth(request)
        _, queues = await all_queues(self.m, vhost=_vhost_or_all(request, self.node))
        return _json(queues)

    async def queue(self, request: Request):
        credentials = self.auth(request)
        vhost = _vhost(request, self.node)
        name = _name(request)
        key = state.key(vhost, name)
        md = state.metadata(self.node)
        if request.method == "GET":
            if state.queue(md, key) is None:
                raise not_found()
            _, rows = await all_queues(self.m, [key])
            return _json(rows[0])
        if request.method == "DELETE":
            if state.queue(md, key) is None:
                raise not_found()
            self.permit(credentials[0], "configure", "queue", name, vhost)
            await self.control("delete_queue", {"queue": name, "vhost": vhost})
            return _no_content()
        body = await _body(request)  # PUT: declare
        arguments = body.get("arguments") or {}
        if not isinstance(arguments, dict):
            raise bad_request("arguments must be a JSON object")
        existed = state.queue(md, key) is not None
        async with client_channel(self.m, credentials, vhost) as ch:
            await ch.queue_declare(name, durable=bool(body.get("durable", True)),
                                   auto_delete=bool(body.get("auto_delete", False)),
                                   arguments=dict(arguments))
        return _no_content(204 if existed else 201)

    async def queue_contents(self, request: Request):
        user, _ = self.auth(request)
        vhost = _vhost(request, self.node)
        name = _name(request)
        self.permit(user, "read", "queue", name, vhost)
        await self.control("purge_queue", {"queue": name, "vhost": vhost})
        return _no_content()

    async def queue_actions(self, request: Request):
        self.auth(request)
        vhost = _vhost(request, self.node)
        name = _name(request)
        action = (await _body(request)).get("action")
        args = {"queue": name, "vhost": vhost}
        key = state.key(vhost, name)
        if action == "sync":
            result = await self.control("sync_queue", args)
            if result and result.get("started"):
                self.m.timeline.add("sync_requested", "sync requested through the API", queue=key)
        elif action == "cancel_sync":
            result = await self.control("cancel_sync_queue", args)
            if result and result.get("cancelled"):
                self.m.timeline.add("sync_cancelled", "sync cancelled through the API", queue=key)
        else:
            raise bad_request(f"unknown action {action!r}: expected \"sync\" or \"cancel_sync\"")
        return _no_content()

    async def queue_get(self, request: Request):
        credentials = self.auth(request)
        vhost = _vhost(request, self.node)
        name = _name(request)
        body = await _body(request)
        ackmode = body.get("ackmode", "ack_requeue_true")
        if ackmode not in ("ack_requeue_true", "ack_requeue_false", "reject_requeue_true",
                           "reject_requeue_false"):
            raise bad_request(f"unknown ackmode {ackmode!r}")
        encoding = body.get("encoding", "auto")
        if encoding not in ("auto", "base64"):
            raise bad_request(f"unknown encoding {encoding!r}: expected \"auto\" or \"base64\"")
        try:
            count = int(body.get("count", 1))
            truncate = int(body["truncate"]) if body.get("truncate") is not None else None
        except (TypeError, ValueError, OverflowError):  # OverflowError: JSON's Infinity
            raise bad_request("count and truncate must be integers") from None
        if state.queue(state.metadata(self.node), state.key(vhost, name)) is None:
            raise not_found()
        out = []
        async with client_channel(self.m, credentials, vhost) as ch:
            got = []
            for _ in range(max(0, count)):
                msg = await ch.basic_get(name)
                if msg is None:
                    break
                got.append(msg)
            for msg in got:
                if ackmode == "ack_requeue_false":
                    ch.basic_ack(msg.delivery_tag)
                elif ackmode == "reject_requeue_false":
                    ch.basic_reject(msg.delivery_tag, requeue=False)
                else:
                    ch.basic_nack(msg.delivery_tag, requeue=True)
                out.append(_message_json(msg, name, encoding, truncate))
            await ch.close()
        for i, row in enumerate(out):
            row["message_count"] = max(0, len(out) - i - 1)
        return _json(out)

    # --- exchanges and publishing --------------------------------------------------------------
    async def exchanges(self, request: Request):
        self.auth(request)
        vhost = _vhost_or_all(request, self.node)
        return _json([_exchange_json(x) for x in state.exchanges(state.metadata(self.node), vhost)])

    async def exchange(self, request: Request):
        self.auth(request)
        vhost = _vhost(request, self.node)
        x = state.exchange(state.metadata(self.node),
                           state.key(vhost, _exchange_name(_name(request))))
        if x is None:
            raise not_found()
        return _json(_exchange_json(x))

    async def publish(self, request: Request):
        credentials = self.auth(request)
        vhost = _vhost(request, self.node)
        exchange_name = _exchange_name(_name(request))
        body = await _body(request)
        for key in ("routing_key", "payload", "payload_encoding", "properties"):
            if key not in body:
                raise bad_request(f"the body needs \"{key}\"")
        payload = body["payload"]
        if body["payload_encoding"] == "base64":
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, TypeError):
                raise bad_request("payload is not base64") from None
        elif body["payload_encoding"] == "string":
            data = str(payload).encode()
        else:
            raise bad_request("payload_encoding must be \"string\" or \"base64\"")
        properties = body.get("properties") or {}
        if not isinstance(properties, dict):
            raise bad_request("properties must be a JSON object")
        md = state.metadata(self.node)
        exchange_key = state.key(vhost, exchange_name)
        if state.exchange(md, exchange_key) is None:
            raise not_found()
        try:
            targets = state.route(md, exchange_key, str(body["routing_key"]),
                                  properties.get("headers"))
        except ProtocolError as exc:
            raise from_protocol_error(exc) from None
        if targets:
            async with client_channel(self.m, credentials, vhost) as ch:
                await ch.confirm_delivery()
                for queue_name in targets:
                    await ch.basic_publish("", queue_name, data, _warren_props(properties))
                if not await ch.wait_for_confirms(CLIENT_TIMEOUT):
                    raise bad_request("the publish was refused (nacked)")
                await ch.close()
        return _json({"routed": bool(targets)})

    async def bindings(self, request: Request):
        self.auth(request)
        vhost = _vhost_or_all(request, self.node)
        only = _name(request) if "name" in request.path_params else None
        md = state.metadata(self.node)
        if only is not None and state.queue(md, state.key(vhost, only)) is None:
            raise not_found()
        return _json([{"source": src, "vhost": v, "destination": dest, "destination_type": kind,
                       "routing_key": key, "arguments": args,
                       "properties_key": key or "~"}
                      for v, src, dest, kind, key, args in state.bindings(md, vhost)
                      if only is None or (kind == "queue" and dest == only)])

    # --- policies ----------------------------------------------------------------------------
    async def policies(self, request: Request):
        self.auth(request)
        return _json(state.policies(state.metadata(self.node), _vhost_or_all(request, self.node)))

    async def policy(self, request: Request):
        self.auth(request, "policymaker" if request.method != "GET" else "management")
        vhost = _vhost(request, self.node)
        name = _name(request)
        md = state.metadata(self.node)
        if request.method == "GET":
            for p in state.policies(md, vhost):
                if p["name"] == name:
                    return _json(p)
            raise not_found()
        if request.method == "DELETE":
            await self.control("clear_policy", {"name": name, "vhost": vhost})
            return _no_content()
        body = await _body(request)
        if "pattern" not in body or "definition" not in body:
            raise bad_request("the body needs \"pattern\" and \"definition\"")
        existed = state.has_policy(md, state.key(vhost, name))
        await self.control("set_policy", {"name": name, "vhost": vhost, "pattern": body["pattern"],
                                          "definition": body["definition"],
                                          "priority": body.get("priority", 0),
                                          "apply_to": body.get("apply-to", "all")})
        return _no_content(204 if existed else 201)

    # --- connections, channels, consumers ----------------------------------------------------
    def _visible(self, user: str, rows: list) -> list:
        """A monitoring user sees every client's connections and channels, another its own."""
        if "monitoring" in user_tags(state.metadata(self.node), user):
            return rows
        return [r for r in rows if r.get("user") == user]

    async def connections(self, request: Request):
        user, _ = self.auth(request)
        rows = self._visible(user, await self.control("list_connections", {}))
        return _json([_connection_json(r) for r in rows])

    async def connection(self, request: Request):
        user, _ = self.auth(request)
        name = _name(request)
        rows = self._visible(user, await self.control("list_connections", {}))
        if not any(row["name"] == name for row in rows):
            raise not_found()
        if request.method == "DELETE":
            reason = request.headers.get("x-reason") or "closed via management API"
            await self.control("close_connection", {"name": name, "explanation": reason})
            return _no_content()
        return _json(next(_connection_json(row) for row in rows if row["name"] == name))

    async def channels(self, request: Request):
        user, _ = self.auth(request)
        rows = self._visible(user, await self.control("list_channels", {}))
        return _json([{**r, "connection_details": {"name": r["connection"]}}
                      for r in rows])

    async def consumers(self, request: Request):
        self.auth(request)
        vhost = _vhost_or_all(request, self.node)
        rows = await self.control("list_consumers", {} if vhost is None else {"vhost": vhost})
        return _json([{"queue": {"name": r["queue_name"], "vhost": r["vhost"]},
                       "consumer_tag": r["consumer_tag"],
                       "channel_details": {"name": r["channel"]},
                       "ack_required": r["ack_required"], "prefetch_count": r["prefetch_count"],
                       "exclusive": r["exclusive"], "arguments": r["arguments"], "active": True}
                      for r in rows])

    # --- health checks -------------------------------------------------------------------------
    async def alarms(self, request: Request):
        self.auth(request, "monitoring")
        alarms = sorted(self.node.memory.status().get("alarms") or ())
        if alarms:
            return _json({"status": "failed", "reason": "There are alarms in effect in the cluster",
                          "alarms": [{"node": n, "resource": "memory"} for n in alarms]}, 503)
        return _json({"status": "ok"})

    async def in_service(self, request: Request):
        """RabbitMQ's is-in-service: 200 while this node serves clients, 503 while its app is
        stopped or stopping, or it is paused under pause_minority (its ports may be open
        meanwhile: a load balancer's check takes it out on this, not on a TCP connect)."""
        self.auth(request, "monitoring")
        reason = out_of_service(self.node)
        if reason is not None:
            return _json({"status": "failed", "reason": reason}, 503)
        return _json({"status": "ok"})

    async def mirror_sync_critical(self, request: Request):
        """RabbitMQ's node-is-mirror-sync-critical: the mirrored queues this node leads whose only
        synchronised replica it holds (the rule `warrenctl node_is_mirror_sync_critical` applies,
        mirroring/maintenance.py): stopping the node now would lose their messages."""
        self.auth(request, "monitoring")
        md = state.metadata(self.node)
        names = state.sync_critical(md, self.node.name, self.node.running)
        if names:
            critical = [{"name": q.name, "vhost": q.vhost, "node": self.node.name,
                         "slave_nodes": list(q.mirrors)}
                        for q in (state.queue(md, key) for key in names)]
            return _json({"status": "failed",
                          "reason": "There are classic mirrored queues without online synchronised "
                                    "mirrors (queues that would potentially lose data if the "
                                    "target node is shut down)", "queues": critical}, 503)
        return _json({"status": "ok"})

    async def aliveness(self, request: Request):
        credentials = self.auth(request)
        vhost = _vhost(request, self.node)
        async with client_channel(self.m, credentials, vhost) as ch:
            await ch.queue_declare("aliveness-test", durable=False)
            await ch.basic_publish("", "aliveness-test", b"test_message")
            msg = None
            with trio.move_on_after(CLIENT_TIMEOUT):
                while msg is None:
                    msg = await ch.basic_get("aliveness-test", auto_ack=True)
                    if msg is None:
                        await trio.sleep(0.01)
            await ch.close()
        if msg is None:
            return _json({"status": "failed", "reason": "the test message did not come back"}, 503)
        return _json({"status": "ok"})

    # --- warren's own: the web UI's view ------------------------------------------------------
    async def cluster_view(self, request: Request):
        """The nodes, the first `limit` queues (of every vhost, by vhost and name) whose name
        holds `filter`, the default vhost's policies, and the timeline's events after `after`:
        what the page draws each second. A queue's row names it by `name` and `vhost`."""
        self.auth(request)
        try:
            after = int(request.query_params.get("after", "0"))
        except ValueError:
            raise bad_request("after must be an integer") from None
        try:
            limit = int(request.query_params.get("limit", "50"))
        except ValueError:
            raise bad_request("limit must be an integer") from None
        contains = request.query_params.get("filter", "")
        md = state.metadata(self.node)
        names = state.queue_names(md)
        matching = sorted((k for k in names if contains in state.vhost_and_name(k)[1]),
                          key=state.vhost_and_name)
        _, queues = await all_queues(self.m, matching[:max(0, limit)])
        node = self.node
        return _json({"node": node.name, "cluster_name": state.cluster_name(md),
                      "app_running": node.app_running, "time": time.time(),
                      "metadata_version": state.metadata_version(md),
                      "nodes": nodes_json(self.m, md), "queues": queues,
                      "queue_count": len(names), "matching": len(matching),
                      "policies": state.policies(md, VHOST),
                      "events": self.m.timeline.since(after)})

    async def events(self, request: Request):
        """The timeline's events after `after`, of the queue `queue` (in `vhost`, when given)."""
        self.auth(request)
        queue = request.query_params.get("queue")
        try:
            after = int(request.query_params.get("after", "0"))
        except ValueError:
            raise bad_request("after must be an integer") from None
        return _json(self.m.timeline.since(after, queue, limit=1000,
                                           vhost=request.query_params.get("vhost")))

    # --- metrics and the UI's files -------------------------------------------------------------
    async def metrics(self, request: Request):
        text = await render_metrics(self.m)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def ui_file(self, request: Request):
        name = request.path_params.get("file", "index.html")
        if name not in UI_FILES:
            raise not_found()
        data = resources.files(__package__).joinpath("ui", name).read_bytes()
        return Response(data, media_type=UI_FILES[name], headers={"cache-control": "no-cache"})


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("warren")
    except Exception:  # noqa: BLE001 - not installed: run from a checkout
        return "0"


def _exchange_name(name: str) -> str:
    return "" if name == "amq.default" else name


def _exchange_json(x: dict) -> dict:
    return {"name": x["name"], "vhost": x["vhost"], "type": x["type"], "durable": x["durable"],
            "auto_delete": x["auto_delete"], "internal": x["internal"],
            "arguments": x.get("arguments") or {}}


def _connection_json(r: dict) -> dict:
    peer_host, _, peer_port = str(r.get("peer", "")).rpartition(":")
    return {"name": r["name"], "node": r["node"], "vhost": r.get("vhost", VHOST), "user": r["user"],
            "peer_host": peer_host, "peer_port": int(peer_port) if peer_port.isdigit() else None,
            "protocol": r["protocol"], "channels": r["channels"], "state": r["state"],
            "client_properties": {"connection_name": r.get("client_name")}}


def _warren_props(properties: dict) -> dict | None:
    props = {k: v for k, v in properties.items() if v is not None}
    return props or None


def _message_json(msg, queue: str, encoding: str, truncate: int | None) -> dict:
    body = msg.body
    payload_bytes = len(body)
    if truncate is not None:
        body = body[:truncate]
    text = None
    if encoding == "auto":
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    return {"payload_bytes": payload_bytes, "redelivered": msg.redelivered, "exchange": "",
            "routing_key": queue, "properties": dict(msg.properties or {}),
            "payload": text if text is not None else base64.b64encode(body).decode(),
            "payload_encoding": "string" if text is not None else "base64"}


class RawPathRouting:
    """Route on the path as sent (its percent-encoding kept), so `%2F` stays one segment."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("raw_path"):
            scope = dict(scope, path=scope["raw_path"].decode("latin-1").partition("?")[0])
        await self.app(scope, receive, send)


def build_app(management):
    h = Handlers(management)
    log = management.node.log

    def route(path, endpoint, methods=("GET",)):
        return Route(path, endpoint, methods=list(methods))

    routes = [
        route("/", h.ui_file), route("/ui/{file}", h.ui_file),
        route("/metrics", h.metrics), route("/metrics/per-object", h.metrics),
        route("/api/overview", h.overview),
        route("/api/nodes", h.nodes), route("/api/nodes/{name}", h.one_node),
        route("/api/vhosts", h.vhosts), route("/api/vhosts/{name}", h.vhost, ("GET", "PUT", "DELETE")),
        route("/api/whoami", h.whoami),
        route("/api/queues", h.queues), route("/api/queues/{vhost}", h.queues),
        route("/api/queues/{vhost}/{name}", h.queue, ("GET", "PUT", "DELETE")),
        route("/api/queues/{vhost}/{name}/contents", h.queue_contents, ("DELETE",)),
        route("/api/queues/{vhost}/{name}/actions", h.queue_actions, ("POST",)),
        route("/api/queues/{vhost}/{name}/get", h.queue_get, ("POST",)),
        route("/api/queues/{vhost}/{name}/bindings", h.bindings),
        route("/api/exchanges", h.exchanges), route("/api/exchanges/{vhost}", h.exchanges),
        route("/api/exchanges/{vhost}/{name}", h.exchange),
        route("/api/exchanges/{vhost}/{name}/publish", h.publish, ("POST",)),
        route("/api/bindings", h.bindings), route("/api/bindings/{vhost}", h.bindings),
        route("/api/policies", h.policies), route("/api/policies/{vhost}", h.policies),
        route("/api/policies/{vhost}/{name}", h.policy, ("GET", "PUT", "DELETE")),
        route("/api/connections", h.connections),
        route("/api/connections/{name}", h.connection, ("GET", "DELETE")),
        route("/api/channels", h.channels),
        route("/api/consumers", h.consumers), route("/api/consumers/{vhost}", h.consumers),
        route("/api/health/checks/alarms", h.alarms),
        route("/api/health/checks/node-is-mirror-sync-critical", h.mirror_sync_critical),
        route("/api/health/checks/is-in-service", h.in_service),
        route("/api/aliveness-test/{vhost}", h.aliveness),
        *UserRoutes(h).routes(route),
        route("/api/warren/cluster", h.cluster_view),
        route("/api/warren/events", h.events),
    ]

    async def api_error(request: Request, exc: ApiError):
        headers = {}
        if exc.status == 401 and not request.headers.get("x-warren-ui"):
            headers["www-authenticate"] = 'Basic realm="warren management"'
        return JSONResponse({"error": exc.error, "reason": exc.reason}, status_code=exc.status,
                            headers=headers)

    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 405:
            return JSONResponse({"error": "Method Not Allowed",
                                 "reason": f"{request.method} is not allowed on {request.url.path}"},
                                status_code=405)
        if exc.status_code == 404:
            return JSONResponse({"error": "Object Not Found", "reason": "Not Found"}, status_code=404)
        return JSONResponse({"error": "bad_request", "reason": str(exc.detail)},
                            status_code=exc.status_code)

    async def internal_error(request: Request, exc: Exception):
        path, method = clip(request.url.path, 255), clip(request.method)  # a stranger's strings
        if isinstance(exc, (ClientDisconnect, trio.BrokenResourceError, trio.BusyResourceError,
                            trio.ClosedResourceError)):
            # the client went while its answer was on its way (hypercorn answers a request the
            # client broke off itself, beside the app's answer): no failure of the node's
            log.debug("management client went away", path=path, method=method)
            return Response(status_code=500)
        log.exception("management request failed", path=path, method=method)
        return JSONResponse({"error": "internal_error", "reason": repr(exc)}, status_code=500)

    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                        Exception: internal_error})
    return RawPathRouting(app)

