"""The peer links of one node's cluster (a part of `Cluster`, broker/cluster.py): which nodes
may link to it, the dialer (every member dials every other it has no link to, paced by
broker/backoff.py), running an authenticated link, handing what arrives on links to the log,
the node and the requests waiting for answers, and the node-to-node requests themselves
(`call_node`, answered by the other node's `node_rpc` hook)."""

from __future__ import annotations

import trio

from mirroring import changes as c
from wire import messages as m
from wire.errors import INTERNAL_ERROR, NOT_ALLOWED, ProtocolError

from .backoff import Backoff
from .framed import FramedStream
from .peers import HANDSHAKE_TIMEOUT, PeerLink, dial_handshake, exchange_link_hellos

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


SEEN_WAIT = 2.0  # seconds a declare waits, at most, for the running nodes to apply it


class NodeStopped(Exception):
    """The node a request went to went away before answering."""


class PeerLinks:
    """Peer links and node-to-node requests (a part of `Cluster`)."""

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
            # the addresses change only with news: a change applied or appended to the log
            await self.wait_changed()

    async def _dial_loop(self, name: str) -> None:
        backoff = Backoff(0.05, min(2.0, self.config.net_ticktime / 4))
        refused = None  # the last refusal's reason, logged when it first comes
        try:
            while self.raft is not None and name in self.addresses():
                if name in self.links:
                    # linked (dialed by either side): dial again once the link goes, the
                    # member leaves or the app stops, each of which is news
                    await self.wait_changed()
                    backoff.reset()
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
                        await backoff.wait()
                    else:
                        backoff.reset()
                        refused = None
                except ProtocolError as exc:  # refused: said once per reason, not per retry
                    if exc.text != refused:
                        refused = exc.text
                        self.log.warning("link refused", peer=name, reason=exc.text)
                    self.refused_by[name] = exc.text
                    await backoff.wait()
                except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                        trio.ClosedResourceError) as exc:
                    self.log.debug("dial failed", peer=name, error=str(exc))
                    await backoff.wait()
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
        self._announce()
        self._lost_at.pop(name, None)
        self.refused_by.pop(name, None)
        now = trio.current_time()
        self.log.info("node up", peer=name, running=sorted(self.running))
        if self.paused:
            link.send(m.NodePaused(True))
        self.raft.peer_up(now, name)
        self.hooks.link_up(name)
        self._after_raft(now)
        self._liveness_due = True
        self._poke()
        reason = await link.run(self._on_peer_messages)
        if self.links.get(name) is link:
            del self.links[name]
            self._announce()
            now = trio.current_time()
            self._lost_at[name] = now
            self.log.warning("node down", peer=name, reason=reason, running=sorted(self.running))
            self._fail_pending(name)
            self.paused_peers.discard(name)
            if self.raft is not None:
                self.raft.peer_down(now, name)
                self._after_raft(now)
            self.hooks.link_down(name)
            self._liveness_due = True
            self._poke()

    def _set_paused(self, paused: bool) -> None:
        """Pause or resume this node's clients, and tell every linked node."""
        self.paused = paused
        msg = m.NodePaused(paused)
        for link in list(self.links.values()):
            link.send(msg)
        self.hooks.paused(paused)

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
            elif t is m.NodePaused:
                if msg.paused:
                    self.paused_peers.add(link.name)
                else:
                    self.paused_peers.discard(link.name)
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

    async def seen_everywhere(self, queue: str) -> None:
        """Wait until every node the metadata records running, this one included, that this
        node has a link to has applied the declaration of `queue` (SEEN_WAIT at most: a node
        that does not answer by then is left behind, as before). A declare-ok given after this
        means a publish through any of them routes to the queue: without it, a node the log's
        leader had not told yet dropped it as unroutable."""
        nodes = [n for n in self.md.up if n == self.name or n in self.links]

        async def ask(node: str) -> None:
            try:
                await self.call_node(node, "queue_known", {"queue": queue})
            except (ProtocolError, NodeStopped):
                pass  # gone, or no longer answering: nothing to wait for

        with trio.move_on_after(SEEN_WAIT):
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    nursery.start_soon(ask, node)

    async def queue_known(self, queue: str) -> bool:
        """Answer `seen_everywhere`: once this node's metadata has the queue (False when it
        did not come within SEEN_WAIT)."""
        with trio.move_on_after(SEEN_WAIT):
            while queue not in self.md.queues:
                await self.wait_changed()
            return True
        return False

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
