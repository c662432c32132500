"""How a chaos runner carries out one fault action, shared by the runner on real processes
(real.py) and the one in the simulation (sim.py).

Both take an action the same way (`FaultRunner.carry_out`): a fault aimed at one node
(schedule.NODE_KINDS) first resolves its target, and is skipped when another fault holds that
node down already; a warrenctl command on the queue (QUEUE_COMMANDS) is skipped when no node
runs, as for an operator whose warrenctl finds no running node. Then the handler the runner's
table (`handlers`: fault kind -> handler) gives for the kind carries it out. A kind the table
does not have is an error. Adding a kind is one entry in schedule.KINDS and one handler per
runner that can inject it.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from .schedule import NODE_KINDS

QUEUE_COMMANDS = ("policy", "sync", "cancel_sync")  # warrenctl commands about the queue

# a handler: (the action, its record, the target node or None, the runner's context)
Handler = Callable[..., Awaitable[None]]


class FaultRunner:
    """What a runner gives `carry_out`: its table of handlers, and how it resolves a target,
    tells whether any node runs, and records a skipped action."""

    def handlers(self) -> dict[str, Handler]:
        raise NotImplementedError

    async def fault_target(self, a, context) -> str:
        """The node a fault aimed at one node goes to now."""
        raise NotImplementedError

    def any_node_running(self) -> bool:
        raise NotImplementedError

    def skip_if_down(self, a, rec, node: str) -> bool:
        """True (the reason recorded in `rec`) when the action must not run on `node` now."""
        raise NotImplementedError

    def skip_no_node_running(self, a, rec) -> None:
        raise NotImplementedError

    async def carry_out(self, a, rec, context) -> None:
        kind = a.kind
        node = None
        if kind in NODE_KINDS:
            node = await self.fault_target(a, context)
            rec.target = node
            if self.skip_if_down(a, rec, node):
                return
        elif kind in QUEUE_COMMANDS and not self.any_node_running():
            self.skip_no_node_running(a, rec)
            return
        handler = self.handlers().get(kind)
        if handler is None:
            raise RuntimeError(f"unknown fault kind {kind}")
        await handler(a, rec, node, context)
