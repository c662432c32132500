"""The management HTTP API, Prometheus metrics and web UI of a node (`--http-port`).

Served from the node's own trio process: the node's listener hands each connection to hypercorn's
trio server for one connection (what escapes it ends that connection only), with a Starlette app
(app.py): RabbitMQ's management API paths and shapes (any node answers for the whole cluster),
`GET /metrics` (metrics.py), and the web UI's static files (ui/) at `/`. The server lives as long
as the process, like the peer port: while the app is stopped it still answers, with every node
shown as not running.

`Management` is what the node holds (`node.management`): the timeline of events (events.py),
fed by the node where the metadata is applied, and the rate samples (rates.py). The metadata is
read only through state.py.
"""

from __future__ import annotations


import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

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
        self.metric_lines: dict = {}  # /metrics' per-queue lines of the last scrape (metrics.py)

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


def connection_server(app, config: HypercornConfig, log):
    """The handler of one accepted HTTP connection: hypercorn's server for that connection
    alone. What escapes it (a request broken off at times makes hypercorn send its error answer
    while another send is in flight: trio.BusyResourceError) ends this connection only, not the
    listener and the node; it is logged to `log`."""
    context = WorkerContext(None)

    async def one_connection(stream) -> None:
        server = TCPServer(app, config, context, ConnectionState({}), stream)
        try:
            await server
        except Exception as exc:  # noqa: BLE001
            log.warning("management connection ended by an error", error=clip(repr(exc), 255))
        finally:
            # the server and its protocol refer to each other (the protocol sends through a
            # method of the server): left whole, every connection's objects and buffers would
            # wait for the interpreter's rare full collection, tens of MB under a flood of them
            vars(server).clear()

    return one_connection


async def serve(node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on the node's http_port (0: any free one) until cancelled; reports the port."""
    from .app import build_app
    management = Management(node)
    management.timeline.resync(state.metadata(node))
    node.management = management
    config = HypercornConfig()
    config.accesslog = None
    config.errorlog = None  # the app logs its own failures through the node's log
    cfg = node.config
    if cfg.tls_cert:  # HTTPS, with the client ports' certificate rules
        import ssl
        config.certfile, config.keyfile, config.ca_certs = cfg.tls_cert, cfg.tls_key or cfg.tls_cert, cfg.tls_ca
        config.verify_mode = (ssl.CERT_REQUIRED if cfg.tls_fail_if_no_peer_cert
                              else ssl.CERT_OPTIONAL if cfg.tls_verify_peer else ssl.CERT_NONE)
    app = wrap_app(build_app(management), config.wsgi_max_body_size, None)
    one_connection = connection_server(app, config, node.stranger_log)

    listeners = await trio.open_tcp_listeners(cfg.http_port, host=cfg.host)
    port = listeners[0].socket.getsockname()[1]
    ssl_context = config.create_ssl_context()
    if ssl_context is not None:
        listeners = [trio.SSLListener(one, ssl_context, https_compatible=True) for one in listeners]
    node.log.info("management listening", http_port=port)
    task_status.started(port)
    await trio.serve_listeners(one_connection, listeners)
