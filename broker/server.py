"""`warren-server`: run one node until SIGINT/SIGTERM or `warrenctl stop`.

Start-up problems a user can fix (a port already in use, a `--cluster-seed` that names no known
node, a bad setting, cluster state saved by an older warren) end the process with one line on
stderr and a non-zero exit, not a traceback.

The cyclic garbage collector is tuned for a broker (`tune_gc`): every message makes short-lived
containers, so at the default threshold (700) a young collection ran every hundred messages or
so; objects that live from start-up on are frozen out of every collection.
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import signal
import socket
import sys

import trio

from . import config as configmod
from . import log as logmod
from . import tls as tlsmod
from .network import TcpNetwork
from .node import Node
from .statefile import StateFormatError

STOP_REPLY_GRACE = 0.05  # let `warrenctl stop` have its answer before the node starts stopping
GC_THRESHOLDS = (100_000, 50, 100)  # young collections per 100k new containers, not per 700


def tune_gc() -> None:
    """Measured with `warren-bench run` (throughput-r1 and -all, 6 interleaved pairs): `all`
    confirmed 132.5k -> 137.6k msgs/s by medians, non-mirrored unchanged; latency at 2,000/s
    unchanged (against the same build with the default thresholds). What a cycle holds waits at
    most one young collection longer."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# Why SCHED_BATCH by default. A node's round ends with writes to several sockets: the replication
# batch to each mirror, confirms to publishers. Under SCHED_OTHER each write that wakes a process
# on this machine (a mirror node, a client) lets that process preempt the writer at once, on the
# writer's CPU (a loopback write is a "sync" wake-up). The round's next write then waits for the
# woken process to finish its own work, so the mirrors of one message are served one after the
# other, and throughput pays a context switch per write. SCHED_BATCH keeps normal priority and
# fairness (its nice value still counts) but a task woken by this one no longer preempts it: the
# round finishes its writes, then blocks, and the woken ones run, on the idle CPU if there is one.
# On machines of their own (a real cluster) nodes rarely share a CPU, and the policy changes
# little. `--sched-policy other` gives the usual SCHED_OTHER, to compare the two on a machine.
def apply_sched_policy(policy: str) -> str | None:
    """Put this process under `policy` ("batch" or "other"); a reason when that is impossible."""
    wanted = {"batch": getattr(os, "SCHED_BATCH", None), "other": getattr(os, "SCHED_OTHER", None)}[policy]
    if wanted is None or not hasattr(os, "sched_setscheduler"):
        return f"this system has no SCHED_{policy.upper()} (the node runs under its default policy)"
    try:
        os.sched_setscheduler(0, wanted, os.sched_param(0))
    except OSError as exc:
        return f"SCHED_{policy.upper()} refused: {exc.strerror or exc}"
    return None


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="warren-server", description="Run one warren node.")
    p.add_argument("--name", help="node name (WARREN_NODE_NAME)")
    p.add_argument("--host", help="address to bind (WARREN_HOST, default 127.0.0.1)")
    p.add_argument("--advertise-host", dest="advertise_host", help="address others use to reach this node")
    p.add_argument("--client-port", dest="client_port", type=int, help="client port (default 5672)")
    p.add_argument("--amqp-port", dest="amqp_port", type=int,
                   help="AMQP 0-9-1 port (WARREN_AMQP_PORT, default 5673; 5672 is the client port)")
    p.add_argument("--peer-port", dest="peer_port", type=int, help="peer/control port (default 25672)")
    p.add_argument("--http-port", dest="http_port", type=int,
                   help="management HTTP API, /metrics and web UI port (WARREN_HTTP_PORT; off unless set)")
    p.add_argument("--secret", help="cluster secret (WARREN_SECRET)")
    p.add_argument("--secret-file", dest="secret_file", help="file holding the cluster secret (WARREN_SECRET_FILE)")
    p.add_argument("--net-ticktime", dest="net_ticktime", type=float, help="seconds of silence before a peer is down (default 60)")
    p.add_argument("--log-format", dest="log_format", choices=["console", "json"])
    p.add_argument("--log-level", dest="log_level", type=str.lower,
                   choices=["debug", "info", "warning", "error"],
                   help="least severe level logged (WARREN_LOG_LEVEL, default info)")
    p.add_argument("--data-dir", dest="data_dir", help="where the node keeps its cluster metadata")
    p.add_argument("--cluster-seed", dest="cluster_seed", help="on first boot, join the cluster of this node (NAME or HOST:PEER_PORT)")
    p.add_argument("--max-frame", dest="max_frame", type=int, help="maximum frame size in bytes")
    p.add_argument("--queue-leader-locator", dest="queue_leader_locator", choices=["client-local", "balanced"],
                   help="where a new queue's leader goes when its declaration does not say "
                        "(WARREN_QUEUE_LEADER_LOCATOR, default client-local)")
    p.add_argument("--users", help="the users a new cluster starts with, administrators, as "
                                   "NAME:PASSWORD,... (read at first boot only; WARREN_USERS, "
                                   "default guest:guest)")
    p.add_argument("--loopback-users", dest="loopback_users",
                   help="users allowed to connect from localhost only, NAME,... or 'none' "
                        "(WARREN_LOOPBACK_USERS, default guest)")
    p.add_argument("--mirroring-sync-batch-size", dest="mirroring_sync_batch_size", type=int,
                   help="messages per batch sync batch when the policy sets no ha-sync-batch-size (default 4096)")
    p.add_argument("--mirroring-sync-max-throughput", dest="mirroring_sync_max_throughput", type=int,
                   help="batch sync limit in bytes per second (default 0: no limit)")
    p.add_argument("--memory-high-watermark", dest="memory_high_watermark",
                   help="memory alarm: a fraction of the machine's memory (default 0.4) or an absolute "
                        "size such as 512MiB or 2GB; above it, publishing connections are held "
                        "(WARREN_MEMORY_HIGH_WATERMARK)")
    p.add_argument("--sched-policy", dest="sched_policy", choices=["batch", "other"],
                   help="Linux scheduling policy of the node: batch (SCHED_BATCH: processes it "
                        "wakes do not preempt it mid-round) or other (SCHED_OTHER) "
                        "(WARREN_SCHED_POLICY, default batch)")
    p.add_argument("--tls-cert", dest="tls_cert",
                   help="the node's certificate (PEM): turns TLS on for the peer, client and HTTP "
                        "ports and opens the AMQPS port (WARREN_TLS_CERT)")
    p.add_argument("--tls-key", dest="tls_key", help="its private key, if not in the certificate's file (WARREN_TLS_KEY)")
    p.add_argument("--tls-ca", dest="tls_ca",
                   help="CA certificates (PEM) that peers' and clients' certificates are checked against (WARREN_TLS_CA)")
    p.add_argument("--tls-verify-peer", dest="tls_verify_peer", action=argparse.BooleanOptionalAction,
                   default=None, help="ask clients for a certificate and check any given (WARREN_TLS_VERIFY_PEER)")
    p.add_argument("--tls-fail-if-no-peer-cert", dest="tls_fail_if_no_peer_cert",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="refuse clients that give no certificate (WARREN_TLS_FAIL_IF_NO_PEER_CERT)")
    p.add_argument("--amqps-port", dest="amqps_port", type=int,
                   help="AMQP 0-9-1 over TLS port when TLS is on (WARREN_AMQPS_PORT, default 5671)")
    p.add_argument("--managed-ha", dest="managed_ha", action="store_const", const=True,
                   help="Amazon MQ's managed HA policy: a system policy mirrors every queue on "
                        "all nodes, and every policy gets ha-mode all, ha-sync-mode automatic "
                        "(WARREN_MANAGED_HA, TOML managed_ha)")
    p.add_argument("--handshake-timeout", dest="handshake_timeout", type=float,
                   help="seconds a client connection has to log in before it is closed "
                        "(WARREN_HANDSHAKE_TIMEOUT, default 10)")
    p.add_argument("--login-failure-delay", dest="login_failure_delay", type=float,
                   help="seconds before a refused login is answered (WARREN_LOGIN_FAILURE_DELAY, default 1)")
    p.add_argument("--max-connections", dest="max_connections", type=int,
                   help="client connections per node, AMQP and native together "
                        "(WARREN_MAX_CONNECTIONS, default 0: no limit)")
    p.add_argument("--channel-max", dest="channel_max", type=int,
                   help="channels per client connection (WARREN_CHANNEL_MAX, default 2047)")
    p.add_argument("--max-tx-bytes", dest="max_tx_bytes", type=int,
                   help="uncommitted publish bytes one transaction may hold "
                        "(WARREN_MAX_TX_BYTES, default 67108864: 64 MiB)")
    p.add_argument("--config", help="TOML configuration file (WARREN_CONFIG_FILE)")
    return vars(p.parse_args(argv))


async def serve(cfg: configmod.NodeConfig, node: Node | None = None) -> None:
    """Run the node until SIGINT/SIGTERM or a `warrenctl stop` (the `request_shutdown` hook the
    control plane calls), then stop its app (a controlled shutdown) and unregister it."""
    node = node or node_for(cfg)
    stop = trio.Event()
    reason: dict = {}

    def request_shutdown(why: str = "warrenctl stop") -> None:
        reason.setdefault("why", why)
        stop.set()

    node.request_shutdown = request_shutdown
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)

        async def on_signals():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for sig in signals:
                    request_shutdown(signal.Signals(sig).name)
                    return

        nursery.start_soon(on_signals)
        await stop.wait()
        if reason["why"] == "warrenctl stop":
            await trio.sleep(STOP_REPLY_GRACE)
        node.log.info("shutting down", reason=reason["why"])
        await node.stop_app()
        configmod.unregister(cfg.name)
        nursery.cancel_scope.cancel()


def node_for(cfg: configmod.NodeConfig) -> Node:
    """The node of these settings, on TCP; with TLS, its contexts built (a TlsError if unusable)
    and its network dialing peers over TLS."""
    contexts = tlsmod.node_contexts(cfg)
    network = TcpNetwork(dial_tls=contexts.peer_dial if contexts else None, log=logmod.get(cfg.name))
    return Node(cfg, network, tls=contexts)


def _port_problem(host: str, port: int, option: str) -> str | None:
    """Why the node could not listen on host:port, or None. Binds (with SO_REUSEADDR, as the
    node's listeners do) and closes at once: a port in use is named before trio starts."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {host}:{port} ({option}): {exc.strerror or exc}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                what = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
                return (f"cannot listen on {host}:{port} ({option}): {what}; is another node "
                        f"(or another program) using it?")
    return None


def _first_os_error(exc: BaseException) -> OSError | None:
    """The OSError inside a (nested) exception group, if that is all there is to it."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _first_os_error(exc.exceptions[0])
    return None


def _fail(message: str, code: int) -> None:
    print(f"warren-server: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv=None) -> None:
    flags = parse_args(argv)
    try:
        cfg = configmod.load(flags)
    except configmod.ConfigError as exc:
        _fail(str(exc), 2)
    logmod.configure(cfg.log_format, cfg.log_level)
    try:
        node = node_for(cfg)
    except tlsmod.TlsError as exc:
        _fail(str(exc), 2)
    try:
        node.cluster.check_state_format()
    except StateFormatError as exc:
        _fail(str(exc), 1)
    if cfg.cluster_seed and not node.has_state():
        try:
            configmod.lookup(cfg.cluster_seed)
        except configmod.ConfigError as exc:
            _fail(f"--cluster-seed {cfg.cluster_seed}: {exc}", 2)
    for port, option in ((cfg.peer_port, "--peer-port"), (cfg.client_port, "--client-port"),
                         (cfg.amqp_port, "--amqp-port"), (cfg.http_port, "--http-port"),
                         (cfg.amqps_port if cfg.tls_cert else None, "--amqps-port")):
        if port is None:
            continue
        problem = _port_problem(cfg.host, port, option)
        if problem:
            _fail(problem, 1)
    tune_gc()
    sched_problem = apply_sched_policy(cfg.sched_policy)
    if sched_problem:
        node.log.warning("scheduling policy not applied", policy=cfg.sched_policy, reason=sched_problem)
    try:
        trio.run(serve, cfg, node)
    except (OSError, BaseExceptionGroup) as exc:
        os_error = _first_os_error(exc)
        if os_error is None:
            raise
        _fail(str(os_error), 1)


if __name__ == "__main__":
    main()
