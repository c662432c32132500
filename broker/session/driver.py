"""The trio side of a session: carries out what the core (broker/session/core.py) cannot do
without waiting. A front end (broker/connection.py's protocols) hands client commands to
`handle` (or a read's run of publishes and acks to `handle_run`), and before each read waits
for credit (`wait_credit`) and, after a run, for room on a full peer link (`wait_link_room`).
What waits here: the cluster's log (a declare, an exchange or a binding: the core's
`Propose` and `DeclareQueue` actions), a peer link's writer, and the credit window (the
`trio.Event` the core's `when_room` sets).
"""

from __future__ import annotations

import trio

from mirroring.changes import QueueDelete
from wire.errors import INTERNAL_ERROR, ProtocolError

from .channels import CLOSE, ChannelError, as_channel_error
from .core import INLINE, DeclareQueue, Propose, Session
from .host import NodeHost


class SessionDriver:
    """One connection's session: the core (`core`, what the node's router and metadata talk
    to) and the waiting around it (`handle`, `wait_credit`, `wait_link_room`)."""

    def __init__(self, host: NodeHost, core: Session):
        self.host = host
        self.core = core

    @classmethod
    def open(cls, node, peer: str, user: str, client_name: str, out,
             vhost: str = "/") -> "SessionDriver":
        """A new session on `node` in `vhost`, registered with it (`node.sessions`: the router's
        events and the metadata's changes go to its core)."""
        host = NodeHost(node)
        sid = node.new_session_id()
        core = Session(host, sid, peer, user, client_name, out, vhost)
        config = node.config
        core.channel_max = config.channel_max
        core.max_tx_bytes = config.max_tx_bytes
        node.sessions[sid] = core
        return cls(host, core)

    async def handle(self, msg) -> bool:
        """One client command; True when the client closed the connection. A ChannelError
        closes the channel; any other ProtocolError is the front end's to answer."""
        core = self.core
        if type(msg) in INLINE:
            core.handle_now(msg)
        else:
            action = core.handle(msg)
            while action is not None:
                if action is CLOSE:
                    return True
                try:
                    action = action.then(await self._carry_out(action))
                except ChannelError as exc:
                    core.action_failed(action, exc)
                    action = None
        if core.full_links:  # a publish (a run of them, or a tx.commit's) went to a full link
            await self.wait_link_room()
        return False

    async def _carry_out(self, action):
        """What an action waits for: a change recorded by the log, or a queue declared."""
        if type(action) is DeclareQueue:
            return await self.host.declare_queue(self.core, action.msg)
        assert type(action) is Propose
        try:
            return await self.host.propose(action.change)
        except ProtocolError as exc:
            raise as_channel_error(exc) from None
        except trio.TooSlowError:
            raise ChannelError(INTERNAL_ERROR, "timed out waiting for the cluster to record the change") from None

    def handle_run(self, msgs: list, i: int) -> int:
        """The core's `handle_run`: call `wait_link_room` after it when `full_links`."""
        return self.core.handle_run(msgs, i)

    @property
    def full_links(self) -> list[str]:
        return self.core.full_links

    async def wait_link_room(self) -> None:
        """Back-pressure for publishes to remote leaders: after a run of publishes, wait while
        the link to a leader that one of them went to is past its writer's high watermark (the
        publish itself was queued: a run never waits halfway)."""
        full = self.core.full_links
        while full:
            await self.host.wait_link_room(full.pop())

    async def wait_credit(self) -> None:
        """Hold the client while too much is in flight (credit flow): the core calls
        `when_room` once credit may be back (a publish accepted, a queue lost, the end)."""
        core = self.core
        while not core.has_credit and not core.closed:
            room = trio.Event()
            core.when_room = room.set
            await room.wait()

    async def delete_exclusive(self) -> None:
        """The connection is gone: its exclusive queues go with it."""
        for qname in list(self.core.exclusive_queues):
            with trio.move_on_after(5):
                try:
                    await self.host.propose(QueueDelete(qname))
                except ProtocolError:
                    pass
