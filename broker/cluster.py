"""Cluster membership and metadata on one node: the peer links, the metadata log, liveness.

Theory of operation:
* Every member dials every other member it has no link to; a link starts with each side's
  `LinkHello(incarnation)`, so a node whose app restarted is known for a new run of it. If two
  links to one peer appear, the one dialed by the lower node name survives on both sides.
* The metadata (mirroring/metadata.py) is the state machine of a Raft log (mirroring/raft.py)
  over all members. This class is that log's driver: it feeds Raft the messages and timer ticks,
  saves its persistent state before sending anything (data_dir/raft.msgpack), and applies what
  is committed, in order, telling the node (`hooks`) after each change.
* Changes are proposed to the log's leader (`propose`, from any node). The leader plans them on
  a copy of its metadata (mirroring/planner.py: placements, promotions), appends the concrete
  changes and answers once they are committed and applied. It plans one batch at a time, after
  the previous batch is applied, so every plan sees the state it will be applied to.
* Liveness is the leader's call: a member whose link broke (or fell silent for net_ticktime) is
  proposed down, a member linked with a new incarnation is proposed up. A majority must agree to
  commit either, so a node cut off from the others cannot promote or drop anything.
* pause_minority: a node that has had no working majority for net_ticktime pauses its clients
  (the node closes their connections and refuses new ones, so they reconnect to the majority),
  as RabbitMQ's `pause_minority` (which Amazon MQ uses) does.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from mirroring import changes as c
from mirroring.metadata import Metadata, MetaError
from mirroring.planner import plan_change
from mirroring.policy import managed_ha_out_of_line
from mirroring.raft import ChangeInProgress, NotLeader, Persistent, Raft, Role
from wire import messages as m
from wire.errors import INTERNAL_ERROR, NOT_ALLOWED, PRECONDITION_FAILED, ProtocolError

from .framed import FramedStream
from .peers import HANDSHAKE_TIMEOUT, PeerLink, dial_handshake, exchange_link_hellos
from .statefile import StateFile, StateFormatError

_ENCODE = msgspec.msgpack.Encoder().encode
PROPOSE_TIMEOUT = 15.0
NOT_LEADER = "not-leader"
LIVENESS_EVERY = 0.5  # seconds between the leader's liveness and placement checks
COMPACT_AFTER = 512  # log entries kept before compacting into a snapshot
# check that the planning copy the leader keeps between rounds of proposals equals its metadata
# each time it is used again (an O(queues) comparison: the simulation turns it on, so every
# seeded schedule checks it)
CHECK_PLANNING_COPY = False
RAFT_MESSAGES = (m.RaftVote, m.RaftVoteReply, m.RaftAppend, m.RaftAppendReply, m.RaftSnapshot,
                 m.RaftTimeoutNow)
# What a log leader sends its followers. Taken from any linked node, member or not in our view,
# if its term is at least ours: our view may be behind the log, and the leader a node added
# since (dst seed 50115: a node cut off while another was forgotten and joined again ignored
# that node, the log's new leader, for 30 s). As in Raft, a follower does not ask who the
# leader is, only whether its term is current: only a majority of the members can have made it
# leader. A non-member's older term gets no answer (an answer would carry our term to it), and
# votes from non-members stay ignored, so a node removed from the cluster cannot disturb it.
LEADER_MESSAGES = (m.RaftAppend, m.RaftSnapshot)


class NodeStopped(Exception):
    """The node a request went to went away before answering."""


class ClusterHooks(Protocol):
    """What the cluster tells the rest of the node."""

    def meta_changed(self, change: c.Change | None) -> None: ...  # None: the whole state was replaced
    def link_up(self, node: str) -> None: ...
    def link_down(self, node: str) -> None: ...
    def link_replaced(self, node: str) -> None: ...  # a second link took over: in-flight may be lost
    def peer_messages(self, link: PeerLink, msgs: list) -> None: ...  # queue, replica, session traffic
    def paused(self, paused: bool) -> None: ...
    def in_step(self) -> None: ...  # the log says this node knows the metadata as it is now
    async def node_rpc(self, name: str, args: dict): ...
    def new_nonce(self) -> bytes: ...  # a handshake challenge


@dataclass
class _Proposal:
    change: c.Change
    done: object  # callable(ok, value, code, text)


def fresh_state(name: str, peer: list, client: list) -> Persistent:
    """A node that belongs to no cluster: a cluster of its own, itself the only member."""
    md = Metadata()
    md.apply(c.MemberAdd(name, tuple(peer), tuple(client)))
    return Persistent(snap_config=(name,), snap_data=md.snapshot())


class Cluster:
    def __init__(self, name: str, config, network, log, hooks: ClusterHooks, *, persist: bool,
                 rng: random.Random):
        self.name = name
        self.config = config
        self.network = network
        self.log = log
        self.hooks = hooks
        self.persist = persist
        self.rng = rng
        self.md = Metadata()
        self.raft: Raft | None = None
        self.links: dict[str, PeerLink] = {}
        self.incarnation = 0
        self.paused = False
        self.saved: dict | None = None  # the persistent state, when not persisting to disk
        self._file = StateFile(Path(config.data_dir) / "raft.msgpack")
        self.applied = 0
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[str, trio.Event, list]] = {}
        self._queue: deque[_Proposal] = deque()
        # proposals appended to the log: index -> (proposal, the term it was appended in)
        self._inflight: dict[int, tuple[_Proposal, int]] = {}
        self._term_start = 0
        self._was_leader = False
        self._bg: set[tuple] = set()
        self._lost_at: dict[str, float] = {}
        self._dialing: set[str] = set()
        # node -> why it refused this node's link, the last time it did (shown by cluster_status;
        # gone once a link to it runs, or it is no longer dialed)
        self.refused_by: dict[str, str] = {}
        self._started_at = 0.0
        self._no_quorum_since: float | None = None
        self._liveness_due = False
        self._liveness_checked = True
        self._planned_for: tuple | None = None  # (metadata version, running) of the last replan
        # the leader's copy of the metadata that proposals are planned on, with what was planned
        # applied: (copy, the metadata it copies, the term it was made in); `_planning_copy`
        self._plan_copy: tuple | None = None
        self._wake = trio.Event()
        self._sleeping_until = float("-inf")  # the driver loop's deadline while it waits
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.peer_addr = [config.advertise_host, config.peer_port]
        self.client_addr = [config.advertise_host, config.client_port]
        timeout = min(2.0, max(0.2, config.net_ticktime / 4))
        self.election_timeout = timeout

    # --- persistent state ----------------------------------------------------------------------
    def has_state(self) -> bool:
        return self.saved is not None if not self.persist else self._file.exists()

    def check_state_format(self) -> None:
        """Raise StateFormatError if the saved state is of a format this warren does not read
        (the node must be reset); anything else wrong with it is `load_state`'s to handle."""
        if self.persist:
            try:
                self._file.load()
            except StateFormatError:
                raise
            except Exception:  # noqa: BLE001 - a corrupt file: load_state starts fresh
                pass

    def load_state(self) -> tuple[Persistent, int]:
        """The saved Raft state and commit index, or a fresh single-node cluster."""
        data = self.saved
        if self.persist:
            try:
                data = self._file.load()
            except StateFormatError:
                raise  # the node must be reset: starting a cluster of its own would split it
            except Exception as exc:  # noqa: BLE001 - a corrupt file must not stop the node
                self.log.error("cannot read the saved cluster state, starting fresh", error=str(exc))
                data = None
        if data is None:
            return fresh_state(self.name, self.peer_addr, self.client_addr), 0
        return Persistent.from_dict(data["raft"]), data.get("commit", 0)

    def save_state(self, state: Persistent, commit: int) -> None:
        if not self.persist:
            self.saved = {"raft": state.to_dict(), "commit": commit}
            return
        self._file.save(state, commit)

    def forget_state(self) -> None:
        self.saved = None
        if self.persist:
            self._file.forget()

    def load_metadata(self) -> Metadata:
        """The metadata as saved (for commands while the app is stopped)."""
        state, commit = self.load_state()
        md = Metadata.from_snapshot(state.snap_data) if state.snap_data else Metadata()
        for i, (_, change) in enumerate(state.entries, state.snap_index + 1):
            if i > commit:
                break
            try:
                md.apply(change)
            except Exception:  # noqa: BLE001
                pass
        return md

    # --- lifetime ------------------------------------------------------------------------------
    @property
    def running(self) -> set[str]:
        """This node and the members it has a link to (empty while its app is stopped)."""
        if self.raft is None:
            return set()
        return {self.name, *self.links}

    @property
    def leader(self) -> str | None:
        return self.raft.leader if self.raft is not None else None

    async def run(self, incarnation: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The app's part of the cluster: the log, the dialer, liveness. Ends when cancelled."""
        now = trio.current_time()
        self.incarnation = incarnation
        self._started_at = now
        state, commit = self.load_state()
        self.raft = Raft(self.name, state, rng=self.rng, now=now,
                         election_timeout=self.election_timeout)
        self.raft.commit = max(self.raft.commit, min(commit, self.raft.last_index))
        self.md = Metadata()
        self.applied = 0
        self._apply_committed()
        me = self.md.members.get(self.name)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._loop)
                nursery.start_soon(self._dialer)
                task_status.started()
                if me is not None and (list(me.peer) != self.peer_addr
                                       or list(me.client) != self.client_addr):
                    nursery.start_soon(self._propose_quietly, c.MemberAdd(
                        self.name, tuple(self.peer_addr), tuple(self.client_addr)))
        finally:
            self._nursery = None
            for link in list(self.links.values()):
                link.close("app stopped")
            self.links.clear()
            self._fail_proposals(NOT_LEADER)
            for rid in list(self._pending):
                self._resolve(rid, None)
            if self.raft is not None:
                self.save_state(self.raft.persistent(), self.raft.commit)
            self.raft = None
            self.paused = False
            # a new run of the app gets the whole grace before it pauses: a node stopped while
            # paused, then started, paused its clients before it had dialed anyone (its
            # `_no_quorum_since` was the old run's), and refused the first client after a rejoin
            self._no_quorum_since = None

    def spawn(self, fn, *args) -> None:
        if self._nursery is not None:
            try:
                self._nursery.start_soon(fn, *args)
            except RuntimeError:  # the app's nursery closed a moment ago
                pass

    # --- the log driver ----------------------------------------------------------------------
    def _poke(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        next_liveness = trio.current_time()
        while True:
            raft = self.raft
            deadline = min(raft.next_deadline(), next_liveness)
            self._sleeping_until = deadline
            with trio.move_on_at(deadline):
                await self._wake.wait()
            self._sleeping_until = float("-inf")  # awake: it reads Raft's deadline itself next
            self._wake = trio.Event()
            now = trio.current_time()
            raft.tick(now)
            self._after_raft(now)
            if now >= next_liveness or self._liveness_due:
                self._liveness_due = False
                next_liveness = now + LIVENESS_EVERY
                self._liveness(now)
            self._check_pause(now)

    def _after_raft(self, now: float) -> None:
        """Carry out what the log asked for: save, send, apply, and lead."""
        raft = self.raft
        if raft is None:
            return
        if raft.dirty:
            self.save_state(raft.persistent(), raft.commit)
        if raft.out:
            out, raft.out = raft.out, []
            links = self.links
            for peer, msg in out:
                link = links.get(peer)
                if link is not None:
                    link.send(msg)
        self._apply_committed()
        if raft.in_step(now):
            self.hooks.in_step()
        leading = raft.role is Role.LEADER
        if self.applied >= self._term_start and leading and not self._liveness_checked:
            self._liveness_checked = True  # first check as leader: as soon as our term starts
            self._liveness_due = True
            self._poke()
        if leading and not self._was_leader:
            self._term_start = raft.last_index
            self._liveness_checked = False
            self.log.info("leading the metadata log", term=raft.term)
        elif not leading and self._was_leader:
            self._fail_proposals(NOT_LEADER)
        self._was_leader = leading
        if leading:
            self._run_proposals(now)
        if self.paused:
            # heard from a majority again, maybe: take clients at once, not at the loop's next
            # wake (up to LIVENESS_EVERY later), or a client that connects as soon as the
            # cluster is whole (a node just rejoined and started) is refused meanwhile
            self._check_pause(now)
        if raft.next_deadline() < self._sleeping_until:
            # a message moved Raft's timer earlier (a split vote's quick retry, a new leader's
            # first heartbeat): wake the loop for it, or the retry waits for the liveness tick,
            # which two nodes started at once share (seed 7348: split votes for ever)
            self._poke()

    def _apply_committed(self) -> None:
        raft = self.raft
        items = raft.take_committed()
        if not items:
            return
        for kind, index, item in items:
            if kind == "snapshot":
                before = self.md
                self.md = Metadata.from_snapshot(item)
                self.applied = index
                self._close_links_to_runs_counted_down(before.up, before.times_down)  # compacted
                self.hooks.meta_changed(None)
                continue
            if type(item) is c.NodeDown:
                was_up, was_down = dict(self.md.up), dict(self.md.times_down)
            else:
                was_up = was_down = None
            value = None
            try:
                value = self.md.apply(item)
            except Exception as exc:  # noqa: BLE001 - the leader validated it: a bug, not fatal
                self.log.error("a committed metadata change did not apply", change=item.kind,
                               error=str(exc))
            self.applied = index
            appended = self._inflight.pop(index, None)
            if appended is not None:
                p, term = appended
                if raft.term_at(index) == term:
                    p.done(True, value, 0, "")
                else:
                    # a deposed leader learns the new leader's log and applies it before it
                    # notices it was deposed: the entry at this index is another leader's,
                    # and this proposal was never committed (it is tried again)
                    p.done(False, None, INTERNAL_ERROR, NOT_LEADER)
            if was_up is not None:
                self._close_links_to_runs_counted_down(was_up, was_down)
            if type(item) is not c.Noop:
                self.hooks.meta_changed(item)
        ev, self._changed = self._changed, trio.Event()
        ev.set()
        if self.persist and len(raft.log) > COMPACT_AFTER and self.applied > raft.snap_index:
            raft.compact(self.applied, self.md.snapshot())
            self.save_state(raft.persistent(), raft.commit)
        elif not self.persist and len(raft.log) > COMPACT_AFTER:
            raft.compact(self.applied, self.md.snapshot())

    def _close_links_to_runs_counted_down(self, was_up: dict, was_down: dict) -> None:
        """Runs in `was_up` (node -> run, before a record or a snapshot; `was_down`: the
        metadata's `times_down` then) that were since counted down for a failure, while our
        link to that run is up (it was frozen, or a partition cut it from the log's leader
        only). Our queue leaders requeue, flagged, what they sent its sessions: close the link,
        so nothing more sent before this reaches the node once it is in step again
        (broker/router.py `counted_down`); it links again, and its sessions register their
        consumers anew. A snapshot may show the same run up again: its count of times down
        tells that it went down meanwhile (only a failure brings the same run back)."""
        md = self.md
        for node, run in was_up.items():
            link = self.links.get(node)
            if link is None or link.incarnation != run \
                    or md.times_down.get(node, 0) == was_down.get(node, 0):
                continue
            if md.up.get(node) == run or (md.up.get(node) is None and md.down.get(node) == "failure"):
                link.close("the cluster counted the node down: what the link carried is stale")

    async def wait_changed(self) -> None:
        await self._changed.wait()

    # --- proposals -----------------------------------------------------------------------------
    def _fail_proposals(self, text: str) -> None:
        self._plan_copy = None
        pending = [p for p, _ in self._inflight.values()] + list(self._queue)
        self._inflight.clear()
        self._queue.clear()
        for p in pending:
            p.done(False, None, INTERNAL_ERROR, text)

    def _planning_view(self) -> set[str]:
        """Members running as far as the leader can tell: linked, and recorded up."""
        return {n for n in self.running if n == self.name or n in self.md.up}

    def _planning_copy(self, term: int) -> Metadata:
        """The metadata to plan this round of proposals on. Planning applies each change to it,
        so it cannot be the metadata itself. Copying every queue's definition for every round
        made declaring N queues cost N² on the log's leader, so the last round's copy serves
        again when the metadata has since applied exactly what was planned on it: a round runs
        only when no proposal is in flight (each one planned was committed and applied), in the
        same term (no other leader's entries came between), and the version has caught up with
        the copy's (a term's no-op entry, or a change that failed to apply, leaves it behind)."""
        kept, self._plan_copy = self._plan_copy, None
        if kept is not None:
            spec, base, made_in = kept
            if base is self.md and made_in == term and spec.version == base.version:
                if CHECK_PLANNING_COPY:
                    assert spec.snapshot() == base.snapshot(), "the planning copy drifted"
                return spec
        return self.md.copy()

    def _run_proposals(self, now: float) -> None:
        raft = self.raft
        if self._inflight or not self._queue or self.applied < self._term_start:
            return
        spec = self._planning_copy(raft.term)
        keep = True  # the copy holds the metadata plus exactly what was proposed
        running = self._planning_view()
        while self._queue:
            p = self._queue.popleft()
            try:
                planned = plan_change(spec, p.change, running)
            except ProtocolError as exc:
                p.done(False, None, exc.code, exc.text)
                continue
            except Exception as exc:  # noqa: BLE001 - a malformed change must not kill the node
                p.done(False, None, INTERNAL_ERROR, f"bad change: {exc!r}")
                spec = self.md.copy()  # it may be half-applied
                keep = False
                continue
            if not planned:
                p.done(True, None, 0, "")
                continue
            self._log_managed_ha(p.change, planned)
            try:
                index = 0
                for change, _ in planned:
                    index = raft.propose(change, send=False)  # the round goes out as one append
            except ChangeInProgress:
                self._queue.appendleft(p)
                keep = False  # planned on the copy, not proposed
                break
            except NotLeader:
                self._queue.appendleft(p)
                self._fail_proposals(NOT_LEADER)
                return
            self._inflight[index] = (p, raft.term)
        if keep:
            self._plan_copy = (spec, self.md, raft.term)
        raft.replicate()
        if raft.out or raft.dirty:
            self._after_raft(now)

    def _log_managed_ha(self, proposed: c.Change, planned: list) -> None:
        """Say what the managed HA did to the policies of a round (mirroring/planner.py)."""
        for change, _ in planned:
            if type(change) is c.PolicySet and change.policy.set_by != "user":
                asked = proposed.policy.definition if type(proposed) is c.PolicySet else None
                self.log.info("policy set by the managed HA", policy=change.policy.name,
                              set_by=change.policy.set_by, definition=change.policy.definition,
                              asked=asked)

    async def propose(self, change: c.Change, timeout: float = PROPOSE_TIMEOUT):
        """Have the log commit a change; returns its value or raises MetaError."""
        with trio.fail_after(timeout):
            while True:
                raft = self.raft
                if raft is None:
                    raise MetaError(NOT_ALLOWED, f"node {self.name} is not running")
                leader = raft.leader
                if leader == self.name and raft.role is Role.LEADER:
                    ev = trio.Event()
                    box: list = []

                    def done(ok, value, code, text, box=box, ev=ev):
                        box.append((ok, value, code, text))
                        ev.set()

                    self._queue.append(_Proposal(change, done))
                    self._poke()
                    await ev.wait()
                    ok, value, code, text = box[0]
                elif leader is not None and leader in self.links:
                    try:
                        reply = await self._call(self.links[leader],
                                                 lambda rid: m.MetaPropose(rid, change))
                    except NodeStopped:
                        await trio.sleep(0.01)
                        continue
                    ok, value, code, text = reply.ok, reply.value, reply.code, reply.error
                else:
                    with trio.move_on_after(0.05):
                        await self.wait_changed()
                    continue
                if ok:
                    return value
                if text == NOT_LEADER:
                    await trio.sleep(0.01)
                    continue
                raise MetaError(code or INTERNAL_ERROR, text)

    async def _propose_quietly(self, change: c.Change) -> None:
        try:
            await self.propose(change)
        except (ProtocolError, trio.TooSlowError) as exc:
            self.log.debug("metadata change not committed", change=change.kind, error=str(exc))

    def propose_soon(self, change: c.Change, key=None) -> None:
        """Propose in the background (once at a time per `key`; by default, per change)."""
        key = key or _ENCODE(change)
        if key in self._bg or self._nursery is None:
            return
        self._bg.add(key)

        async def go():
            try:
                await self._propose_quietly(change)
            finally:
                self._bg.discard(key)

        self.spawn(go)

    def _serve_propose(self, link: PeerLink, msg: m.MetaPropose) -> None:
        raft = self.raft
        if raft is None or raft.role is not Role.LEADER:
            link.send(m.MetaResult(msg.rid, False, None, 0, NOT_LEADER))
            return

        def done(ok, value, code, text):
            link.send(m.MetaResult(msg.rid, ok, value, code or 0, text))

        try:
            change = c.decode_change(msg.change)
        except ProtocolError as exc:
            done(False, None, exc.code, exc.text)
            return
        self._queue.append(_Proposal(change, done))
        self._poke()

    # --- liveness and placement (the leader's duty) ------------------------------------------
    def _liveness(self, now: float) -> None:
        raft = self.raft
        if raft is None or raft.role is not Role.LEADER or self.applied < self._term_start:
            return
        md = self.md
        if md.up.get(self.name) != self.incarnation:
            self.propose_soon(c.NodeUp(self.name, self.incarnation))
        if self.config.managed_ha and (not md.managed_ha or managed_ha_out_of_line(md.policies)):
            self.propose_soon(c.ManagedHAEnable())
        for node in list(md.members):
            if node == self.name:
                continue
            link = self.links.get(node)
            if link is not None and link.incarnation:
                if md.up.get(node) != link.incarnation:
                    self.propose_soon(c.NodeUp(node, link.incarnation))
            elif node in md.up:
                # down: we saw its link go, or we have been up for net_ticktime without one
                if node in self._lost_at or now - self._started_at > self.config.net_ticktime:
                    self.propose_soon(c.NodeDown(node, md.up[node], "failure"))
        self._replan_soon()

    def _replan_soon(self) -> None:
        """Ask the planner whether the queues' placement should change: only when what it plans
        from (the metadata's version, the members running) changed since it last answered.
        Planning copies and walks every queue, which with 1,000 queues cost milliseconds of the
        loop that serves clients on every liveness tick."""
        view = (self.md.version, frozenset(self._planning_view()))
        if view == self._planned_for or ("replan",) in self._bg or self._nursery is None:
            return
        self._bg.add(("replan",))

        async def go():
            try:
                await self.propose(c.Replan())
                self._planned_for = view
            except (ProtocolError, trio.TooSlowError) as exc:
                self.log.debug("metadata change not committed", change="replan", error=str(exc))
            finally:
                self._bg.discard(("replan",))

        self.spawn(go)

    def in_step(self, now: float | None = None) -> bool:
        """This node knows the metadata as the cluster has it now (mirroring/raft.py: a read
        index): a queue leader shows new deliveries only then. Without a log (not yet part of
        a cluster) the node is its own authority."""
        raft = self.raft
        return raft is None or raft.in_step(trio.current_time() if now is None else now)

    def _check_pause(self, now: float) -> None:
        raft = self.raft
        if raft is None:
            return
        if raft.has_quorum_contact(now):
            self._no_quorum_since = None
            if self.paused:
                self.paused = False
                self.log.warning("a majority of the cluster is reachable again: resuming clients")
                self.hooks.paused(False)
            return
        if self._no_quorum_since is None:
            self._no_quorum_since = now
        elif not self.paused and now - self._no_quorum_since > self.pause_after:
            self.paused = True
            self.log.warning("no majority of the cluster reachable: pausing clients (pause_minority)",
                             members=list(self.md.members), running=sorted(self.running))
            self.hooks.paused(True)

    @property
    def pause_after(self) -> float:
        return max(3 * self.election_timeout, self.config.net_ticktime)

    # --- links ---------------------------------------------------------------------------------
    def is_member(self, node: str) -> bool:
        return node in self.md.members or (self.raft is not None and node in self.raft.voters)

    def accepts_link_from(self, node: str) -> bool:
        """May `node` open a peer link to this one? A member may. So may a node this view does
        not list, while this node is out of touch with a working majority: the view may then
        be behind the log (the node joined again, and leads the log now, while this one was cut
        off), and only the log's leader, over such a link, can bring it up to date (dst seed
        105384: a node that missed a forget and rejoin refused the log's new leader as a
        non-member for 30 s, paused the while). Over it, only a log leader's appends count
        (LEADER_MESSAGES). In touch with a majority, this view is the cluster's, and a node it
        does not list is told to join first."""
        if self.is_member(node):
            return True
        raft = self.raft
        return raft is not None and not raft.has_quorum_contact(trio.current_time())

    def addresses(self) -> dict[str, list]:
        """Peer addresses of every member, as the metadata applied here lists them and as the
        log's changes not yet applied add and remove them (a node being added is dialed before
        its change commits: the log's leader must reach it to replicate to it). A member that
        was removed is no longer dialed, though its old member.add is still in the log (it was:
        a forgotten node restarted without a reset was linked to by every member, counted
        running, and never told it had to reset)."""
        out = {n: rec.peer for n, rec in self.md.members.items()}
        if self.raft is not None:
            for change in self.raft.unapplied():
                if type(change) is c.MemberAdd:
                    out[change.name] = change.peer
                elif type(change) is c.MemberRemove:
                    out.pop(change.name, None)
        return out

    async def _dialer(self) -> None:
        while True:
            for name, addr in self.addresses().items():
                if name != self.name and name not in self.links and name not in self._dialing:
                    self._dialing.add(name)
                    self.spawn(self._dial_loop, name)
            with trio.move_on_after(1.0):
                await self.wait_changed()

    async def _dial_loop(self, name: str) -> None:
        delay = 0.05
        cap = min(2.0, self.config.net_ticktime / 4)
        refused = None  # the last refusal's reason, logged when it first comes
        try:
            while self.raft is not None and name in self.addresses():
                if name in self.links:
                    await trio.sleep(0.25)
                    delay = 0.05
                    continue
                host, port = self.addresses()[name]
                try:
                    with trio.fail_after(HANDSHAKE_TIMEOUT):
                        stream = await self.network.connect(host, port)
                        framed = FramedStream(stream, self.config.max_frame)
                        other = await dial_handshake(framed, self.name, self.config.secret, "peer", self.hooks.new_nonce())
                    if other != name:
                        await stream.aclose()
                        raise ProtocolError(NOT_ALLOWED, f"expected node {name}, reached {other}")
                    started = trio.current_time()
                    await self.run_link(name, framed, dialer=self.name)
                    # a link that ended at once (a duplicate, a refusal) is dialed again only
                    # after the usual back-off; one that lived a while, at once
                    if trio.current_time() - started < 1.0:
                        await trio.sleep(delay)
                        delay = min(delay * 2, cap)
                    else:
                        delay = 0.05
                        refused = None
                except ProtocolError as exc:  # refused: said once per reason, not per retry
                    if exc.text != refused:
                        refused = exc.text
                        self.log.warning("link refused", peer=name, reason=exc.text)
                    self.refused_by[name] = exc.text
                    await trio.sleep(delay)
                    delay = min(delay * 2, cap)
                except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                        trio.ClosedResourceError) as exc:
                    self.log.debug("dial failed", peer=name, error=str(exc))
                    await trio.sleep(delay)
                    delay = min(delay * 2, cap)
        finally:
            self._dialing.discard(name)
            self.refused_by.pop(name, None)

    async def run_link(self, name: str, framed: FramedStream, dialer: str) -> None:
        """Serve an authenticated link to member `name` until it ends."""
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            hello = await exchange_link_hellos(framed, self.incarnation)
        if hello is None:  # the other side dropped it (a duplicate of a link it has)
            raise trio.BrokenResourceError("link closed during set-up")
        if self.raft is None:
            return
        link = PeerLink(name, framed, dialer, self.config.net_ticktime)
        link.incarnation = hello.incarnation
        existing = self.links.get(name)
        if existing is not None:
            if dialer == min(self.name, name) and existing.dialer != dialer:
                existing.superseded = True
                existing.close("superseded by a second link")
                self.hooks.link_replaced(name)
            else:
                return
        self.links[name] = link
        self._lost_at.pop(name, None)
        self.refused_by.pop(name, None)
        now = trio.current_time()
        self.log.info("node up", peer=name, running=sorted(self.running))
        self.raft.peer_up(now, name)
        self.hooks.link_up(name)
        self._after_raft(now)
        self._liveness_due = True
        self._poke()
        reason = await link.run(self._on_peer_messages)
        if self.links.get(name) is link:
            del self.links[name]
            now = trio.current_time()
            self._lost_at[name] = now
            self.log.warning("node down", peer=name, reason=reason, running=sorted(self.running))
            self._fail_pending(name)
            if self.raft is not None:
                self.raft.peer_down(now, name)
                self._after_raft(now)
            self.hooks.link_down(name)
            self._liveness_due = True
            self._poke()

    def _on_peer_messages(self, link: PeerLink, batch: list) -> None:
        raft_touched = False
        now = link.last_heard  # (PeerLink.run reads the clock just before handing us the batch)
        traffic = []  # for the node, in order, as one batch (Router.peer_messages)
        for msg in batch:
            t = type(msg)
            if t in RAFT_MESSAGES:
                if self.raft is not None and (self.is_member(link.name) or (
                        t in LEADER_MESSAGES and msg.term >= self.raft.term)):
                    if t is m.RaftAppend and msg.entries:
                        try:  # the wire brings plain lists: the log holds typed changes
                            msg.entries = c.decode_entries(msg.entries)
                        except ProtocolError as exc:
                            link.close(exc.text)
                            break
                    self.raft.receive(now, link.name, msg)
                    raft_touched = True
            elif t is m.Tick:
                pass
            elif t is m.MetaPropose:
                self._serve_propose(link, msg)
            elif t is m.MetaResult or t is m.NodeRpcReply:
                self._resolve(msg.rid, msg)
            elif t is m.NodeRpc:
                self.spawn(self._serve_rpc, link, msg)
            else:
                traffic.append(msg)
        if traffic:
            self.hooks.peer_messages(link, traffic)
        if raft_touched:
            self._after_raft(now)

    # --- node-to-node requests ---------------------------------------------------------------
    async def _call(self, link: PeerLink, make):
        rid = next(self._rids)
        ev = trio.Event()
        box: list = []
        self._pending[rid] = (link.name, ev, box)
        link.send(make(rid))
        try:
            await ev.wait()
        finally:
            self._pending.pop(rid, None)
        if not box or box[0] is None:
            raise NodeStopped(link.name)
        return box[0]

    def _resolve(self, rid: int, reply) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[2].append(reply)
            entry[1].set()

    def _fail_pending(self, node: str) -> None:
        for rid, (name, ev, _) in list(self._pending.items()):
            if name == node:
                del self._pending[rid]
                ev.set()

    async def call_node(self, node: str, name: str, args: dict):
        """A request to another running node (or this one); returns the value or raises."""
        if node == self.name:
            return await self.hooks.node_rpc(name, args)
        link = self.links.get(node)
        if link is None:
            raise NodeStopped(node)
        reply = await self._call(link, lambda rid: m.NodeRpc(rid, name, args))
        if not reply.ok:
            raise ProtocolError(reply.code, reply.error)
        return reply.value

    async def _serve_rpc(self, link: PeerLink, msg: m.NodeRpc) -> None:
        try:
            value = await self.hooks.node_rpc(msg.name, msg.args)
        except ProtocolError as exc:
            link.send(m.NodeRpcReply(msg.rid, False, None, exc.code, exc.text))
        except NodeStopped as exc:
            link.send(m.NodeRpcReply(msg.rid, False, None, NOT_ALLOWED, f"node {exc} went away"))
        except Exception as exc:  # noqa: BLE001
            self.log.exception("node rpc failed", rpc=msg.name)
            link.send(m.NodeRpcReply(msg.rid, False, None, INTERNAL_ERROR, repr(exc)))
        else:
            link.send(m.NodeRpcReply(msg.rid, True, value, 0, ""))

    # --- membership ----------------------------------------------------------------------------
    async def admit(self, name: str, peer: list, client: list) -> dict:
        """A node asks to join (join_cluster on it named us): the log's leader appends it as a
        member and hands it the log. It answers before the entry commits: with two members the
        new one's own acknowledgement is needed for that."""
        raft = self.raft
        if raft is None:
            raise ProtocolError(NOT_ALLOWED, f"node {self.name} is not running (its app is stopped)")
        leader = raft.leader
        with trio.move_on_after(5):
            while leader is None and self.raft is not None:
                await trio.sleep(0.02)
                leader = self.raft.leader if self.raft is not None else None
        if leader is None:
            raise ProtocolError(NOT_ALLOWED, "the cluster has no leader right now; try again")
        if leader != self.name:
            return await self.call_node(leader, "admit", {"name": name, "peer": peer, "client": client})
        known = self.md.members.get(name)
        if name in raft.voters and known is not None and list(known.peer) == list(peer):
            return self._state_for_joiner()
        deadline = trio.current_time() + 10
        while True:
            try:
                raft.propose(c.MemberAdd(name, tuple(peer), tuple(client)))
                break
            except ChangeInProgress as exc:
                # one membership change at a time: wait for the one under way to commit
                if trio.current_time() > deadline:
                    raise ProtocolError(PRECONDITION_FAILED, f"cannot add {name} now ({exc}); try again") from None
                with trio.move_on_after(0.1):
                    await self.wait_changed()
                raft = self.raft
                if raft is None or raft.role is not Role.LEADER:
                    raise ProtocolError(NOT_ALLOWED, "the cluster's leader changed; try again") from None
            except NotLeader:
                raise ProtocolError(NOT_ALLOWED, "the cluster's leader changed; try again") from None
        self._after_raft(trio.current_time())
        self.log.info("node joins the cluster", joining=name)
        return self._state_for_joiner()

    def _state_for_joiner(self) -> dict:
        state = self.raft.persistent()
        self.raft.dirty = True  # persistent() cleared it; the loop still has to save
        self._poke()
        state.voted_for = None
        return {"raft": state.to_dict(), "commit": self.raft.commit}

    def adopt(self, joined: dict) -> None:
        """This node joins: the leader's log becomes ours (the app is stopped)."""
        self.save_state(Persistent.from_dict(joined["raft"]), joined["commit"])
        self.md = self.load_metadata()
