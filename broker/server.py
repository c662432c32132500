"""`warren-server`: run one node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from . import config as configmod
from . import log as logmod
from .network import TcpNetwork
from .node import Node


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="warren-server", description="Run one warren node.")
    p.add_argument("--name", help="node name (WARREN_NODE_NAME)")
    p.add_argument("--host", help="address to bind (WARREN_HOST, default 127.0.0.1)")
    p.add_argument("--advertise-host", dest="advertise_host", help="address others use to reach this node")
    p.add_argument("--client-port", dest="client_port", type=int, help="client port (default 5672)")
    p.add_argument("--peer-port", dest="peer_port", type=int, help="peer/control port (default 25672)")
    p.add_argument("--secret", help="cluster secret (WARREN_SECRET)")
    p.add_argument("--secret-file", dest="secret_file", help="file holding the cluster secret (WARREN_SECRET_FILE)")
    p.add_argument("--net-ticktime", dest="net_ticktime", type=float, help="seconds of silence before a peer is down (default 60)")
    p.add_argument("--log-format", dest="log_format", choices=["console", "json"])
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--data-dir", dest="data_dir", help="where the node keeps its cluster metadata")
    p.add_argument("--cluster-seed", dest="cluster_seed", help="on first boot, join the cluster of this node (NAME or HOST:PEER_PORT)")
    p.add_argument("--max-frame", dest="max_frame", type=int, help="maximum frame size in bytes")
    p.add_argument("--queue-leader-locator", dest="queue_leader_locator", choices=["client-local", "balanced"])
    p.add_argument("--mirroring-sync-batch-size", dest="mirroring_sync_batch_size", type=int,
                   help="messages per batch sync batch when the policy sets no ha-sync-batch-size (default 4096)")
    p.add_argument("--mirroring-sync-max-throughput", dest="mirroring_sync_max_throughput", type=int,
                   help="batch sync limit in bytes per second (default 0: no limit)")
    p.add_argument("--config", help="TOML configuration file (WARREN_CONFIG_FILE)")
    return vars(p.parse_args(argv))


async def serve(cfg: configmod.NodeConfig) -> None:
    node = Node(cfg, TcpNetwork())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for sig in signals:
                node.log.info("shutting down", signal=signal.Signals(sig).name)
                await node.stop_app()
                configmod.unregister(cfg.name)
                nursery.cancel_scope.cancel()
                break


def main(argv=None) -> None:
    flags = parse_args(argv)
    try:
        cfg = configmod.load(flags)
    except configmod.ConfigError as exc:
        print(f"warren-server: {exc}", file=sys.stderr)
        sys.exit(2)
    logmod.configure(cfg.log_format, cfg.log_level)
    try:
        trio.run(serve, cfg)
    except OSError as exc:
        print(f"warren-server: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
