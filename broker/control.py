"""The control plane: warrenctl's commands, served on the peer port (role "ctl"), and the small
node-to-node requests that listings and joins need.

A ctl connection is authenticated with the cluster secret exactly like a peer (rabbitmqctl
likewise uses the Erlang cookie), so it works while the node's app is stopped.
"""

from __future__ import annotations

import trio

from wire import messages as m
from wire.errors import (COMMAND_INVALID, CONNECTION_FORCED, NOT_ALLOWED, NOT_FOUND, PRECONDITION_FAILED,
                         ProtocolError)

from mirroring.changes import (MemberRemove, OperatorPolicyClear, OperatorPolicySet, PolicyClear,
                               PolicySet, QueueDelete, VHostAdd, VHostDelete)
from mirroring.exchanges import named_binding_rows
from mirroring.metadata import policy_not_found
from mirroring.maintenance import replicas, sync_critical_queues, unsynchronised_queues
from mirroring.policy import (effective_definition, effective_policy, make_operator_policy,
                             make_policy)
from mirroring.records import VHost, in_vhost, qualify, shown, split_key
from mirroring.sync import progress_line

from . import access_control
from . import config as configmod
from .cluster import NodeStopped
from .framed import FramedStream
from .network import connect_reason
from .peers import dial_handshake

QUEUE_COLUMNS = ("name", "durable", "auto_delete", "exclusive", "arguments", "policy", "pid",
                 "mirror_pids", "synchronised_mirror_pids", "messages", "messages_ready",
                 "messages_unacknowledged", "consumers", "leader", "state", "sync_progress",
                 "type", "effective_policy_definition", "operator_policy",
                 # RabbitMQ's names before 3.11.4 (3.10, and Amazon MQ's 3.8-3.10), where
                 # mirror_pids came in as their alias: the same lists
                 "slave_pids", "synchronised_slave_pids")
DEFAULT_QUEUE_COLUMNS = ("name", "messages")
EXCHANGE_COLUMNS = ("name", "type", "durable", "auto_delete", "internal", "arguments")
DEFAULT_EXCHANGE_COLUMNS = ("name", "type")
BINDING_COLUMNS = ("source_name", "source_kind", "destination_name", "destination_kind",
                   "routing_key", "arguments")


async def ctl_call(network, host: str, port: int, me: str, secret: bytes, command: str,
                   args: dict, timeout: float = 30.0):
    """One control command to the node at host:port; returns its value or raises ProtocolError."""
    with trio.fail_after(timeout):
        stream = await network.connect(host, port)
        async with stream:
            framed = FramedStream(stream)
            try:
                await dial_handshake(framed, me, secret, "ctl")
                await framed.send_now(m.CtlCommand(1, command, args))
                reply = await framed.receive(frozenset({"ctl.reply", "error"}))
            except trio.BrokenResourceError as exc:  # the node went (or reset us) mid-call
                raise ProtocolError(NOT_ALLOWED, f"the connection to {host}:{port} broke: {str(exc) or exc.__cause__}") from None
    if reply is None:
        raise ProtocolError(NOT_ALLOWED, "the node closed the connection without answering")
    if isinstance(reply, m.Error):
        raise ProtocolError(reply.code, reply.text)
    if not reply.ok:
        raise ProtocolError(reply.value or PRECONDITION_FAILED, reply.error)
    return reply.value


async def serve_ctl(node, framed: FramedStream, who: str) -> None:
    while True:
        try:
            msg = await framed.receive(frozenset({"ctl.command"}))
        except ProtocolError as exc:
            await framed.send_now(m.Error(exc.code, exc.text))
            return
        if msg is None:
            return
        handler = COMMANDS.get(msg.command)
        try:
            if handler is None:
                raise ProtocolError(COMMAND_INVALID, f"unknown command {msg.command!r}")
            value = await handler(node, msg.args)
        except ProtocolError as exc:
            await framed.send_now(m.CtlReply(msg.rid, False, exc.code, exc.text))
        except trio.TooSlowError:
            await framed.send_now(m.CtlReply(msg.rid, False, NOT_ALLOWED, "timed out"))
        except configmod.ConfigError as exc:  # e.g. join_cluster to a node name nobody registered
            await framed.send_now(m.CtlReply(msg.rid, False, COMMAND_INVALID, str(exc)))
        except (KeyError, TypeError, ValueError) as exc:
            await framed.send_now(m.CtlReply(msg.rid, False, COMMAND_INVALID,
                                             f"bad arguments for {msg.command}: {exc!r}"))
        else:
            await framed.send_now(m.CtlReply(msg.rid, True, value, ""))


def _require_running(node) -> None:
    if not node.app_running:
        raise ProtocolError(NOT_ALLOWED, f"node {node.name} is not running (its app is stopped): run start_app")


async def _each_running_node(node, rpc: str, args: dict) -> dict:
    """Call `rpc` on every running node; {node: value} (nodes that fail are left out)."""
    results: dict = {}

    async def one(name):
        try:
            with trio.fail_after(10):
                results[name] = await node.cluster.call_node(name, rpc, args)
        except Exception:
            pass

    async with trio.open_nursery() as n:
        for name in sorted(node.running):
            n.start_soon(one, name)
    return results


# --- commands --------------------------------------------------------------------------------

def _md(node):
    """The metadata: live while the app runs, else as saved."""
    return node.md if node.app_running else node.cluster.load_metadata()


async def cmd_status(node, args):
    md = _md(node)
    return {"node": node.name, "app_running": node.app_running, "peer_port": node.peer_port,
            "client_port": node.client_port, "amqp_port": node.amqp_port,
            "cluster_name": md.cluster_name,
            "metadata_version": md.version, "net_ticktime": node.config.net_ticktime,
            "paused": node.cluster.paused, **node.memory.status()}


async def cmd_force_gc(node, args):
    from .memory import full_collection
    return full_collection(node.memory.probe)


async def cmd_set_vm_memory_high_watermark(node, args):
    """A new high watermark for this node until it restarts (rabbitmqctl's command of that
    name): a fraction of memory, or an absolute size."""
    from mirroring.alarm import format_bytes, parse_watermark
    try:
        watermark = parse_watermark(args["value"])
    except ValueError as exc:
        raise ProtocolError(PRECONDITION_FAILED, str(exc)) from None
    limit = node.memory.set_watermark(watermark)
    return f"Setting memory threshold on {node.name} to {watermark} ({format_bytes(limit)}) ..."


async def cmd_cluster_status(node, args):
    md = _md(node)
    raft = node.cluster.raft
    return {"cluster_name": md.cluster_name, "node": node.name,
            "members": list(md.members), "running_nodes": sorted(node.running),
            "metadata_leader": node.cluster.leader, "term": raft.term if raft else None,
            "down": dict(md.down), "paused": node.cluster.paused,
            "refused_by": dict(node.cluster.refused_by)}


async def cmd_stop_app(node, args):
    await node.stop_app()
    return f"Stopping rabbit application on node {node.name} ..."


async def cmd_stop(node, args):
    """Stop the node and its process (rabbitmqctl stop): the process that runs the node installs
    `node.request_shutdown` (warren-server does); the shutdown itself runs there, after this
    answer has gone out."""
    hook = getattr(node, "request_shutdown", None)
    if hook is None:
        raise ProtocolError(NOT_ALLOWED, f"node {node.name} runs inside another program and cannot "
                                         "be stopped from warrenctl: stop that program")
    hook()
    return f"Stopping and halting node {node.name} ..."


async def cmd_start_app(node, args):
    await node.start_app()
    return f"Starting node {node.name} ..."


async def cmd_join_cluster(node, args):
    target = args["node"]
    host, port = configmod.lookup(target)  # an unknown name: a refusal with its reason (serve_ctl)
    if target == node.name or [host, port] == list(node.cluster.peer_addr or ()):
        raise ProtocolError(PRECONDITION_FAILED, f"cannot cluster node {node.name} with itself")
    try:
        members = await node.join_cluster(host, port)
    except OSError as exc:
        where = target if ":" in target else f"{target} ({host}:{port})"
        raise ProtocolError(NOT_FOUND,
                            f"cannot reach node {where}: {connect_reason(exc)}. Is it running?") from None
    return f"Clustering node {node.name} with {target}: members {members}"


async def cmd_reset(node, args):
    await node.reset()
    return f"Resetting node {node.name} ..."


async def cmd_forget_cluster_node(node, args):
    _require_running(node)
    target = configmod.node_name(args["node"], node.md.members)
    if target == node.name:
        raise ProtocolError(PRECONDITION_FAILED, "a node cannot forget itself: run reset on it instead")
    if target not in node.md.members:
        raise ProtocolError(NOT_FOUND, f"node {target} is not a member of cluster {node.md.cluster_name}")
    if target in node.running:
        raise ProtocolError(PRECONDITION_FAILED, f"node {target} is running: stop its app first")
    members = sorted(node.md.members)
    up = [n for n in members if n in node.running]  # running: this node and those it links to
    if 2 * len(up) <= len(members):
        # the metadata log records a change only with a majority of its members (RabbitMQ's
        # Mnesia would forget the node anyway; a Raft log cannot without risking a split)
        raise ProtocolError(PRECONDITION_FAILED, (
            f"cannot forget {target}: the cluster's metadata changes only with a majority of its "
            f"{len(members)} members ({', '.join(members)}), and only {', '.join(up)} run; "
            "start enough of the others first"))
    await node.cluster.propose(MemberRemove(target))
    return f"Removing node {target} from the cluster"


async def cmd_add_member(node, args):
    """A node asks to join (join_cluster on it named us): it gets the cluster's log."""
    _require_running(node)
    return await node.cluster.admit(args["name"], args["peer"], args["client"])


async def cmd_remove_member(node, args):
    _require_running(node)
    if args["name"] in node.running:
        raise ProtocolError(PRECONDITION_FAILED, f"node {args['name']} is still running")
    if args["name"] in node.md.members:
        await node.cluster.propose(MemberRemove(args["name"]))
    return None


def _vhost(node, args) -> str:
    """The vhost a command names (-p, default "/"); NOT_FOUND when there is none of that name."""
    vhost = args.get("vhost", "/")
    node.md.require_vhost(vhost)
    return vhost


def _queue_key(node, args) -> str:
    """The key of the queue a command names (its `queue`, in its -p vhost)."""
    name = args["queue"]
    if not isinstance(name, str):
        raise TypeError(f"'queue' must be a string, not {type(name).__name__}")
    return qualify(_vhost(node, args), name)


async def cmd_add_vhost(node, args):
    _require_running(node)
    await node.cluster.propose(VHostAdd(VHost(args["name"], args.get("description", ""),
                                              bool(args.get("tracing", False)))))
    return None


async def cmd_delete_vhost(node, args):
    """The vhost goes with everything in it: its queues' replicas stop on every node, and the
    connections into it are closed (Node.meta_changed)."""
    _require_running(node)
    node.md.require_vhost(args["name"])
    await node.cluster.propose(VHostDelete(args["name"]))
    return None


async def cmd_list_vhosts(node, args):
    return [{"name": v.name, "description": v.description, "tracing": v.tracing}
            for _, v in sorted(_md(node).vhosts.items())]


async def cmd_list_queues(node, args):
    _require_running(node)
    vhost = _vhost(node, args)
    columns = args.get("columns") or list(DEFAULT_QUEUE_COLUMNS)
    bad = [c for c in columns if c not in QUEUE_COLUMNS]
    if bad:
        raise ProtocolError(COMMAND_INVALID, f"unknown queue info item(s) {bad}; valid: {' '.join(QUEUE_COLUMNS)}")
    stats: dict = {}
    mirrors: dict = {}  # queue -> {node: pid}
    for per_node in (await _each_running_node(node, "queue_stats", {})).values():
        for qname, st in per_node.items():
            if st["role"] == "leader":
                stats[qname] = st
            else:
                mirrors.setdefault(qname, {})[st["node"]] = st["pid"]
    rows = []
    for name, q in sorted(node.md.queues.items()):
        if q.vhost != vhost:
            continue
        s = stats.get(name)
        pol = effective_policy(node.md.policies, q.name, vhost)
        op = effective_policy(node.md.operator_policies, q.name, vhost)
        listed = [n for n in q.mirrors if n in mirrors.get(name, {})]
        synced = set(s["synced"]) if s else set()
        full = {
            "name": q.name, "durable": q.durable, "auto_delete": q.auto_delete,
            "exclusive": q.exclusive, "arguments": q.arguments,
            "policy": pol.name if pol else "",
            "type": "classic",
            "effective_policy_definition": effective_definition(
                node.md.policies, node.md.operator_policies, q.name, vhost),
            "operator_policy": op.name if op else "",
            "pid": s["pid"] if s else "",
            "mirror_pids": [mirrors[name][n] for n in listed],
            "synchronised_mirror_pids": [mirrors[name][n] for n in listed if n in synced],
            "messages": s["messages"] if s else 0,
            "messages_ready": s["messages_ready"] if s else 0,
            "messages_unacknowledged": s["messages_unacknowledged"] if s else 0,
            "consumers": s["consumers"] if s else 0,
            "leader": q.leader, "state": ("syncing" if s and s.get("sync") else "running") if s else "down",
            "sync_progress": progress_line(s["sync"]) if s and s.get("sync") else "",
        }
        full["slave_pids"] = full["mirror_pids"]
        full["synchronised_slave_pids"] = full["synchronised_mirror_pids"]
        rows.append({c: full[c] for c in columns})
    return rows


async def _from_every_node(node, rpc: str, order=None) -> list:
    """The rows `rpc` gives on every running node, together (sorted by the key `order`)."""
    _require_running(node)
    rows = [row for per_node in (await _each_running_node(node, rpc, {})).values() for row in per_node]
    return sorted(rows, key=order) if order is not None else rows


async def cmd_list_connections(node, args):
    return await _from_every_node(node, "connections")


async def cmd_list_channels(node, args):
    return await _from_every_node(node, "channels", lambda r: (r["connection"], r["number"]))


async def cmd_close_connection(node, args):
    """rabbitmqctl's close_connection: a client connection, named as list_connections names it
    (NODE/NUMBER), is closed by the server with CONNECTION_FORCED and the explanation."""
    _require_running(node)
    name, explanation = args["name"], args.get("explanation") or "closed by warrenctl"
    owner, _, sid = name.rpartition("/")
    if not sid.isdigit() or owner not in node.running:
        raise ProtocolError(NOT_FOUND, f"no connection '{name}' (names as list_connections gives "
                                       f"them: NODE/NUMBER, on a running node)")
    await node.cluster.call_node(owner, "close_connection", {"sid": int(sid), "name": name,
                                                             "explanation": explanation})
    return f"Closing connection {name}, reason: {explanation}..."


async def cmd_list_consumers(node, args):
    """The consumers of the queues of the vhost `args` names (of every vhost when it names
    none)."""
    vhost = _vhost(node, args) if "vhost" in args else None
    rows = await _from_every_node(node, "consumers",
                                  lambda r: (r["vhost"], r["queue_name"], r["consumer_tag"]))
    return [r for r in rows if vhost is None or r["vhost"] == vhost]


async def cmd_delete_queue(node, args):
    _require_running(node)
    key = _queue_key(node, args)
    if key not in node.md.queues:
        raise ProtocolError(NOT_FOUND, f"no {in_vhost('queue', key)}")
    await node.cluster.propose(QueueDelete(key))
    vhost, name = split_key(key)
    return f"Deleting queue '{name}' on vhost '{vhost}' ..."


async def cmd_purge_queue(node, args):
    return await _leader_rpc(node, "purge", args)


async def _set_policy(node, args, make, change) -> None:
    """set_policy and set_operator_policy: `make` validates the record, `change` carries it."""
    _require_running(node)
    record = make(args["name"], args["pattern"], args["definition"], args.get("priority", 0),
                  args.get("apply_to", "all"), _vhost(node, args))
    await node.cluster.propose(change(record))


async def _clear_policy(node, args, policies: dict, what: str, change) -> None:
    """clear_policy and clear_operator_policy: `what` names the kind in the not-found error."""
    _require_running(node)
    key = qualify(_vhost(node, args), args["name"])
    if key not in policies:
        raise ProtocolError(NOT_FOUND, policy_not_found(what, key))
    await node.cluster.propose(change(key))


async def cmd_set_policy(node, args):
    await _set_policy(node, args, make_policy, PolicySet)


async def cmd_clear_policy(node, args):
    await _clear_policy(node, args, node.md.policies, "policy", PolicyClear)


def _policy_rows(node, args, policies: dict, *extra: str) -> list[dict]:
    vhost = _vhost(node, args)
    return [{"vhost": p.vhost, "name": p.name, "pattern": p.pattern, "apply-to": p.apply_to,
             "definition": p.definition, "priority": p.priority,
             **{k: getattr(p, k) for k in extra}}
            for p in sorted(policies.values(), key=lambda p: p.name) if p.vhost == vhost]


async def cmd_list_policies(node, args):
    return _policy_rows(node, args, node.md.policies, "set_by")


async def cmd_set_operator_policy(node, args):
    await _set_policy(node, args, make_operator_policy, OperatorPolicySet)


async def cmd_clear_operator_policy(node, args):
    await _clear_policy(node, args, node.md.operator_policies, "operator policy",
                        OperatorPolicyClear)


async def cmd_list_operator_policies(node, args):
    return _policy_rows(node, args, node.md.operator_policies)


async def cmd_list_exchanges(node, args):
    """Every exchange of the vhost, the built-in ones among them (the default exchange's name
    is "")."""
    _require_running(node)
    vhost = _vhost(node, args)
    return [{col: getattr(x, col) for col in EXCHANGE_COLUMNS}
            for _, x in sorted(node.md.exchanges.items()) if x.vhost == vhost]


async def cmd_list_bindings(node, args):
    """Every binding of the vhost, as rabbitmqctl lists them: first the default exchange's
    implicit one to each queue (its routing key the queue's name), then the declared ones, by
    source."""
    _require_running(node)
    vhost = _vhost(node, args)
    md = node.md
    return [{"source_name": src, "source_kind": "exchange", "destination_name": dest,
             "destination_kind": kind, "routing_key": key, "arguments": args}
            for _, src, dest, kind, key, args in named_binding_rows(md.queues, md.bindings,
                                                                     md.exchange_bindings, vhost)]


async def _leader_rpc(node, rpc: str, args: dict):
    """A command carried out by the leader of the queue `args` names (in its -p vhost). If the
    leader's node goes before it answers (the metadata has not recorded it down yet), the
    command is refused with that reason."""
    _require_running(node)
    queue = _queue_key(node, args)
    qdef = node.md.queues.get(queue)
    if qdef is None:
        raise ProtocolError(NOT_FOUND, f"no {in_vhost('queue', queue)}")
    node.check_queue_available(qdef)
    try:
        return await node.cluster.call_node(qdef.leader, rpc, {"queue": queue})
    except NodeStopped:
        mirrors = " (a mirror takes over if one may: try again)" if qdef.mirrors else ""
        raise ProtocolError(NOT_FOUND, f"the leader of {in_vhost('queue', queue)}, on node "
                                       f"{qdef.leader}, went down before it answered{mirrors}") from None


async def cmd_sync_queue(node, args):
    return await _leader_rpc(node, "sync_queue", args)


async def cmd_cancel_sync_queue(node, args):
    return await _leader_rpc(node, "cancel_sync_queue", args)


async def cmd_sync_status(node, args):
    return await _leader_rpc(node, "sync_status", args)


async def cmd_node_is_mirror_sync_critical(node, args):
    """The mirrored queues this node leads whose only synchronised replica it holds (RabbitMQ's
    node-is-mirror-sync-critical check; mirroring/maintenance.py has the rule)."""
    _require_running(node)
    return {"node": node.name,
            "queues": [shown(k) for k in sync_critical_queues(node.md, node.name, node.running)]}


async def cmd_maintenance_status(node, args):
    """What a rolling restart watches: the members' peer addresses, the running nodes, and per
    queue its replicas (from the metadata) with its leader's sync figures (the one running now,
    the last one ended). `waiting`: the queues a rolling restart waits for, given the mirror
    counts (`least_mirrors`, by queue key: records.qualify) they had before its node went down.
    A queue is named by its name and vhost, as RabbitMQ lists them."""
    _require_running(node)
    md = node.md
    reports: dict = {}
    for per_node in (await _each_running_node(node, "sync_report", {})).values():
        reports.update(per_node)
    queues = []
    for q in replicas(md):
        report = reports.get(q.name, {})
        vhost, name = split_key(q.name)
        queues.append({"name": name, "vhost": vhost, "leader": q.leader, "mirrors": list(q.mirrors),
                       "synced": list(q.synced), "mirrored": q.mirrored, "sync_mode": q.sync_mode,
                       "messages": report.get("messages", 0), "sync": report.get("sync"),
                       "last_sync": report.get("last_sync")})
    return {"node": node.name, "members": {n: list(rec.peer) for n, rec in md.members.items()},
            "running_nodes": sorted(node.running), "queues": queues,
            "waiting": [{"name": name, "vhost": vhost, "why": why} for (vhost, name), why in
                        ((split_key(k), why) for k, why in
                         unsynchronised_queues(md, node.running, args.get("least_mirrors")).items())]}


COMMANDS = {
    "node_is_mirror_sync_critical": cmd_node_is_mirror_sync_critical,
    "maintenance_status": cmd_maintenance_status,
    "sync_queue": cmd_sync_queue, "cancel_sync_queue": cmd_cancel_sync_queue,
    "sync_status": cmd_sync_status,
    "add_vhost": cmd_add_vhost, "delete_vhost": cmd_delete_vhost, "list_vhosts": cmd_list_vhosts,
    "set_policy": cmd_set_policy, "clear_policy": cmd_clear_policy,
    "list_policies": cmd_list_policies,
    "set_operator_policy": cmd_set_operator_policy,
    "clear_operator_policy": cmd_clear_operator_policy,
    "list_operator_policies": cmd_list_operator_policies,
    "status": cmd_status, "force_gc": cmd_force_gc, "set_vm_memory_high_watermark": cmd_set_vm_memory_high_watermark,
    "cluster_status": cmd_cluster_status, "stop": cmd_stop,
    "stop_app": cmd_stop_app,
    "start_app": cmd_start_app, "join_cluster": cmd_join_cluster, "reset": cmd_reset,
    "forget_cluster_node": cmd_forget_cluster_node, "add_member": cmd_add_member,
    "remove_member": cmd_remove_member, "list_queues": cmd_list_queues,
    "list_connections": cmd_list_connections, "list_consumers": cmd_list_consumers,
    "list_exchanges": cmd_list_exchanges, "list_bindings": cmd_list_bindings,
    "list_channels": cmd_list_channels, "close_connection": cmd_close_connection,
    "delete_queue": cmd_delete_queue, "purge_queue": cmd_purge_queue,
    **access_control.COMMANDS,
}


# --- node-to-node requests -------------------------------------------------------------------

async def node_rpc(node, name: str, args: dict):
    if name == "queue_stats":
        now = trio.current_time()
        return {qname: qp.replica.stats(now) for qname, qp in node.router.replicas.items()}
    if name == "sync_report":
        now = trio.current_time()
        return {qname: {"messages": qp.replica.q.stats()["messages"],
                        "sync": qp.replica.sync.pacer.progress(now) if qp.replica.sync else None,
                        "last_sync": qp.replica.last_sync}
                for qname, qp in node.router.replicas.items() if qp.role == "leader"}
    if name == "connections":
        blocked = node.memory.blocked
        return [{"node": node.name, "name": s.conn_id, "peer": s.peer, "user": s.user,
                 "vhost": s.vhost,
                 "client_name": s.client_name, "channels": len(s.channels),
                 "protocol": s.protocol,
                 # RabbitMQ's words: held (blocked), would be held if it published (blocking)
                 "state": ("blocked" if s.publisher else "blocking") if blocked else "running"}
                for s in node.clients()]
    if name == "channels":
        return [{"node": node.name, "connection": s.conn_id, "number": ch.id, "vhost": s.vhost,
                 "name": f"{s.conn_id} ({ch.id})", "user": s.user, "confirm": ch.confirm,
                 "transactional": ch.tx, "consumer_count": len(ch.consumers),
                 "messages_unacknowledged": ch.unacked(), "messages_unconfirmed": ch.inflight,
                 "prefetch_count": ch.prefetch}
                for s in node.clients() for ch in s.channels.values()]
    if name == "close_connection":
        conn = node.connections.get(args["sid"])
        if conn is None:
            raise ProtocolError(NOT_FOUND, f"no connection '{args['name']}'")
        conn.force_close(CONNECTION_FORCED, args["explanation"])
        return None
    if name == "consumers":
        return [{"queue_name": split_key(qname)[1], "vhost": split_key(qname)[0],
                 "consumer_tag": c.tag,
                 "channel": f"{c.owner[0]}/{c.owner[1]}:{c.owner[2]}", "ack_required": not c.no_ack,
                 "prefetch_count": c.prefetch, "exclusive": c.exclusive, "arguments": c.arguments}
                for qname, qp in node.router.replicas.items() if qp.role == "leader"
                for c in qp.replica.q.consumers.values()]
    if name == "queue_known":
        return await node.cluster.queue_known(args["queue"])
    if name == "admit":
        return await node.cluster.admit(args["name"], args["peer"], args["client"])
    if name in ("sync_queue", "cancel_sync_queue", "sync_status", "purge"):
        qname = args["queue"]
        qp = node.router.replicas.get(qname)
        if qp is None or qp.role != "leader":
            raise ProtocolError(NOT_FOUND, f"no {in_vhost('queue', qname)} on {node.name}")
        if name == "sync_queue":
            def start(replica, now):
                started = replica.request_sync("sync_queue", now)
                return {"started": started, "unsynchronised": replica.sync_status(now)["unsynchronised"]}
            return await node.router.ask(qname, start)
        if name == "cancel_sync_queue":
            return await node.router.ask(qname, lambda r, now: {"cancelled": r.cancel_sync(now)})
        if name == "sync_status":
            return await node.router.ask(qname, lambda r, now: r.sync_status(now))
        return await node.router.ask(qname, lambda r, now: r.purge_now())
    raise ProtocolError(COMMAND_INVALID, f"unknown node request {name!r}")
