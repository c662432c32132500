"""Declare scenarios (`declare_queues: N`): the plan and the book-keeping the two generators share.

This module owns which connection declares which queue (`shares`: queue i through node i % nodes,
one connection per node) and `Phases`, the record of one run inside the generator process: who
is connected, when each phase may begin, the start, end and outcome of every queue.declare and
queue.delete, the progress counts handed to the runner, and one connection's two phases of calls
(`Phases.calls`) on a channel the generator opened: `bench.gen_warren.run_declare` (trio,
warren's own client) or `bench.gen_amqp.run_declare` (asyncio, the AMQP client).
`bench.runner.Runner.run_declare` turns `Phases.result()` into the `declare` object of
scenario.json. It imports neither trio nor asyncio: the caller passes its library's Event class
and sleep.
"""

from __future__ import annotations

import time

PHASES = ("declare", "delete")
MAX_ERROR_LINES = 20


def shares(names: list[str], nodes: int) -> list[list[str]]:
    """The queues of each connection k (one per node, k = 0 .. nodes-1), in declaring order:
    queue i goes to connection i % nodes."""
    return [names[k::nodes] for k in range(nodes)]


class Phases:
    """One declare run seen from inside the generator process.

    Each connection calls `arrived(k)` once it has a channel, waits for `begin["declare"]` (set
    by the caller once the runner gives the start), makes its calls, reporting each with
    `call(...)`, then `finished("declare", k)`; when every connection has finished declaring,
    `begin["delete"]` is set and the same follows for deletes. `gone(k, why)` ends a connection
    for good (done, or failed): the others never wait for it."""

    def __init__(self, connections: int, event):
        self.n = connections
        self.all_connected = event()
        self.begin = {p: event() for p in PHASES}
        self.t0 = 0.0  # the runner's start time: when the declare phase begins
        self._arrived: set[int] = set()
        self._finished: dict[str, set[int]] = {p: set() for p in PHASES}
        self.first: dict[str, float | None] = {p: None for p in PHASES}  # earliest call start
        self.last: dict[str, float | None] = {p: None for p in PHASES}   # latest call end
        self.ms: dict[str, list[float]] = {p: [] for p in PHASES}        # each call that succeeded
        self.ok: dict[str, list[int]] = {p: [0] * connections for p in PHASES}
        self.failed: dict[str, int] = {p: 0 for p in PHASES}
        self.lost_connections = 0
        self.errors: list[str] = []
        self._reported = [0, 0]
        self.stopping = False  # the runner asked to stop (interrupt or time limit)

    def arrived(self, k: int) -> None:
        self._arrived.add(k)
        if len(self._arrived) >= self.n:
            self.all_connected.set()

    def call(self, phase: str, k: int, queue: str, t_start: float, t_end: float,
             exc: BaseException | None = None) -> None:
        if self.first[phase] is None or t_start < self.first[phase]:
            self.first[phase] = t_start
        if self.last[phase] is None or t_end > self.last[phase]:
            self.last[phase] = t_end
        if exc is None:
            self.ms[phase].append((t_end - t_start) * 1000.0)
            self.ok[phase][k] += 1
            return
        self.failed[phase] += 1
        self._error(f"connection {k}: queue.{phase} {queue}: {exc}")

    async def calls(self, k: int, names: list[str], ch, reopen, sleep, ends_connection) -> None:
        """Connection k's two phases on channel `ch`: once each may begin, a queue.declare (then a
        queue.delete) of every name, the reply before the next call. A call the broker refuses
        is counted and the next goes on (on a new channel, `await reopen()`, if the broker closed
        this one); an error for which `ends_connection(exc)` is true ends them all (raised)."""
        now = time.time
        for phase in PHASES:
            await self.begin[phase].wait()
            if phase == "declare" and self.t0 > now():
                await sleep(self.t0 - now())
            for q in names:
                if self.stopping:
                    break
                t = now()
                try:
                    await (ch.queue_declare(q) if phase == "declare" else ch.queue_delete(q))
                except Exception as exc:  # noqa: BLE001 - the caller says which errors end it
                    if ends_connection(exc):
                        raise
                    self.call(phase, k, q, t, now(), exc)
                    if not ch.is_open:
                        ch = await reopen()
                    continue
                self.call(phase, k, q, t, now())
            self.finished(phase, k)

    def finished(self, phase: str, k: int) -> None:
        if k in self._finished[phase]:
            return
        self._finished[phase].add(k)
        if phase == "declare" and len(self._finished["declare"]) >= self.n:
            self.begin["delete"].set()

    def gone(self, k: int, why: str | None = None) -> None:
        if why is not None:
            self.lost_connections += 1
            self._error(why)
        self.arrived(k)
        for phase in PHASES:
            self.finished(phase, k)

    def _error(self, line: str) -> None:
        if len(self.errors) < MAX_ERROR_LINES:
            self.errors.append(line)

    def progress(self, shared) -> None:
        """Add the queues declared and deleted since the last call to the runner's counters
        (slots 0 and 1 of `bench.shared.Shared.counters`), and read its stop flag."""
        now = [sum(self.ok["declare"]), sum(self.ok["delete"])]
        shared.add([now[0] - self._reported[0], now[1] - self._reported[1], 0, 0])
        self._reported = now
        self.stopping = shared.stop.is_set()

    def result(self) -> dict:
        return {"connections": self.n, "t0": self.t0, "first": self.first, "last": self.last,
                "ms": self.ms, "ok": self.ok, "failed": self.failed,
                "lost_connections": self.lost_connections, "errors": self.errors}
