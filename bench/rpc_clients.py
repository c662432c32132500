"""RPC-client scenarios (`rpc_clients: N`): what the two generators share.

An RPC caller connects, opens a channel and declares an exclusive, server-named queue for its
replies; the broker names it (`amq.gen-...` on warren and RabbitMQ) and deletes it when the
connection closes. This module owns the numbers of that scenario's generator side (`PER_PROC`
clients per worker process unless the scenario says `procs`, `AT_ONCE` clients of a process
connecting at the same time) and `Holders`, the record of one worker process's clients: client
`first + j` goes to node (first + j) % nodes; when each began connecting and when its declare-ok
came, the queue name the broker gave it, the failures, the progress counts handed to the runner,
and the file of names (`names_file`) the runner reads once the process says all its clients hold
their queue. It makes no call itself: the calls are `bench.gen_warren.run_rpc` (trio, warren's
own client) and `bench.gen_amqp.run_rpc` (asyncio, the AMQP client); `bench.runner.Runner.run_rpc`
lists the queues, orders the close and writes the `rpc` object of scenario.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

PER_PROC = 500   # clients per worker process when the scenario gives no procs
AT_ONCE = 64     # clients of one process between their connect and their declare-ok at once
MAX_ERROR_LINES = 20


def names_file(out_dir: str | Path, part: int) -> Path:
    """Where worker `part` leaves the names of the queues its clients hold."""
    return Path(out_dir) / f"rpc.names.part{part}"


class Holders:
    """The clients of one worker process, seen from inside it.

    Each client calls `held(j, name, t_begin, t_end)` once its queue is declared (t_begin: just
    before it connects, t_end: the declare-ok), or `fail(j, exc)`; when every client has done one
    or the other (`done`), the process calls `announce(shared)`, then closes the connections when
    the runner sets `shared.stop`, noting `t_stop` (when it saw the order) and `t_closed`."""

    def __init__(self, spec: dict):
        self.first = spec["first"]
        self.n = spec["clients"]
        self.nodes = spec["nodes"]
        self.out_dir, self.part = spec["out_dir"], spec["part"]
        self.t_begin: list[float | None] = [None] * self.n
        self.t_held: list[float | None] = [None] * self.n
        self.names: list[str | None] = [None] * self.n
        self.opened = 0
        self.failed = 0
        self.errors: list[str] = []
        self.t_ready: float | None = None
        self.t_stop: float | None = None
        self.t_closed: float | None = None
        self._reported = [0, 0]

    def address(self, j: int) -> str:
        return self.nodes[(self.first + j) % len(self.nodes)]

    def client_name(self, j: int) -> str:
        return f"bench-rpc-{self.first + j}"

    @property
    def done(self) -> bool:
        return self.opened + self.failed >= self.n

    def held(self, j: int, name: str, t_begin: float, t_end: float) -> None:
        self.t_begin[j], self.t_held[j], self.names[j] = t_begin, t_end, name
        self.opened += 1

    def fail(self, j: int, exc: BaseException) -> None:
        self.failed += 1
        if len(self.errors) < MAX_ERROR_LINES:
            self.errors.append(f"rpc client {self.first + j} to {self.address(j)}: {exc!r}")

    def progress(self, shared) -> None:
        """Add the clients that got their queue, and those that failed, since the last call to
        the runner's counters (slots 0 and 1 of `bench.shared.Shared.counters`)."""
        now = [self.opened, self.failed]
        shared.add([now[0] - self._reported[0], now[1] - self._reported[1], 0, 0])
        self._reported = now

    def announce(self, shared) -> None:
        """Every client holds its queue (or failed): leave the names for the runner, then say so."""
        self.t_ready = time.time()
        names_file(self.out_dir, self.part).write_text(json.dumps([q for q in self.names if q]))
        self.progress(shared)
        with shared.held.get_lock():
            shared.held.value += 1

    def result(self) -> dict:
        begun = [t for t in self.t_begin if t is not None]
        ms = [(e - b) * 1000.0 for b, e in zip(self.t_begin, self.t_held) if b is not None and e is not None]
        return {"first": self.first, "clients": self.n, "opened": self.opened, "failed": self.failed,
                "t_first": min(begun) if begun else None,
                "t_last": max((t for t in self.t_held if t is not None), default=None),
                "ms": ms, "t_ready": self.t_ready, "t_stop": self.t_stop, "t_closed": self.t_closed,
                "errors": self.errors}
