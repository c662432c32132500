"""A queue's consumer as the queue sees it: who it is (the owning session and its tag), how it
acknowledges, and the credit its prefetch leaves it. Shared by a queue's leader side
(mirroring/queue.py) and its mirror side (mirroring/queue_mirror.py), which keeps the same
consumers so a promoted mirror serves them at once."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DISPATCH = 2048  # messages handed out per dispatch() call, so one queue cannot hog the loop


@dataclass(slots=True)
class Consumer:
    owner: tuple
    tag: str
    no_ack: bool
    prefetch: int
    exclusive: bool = False
    arguments: dict = field(default_factory=dict)
    in_flight: int = 0
    priority: int = field(init=False, default=0)  # x-priority (checked at basic.consume)

    def __post_init__(self):
        p = self.arguments.get("x-priority")
        self.priority = p if type(p) is int else 0

    def credit(self) -> int:
        if self.no_ack or self.prefetch == 0:
            return MAX_DISPATCH
        return self.prefetch - self.in_flight
