"""A leading replica's batch sync: sending the messages it held before a mirror started, paced
by mirroring/sync.py, blocking (client operations wait, the spec's way) or in the background
(ha-sync-mode background). Mixed into `Replica` (mirroring/replica.py), whose state it shares."""

from __future__ import annotations

from wire import messages as m

from .replica_states import LEADING, S
from .sync import BatchSync, message_size, progress_line

SYNC_PROGRESS_EVERY = 1.0  # seconds between sync progress log lines
LIVE_SYNC_BATCH_BYTES = 128 << 10  # a background sync's batches are small (see _SyncJob)


class _SyncJob:
    """A batch sync in progress: the pacing (BatchSync) and each target's acknowledgements."""

    def __init__(self, replica: Syncing, targets: list, blocking: bool, why: str, now: float):
        self.blocking = blocking
        self.why = why
        self.low = max(t.start_id for t in targets)  # send ids below the newest start
        self.cursor = min(t.synced_upto for t in targets)  # ids up to here were sent before
        self.acks = {t.node: 0 for t in targets}
        total, size = replica.old_messages_count(self.cursor, self.low)
        cfg = replica.cfg
        batch_size = replica.assign.ha.sync_batch_size or cfg.sync_batch_size
        max_bytes = cfg.max_sync_bytes
        if blocking:
            # about 8192 messages unacknowledged at most, in at least 4 batches
            window = max(4, min(4096, 8192 // batch_size))
        else:
            # the live stream shares the link and the mirror: keep little sync data ahead of it
            # (what the mirror must acknowledge before a confirm), so confirms stay prompt
            window = 2
            max_bytes = min(max_bytes, LIVE_SYNC_BATCH_BYTES)
        self.replica = replica
        self.progress_at = now  # when a target last acknowledged a batch
        self.pacer = BatchSync(self, total, size, batch_size, max_bytes,
                               cfg.sync_max_throughput, now, window)
        self.next_report = now + SYNC_PROGRESS_EVERY

    def take(self, max_msgs: int, max_bytes: int) -> list:
        """The next old messages after `cursor`, as the queue holds them now."""
        batch = self.replica.old_messages(self.cursor, self.low, max_msgs, max_bytes)
        if batch:
            self.cursor = batch[-1][0]
        return batch


class Syncing:
    """The leader's batch sync (a part of `Replica`)."""

    def request_sync(self, why: str, now: float) -> bool:
        """Start a batch sync of the unsynchronised mirrors after this round (False: nothing to do)."""
        if self.state not in LEADING or self.sync is not None:
            return self.sync is not None
        if not any(t.ready and not t.synced for t in self.rep.mirrors.values()):
            return False
        self.sync_wanted = why
        return True

    def cancel_sync(self, now: float) -> bool:
        if self.sync is None:
            return False
        self._end_sync(False, now, "cancelled", cancelled=True)
        return True

    def old_messages_count(self, lo: int, hi: int) -> tuple[int, int]:
        n = size = 0
        for msg in self.q.ready_by_id():
            if msg[0] >= hi:
                break
            if msg[0] > lo:
                n += 1
                size += len(msg[1])
        for _, _, msg in self.q.unacked.values():
            if msg is not None and lo < msg[0] < hi:
                n += 1
                size += len(msg[1])
        return n, size

    def old_messages(self, lo: int, hi: int, max_msgs: int, max_bytes: int) -> list:
        """The next messages with lo < id < hi, oldest first, as the queue holds them now
        (ready ones with their redelivered flag, unacknowledged ones too)."""
        q = self.q
        cands = q.ready_between(lo, hi, max_msgs)
        if q.unacked:
            cands.extend(e[2] for mid, e in q.unacked.items()
                         if lo < mid < hi and e[2] is not None)
            cands.sort()
        out = []
        size = 0
        for msg in cands[:max_msgs]:
            s = message_size(msg)
            if out and size + s > max_bytes:
                break
            out.append([msg[0], msg[1], msg[2], msg[3]])
            size += s
        return out

    def _start_sync(self, now: float) -> None:
        why, self.sync_wanted = self.sync_wanted, ""
        targets = [t for t in self.rep.mirrors.values() if t.ready and not t.synced]
        if self.state is not S.LEADER or not targets:
            return
        blocking = self.assign.ha.sync_mode != "background"
        self._ship(now)
        job = self.sync = _SyncJob(self, targets, blocking, why, now)
        self._to(S.LEADER_SYNCING if blocking else S.LEADER_SYNCING_LIVE)
        p = job.pacer
        self._log(f"{self.qlog}: Synchronising {p.total_msgs} messages to mirrors on "
                  f"{', '.join(sorted(job.acks))}", reason=why, batch_size=p.batch_size,
                  max_throughput=p.max_rate, bytes=p.total_bytes,
                  mode="blocking" if blocking else "background")

    def _sync_step(self, now: float) -> None:
        job = self.sync
        p = job.pacer
        while True:
            batch = p.next_batch(now)
            if batch is None:
                break
            msg = m.RSyncBatch(self.name, self.epoch, p.sent_batches, batch, job.cursor)
            for node in job.acks:
                self._send(node, msg)
        if p.done(now):
            self._end_sync(True, now, "completed")
            return
        if now >= job.next_report:
            job.next_report = now + SYNC_PROGRESS_EVERY
            prog = p.progress(now)
            self._log(f"{self.qlog}: Synchronising: {progress_line(prog)}", **prog)

    def _on_sync_ok(self, msg: m.RSyncOk, now: float) -> None:
        track = self.rep.mirrors.get(msg.node)
        if msg.epoch != self.epoch or track is None:
            return
        track.synced_upto = max(track.synced_upto, msg.upto)
        job = self.sync
        if job is None or msg.node not in job.acks:
            return
        job.acks[msg.node] = max(job.acks[msg.node], msg.n)
        job.progress_at = now
        low = min(job.acks.values())
        job.pacer.acked(low - job.pacer.acked_batches)

    def _end_sync(self, completed: bool, now: float, how: str, cancelled: bool = False) -> None:
        job = self.sync
        if job is None:
            return
        self.sync = None
        p = job.pacer
        p.finished_at = now
        completed = completed and bool(job.acks)
        for node in job.acks:
            self._send(node, m.RSyncEnd(self.name, self.epoch, completed))
            if completed:
                self.rep.mirror_state(node, 0, 0, now)
        status = "completed" if completed else ("cancelled" if cancelled else "stopped")
        self.last_sync = {**p.progress(now), "status": status, "reason": job.why,
                          "mode": "blocking" if job.blocking else "background"}
        word = "complete" if completed else status
        self._log(f"{self.qlog}: Synchronisation {word}: {p.msgs_sent} messages, "
                  f"{p.body_bytes_sent} bytes in {self.last_sync['elapsed']:.3f} s",
                  **self.last_sync, detail=how)
        if self.state in (S.LEADER_SYNCING, S.LEADER_SYNCING_LIVE):
            self._to(S.LEADER)
        self._synced_check_at = 0.0
        parked, self.parked = self.parked, []
        for op in parked:
            self.handle(op, now)

    def sync_status(self, now: float) -> dict:
        unsynced = [t.node for t in self.rep.mirrors.values() if not t.synced]
        return {"running": self.sync is not None or bool(self.sync_wanted),
                "progress": self.sync.pacer.progress(now) if self.sync else None,
                "last": self.last_sync, "unsynchronised": unsynced}
