"""In-memory records of one load-generator process and how they become the lines of LOGS.md.

This module owns the per-message bookkeeping (kept as flat arrays so the hot path is an append)
and the writing of `publish`, `deliver` and `intervals` parts in large blocks after the load has
stopped; nothing here runs per message while measuring except `array.append`.
"""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

ID_SHIFT = 40  # message id = producer index * 2**40 + sequence
BLOCK = 20_000  # lines per write

CONF_NONE, CONF_ACK, CONF_NACK = 0, 1, 2
# the latency kinds computed from these lines (LOGS.md), by the runner and by the Spark job alike
LATENCY_KINDS = ("confirm", "delivery", "send_lag", "confirm_sent")
_CONF_TEXT = {CONF_NONE: "null", CONF_ACK: '"ack"', CONF_NACK: '"nack"'}


def make_id(producer: int, seq: int) -> int:
    return (producer << ID_SHIFT) | seq


def _num(x: float) -> str:
    return "null" if math.isnan(x) else repr(round(x, 6))


class PublishRecord:
    """One producer's messages, indexed by sequence number (0, 1, 2, ...)."""

    def __init__(self, producer: int, queues: list[str], size: int, paced: bool = False):
        self.producer = producer
        self.queues = queues
        self.size = size
        self.t_pub = array("d")
        # intended send times (open loop, see bench.schedule); empty for a closed loop
        self.t_int = array("d") if paced else None
        self.q = array("I")
        self.t_conf = array("d")
        self.conf = bytearray()
        self.unknown = 0  # confirms of sequences never published
        self.unknown_ranges: list[tuple[int, int]] = []

    def grow_confirms(self) -> None:
        """Make room for confirms of everything published so far (called before waiting on them)."""
        missing = len(self.t_pub) - len(self.t_conf)
        if missing > 0:
            self.t_conf.extend([math.nan] * missing)
            self.conf.extend(bytes(missing))

    def confirm(self, first: int, last: int, code: int, now: float) -> int:
        """Sequences first..last (inclusive) got `code`; returns how many were newly resolved.
        A confirm for sequences never published is counted in `unknown` and otherwise ignored
        (it would be a broker or client bug; the runner reports it)."""
        if last >= len(self.t_pub):
            beyond = last - max(first, len(self.t_pub)) + 1
            self.unknown += beyond
            self.unknown_ranges.append((first, last))
            last = len(self.t_pub) - 1
            if first > last:
                return 0
        if last >= len(self.t_conf):
            self.grow_confirms()
        conf, t_conf = self.conf, self.t_conf
        newly = 0
        for s in range(first, last + 1):
            if conf[s] == CONF_NONE and math.isnan(t_conf[s]):
                newly += 1
                if code == CONF_NONE:
                    t_conf[s] = -1.0  # resolved without a confirm (connection lost): stays null
                else:
                    conf[s] = code
                    t_conf[s] = now
        return newly

    def lines(self, sample_every: int):
        self.grow_confirms()
        p, size, queues = self.producer, self.size, self.queues
        qnames = [json.dumps(q) for q in queues]
        base = p << ID_SHIFT
        t_pub, t_conf, conf, qs, t_int = self.t_pub, self.t_conf, self.conf, self.q, self.t_int
        for s in range(0, len(t_pub), sample_every):
            tc = t_conf[s]
            c = conf[s]
            ti = f',"t_int":{_num(t_int[s])}' if t_int is not None and s < len(t_int) else ""
            yield (f'{{"id":{base | s},"p":{p},"q":{qnames[qs[s]]},"size":{size},'
                   f'"t_pub":{_num(t_pub[s])}{ti},"t_conf":{"null" if c == CONF_NONE else _num(tc)},'
                   f'"conf":{_CONF_TEXT[c]}}}\n')


class DeliverRecord:
    """One consumer's deliveries in arrival order."""

    def __init__(self, consumer: int, queues: list[str]):
        self.consumer = consumer
        self.queues = queues
        self.ids = array("Q")
        self.t_del = array("d")
        self.q = array("I")
        self.red = bytearray()
        self.node = array("H")
        self.node_names: list[str] = []
        self.first = 0  # deliveries without the redelivered flag (for the drain check)

    def node_index(self, name: str | None) -> int:
        name = name or "?"
        try:
            return self.node_names.index(name)
        except ValueError:
            self.node_names.append(name)
            return len(self.node_names) - 1

    def lines(self, sample_every: int):
        c = self.consumer
        qnames = [json.dumps(q) for q in self.queues]
        nodes = [json.dumps(n) for n in self.node_names]
        ids, t_del, qs, red, node = self.ids, self.t_del, self.q, self.red, self.node
        for i in range(len(ids)):
            mid = ids[i]
            # sample on the id, not the arrival index, so sampled publishes and deliveries match
            if sample_every > 1 and (mid & ((1 << ID_SHIFT) - 1)) % sample_every:
                continue
            yield (f'{{"id":{mid},"c":{c},"q":{qnames[qs[i]]},"t_del":{_num(t_del[i])},'
                   f'"red":{"true" if red[i] else "false"},"node":{nodes[node[i]]}}}\n')


def write_lines(path: Path, generators) -> int:
    """Write the lines of every generator to `path` in blocks; returns the line count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        block: list[str] = []
        for gen in generators:
            for line in gen:
                block.append(line)
                if len(block) >= BLOCK:
                    f.write("".join(block))
                    n += len(block)
                    block.clear()
        f.write("".join(block))
        n += len(block)
    return n


def per_second(times, size: int, counts: dict, role: str) -> None:
    """Add the events at `times` into counts[(second, role)] = [n, bytes]."""
    for t in times:
        if t > 0:  # NaN and the -1 placeholder fail this test
            k = (int(t), role)
            c = counts.get(k)
            if c is None:
                counts[k] = [1, size]
            else:
                c[0] += 1
                c[1] += size


def interval_lines(counts: dict):
    for (sec, role), (n, b) in sorted(counts.items()):
        yield json.dumps({"t": float(sec), "role": role, "n": n, "bytes": b}) + "\n"
