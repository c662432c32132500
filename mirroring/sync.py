"""Batch synchronisation of unsynchronised mirrors: how big each batch is and when it may go.
Pure: no I/O, time is an argument.

The spec ("Batch Synchronization", "Configuring Synchronisation"): the leader sends the messages a
mirror lacks in batches of `ha-sync-batch-size` messages (default: the node's
`mirroring_sync_batch_size`, 4096), no faster than `mirroring_sync_max_throughput` bytes per
second (0: no limit).

What to send comes from a *source*: `take(max_msgs, max_bytes)` returns the next messages, oldest
first (a list, so a blocking sync that serves nothing else meanwhile, or the replica's live view of
its older messages, so a background sync always sends what the queue holds now). This module
decides the rest:

* A batch never exceeds `max_bytes` (the peer link's maximum frame size less room for the
  envelope), whatever the batch size: a batch that would is cut short, and a single message that
  alone is larger than `max_bytes` still travels alone (it fitted in its publish frame, which has
  the same limit).
* With a throughput limit (body bytes per second), batch k may start once `body bytes sent so far
  / limit` seconds have passed since the sync began; batches are cut to a quarter second's worth
  of bytes so the rate stays even; and the sync is not done before its last bytes' time has come,
  so the rate measured from outside holds the limit.
* At most `window` batches are unacknowledged at any time, so memory and the link stay bounded.
"""

from __future__ import annotations

ENVELOPE = 24  # msgpack overhead per message in a batch (id, flags, array headers), for the frame limit


def message_size(msg) -> int:
    """Bytes a message takes in a sync batch frame (an estimate that errs on the large side)."""
    props = msg[2]
    return len(msg[1]) + ENVELOPE + (64 * len(props) if props else 0)


class ListSource:
    """A fixed list of messages, oldest first."""

    def __init__(self, messages: list):
        self.messages = messages
        self.pos = 0

    def take(self, max_msgs: int, max_bytes: int) -> list:
        return take_batch(self.messages, self, max_msgs, max_bytes)


def take_batch(messages, cursor, max_msgs: int, max_bytes: int) -> list:
    """Messages from `messages[cursor.pos:]` up to the limits (at least one if any is left)."""
    batch = []
    size = 0
    pos = cursor.pos
    n = len(messages)
    while pos < n and len(batch) < max_msgs:
        m = messages[pos]
        s = message_size(m)
        if batch and size + s > max_bytes:
            break
        batch.append(m)
        size += s
        pos += 1
    cursor.pos = pos
    return batch


class BatchSync:
    def __init__(self, source, total_msgs: int, total_bytes: int, batch_size: int,
                 max_bytes: int, max_rate: int, now: float, window: int = 4):
        if batch_size < 1:
            raise ValueError("batch size must be at least 1")
        self.source = source
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.max_rate = max_rate
        self.window = window
        self.started = now
        self.exhausted = False
        self.sent_batches = 0
        self.acked_batches = 0
        self.msgs_sent = 0
        self.total_msgs = total_msgs
        self.total_bytes = total_bytes
        self.body_bytes_sent = 0
        self.cancelled = False
        self.finished_at: float | None = None

    @classmethod
    def of_list(cls, messages: list, batch_size: int, max_bytes: int, max_rate: int, now: float,
                window: int = 4) -> "BatchSync":
        return cls(ListSource(messages), len(messages), sum(len(m[1]) for m in messages),
                   batch_size, max_bytes, max_rate, now, window)

    def _paced_until(self) -> float:
        if not self.max_rate:
            return self.started
        return self.started + self.body_bytes_sent / self.max_rate

    def done(self, now: float) -> bool:
        """Everything sent and acknowledged, and the throughput limit's time for it has come."""
        return (self.exhausted and self.acked_batches >= self.sent_batches
                and now >= self._paced_until())

    def wait_time(self, now: float) -> float:
        """Seconds until the throughput limit lets the next batch go (0: now)."""
        return max(0.0, self._paced_until() - now)

    def next_time(self) -> float | None:
        """When a timer should look again: the limit's time for the next batch, or for the
        end; None while only acknowledgements can move it on."""
        window_full = self.sent_batches - self.acked_batches >= self.window
        if not self.exhausted and not window_full:
            return self._paced_until()
        if self.exhausted and self.acked_batches >= self.sent_batches:
            return self._paced_until()
        return None

    def next_batch(self, now: float) -> list | None:
        """The next batch to send now, or None (no more, window full, or the limit says wait)."""
        if self.exhausted or self.sent_batches - self.acked_batches >= self.window:
            return None
        if self.wait_time(now) > 0:
            return None
        limit = self.max_bytes
        if self.max_rate:
            limit = min(limit, max(1, self.max_rate // 4))
        batch = self.source.take(self.batch_size, limit)
        if not batch:
            self.exhausted = True
            return None
        self.sent_batches += 1
        self.msgs_sent += len(batch)
        self.body_bytes_sent += sum(len(m[1]) for m in batch)
        return batch

    def acked(self, batches: int = 1) -> None:
        self.acked_batches = min(self.sent_batches, self.acked_batches + batches)

    def progress(self, now: float) -> dict:
        elapsed = max((self.finished_at or now) - self.started, 1e-9)
        rate_msgs = self.msgs_sent / elapsed
        rate_bytes = self.body_bytes_sent / elapsed
        total = max(self.total_msgs, self.msgs_sent)
        left = total - self.msgs_sent
        return {
            "messages": self.msgs_sent, "total_messages": total,
            "bytes": self.body_bytes_sent, "total_bytes": max(self.total_bytes, self.body_bytes_sent),
            "elapsed": round(elapsed, 3), "rate_msgs": round(rate_msgs, 1),
            "rate_bytes": round(rate_bytes, 1),
            "eta": round(left / rate_msgs, 1) if rate_msgs > 0 and left else 0.0,
            "batches": self.sent_batches,
        }


def progress_line(p: dict, width: int = 30) -> str:
    """A one-line progress bar: [#####.....] 45% 45,000/100,000 msgs 12.3 MB/s eta 4.1 s."""
    total = p["total_messages"] or 1
    frac = min(1.0, p["messages"] / total)
    bar = "#" * int(frac * width) + "." * (width - int(frac * width))
    return (f"[{bar}] {frac * 100:5.1f}% {p['messages']:,}/{p['total_messages']:,} msgs "
            f"{p['rate_bytes'] / 1e6:.1f} MB/s eta {p['eta']:.1f} s")
