"""The management HTTP API, Prometheus metrics and web UI of a node (`--http-port`).

Served from the node's own trio process by hypercorn's trio worker, with a Starlette app
(app.py): RabbitMQ's management API paths and shapes (any node answers for the whole cluster),
`GET /metrics` (metrics.py), and the web UI's static files (ui/) at `/`. The server lives as long
as the process, like the peer port: while the app is stopped it still answers, with every node
shown as not running.

`Management` is what the node holds (`node.management`): the timeline of events (events.py),
fed by the node where the metadata is applied, and the rate samples (rates.py). The metadata is
read only through state.py.
"""

from __future__ import annotations

import functools

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ..log import clip
from . import state
from .events import Timeline
from .rates import Rates


class Management:
    def __init__(self, node):
        self.node = node
        self.timeline = Timeline(node)
        self.rates = Rates()
        self.started_at = trio.current_time()

    # --- the node's news -----------------------------------------------------------------------
    def meta_changed(self, change) -> None:
        """Called by the node after each applied change, inside the metadata's apply loop: a
        failure here is logged and costs the timeline an event, never the node its metadata."""
        try:
            self.timeline.meta_changed(change, state.applied(self.node))
        except Exception:  # noqa: BLE001
            self.node.log.exception("the management timeline could not follow a metadata change")
            self.timeline.resync(state.applied(self.node))

    def link_down(self, peer: str) -> None:
        self.timeline.link_down(peer)

    # --- live counts ---------------------------------------------------------------------------
    def observe(self, leaders: dict) -> None:
        """Feed one look at the leaders' stats to the rates and the timeline's sync events."""
        now = trio.current_time()
        self.rates.observe(leaders, now)
        for name, st in leaders.items():
            self.timeline.sync_seen(name, st.get("sync"), st["node"])


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve(node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on the node's http_port (0: any free one) until cancelled; reports the port."""
    from .app import build_app
    management = Management(node)
    management.timeline.resync(state.metadata(node))
    node.management = management
    config = HypercornConfig()
    config.bind = [f"{_bind_host(node.config.host)}:{node.config.http_port}"]
    config.accesslog = None
    config.errorlog = None  # the app logs its own failures through the node's log
    config.graceful_timeout = 0.5
    cfg = node.config
    if cfg.tls_cert:  # HTTPS, with the client ports' certificate rules
        import ssl
        config.certfile, config.keyfile, config.ca_certs = cfg.tls_cert, cfg.tls_key or cfg.tls_cert, cfg.tls_ca
        config.verify_mode = (ssl.CERT_REQUIRED if cfg.tls_fail_if_no_peer_cert
                              else ssl.CERT_OPTIONAL if cfg.tls_verify_peer else ssl.CERT_NONE)
    app = build_app(management)
    port = None
    while True:
        try:
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(functools.partial(hypercorn_serve, app, config))
                if port is None:
                    port = int(binds[0].rpartition(":")[2])
                    config.bind = [f"{_bind_host(node.config.host)}:{port}"]  # the same one again
                    node.log.info("management listening", http_port=port)
                    task_status.started(port)
        except Exception as exc:  # noqa: BLE001
            # hypercorn lets a request broken off in the middle escape at times (its error answer
            # sent while another send is in flight: trio.BusyResourceError), which ends its
            # server: the HTTP connections of the moment are dropped, the listener starts again,
            # and the node carries on
            node.stranger_log.warning("management HTTP server restarted", error=clip(repr(exc), 255))
            await trio.sleep(0.1)
