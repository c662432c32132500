"""The AMQP port's connections: the connection driver (broker/connection.py: the socket, the
tasks, the timers, credit and memory-alarm holds) speaking the sans-IO AMQP 0-9-1 protocol
(broker/amqp/protocol.py). While credit flow or a memory alarm holds a connection, the client
is told `connection.blocked` (`connection.unblocked` when it is released) and its heartbeats are
not checked meanwhile.
"""

from __future__ import annotations

from ..connection import ClientConnection
from . import protocol as proto


class AmqpConnection(ClientConnection):
    """A connection on the AMQP port."""

    def make_protocol(self, now: float) -> proto.AmqpProtocol:
        node = self.node
        return proto.AmqpProtocol(
            authenticate=lambda mechanism, user, password: self._authenticate(user, password),
            can_open=self._can_open, has_vhost=self._has_vhost, enter_vhost=self._enter_vhost,
            node=node.name, cluster=node.cluster.md.cluster_name, channel_max=node.config.channel_max,
            max_message=max(4096, node.config.max_frame - 65536), now=now)

    def _can_open(self) -> str:
        self._check_connection_limit()
        node = self.node
        if not node.app_running:
            return f"node {node.name} is not running (its app is stopped)"
        if node.cluster.paused:
            return node.paused_reason()
        return ""
