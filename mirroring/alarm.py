"""The memory alarm's rules, pure: the high watermark as a value, the alarm's hysteresis, and the
cluster-wide view of alarms. No I/O and no clock of its own (broker/memory.py measures, trims and
tells the peers and the clients).

* A watermark is a fraction of the machine's memory (`0.4`, RabbitMQ's
  `vm_memory_high_watermark.relative`) or an absolute size with a unit (`512MiB`, `2GB`,
  `vm_memory_high_watermark.absolute`). Units as RabbitMQ reads them: k/KiB, M/MiB, G/GiB, T/TiB
  are powers of 1024; kB, MB, GB, TB powers of 1000; B is bytes. A number without a unit is
  always a fraction, so `2` can never mean two bytes (or twice the memory) by mistake.
  A fraction of 0 raises the alarm at once and for good, as RabbitMQ's 0 does (a way to stop all
  publishing).
* Hysteresis (`MemoryAlarm`): the alarm goes on when the memory in use passes the limit and off
  only once it is back below CLEAR_RATIO of it, so a node hovering at its mark does not flap
  between blocking and releasing its publishers every check.
* Freed memory is not always given back to the system at once (the C allocator keeps it for
  reuse), so process RSS can stay high after a queue drained. The monitor may ask the allocator
  to return it (`wants_trim`) before raising the alarm and while the alarm is on, at most once
  every TRIM_EVERY seconds: that is only ever done near the mark, never on the hot path.
* `Alarms` is what blocks publishers: this node's alarm or any alarm a running peer reports
  (RabbitMQ blocks publishers cluster-wide while any node has a memory alarm). A peer's alarm
  is forgotten when the link to it goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CLEAR_RATIO = 0.9  # the alarm clears once use is below this share of the limit
TRIM_EVERY = 1.0  # seconds between two requests to give freed memory back

_UNITS = {
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
    "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
    "b": 1,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*")
_FRACTION = re.compile(r"\s*(\d*\.?\d+)\s*")


@dataclass(frozen=True)
class Watermark:
    """A high watermark: `fraction` of the total memory, or `absolute` bytes (one is None);
    `text` is how it was given."""
    fraction: float | None = None
    absolute: int | None = None
    text: str = field(default="", compare=False)

    def limit(self, total: int) -> int:
        """The mark in bytes on a machine (or cgroup) with `total` bytes of memory."""
        if self.absolute is not None:
            return self.absolute
        return int(total * self.fraction)

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.absolute is not None:
            return format_bytes(self.absolute)
        return f"{self.fraction:g}"


def parse_watermark(value) -> Watermark:
    """`0.4`, `"0.4"` (a fraction of memory, 0 to 1) or `"512MiB"`, `"2GB"`, `"1073741824B"`
    (absolute). Raises ValueError saying what is accepted."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a memory high watermark")
    if isinstance(value, (int, float)):
        text = repr(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"{value!r} is not a memory high watermark")
    hint = ("expected a fraction of the machine's memory from 0 to 1 (e.g. 0.4) or an absolute "
            "size with a unit (e.g. 512MiB, 2GB)")
    if _FRACTION.fullmatch(text):
        fraction = float(text)
        if fraction > 1:
            raise ValueError(f"memory high watermark {text.strip()!r} is more than all the memory: {hint}")
        return Watermark(fraction=fraction, text=text.strip())
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"memory high watermark {text.strip()!r}: {hint}")
    number, unit = match.groups()
    size = int(float(number) * _UNITS[unit.lower()])
    if size <= 0:
        raise ValueError(f"memory high watermark {text.strip()!r}: an absolute size must be positive")
    return Watermark(absolute=size, text=f"{number}{unit}")


def format_bytes(n: int) -> str:
    """A size as a person reads it: 512MiB, 1.5GiB, 2000B."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


class MemoryAlarm:
    """This node's memory alarm: on above `limit`, off again below `limit * clear_ratio`."""

    def __init__(self, limit: int, clear_ratio: float = CLEAR_RATIO, trim_every: float = TRIM_EVERY):
        self.limit = limit
        self.clear_ratio = clear_ratio
        self.trim_every = trim_every
        self.on = False
        self.used = 0
        self._trimmed_at: float | None = None

    @property
    def clear_below(self) -> int:
        return int(self.limit * self.clear_ratio)

    def set_limit(self, limit: int) -> None:
        """A new mark; the next `observe` decides with it."""
        self.limit = limit

    def observe(self, used: int) -> bool:
        """The memory in use now; returns True when the alarm went on or off."""
        self.used = used
        if not self.on and used > self.limit:
            self.on = True
            return True
        if self.on and used < self.clear_below:
            self.on = False
            return True
        return False

    def wants_trim(self, used: int, now: float) -> bool:
        """Should freed memory be handed back before deciding? Only where the decision is at
        stake (above the mark while off, above the clear mark while on) and not too often."""
        if self.limit <= 0:
            return False  # a mark of 0 holds publishers for good: nothing to find out
        at_stake = used > self.limit if not self.on else used >= self.clear_below
        if not at_stake:
            return False
        return self._trimmed_at is None or now - self._trimmed_at >= self.trim_every

    def trimmed(self, now: float) -> None:
        self._trimmed_at = now

    def detail(self, node: str) -> str:
        return (f"node {node} uses {format_bytes(self.used)} of memory, above its high watermark "
                f"of {format_bytes(self.limit)}")


class Alarms:
    """Who has a memory alarm: this node (`local`) and running peers (`remote`), each with the
    detail that goes into the blocked reason. Publishers are blocked while any is on."""

    def __init__(self, node: str):
        self.node = node
        self.local: str | None = None
        self.remote: dict[str, str] = {}

    @property
    def blocked(self) -> bool:
        return self.local is not None or bool(self.remote)

    @property
    def nodes(self) -> list[str]:
        return sorted(([self.node] if self.local is not None else []) + list(self.remote))

    @property
    def reason(self) -> str:
        """What a blocked client is told (RabbitMQ says "low on memory")."""
        if not self.blocked:
            return ""
        details = ([self.local] if self.local is not None else []) + \
            [self.remote[n] for n in sorted(self.remote)]
        return "low on memory: " + "; ".join(details)

    def set_local(self, detail: str | None) -> bool:
        """This node's alarm is on (with its detail) or off (None); True when `blocked` changed."""
        before = self.blocked
        self.local = detail
        return self.blocked != before

    def set_remote(self, node: str, detail: str | None) -> bool:
        before = self.blocked
        if detail is None:
            self.remote.pop(node, None)
        else:
            self.remote[node] = detail
        return self.blocked != before

    def forget(self, node: str) -> bool:
        """The link to `node` went: its alarm no longer counts (it tells us again if it comes
        back with one)."""
        return self.set_remote(node, None)

    def forget_peers(self) -> bool:
        before = self.blocked
        self.remote.clear()
        return self.blocked != before
