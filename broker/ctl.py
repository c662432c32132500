"""`warrenctl`: a rabbitmqctl-shaped command line for warren nodes.

`-n NODE` picks the node (a local node name, or HOST:PEER_PORT); the cluster secret comes from
the same places as the server's. Output is tab-separated like rabbitmqctl, or JSON with
`--formatter json`. Errors name the problem and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import trio

from wire.errors import ProtocolError

from . import config as configmod
from .control import DEFAULT_QUEUE_COLUMNS, QUEUE_COLUMNS, ctl_call
from .network import TcpNetwork

CONNECTION_COLUMNS = ("name", "node", "peer", "user", "client_name", "channels")
POLICY_COLUMNS = ("vhost", "name", "pattern", "apply-to", "definition", "priority")
CONSUMER_COLUMNS = ("queue_name", "channel", "consumer_tag", "ack_required", "prefetch_count",
                    "exclusive", "arguments")


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument("-n", "--node", default=d(os.environ.get("WARREN_NODE", "warren")),
                   help="node name (local) or HOST:PEER_PORT (default $WARREN_NODE or 'warren')")
    p.add_argument("--secret", default=d(None),
                   help="cluster secret (else WARREN_SECRET, WARREN_SECRET_FILE, $WARREN_HOME/cookie)")
    p.add_argument("--secret-file", dest="secret_file", default=d(None))
    p.add_argument("--formatter", choices=["table", "json"], default=d("table"))
    p.add_argument("-q", "--quiet", action="store_true", default=d(False), help="no header lines")
    p.add_argument("-t", "--timeout", type=float, default=d(30.0))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="warrenctl", description="Manage warren nodes, like rabbitmqctl.")
    _global_options(p, True)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=lambda **kw: argparse.ArgumentParser(parents=[common], **kw))
    sub.add_parser("status")
    sub.add_parser("cluster_status")
    sub.add_parser("stop_app")
    sub.add_parser("start_app")
    sub.add_parser("reset")
    j = sub.add_parser("join_cluster")
    j.add_argument("target", help="a node of the cluster to join (NAME or HOST:PEER_PORT)")
    f = sub.add_parser("forget_cluster_node")
    f.add_argument("target")
    lq = sub.add_parser("list_queues")
    lq.add_argument("-p", "--vhost", default="/")
    lq.add_argument("columns", nargs="*", metavar="COLUMN", help=" ".join(QUEUE_COLUMNS))
    for name in ("list_connections", "list_consumers"):
        s = sub.add_parser(name)
        s.add_argument("-p", "--vhost", default="/")
        s.add_argument("columns", nargs="*")
    for name in ("delete_queue", "purge_queue", "sync_queue", "cancel_sync_queue"):
        s = sub.add_parser(name)
        s.add_argument("-p", "--vhost", default="/")
        s.add_argument("queue")
    sp = sub.add_parser("set_policy", help="set_policy [--priority N] [--apply-to queues|all] NAME PATTERN DEFINITION")
    sp.add_argument("-p", "--vhost", default="/")
    sp.add_argument("--priority", default="0")
    sp.add_argument("--apply-to", dest="apply_to", default="all")
    sp.add_argument("name")
    sp.add_argument("pattern")
    sp.add_argument("definition", help="a JSON object, e.g. '{\"ha-mode\":\"all\"}'")
    cp = sub.add_parser("clear_policy")
    cp.add_argument("-p", "--vhost", default="/")
    cp.add_argument("name")
    lp = sub.add_parser("list_policies")
    lp.add_argument("-p", "--vhost", default="/")
    return p


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


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        host, port = configmod.lookup(args.node)
        secret = configmod.resolve_secret(args.secret, args.secret_file)
    except configmod.ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    cmd = args.command
    payload: dict = {}
    columns = None
    header = None
    if cmd in ("join_cluster", "forget_cluster_node"):
        payload["node"] = args.target
    elif cmd == "list_queues":
        if args.vhost != "/":
            print(f"Error: virtual host '{args.vhost}' does not exist (warren has only '/')", file=sys.stderr)
            return 2
        columns = args.columns or list(DEFAULT_QUEUE_COLUMNS)
        payload["columns"] = columns
        header = "Listing queues for vhost / ..."
    elif cmd == "list_connections":
        columns = args.columns or ["name", "node", "peer", "user"]
        header = "Listing connections ..."
    elif cmd == "list_consumers":
        columns = args.columns or list(CONSUMER_COLUMNS)
        header = "Listing consumers in vhost / ..."
    elif cmd in ("delete_queue", "purge_queue", "sync_queue", "cancel_sync_queue"):
        payload["queue"] = args.queue
    elif cmd == "set_policy":
        try:
            priority = int(args.priority)
        except ValueError:
            print(f"Error: --priority must be an integer, got {args.priority!r}", file=sys.stderr)
            return 2
        payload.update(name=args.name, pattern=args.pattern, definition=args.definition,
                       priority=priority, apply_to=args.apply_to)
        print(f'Setting policy "{args.name}" for pattern "{args.pattern}" to "{args.definition}" '
              f'with priority "{priority}" for vhost "/" ...', file=sys.stderr)
    elif cmd == "clear_policy":
        payload["name"] = args.name
        print(f'Clearing policy "{args.name}" on vhost "/" ...', file=sys.stderr)
    elif cmd == "list_policies":
        columns = list(POLICY_COLUMNS)
        header = "Listing policies for vhost \"/\" ..."
    for c in columns or []:
        valid = {"list_queues": QUEUE_COLUMNS, "list_connections": CONNECTION_COLUMNS,
                 "list_consumers": CONSUMER_COLUMNS, "list_policies": POLICY_COLUMNS}[cmd]
        if c not in valid:
            print(f"Error: unknown column {c!r} for {cmd}; valid: {' '.join(valid)}", file=sys.stderr)
            return 2
    me = f"warrenctl-{os.getpid()}"
    try:
        value = trio.run(ctl_call, TcpNetwork(), host, port, me, secret, cmd, payload, args.timeout)
    except ProtocolError as exc:
        print(f"Error: {exc.text}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"Error: unable to perform an operation on node '{args.node}' ({host}:{port}): "
              f"{exc.strerror or exc}. Is the node running?", file=sys.stderr)
        return 69
    except trio.TooSlowError:
        print(f"Error: node '{args.node}' did not answer within {args.timeout:g} s", file=sys.stderr)
        return 75
    if cmd == "sync_queue" and args.formatter != "json":
        return _follow_sync(args, host, port, me, secret, value)
    if args.formatter == "json":
        print(json.dumps(value, indent=None if isinstance(value, list) else 2))
        return 0
    if columns is not None:
        if not args.quiet and header:
            print(header)
            print("\t".join(columns))
        if value:
            print(_table(value, columns))
    elif cmd == "cluster_status":
        print(f"Cluster status of node {value['node']} ...")
        print(f"Cluster name: {value['cluster_name']}")
        print("Members: " + ", ".join(value["members"]))
        print("Running nodes: " + ", ".join(value["running_nodes"]))
    elif isinstance(value, dict):
        for k, v in value.items():
            print(f"{k}\t{_cell(v)}")
    elif value is not None:
        print(value)
    return 0


def _follow_sync(args, host, port, me, secret, started: dict) -> int:
    """sync_queue: show the sync's progress until it ends (a bar on a terminal, lines otherwise)."""
    import time

    from mirroring.sync import progress_line
    q = args.queue
    print(f"Synchronising queue '{q}' in vhost '/' ...")
    if not started["started"]:
        print(f"queue '{q}' has no unsynchronised mirror: nothing to do")
        return 0
    tty = sys.stdout.isatty()
    last_print = 0.0
    while True:
        try:
            st = trio.run(ctl_call, TcpNetwork(), host, port, me, secret, "sync_status", {"queue": q},
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
    if tty:
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
