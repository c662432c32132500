"""`warrenctl`: a rabbitmqctl-shaped command line for warren nodes.

`-n NODE` picks the node (a local node name, or HOST:PEER_PORT); without it, $WARREN_NODE, else
the one local node running under $WARREN_HOME/run (with none or several, the error lists them and
says how to name one). The cluster secret comes from the same places as the server's. Output is
tab-separated like rabbitmqctl, or JSON with `--formatter json`. Errors name the problem and exit
non-zero; a mistyped command or column gets the nearest valid ones. `stop` returns once the
node's process has exited.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import time

import trio

from wire.errors import ProtocolError

from . import config as configmod
from .control import (BINDING_COLUMNS, DEFAULT_EXCHANGE_COLUMNS, DEFAULT_QUEUE_COLUMNS,
                      EXCHANGE_COLUMNS, QUEUE_COLUMNS, ctl_call)
from .network import TcpNetwork, connect_reason

CONNECTION_COLUMNS = ("name", "node", "peer", "user", "vhost", "client_name", "channels", "state")
VHOST_COLUMNS = ("name", "description", "tracing")
# set_by: "user", "managed-ha" (the managed HA's system policy) or "user+managed-ha" (a user's
# policy whose HA keys the managed HA added or replaced: broker/config.py `managed_ha`)
POLICY_COLUMNS = ("vhost", "name", "pattern", "apply-to", "definition", "priority", "set_by")
OPERATOR_POLICY_COLUMNS = ("vhost", "name", "pattern", "apply-to", "definition", "priority")
CHANNEL_COLUMNS = ("name", "connection", "number", "node", "user", "confirm", "transactional",
                   "consumer_count", "messages_unacknowledged", "messages_unconfirmed",
                   "prefetch_count")
DEFAULT_CHANNEL_COLUMNS = ("name", "user", "consumer_count", "messages_unacknowledged")
CONSUMER_COLUMNS = ("queue_name", "channel", "consumer_tag", "ack_required", "prefetch_count",
                    "exclusive", "arguments")


# The list commands: their valid columns, the columns shown when none are named, the header
# ({vhost}: the -p vhost of the listings that take one, VHOST_LISTINGS).
LISTINGS = {
    "list_vhosts": (VHOST_COLUMNS, ("name",), "Listing vhosts ..."),
    "list_queues": (QUEUE_COLUMNS, DEFAULT_QUEUE_COLUMNS, "Listing queues for vhost {vhost} ..."),
    "list_connections": (CONNECTION_COLUMNS, ("name", "node", "peer", "user"), "Listing connections ..."),
    "list_channels": (CHANNEL_COLUMNS, DEFAULT_CHANNEL_COLUMNS, "Listing channels ..."),
    "list_consumers": (CONSUMER_COLUMNS, CONSUMER_COLUMNS, "Listing consumers in vhost {vhost} ..."),
    "list_exchanges": (EXCHANGE_COLUMNS, DEFAULT_EXCHANGE_COLUMNS, "Listing exchanges for vhost {vhost} ..."),
    "list_bindings": (BINDING_COLUMNS, BINDING_COLUMNS, "Listing bindings for vhost {vhost}..."),
    "list_policies": (POLICY_COLUMNS, POLICY_COLUMNS, 'Listing policies for vhost "{vhost}" ...'),
    "list_operator_policies": (OPERATOR_POLICY_COLUMNS, OPERATOR_POLICY_COLUMNS,
                               'Listing operator policy overrides for vhost "{vhost}" ...'),
}
# The user and permission listings: their columns, their header (formatted with the arguments).
USER_LISTINGS = {
    "list_users": (("user", "tags"), "Listing users ..."),
    "list_permissions": (("user", "configure", "write", "read"),
                         'Listing permissions for vhost "{vhost}" ...'),
    "list_user_permissions": (("vhost", "configure", "write", "read"),
                              'Listing permissions for user "{user}" ...'),
}
VHOST_LISTINGS = ("list_queues", "list_consumers", "list_exchanges", "list_bindings",
                  "list_policies", "list_operator_policies")
POLICY_SETTERS = {"set_policy": "policy", "set_operator_policy": "operator policy override"}
POLICY_CLEARERS = {"clear_policy": "policy", "clear_operator_policy": "operator policy"}


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument("-n", "--node", default=d(os.environ.get("WARREN_NODE") or None),
                   help="node name (local) or HOST:PEER_PORT (default $WARREN_NODE, else the only "
                        "local node running under $WARREN_HOME/run)")
    p.add_argument("--secret", default=d(None),
                   help="cluster secret (else WARREN_SECRET, WARREN_SECRET_FILE, $WARREN_HOME/cookie)")
    p.add_argument("--secret-file", dest="secret_file", default=d(None), help="file holding the cluster secret")
    p.add_argument("--formatter", choices=["table", "json"], default=d("table"), help="output format")
    p.add_argument("-q", "--quiet", action="store_true", default=d(False), help="no header lines")
    p.add_argument("-t", "--timeout", type=float, default=d(30.0),
                   help="seconds to wait for the node (default 30)")
    p.add_argument("--tls-cert", dest="tls_cert", default=d(os.environ.get("WARREN_TLS_CERT") or None),
                   help="a certificate to present to nodes whose peer port speaks TLS "
                        "(default $WARREN_TLS_CERT): TLS to the node when set")
    p.add_argument("--tls-key", dest="tls_key", default=d(os.environ.get("WARREN_TLS_KEY") or None),
                   help="its private key (default $WARREN_TLS_KEY)")
    p.add_argument("--tls-ca", dest="tls_ca", default=d(os.environ.get("WARREN_TLS_CA") or None),
                   help="the CA the node's certificate is checked against (default $WARREN_TLS_CA)")


# What sync_queue's rate means, in its help (the bar and the summary show the same figure).
SYNC_RATE_HELP = ("The rate shown, in the progress bar and in the closing summary alike, is the "
                  "bytes of message bodies sent to the mirrors divided by the seconds since the "
                  "sync started (until it ended, once every mirror acknowledged the last batch); "
                  "MB is 10^6 bytes. The bar is drawn once more with the final figures at the end.")


def nearest(word: str, choices, what: str) -> str:
    """`unknown WHAT 'word'`, with the nearest of `choices` when one is close enough."""
    def likeness(choice: str) -> float:
        return difflib.SequenceMatcher(None, word, choice).ratio()

    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    close = [c for c in close if likeness(c) >= likeness(close[0]) - 0.1]  # only the nearest ones
    hint = f": did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown {what} {word!r}{hint}"


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistyped command answered in one line that names the nearest commands."""

    def error(self, message: str):
        bad = re.match(r"argument COMMAND: invalid choice: '([^']*)'", message)
        if bad:
            self.exit(2, f"{self.prog}: error: {nearest(bad.group(1), COMMAND_HELP, 'command')} "
                         f"(warrenctl --help lists the commands)\n")
        super().error(message)


# Every command with its one-line description, in the order `warrenctl --help` lists them.
COMMAND_HELP = {
    # nodes
    "status": "node name, ports, app state, metadata version, memory and alarms",
    "await_startup": "wait until the node runs its app (up to --timeout)",
    "stop": "stop the node cleanly (queues handed over) and exit",
    "stop_app": "stop the app; the node still answers warrenctl",
    "start_app": "start the node's app again",
    "set_vm_memory_high_watermark": "[absolute] VALUE: the memory alarm's mark until restart",
    "node_is_mirror_sync_critical": "fail if the node holds a queue's only synced replica",
    "force_gc": "a full garbage collection in the node now, a trim, and what they freed",
    # cluster
    "cluster_status": "cluster name, members and running nodes",
    "await_online_nodes": "wait until COUNT nodes run (up to --timeout)",
    "join_cluster": "join TARGET's cluster (stop_app first)",
    "reset": "leave the cluster, forget it (stop_app first)",
    "forget_cluster_node": "remove a stopped node from the members",
    "rolling_restart": "restart each node in turn, waiting for the mirrors' sync",
    # virtual hosts
    "add_vhost": "create a virtual host: NAME [--description TEXT] [--tracing]",
    "delete_vhost": "delete a virtual host and everything in it, on every node",
    "list_vhosts": "virtual hosts, with COLUMNs (default: name)",
    # queues, connections, consumers
    "list_queues": "queues, with COLUMNs (default: name messages)",
    "list_connections": "client connections on every running node",
    "list_channels": "channels of every client connection, with COLUMNs",
    "list_consumers": "consumers of every queue",
    "close_connection": "close a client connection, with an explanation",
    "list_exchanges": "exchanges, with COLUMNs (default: name type)",
    "list_bindings": "bindings (the default exchange's too), with COLUMNs",
    "delete_queue": "delete a queue and its messages",
    "purge_queue": "drop a queue's ready messages",
    "sync_queue": "synchronise a queue's mirrors now, with progress and its rate",
    "cancel_sync_queue": "stop a queue's running synchronisation",
    # policies
    "set_policy": "set a policy: NAME PATTERN DEFINITION",
    "clear_policy": "remove a policy",
    "list_policies": "list the policies, by name, with who set them",
    "set_operator_policy": "set an operator policy (caps queue limits): NAME PATTERN DEFINITION",
    "clear_operator_policy": "remove an operator policy",
    "list_operator_policies": "list the operator policies, by name",
    # users and permissions
    "add_user": "add a user: NAME PASSWORD (no tags, no permissions)",
    "delete_user": "remove a user and its permissions",
    "change_password": "set a user's password: NAME PASSWORD",
    "list_users": "users and their tags (never their passwords)",
    "set_user_tags": "NAME [TAG ...]: a user's tags (none: no tags)",
    "set_permissions": "[-p VHOST] USER CONF WRITE READ: three regular expressions",
    "clear_permissions": "[-p VHOST] USER: remove a user's permissions in a vhost",
    "list_permissions": "[-p VHOST]: every user's permissions in a vhost",
    "list_user_permissions": "USER: a user's permissions in every vhost",
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="warrenctl", description="Manage warren nodes, like rabbitmqctl.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=26),
        epilog="`warrenctl COMMAND --help` shows a command's arguments. Errors go to stderr and "
               "exit non-zero.")
    _global_options(p, True)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands",
                           parser_class=lambda **kw: argparse.ArgumentParser(parents=[common], **kw))

    def command(name: str) -> argparse.ArgumentParser:
        description = COMMAND_HELP[name] + (". " + SYNC_RATE_HELP if name == "sync_queue" else "")
        return sub.add_parser(name, help=COMMAND_HELP[name], description=description)

    for name in ("status", "await_startup", "stop", "stop_app", "start_app", "cluster_status", "reset",
                 "node_is_mirror_sync_critical", "force_gc"):
        command(name)
    _rolling_restart_options(command("rolling_restart"))
    w = command("set_vm_memory_high_watermark")
    w.add_argument("value", nargs="+", metavar="VALUE",
                   help="a fraction of memory (0.4), or 'absolute' and a size (absolute 512MiB)")
    a = command("await_online_nodes")
    a.add_argument("count", type=int, help="how many nodes must be running")
    j = command("join_cluster")
    j.add_argument("target", help="a node of the cluster to join (NAME or HOST:PEER_PORT)")
    f = command("forget_cluster_node")
    f.add_argument("target", help="the node to remove (its app must be stopped)")
    av = command("add_vhost")
    av.add_argument("name")
    av.add_argument("--description", default="")
    av.add_argument("--tracing", action="store_true", help="recorded and listed only")
    command("delete_vhost").add_argument("name")
    for name, (valid, _, _) in LISTINGS.items():
        s = command(name)
        if name in VHOST_LISTINGS:
            s.add_argument("-p", "--vhost", default="/")
        if name not in ("list_policies", "list_operator_policies"):  # they take no columns
            s.add_argument("columns", nargs="*", metavar="COLUMN", help=" ".join(valid))
    cc = command("close_connection")
    cc.add_argument("name", help="the connection's name, NODE/NUMBER, from list_connections")
    cc.add_argument("explanation", nargs="?", default="closed by warrenctl",
                    help="the reason the client is given")
    for name in ("delete_queue", "purge_queue", "sync_queue", "cancel_sync_queue"):
        s = command(name)
        s.add_argument("-p", "--vhost", default="/")
        s.add_argument("queue")
    for name, example in (("set_policy", '{"ha-mode":"all"}'),
                          ("set_operator_policy", '{"max-length":1000}')):
        sp = command(name)
        sp.add_argument("-p", "--vhost", default="/")
        sp.add_argument("--priority", default="0")
        sp.add_argument("--apply-to", dest="apply_to", default="all")
        sp.add_argument("name")
        sp.add_argument("pattern", help="a regular expression matched against queue names")
        sp.add_argument("definition", help=f"a JSON object, e.g. '{example}'")
    for name in POLICY_CLEARERS:
        cp = command(name)
        cp.add_argument("-p", "--vhost", default="/")
        cp.add_argument("name")
    _user_commands(command)
    # the subcommand list argparse prints under "commands", in COMMAND_HELP's order
    sub._choices_actions.sort(key=lambda a: list(COMMAND_HELP).index(a.dest))
    return p


def _user_commands(command) -> None:
    """The user and permission commands' arguments (rabbitmqctl's)."""
    for name, (args, helps) in {
        "add_user": (("name", "password"), ("the user's name", "its password")),
        "change_password": (("name", "password"), ("the user's name", "its new password")),
        "delete_user": (("name",), ("the user's name",)),
        "list_user_permissions": (("user",), ("the user's name",)),
    }.items():
        c = command(name)
        for arg, text in zip(args, helps):
            c.add_argument(arg, help=text)
    command("list_users")
    t = command("set_user_tags")
    t.add_argument("name", help="the user's name")
    t.add_argument("tags", nargs="*", metavar="TAG",
                   help="administrator, monitoring, policymaker or management (none: no tags)")
    for name in ("set_permissions", "clear_permissions", "list_permissions"):
        c = command(name)
        c.add_argument("-p", "--vhost", default="/")
        if name != "list_permissions":
            c.add_argument("user", help="the user's name")
        if name == "set_permissions":
            for kind in ("configure", "write", "read"):
                c.add_argument(kind, help=f"the {kind} permission: a regular expression over "
                                          "queue and exchange names")


def _rolling_restart_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--force", action="store_true",
                   help="take down a node even if it is sync-critical (node_is_mirror_sync_critical)")
    r.add_argument("--nodes", nargs="+", metavar="NODE", help="these members, in this order "
                   "(default: every member, in join order)")
    r.add_argument("--pause", type=float, default=0.0,
                   help="seconds each node's app stays stopped (default 0)")
    r.add_argument("--sync-timeout", dest="sync_timeout", type=float, default=600.0,
                   help="seconds to wait for the mirrors after each node (default 600)")
    r.add_argument("--client-log", dest="client_log", metavar="FILE",
                   help="a client's delivery log (a line per delivery, its first field the Unix "
                        "time it arrived): the report adds the longest gap around each node")


def _cell(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    if isinstance(v, dict):
        return json.dumps(v)
    return str(v)


def _table(rows: list[dict], columns) -> str:
    return "\n".join("\t".join(_cell(r.get(c, "")) for c in columns) for r in rows)


def ctl_network(args) -> TcpNetwork:
    """Plain TCP, or TLS to the peer port when a certificate is given (nodes with TLS on require
    one there)."""
    if not args.tls_cert:
        return TcpNetwork()
    from .tls import client_context
    return TcpNetwork(dial_tls=client_context(args.tls_cert, args.tls_key or "", args.tls_ca or ""))


_network = TcpNetwork()  # run() sets it from the TLS options


class _Refused(Exception):
    """A command line warrenctl refuses before asking any node: exit 2 with its message."""


def run(argv=None) -> int:
    global _network
    args = build_parser().parse_args(argv)
    try:
        from .tls import TlsError
        try:
            _network = ctl_network(args)
        except TlsError as exc:
            raise configmod.ConfigError(str(exc)) from None
        if args.node is None:
            args.node = default_node(args.command)
        secret = configmod.resolve_secret(args.secret, args.secret_file, create=False)
        waiter = WAITERS.get(args.command)
        if waiter is not None:
            return waiter(args, secret)
        host, port = configmod.lookup(args.node)
    except configmod.ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    if args.command == "rolling_restart":
        return _rolling_restart(args, secret, host, port)
    try:
        payload, columns, header = _request(args)
    except _Refused as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    return _call_and_show(args, secret, host, port, payload, columns, header)


def _await_startup(args, secret: bytes) -> int:
    return _await(args, secret, _started, f"node '{args.node}' to start")


def _await_online_nodes(args, secret: bytes) -> int:
    if args.count < 1:
        print("Error: COUNT must be at least 1", file=sys.stderr)
        return 2
    return _await(args, secret, _online(args.count),
                  f"{args.count} running node(s) in the cluster of '{args.node}'")


# The commands that wait for a node or a cluster to come up: name -> handler(args, secret).
WAITERS = {"await_startup": _await_startup, "await_online_nodes": _await_online_nodes}


def _request(args) -> tuple[dict, list | None, str | None]:
    """What to ask the node for `args.command`: its payload, and for a listing the columns to
    show and their header. Raises _Refused on a command line no node could answer."""
    cmd = args.command
    if cmd in USER_LISTINGS:
        columns, header = USER_LISTINGS[cmd]
        return _user_payload(args), list(columns), header.format(**vars(args))
    if cmd in USER_PAYLOADS:
        return _user_payload(args), None, None
    vhost = {"vhost": args.vhost} if hasattr(args, "vhost") else {}
    if cmd in LISTINGS:
        valid, default, header = LISTINGS[cmd]
        columns = getattr(args, "columns", None) or list(default)
        for c in columns:
            if c not in valid:
                raise _Refused(f"{nearest(c, valid, 'column')} ({cmd}'s columns: {' '.join(valid)})")
        payload = {"columns": columns} if cmd == "list_queues" else {}  # the node builds only these
        return {**payload, **vhost}, columns, header.format(vhost=getattr(args, "vhost", "/"))
    build = PAYLOADS.get(cmd)
    return {**(build(args) if build else {}), **vhost}, None, None


def _node_payload(args) -> dict:
    return {"node": args.target}


def _queue_payload(args) -> dict:
    return {"queue": args.queue}


def _vhost_payload(args) -> dict:
    if args.command == "add_vhost":
        print(f'Adding vhost "{args.name}" ...', file=sys.stderr)
        return {"name": args.name, "description": args.description, "tracing": args.tracing}
    print(f'Deleting vhost "{args.name}" ...', file=sys.stderr)
    return {"name": args.name}


def _watermark_payload(args) -> dict:
    words = args.value
    absolute = words[0] == "absolute"
    if absolute:
        words = words[1:]
    if len(words) != 1:
        raise _Refused("expected a fraction (0.4) or 'absolute' and a size (absolute 512MiB)")
    # rabbitmqctl's `absolute 1073741824` is bytes; a bare number is otherwise a fraction
    return {"value": words[0] + "B" if absolute and words[0].isdigit() else words[0]}


def _close_connection_payload(args) -> dict:
    return {"name": args.name, "explanation": args.explanation}


def _set_policy_payload(args) -> dict:
    try:
        priority = int(args.priority)
    except ValueError:
        raise _Refused(f"--priority must be an integer, got {args.priority!r}") from None
    print(f'Setting {POLICY_SETTERS[args.command]} "{args.name}" for pattern "{args.pattern}" to '
          f'"{args.definition}" with priority "{priority}" for vhost "{args.vhost}" ...',
          file=sys.stderr)
    return {"name": args.name, "pattern": args.pattern, "definition": args.definition,
            "priority": priority, "apply_to": args.apply_to}


def _clear_policy_payload(args) -> dict:
    print(f'Clearing {POLICY_CLEARERS[args.command]} "{args.name}" on vhost "{args.vhost}" ...',
          file=sys.stderr)
    return {"name": args.name}


# What the user and permission commands say they do (stderr, like the policy commands).
USER_ANNOUNCE = {
    "add_user": 'Adding user "{name}" ...',
    "delete_user": 'Deleting user "{name}" ...',
    "change_password": 'Changing password for user "{name}" ...',
    "set_user_tags": 'Setting tags for user "{name}" to [{tags}] ...',
    "set_permissions": 'Setting permissions for user "{user}" in vhost "{vhost}" ...',
    "clear_permissions": 'Clearing permissions for user "{user}" in vhost "{vhost}" ...',
}
# each user command's request: the arguments it sends
USER_PAYLOADS = {
    "add_user": ("name", "password"), "delete_user": ("name",),
    "change_password": ("name", "password"), "set_user_tags": ("name", "tags"),
    "set_permissions": ("vhost", "user", "configure", "write", "read"),
    "clear_permissions": ("vhost", "user"), "list_users": (), "list_permissions": ("vhost",),
    "list_user_permissions": ("user",),
}


def _user_payload(args) -> dict:
    announce = USER_ANNOUNCE.get(args.command)
    if announce and not args.quiet:
        shown = {**vars(args), "tags": ", ".join(getattr(args, "tags", None) or ())}
        print(announce.format(**shown), file=sys.stderr)
    return {key: getattr(args, key) for key in USER_PAYLOADS[args.command]}


# The commands whose request carries arguments: name -> builder(args) -> payload. The others
# (and the listings, which _request handles) send an empty one.
PAYLOADS = {
    "join_cluster": _node_payload,
    "forget_cluster_node": _node_payload,
    "set_vm_memory_high_watermark": _watermark_payload,
    "close_connection": _close_connection_payload,
    "add_vhost": _vhost_payload,
    "delete_vhost": _vhost_payload,
    "delete_queue": _queue_payload,
    "purge_queue": _queue_payload,
    "sync_queue": _queue_payload,
    "cancel_sync_queue": _queue_payload,
    **{name: _set_policy_payload for name in POLICY_SETTERS},
    **{name: _clear_policy_payload for name in POLICY_CLEARERS},
}


def _call_and_show(args, secret: bytes, host: str, port: int, payload: dict, columns, header) -> int:
    """Send the command to the node, then print its answer (or what went wrong); the exit code."""
    cmd = args.command
    me = f"warrenctl-{os.getpid()}"
    process = local_process(host, port) if cmd == "stop" else None
    try:
        value = trio.run(ctl_call, _network, host, port, me, secret, cmd, payload, args.timeout)
    except ProtocolError as exc:
        hint = ("; if the node's peer port speaks TLS, give --tls-cert, --tls-key and --tls-ca "
                "(or WARREN_TLS_CERT, WARREN_TLS_KEY, WARREN_TLS_CA)"
                if "before the handshake" in exc.text and not args.tls_cert else "")
        print(f"Error: {exc.text}{hint}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"Error: unable to perform an operation on node '{args.node}' ({host}:{port}): "
              f"{connect_reason(exc)}. Is the node running?", file=sys.stderr)
        return 69
    except trio.TooSlowError:
        print(f"Error: node '{args.node}' did not answer within {args.timeout:g} s", file=sys.stderr)
        return 75
    if cmd == "node_is_mirror_sync_critical":
        return _sync_critical_result(args, value)
    if cmd == "sync_queue" and args.formatter != "json":
        return _follow_sync(args, host, port, me, secret, value)
    if cmd == "stop" and not _stopped(args, process, host, port, me, secret):
        return 75
    _show(args, value, columns, header)
    return 0


def _stopped(args, process, host: str, port: int, me: str, secret: bytes) -> bool:
    """After `stop`: wait for the node's process to exit (or, remote, for it to stop answering);
    False, having said why, when it does not within the timeout."""
    if process is not None:
        if not wait_exited(*process, args.timeout):
            print(f"Error: node '{args.node}' accepted stop, but its process (pid {process[0]}) "
                  f"has not exited after {args.timeout:g} s (-t/--timeout); its log says what "
                  f"it is doing", file=sys.stderr)
            return False
    elif not _wait_gone(host, port, me, secret, args.timeout):
        print(f"Error: node '{args.node}' accepted stop but still answers after {args.timeout:g} s",
              file=sys.stderr)
        return False
    return True


def _show(args, value, columns, header) -> None:
    """Print a node's answer: JSON, a listing's table, cluster_status's summary, or key/values."""
    if args.formatter == "json":
        if getattr(args, "columns", None) and isinstance(value, list):
            value = [{c: row.get(c) for c in columns} for row in value]  # the columns asked for
        print(json.dumps(value, indent=None if isinstance(value, list) else 2))
    elif columns is not None:
        if not args.quiet and header:
            print(header)
            print("\t".join(columns))
        if value:
            print(_table(value, columns))
    elif args.command == "cluster_status":
        _show_cluster_status(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            print(f"{k}\t{_cell(v)}")
    elif value is not None:
        print(value)


def _show_cluster_status(value: dict) -> None:
    print(f"Cluster status of node {value['node']} ...")
    print(f"Cluster name: {value['cluster_name']}")
    print("Members: " + ", ".join(value["members"]))
    print("Running nodes: " + ", ".join(value["running_nodes"]))
    if value.get("paused"):
        print("Paused: clients refused, no majority of the members reachable (pause_minority)")
    for peer, reason in sorted((value.get("refused_by") or {}).items()):
        print(f"Link refused by {peer}: {reason}")


def _sync_critical_result(args, value: dict) -> int:
    """node_is_mirror_sync_critical's answer: exit 0 when no queue depends on the node alone."""
    queues = value["queues"]
    if queues:
        message = (f"node {value['node']} holds the only synchronised replica of {len(queues)} "
                   f"mirrored queue(s): {', '.join(queues)}")
    else:
        message = f"node {value['node']} reported no mirrored queues whose only synchronised replica it holds"
    if args.formatter == "json":
        print(json.dumps({"result": "error" if queues else "ok", "node": value["node"],
                          "queues": queues, "message": message}))
    elif queues:
        print(f"Error: {message}", file=sys.stderr)
    elif not args.quiet:
        print(message)
    return 1 if queues else 0


def _rolling_restart(args, secret: bytes, host: str, port: int) -> int:
    """rolling_restart (broker/rolling.py): progress on stdout (stderr with --formatter json),
    then the per-node report."""
    from .rolling import RollingError, RollingRestart, print_report, report_rows

    me = f"warrenctl-{os.getpid()}"
    entry = args.node

    def call(where, command, payload, timeout):
        h, p = (host, port) if where == entry else where
        return trio.run(ctl_call, _network, h, p, me, secret, command, payload, timeout)

    out = sys.stderr if args.formatter == "json" else sys.stdout
    rolling = RollingRestart(call, entry, force=args.force, pause=args.pause,
                             sync_timeout=args.sync_timeout, timeout=args.timeout,
                             say=lambda line: print(line, file=out, flush=True))
    code = 0
    try:
        rolling.run(args.nodes)
    except RollingError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        code = 1
    except ProtocolError as exc:
        print(f"Error: {exc.text}", file=sys.stderr)
        code = 1
    except (OSError, trio.TooSlowError) as exc:
        print(f"Error: a node did not answer: {connect_reason(exc) if isinstance(exc, OSError) else 'timed out'}",
              file=sys.stderr)
        code = 69
    if rolling.reports or args.formatter == "json":
        print_report(report_rows(rolling.reports, args.client_log), args.formatter)
    return code


def default_node(command: str) -> str:
    """The node of a command given no -n (and no $WARREN_NODE): the one local node running under
    $WARREN_HOME/run. A ConfigError that says how to name a node when none or several run."""
    from .localcluster import running_registered

    run = configmod.warren_home() / "run"
    running = sorted(running_registered(run.parent))
    if len(running) == 1:
        return running[0]
    how = "name one with -n NAME (a local node) or -n HOST:PEER_PORT, or set $WARREN_NODE"
    if not running:
        raise configmod.ConfigError(f"no node given and no local node runs under {run} "
                                    f"($WARREN_HOME/run): {how}")
    raise configmod.ConfigError(f"no node given and {len(running)} local nodes run under {run}: "
                                f"{', '.join(running)}; {how} (e.g. warrenctl -n {running[0]} {command})")


def local_process(host: str, port: int) -> tuple[int, str] | None:
    """The pid and name of the local node registered under $WARREN_HOME/run with this peer
    address, if its process runs on this machine (None otherwise: a remote node)."""
    from .localcluster import is_node_process

    for path in (configmod.warren_home() / "run").glob("*.json"):
        try:
            entry = json.loads(path.read_text())
            peer_host, peer_port = entry["peer"]
            pid, name = int(entry["pid"]), str(entry["name"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if peer_port == port and (host == peer_host or host in ("127.0.0.1", "localhost")) \
                and is_node_process(pid, name)[0]:
            return pid, name
    return None


def wait_exited(pid: int, name: str, timeout: float) -> bool:
    """Wait until process `pid` no longer runs node `name` (gone, or a zombie); False if it still
    does after `timeout` seconds."""
    from .localcluster import is_node_process

    deadline = time.monotonic() + timeout
    while is_node_process(pid, name)[0]:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _started(status: dict) -> str | None:
    return None if status.get("app_running") else "its app is not running"


def _online(count: int):
    def check(status: dict) -> str | None:
        running = status.get("running_nodes", [])
        return None if len(running) >= count else f"running: {', '.join(running)}"
    return check


def _await(args, secret: bytes, check, what: str) -> int:
    """await_startup / await_online_nodes: ask the node again and again (it may not even be
    registered yet) until `check(answer)` returns None or --timeout runs out."""
    command = "status" if check is _started else "cluster_status"
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            host, port = configmod.lookup(args.node)
            answer = trio.run(ctl_call, _network, host, port, f"warrenctl-{os.getpid()}", secret,
                              command, {}, max(0.5, min(5.0, deadline - time.monotonic())))
            problem = check(answer)
        except ProtocolError as exc:
            if "secret" in exc.text:
                print(f"Error: {exc.text}", file=sys.stderr)
                return 1
            problem = exc.text
        except configmod.ConfigError as exc:
            problem = str(exc)
        except (OSError, trio.TooSlowError) as exc:
            problem = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if problem is None:
            if args.command == "await_online_nodes" and args.formatter != "json":
                print(f"Running nodes: {', '.join(answer['running_nodes'])}")
            return 0
        if time.monotonic() >= deadline:
            print(f"Error: timed out after {args.timeout:g} s waiting for {what}: {problem}",
                  file=sys.stderr)
            return 75
        time.sleep(0.2)


def _wait_gone(host: str, port: int, me: str, secret: bytes, timeout: float) -> bool:
    """After `stop`: wait until the node no longer answers on its peer port (asking it for its
    status, so that the node logs no half-opened connection)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            trio.run(ctl_call, _network, host, port, me, secret, "status", {}, 2.0)
        except (OSError, ProtocolError, trio.TooSlowError, trio.BrokenResourceError):
            return True
        time.sleep(0.1)
    return False


def _follow_sync(args, host, port, me, secret, started: dict) -> int:
    """sync_queue: show the sync's progress until it ends (a bar on a terminal, lines otherwise)."""
    from mirroring.sync import progress_line
    q = args.queue
    vhost = getattr(args, "vhost", "/")
    print(f"Synchronising queue '{q}' in vhost '{vhost}' ...")
    if not started["started"]:
        print(f"queue '{q}' has no unsynchronised mirror: nothing to do")
        return 0
    tty = sys.stdout.isatty()
    last_print = 0.0
    while True:
        try:
            st = trio.run(ctl_call, _network, host, port, me, secret, "sync_status",
                          {"queue": q, "vhost": vhost},
                          args.timeout)
        except (ProtocolError, OSError, trio.TooSlowError) as exc:
            print(f"\nError: lost track of the sync: {getattr(exc, 'text', exc)}", file=sys.stderr)
            return 1
        if st["progress"]:
            line = progress_line(st["progress"])
            if tty:
                print("\r" + line, end="", flush=True)
            elif time.monotonic() - last_print >= 1.0:
                print(line, flush=True)
                last_print = time.monotonic()
        if not st["running"]:
            break
        time.sleep(0.2)
    last = st["last"] or {}
    if last:
        print(("\r" if tty else "") + progress_line(last))  # the final figures, as the summary's
    elif tty:
        print()
    status = last.get("status", "completed")
    print(f"sync {status}: {last.get('messages', 0):,} messages, {last.get('bytes', 0):,} bytes in "
          f"{last.get('elapsed', 0):.2f} s ({last.get('rate_msgs', 0):,.0f} msgs/s, "
          f"{last.get('rate_bytes', 0) / 1e6:.1f} MB/s)")
    return 0 if status == "completed" else 1


def main(argv=None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
