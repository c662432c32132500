"""Cluster membership and metadata on one node: the peer links (their part of `Cluster` is in
cluster_links.py), the metadata log, liveness.

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
import os
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from mirroring import changes as c
from mirroring.access import FULL, SALT_BYTES, hash_password
from mirroring.metadata import Metadata, MetaError
from mirroring.planner import plan_change
from mirroring.policy import managed_ha_out_of_line
from mirroring.raft import ChangeInProgress, NotLeader, Persistent, Raft, Role
from mirroring.records import DEFAULT_VHOST, Permission, User
from wire import messages as m
from wire.errors import INTERNAL_ERROR, NOT_ALLOWED, PRECONDITION_FAILED, ProtocolError

from .cluster_links import NodeStopped, PeerLinks
from .peers import PeerLink
from .statefile import StateFile, StateFormatError

_ENCODE = msgspec.msgpack.Encoder().encode
PROPOSE_TIMEOUT = 15.0
NOT_LEADER = "not-leader"
LIVENESS_EVERY = 0.5  # seconds between the leader's liveness and placement checks
COMPACT_AFTER = 512  # log entries kept before compacting into a snapshot


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


def fresh_state(name: str, peer: list, client: list, users: dict | None = None,
                salt=os.urandom) -> Persistent:
    """A node that belongs to no cluster: a cluster of its own, itself the only member, with
    the configured `users` (name -> password), as RabbitMQ's default user: the administrator
    tag and every permission in the default vhost. This is the first boot's only: later the
    users are the metadata's, changed through warrenctl or the management API. `salt(n)` makes
    the password hashes' salts (the node's random generator: a simulated run replays)."""
    md = Metadata()
    md.apply(c.MemberAdd(name, tuple(peer), tuple(client)))
    for user, password in (users or {}).items():
        md.apply(c.UserAdd(User(user, hash_password(password, salt(SALT_BYTES)),
                                ("administrator",))))
        md.apply(c.PermissionSet(Permission(user, DEFAULT_VHOST, FULL, FULL, FULL)))
    return Persistent(snap_config=(name,), snap_data=md.snapshot())


class Cluster(PeerLinks):
    """The cluster on one node: its metadata log's driver, proposals, liveness and pause;
    its peer links and the requests over them are `PeerLinks` (cluster_links.py)."""

    def __init__(self, name: str, config, network, log, hooks: ClusterHooks, *, persist: bool,
                 rng: random.Random, check_planning_copy: bool = False):
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
        self.paused_peers: set[str] = set()  # linked nodes that said they paused (NodePaused)
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
        # check that this copy equals the metadata each time it is used again (an O(queues)
        # comparison: the simulation turns it on, so every seeded schedule checks it)
        self.check_planning_copy = check_planning_copy
        self._wake = trio.Event()
        self._sleeping_until = float("-inf")  # the driver loop's deadline while it waits
        # the news a waiter wakes on (`wait_changed`), replaced each time it is set (`_announce`),
        # and the log's (leader, role, term, last index) the last news was for
        self._changed = trio.Event()
        self._log_view: tuple | None = None
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
            return fresh_state(self.name, self.peer_addr, self.client_addr, self.config.users,
                               self.rng.randbytes), 0
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
            self.paused_peers.clear()
            self._fail_proposals(NOT_LEADER)
            for rid in list(self._pending):
                self._resolve(rid, None)
            if self.raft is not None:
                self.save_state(self.raft.persistent(), self.raft.commit)
            self.raft = None
            self._announce()  # waiters see the app stopped
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
        view = (raft.leader, raft.role, raft.term, raft.last_index)
        if view != self._log_view:
            self._log_view = view
            self._announce()
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
        self._announce()
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

    def _announce(self) -> None:
        ev, self._changed = self._changed, trio.Event()
        ev.set()

    async def wait_changed(self) -> None:
        """Wait for news: a committed change applied, the log's leader, role, term or length
        moved, a peer link came or went, or the app stopped. Whatever a waiter here waits for
        (a leader to send a proposal to, a link to a member, a change to commit) can only come
        with one of these, so it rechecks its condition after each and never polls. The news
        says the condition may hold now, not that it does; a waiter that awaits something else
        between its check and this wait takes `self._changed` before the check and waits on
        that, so news in between is not missed."""
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
                if self.check_planning_copy:
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
            log_managed_ha(self.log, p.change, planned)
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

    async def propose(self, change: c.Change, timeout: float = PROPOSE_TIMEOUT):
        """Have the log commit a change; returns its value or raises MetaError."""
        with trio.fail_after(timeout):
            while True:
                raft = self.raft
                if raft is None:
                    raise MetaError(NOT_ALLOWED, f"node {self.name} is not running")
                # an attempt that fails waits for the news from here on (see wait_changed):
                # a new leader, a new term, or a link to the leader
                news = self._changed
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
                    except NodeStopped:  # the link went: that is news
                        await news.wait()
                        continue
                    ok, value, code, text = reply.ok, reply.value, reply.code, reply.error
                else:  # no leader known, or no link to it: either comes as news
                    await news.wait()
                    continue
                if ok:
                    return value
                if text == NOT_LEADER:
                    # the leader asked had stepped down, or its term ended before the change
                    # committed: the next leader, or at least the next term, is news here
                    await news.wait()
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
        if self.config.managed_ha and (not md.managed_ha
                                       or managed_ha_out_of_line(md.policies, md.vhosts)):
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
                self.log.warning("a majority of the cluster is reachable again: resuming clients")
                self._set_paused(False)
            return
        if self._no_quorum_since is None:
            self._no_quorum_since = now
        elif not self.paused and now - self._no_quorum_since > self.pause_after:
            self.log.warning("no majority of the cluster reachable: pausing clients (pause_minority)",
                             members=list(self.md.members), running=sorted(self.running))
            self._set_paused(True)

    @property
    def pause_after(self) -> float:
        return max(3 * self.election_timeout, self.config.net_ticktime)

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
                await self.wait_changed()  # an elected leader is news
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
                # one membership change at a time: wait for the one under way to commit (its
                # commit is news), or for the leader to change
                with trio.move_on_at(deadline) as waited:
                    await self.wait_changed()
                if waited.cancelled_caught:
                    raise ProtocolError(PRECONDITION_FAILED, f"cannot add {name} now ({exc}); try again") from None
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


def log_managed_ha(log, proposed: c.Change, planned: list) -> None:
    """Say what the managed HA did to the policies of a round (mirroring/planner.py)."""
    for change, _ in planned:
        if type(change) is c.PolicySet and change.policy.set_by != "user":
            asked = proposed.policy.definition if type(proposed) is c.PolicySet else None
            log.info("policy set by the managed HA", policy=change.policy.name,
                     set_by=change.policy.set_by, definition=change.policy.definition, asked=asked)
