"""One warren node: its lifetime, its app, the cluster links and the routing between them.

Theory of operation:
* `run()` lives as long as the process. It listens on the peer port (needed even while the app is
  stopped: warrenctl speaks there) and starts the app.
* The app (`start_app`/`stop_app`, as in rabbitmqctl) is the client listener, the peer links,
  and one task per local queue replica. Stopping it looks like a node failure to the others.
* Metadata (members, queues) is a `mirroring.metadata.Metadata` copy on every node. Changes go to
  the coordinator (the most senior running member), which applies them, persists, and broadcasts
  them in version order; a link-up exchanges authority keys and the weaker side adopts the other's
  snapshot. The copy is persisted under data_dir so a restarted node knows its cluster.
* Every node dials every member it has no link to; if two links to one peer appear, the one
  dialed by the lower node name survives on both sides.
* Routing: `queue_op` sends an operation to the queue's leader (local inbox or peer link);
  `to_session` sends events to a client session (local inbox or peer link).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import msgpack
import trio

from mirroring import planner
from mirroring.metadata import Metadata, MetaError, authority_key
from wire import messages as m
from wire.errors import (ACCESS_REFUSED, INTERNAL_ERROR, NOT_ALLOWED, NOT_FOUND, PRECONDITION_FAILED,
                         ProtocolError)

from . import config as configmod
from . import log as logmod
from .framed import FramedStream
from .peers import HANDSHAKE_TIMEOUT, PeerLink, accept_handshake, dial_handshake
from .queue_process import QueueProcess
from .session import ChannelError, Session

PROPOSE_TIMEOUT = 15.0
SHUTDOWN_HANDOVER_TIMEOUT = 5.0
EARLY_OP_WAIT = 3.0  # how long an op for a queue this node has not heard of yet is kept


class NodeStopped(Exception):
    pass


class Node:
    def __init__(self, config: configmod.NodeConfig, network, *, persist: bool = True):
        self.config = config
        self.name = config.name
        self.network = network
        self.persist = persist
        self.log = logmod.get(self.name)
        self.md = Metadata()
        self.links: dict[str, PeerLink] = {}
        self.queues: dict[str, QueueProcess] = {}
        self.sessions: dict[int, Session] = {}
        self.app_running = False
        self.booting = True
        self.peer_port = config.peer_port
        self.client_port = config.client_port
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[str, trio.Event, list]] = {}
        self._app_scope: trio.CancelScope | None = None
        self._dialing: set[str] = set()
        self._early: dict[str, list] = {}  # queue -> ops that arrived before its declaration
        self._app_started_at = 0.0
        self._last_beat = 0.0
        self._liveness_later = False
        self._meta_event = trio.Event()
        self.root = None
        self.app = None
        self.started = trio.Event()

    # --- paths and persistence ---------------------------------------------------------------
    @property
    def _meta_path(self) -> Path:
        return Path(self.config.data_dir) / "metadata.msgpack"

    def has_state(self) -> bool:
        return self.persist and self._meta_path.exists()

    def _save(self) -> None:
        if not self.persist:
            return
        path = self._meta_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgpack.packb(self.md.snapshot(), use_bin_type=True))
        os.replace(tmp, path)

    def _load(self) -> Metadata:
        if not self.persist and self.md.version and self.name in self.md.members:
            return self.md  # in-memory node (tests): keep what join_cluster took
        if self.has_state():
            try:
                md = Metadata.from_snapshot(msgpack.unpackb(self._meta_path.read_bytes(), raw=False,
                                                            strict_map_key=False))
                # non-durable queues do not survive a restart of the node that led them
                for q in list(md.queues.values()):
                    if q["leader"] == self.name and (not q["durable"] or q["exclusive"]):
                        del md.queues[q["name"]]
                if self.name in md.members:
                    return md
            except Exception as exc:  # a corrupt file must not stop the node
                self.log.error("cannot read saved metadata, starting fresh", error=str(exc))
        return self._fresh_metadata()

    def _fresh_metadata(self) -> Metadata:
        md = Metadata()
        md.apply(["member.add", self.name, self._peer_addr(), self._client_addr()])
        return md

    def _peer_addr(self) -> list:
        return [self.config.advertise_host, self.peer_port]

    def _client_addr(self) -> list:
        return [self.config.advertise_host, self.client_port]

    # --- running set -------------------------------------------------------------------------
    @property
    def running(self) -> set[str]:
        if not self.app_running:
            return set()
        return {self.name, *self.links}

    @property
    def coordinator(self) -> str | None:
        return self.md.coordinator(self.running)

    def spawn(self, fn, *args) -> None:
        """Run a helper task in the app (dies with the app)."""
        if self.app is not None:
            self.app.start_soon(fn, *args)

    # --- process lifetime --------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as root:
            self.root = root
            self.peer_port = await root.start(self.network.serve, self.config.host,
                                              self.config.peer_port, self._on_peer_conn)
            self.log.info("node listening", peer_port=self.peer_port)
            if self.config.cluster_seed and not self.has_state():
                await self._join_seed(self.config.cluster_seed)
            await self.start_app()
            if self.persist:
                configmod.register(self.name, (self.config.advertise_host, self.peer_port),
                                   (self.config.advertise_host, self.client_port), os.getpid())
            self.started.set()
            task_status.started(self)

    async def _join_seed(self, seed: str) -> None:
        """First boot with a cluster seed: keep trying to join until the seed answers."""
        host, port = configmod.lookup(seed)
        if (host, port) == (self.config.advertise_host, self.peer_port):
            return
        delay = 0.2
        while True:
            try:
                await self.join_cluster(host, port)
                return
            except (OSError, ProtocolError, trio.TooSlowError) as exc:
                self.log.info("waiting for cluster seed", seed=seed, error=str(exc))
                await trio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def start_app(self) -> None:
        if self.app_running:
            return
        await self.root.start(self._app)

    async def stop_app(self) -> None:
        if not self.app_running or self._app_scope is None:
            return
        self.log.info("stopping app")
        with trio.move_on_after(SHUTDOWN_HANDOVER_TIMEOUT):
            await self._hand_over_on_shutdown()
        # closing a link drops what its writer has not sent yet: let the shutdown record (the
        # node.down change with its promotions) reach the others first
        with trio.move_on_after(1.0):
            while any(link.outbox._queued for link in self.links.values()):
                await trio.sleep(0.005)
        for link in list(self.links.values()):
            link.close("peer stopped its app")
            with trio.move_on_after(0.5):  # the peer sees the link end now, not after net_ticktime
                await link.framed.stream.aclose()
        self._app_scope.cancel()
        while self.app_running:
            await trio.sleep(0.01)

    async def _app(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._app_scope = scope
            self.md = self._load()
            self.booting = True
            self._app_started_at = self._last_beat = trio.current_time()
            try:
                async with trio.open_nursery() as app:
                    self.app = app
                    self.client_port = await app.start(self.network.serve, self.config.host,
                                                       self.config.client_port, self._on_client_conn)
                    self.app_running = True
                    me = self.md.members.get(self.name)
                    if me != {"peer": self._peer_addr(), "client": self._client_addr()} and len(self.md.members) == 1:
                        self.md.apply(["member.add", self.name, self._peer_addr(), self._client_addr()])
                    self._save()
                    self._reconcile_queues()
                    app.start_soon(self._dialer)
                    app.start_soon(self._heartbeat)
                    self.log.info("app started", client_port=self.client_port,
                                  members=list(self.md.members))
                    task_status.started()
            finally:
                self.app_running = False
                self.app = None
                for q in list(self.queues.values()):
                    q.scope.cancel()
                self.queues.clear()
                for link in list(self.links.values()):
                    link.close("app stopped")
                self.links.clear()
                self.log.info("app stopped")

    # --- peer port ---------------------------------------------------------------------------
    async def _on_peer_conn(self, stream, peer: str) -> None:
        try:
            await self._accept_peer(stream, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except ProtocolError as exc:  # e.g. the dialer dropped a duplicate link during set-up
            self.log.debug("peer connection ended during set-up", peer=peer, reason=exc.text)
        except Exception:  # a bug in handling one connection must not bring the node down
            self.log.exception("peer connection failed", peer=peer)

    async def _accept_peer(self, stream, peer: str) -> None:
        framed = FramedStream(stream, self.config.max_frame)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                auth = await accept_handshake(framed, self.name, self.config.secret)
        except ProtocolError as exc:
            self.log.warning("peer connection refused", peer=peer, reason=exc.text)
            await _send_error(framed, exc)
            return
        except trio.TooSlowError:
            self.log.warning("peer handshake timed out", peer=peer)
            return
        if auth.role == "ctl":
            from .control import serve_ctl
            await serve_ctl(self, framed, auth.node)
            return
        if not self.app_running:
            await _send_error(framed, ProtocolError(NOT_ALLOWED, f"node {self.name} is not running (its app is stopped)"))
            return
        if auth.node not in self.md.members:
            await _send_error(framed, ProtocolError(
                NOT_ALLOWED, f"node {auth.node} is not a member of cluster {self.md.cluster_name}; "
                             "run join_cluster on it first"))
            return
        await self._run_link(auth.node, framed, dialer=auth.node)

    async def _dialer(self) -> None:
        while True:
            for name in list(self.md.members):
                if name != self.name and name not in self.links and name not in self._dialing:
                    self._dialing.add(name)
                    self.app.start_soon(self._dial_loop, name)
            with trio.move_on_after(1.0):
                await self._meta_event.wait()

    async def _dial_loop(self, name: str) -> None:
        delay = 0.05
        try:
            while name in self.md.members and self.app_running:
                if name in self.links:
                    await trio.sleep(0.25)
                    delay = 0.05
                    continue
                rec = self.md.members[name]
                try:
                    with trio.fail_after(HANDSHAKE_TIMEOUT):
                        stream = await self.network.connect(*rec["peer"])
                        framed = FramedStream(stream, self.config.max_frame)
                        other = await dial_handshake(framed, self.name, self.config.secret, "peer")
                    if other != name:
                        await stream.aclose()
                        raise ProtocolError(NOT_ALLOWED, f"expected node {name}, reached {other}")
                    await self._run_link(name, framed, dialer=self.name)
                    delay = 0.05
                except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                        trio.ClosedResourceError, ProtocolError) as exc:
                    self.log.debug("dial failed", peer=name, error=str(exc))
                    await trio.sleep(delay)
                    delay = min(delay * 2, min(2.0, self.config.net_ticktime / 4))
                except Exception:
                    self.log.exception("peer link failed", peer=name)
                    await trio.sleep(delay)
                    delay = min(delay * 2, min(2.0, self.config.net_ticktime / 4))
        finally:
            self._dialing.discard(name)

    async def _run_link(self, name: str, framed: FramedStream, dialer: str) -> None:
        link = PeerLink(name, framed, dialer, self.config.net_ticktime)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await self._exchange_metadata(name, framed)
        except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.log.debug("link set-up failed", peer=name, error=str(exc))
            raise
        if not self.app_running:
            return
        existing = self.links.get(name)
        if existing is not None:
            if dialer == min(self.name, name) and existing.dialer != dialer:
                existing.superseded = True
                existing.close("superseded by a second link")
            else:
                return
        self.links[name] = link
        self.booting = False
        self.log.info("node up", peer=name, running=sorted(self.running))
        self._running_changed(up=name)
        reason = await link.run(self._on_peer_messages)
        if self.links.get(name) is link:
            del self.links[name]
            self.log.warning("node down", peer=name, reason=reason, running=sorted(self.running))
            self._running_changed(down=name)

    async def _exchange_metadata(self, name: str, framed: FramedStream) -> None:
        """Both sides send LinkHello; the weaker side adopts the stronger side's snapshot."""
        mine = list(authority_key(self.md, self.booting, sorted(self.running)))
        await framed.send_now(m.LinkHello(mine, self.md.version, self.md.digest()))
        theirs = await framed.receive(frozenset({"link.hello"}))
        if theirs is None:
            raise ProtocolError(NOT_ALLOWED, "link closed during set-up")
        if theirs.version == self.md.version and theirs.digest == self.md.digest():
            return
        if (mine, self.name) > (list(theirs.key), name):
            await framed.send_now(m.MetaSnapshot(self.md.snapshot()))
        else:
            snap = await framed.receive(frozenset({"meta.snapshot"}))
            if snap is None:
                raise ProtocolError(NOT_ALLOWED, "link closed during set-up")
            self._adopt(snap.state, f"from {name}")

    def _adopt(self, state: dict, source: str) -> None:
        md = Metadata.from_snapshot(state)
        if self.name not in md.members:
            self.log.warning("ignoring a snapshot that does not list this node", source=source)
            return
        self.log.info("adopting cluster metadata", source=source, version=md.version)
        self.md = md
        self._meta_changed()

    async def _on_peer_messages(self, link: PeerLink, batch: list) -> None:
        for msg in batch:
            t = type(msg)
            if t is m.ToQueue:
                await self._queue_op_local(msg.queue, msg.op)
            elif t is m.ToSession:
                s = self.sessions.get(msg.sid)
                if s is not None:
                    s.inbox.send_nowait(msg.ops)
            elif t is m.Tick:
                pass
            elif t is m.MetaApply:
                self._on_meta_apply(link, msg)
            elif t is m.MetaPropose:
                self._serve_propose(link, msg)
            elif t is m.MetaResult:
                self._resolve(msg.rid, msg)
            elif t is m.NodeRpc:
                self.spawn(self._serve_rpc, link, msg)
            elif t is m.NodeRpcReply:
                self._resolve(msg.rid, msg)
            elif t is m.MetaSnapshot:
                self._adopt(msg.state, f"from {link.name}")
            else:
                link.close(f"unexpected message {msg.KIND!r} on a peer link")
                return

    # --- metadata ----------------------------------------------------------------------------
    async def propose(self, change: list):
        """Have the coordinator apply a change; returns its value or raises MetaError."""
        with trio.fail_after(PROPOSE_TIMEOUT):
            while True:
                if not self.app_running:
                    raise MetaError(NOT_ALLOWED, f"node {self.name} is not running")
                coord = self.coordinator
                if coord == self.name:
                    return self._coord_apply(change)
                link = self.links.get(coord)
                if link is None:
                    await trio.sleep(0.05)
                    continue
                try:
                    reply = await self._call(link, lambda rid: m.MetaPropose(rid, change))
                except NodeStopped:
                    await trio.sleep(0.05)
                    continue
                if reply.ok:
                    return reply.value
                if reply.error == "not-coordinator":
                    await trio.sleep(0.05)
                    continue
                raise MetaError(reply.value or INTERNAL_ERROR, reply.error)

    def _coord_apply(self, change: list):
        change = self._plan_change(change)
        if change is None:
            return None
        value = self.md.apply(change)  # MetaError leaves the state untouched
        msg = m.MetaApply(self.md.version, change)
        for link in self.links.values():
            link.send(msg)
        self._meta_changed()
        return value

    def _serve_propose(self, link: PeerLink, msg: m.MetaPropose) -> None:
        if self.coordinator != self.name:
            link.send(m.MetaResult(msg.rid, False, None, "not-coordinator"))
            return
        try:
            value = self._coord_apply(msg.change)
        except ProtocolError as exc:
            link.send(m.MetaResult(msg.rid, False, exc.code, exc.text))
            return
        except Exception as exc:  # a malformed change from a peer must not kill the node
            link.send(m.MetaResult(msg.rid, False, INTERNAL_ERROR, f"bad change: {exc!r}"))
            return
        link.send(m.MetaResult(msg.rid, True, value, ""))

    def _on_meta_apply(self, link: PeerLink, msg: m.MetaApply) -> None:
        if msg.version <= self.md.version:
            return
        if msg.version == self.md.version + 1:
            try:
                self.md.apply(msg.change)
            except Exception as exc:
                self.log.error("metadata change failed to apply; asking for a snapshot", error=str(exc))
                self.spawn(self._fetch_snapshot, link)
                return
            self._meta_changed()
        else:
            self.spawn(self._fetch_snapshot, link)

    async def _fetch_snapshot(self, link: PeerLink) -> None:
        try:
            reply = await self._call(link, lambda rid: m.NodeRpc(rid, "snapshot", {}))
        except NodeStopped:
            return
        if reply.ok and reply.value["version"] > self.md.version:
            self._adopt(reply.value, f"from {link.name}")

    def _meta_changed(self) -> None:
        self._save()
        self._reconcile_queues()
        ev, self._meta_event = self._meta_event, trio.Event()
        ev.set()

    async def wait_meta_change(self) -> None:
        await self._meta_event.wait()

    def _reconcile_queues(self) -> None:
        """Start the replicas this node should run, stop those it should not, promote a mirror
        the metadata made leader, and give leaders their current mirror lists."""
        if not self.app_running:
            return
        me = self.name
        for qdef in self.md.queues.values():
            name = qdef["name"]
            qp = self.queues.get(name)
            if qdef["leader"] == me:
                if qp is None:
                    qp = QueueProcess(self, qdef, "leader")
                    self.queues[name] = qp
                    self.app.start_soon(qp.run)
                    for op in self._early.pop(name, ()):
                        self._to_inbox(qp, op)
                elif qp.role == "mirror":
                    qp.promote(qdef, qp.leader_node)
                elif qp.epoch != qdef.get("epoch", 1):
                    qp.restart_epoch(qdef)
                else:
                    qp.update_mirrors(qdef)
            elif me in qdef.get("mirrors", ()):
                if qp is None:
                    self._start_mirror(qdef)
                elif qp.role == "leader":  # demoted (a partition healed against us)
                    del self.queues[name]
                    qp.stop("queue moved", cancel_consumers=False)
                    self._start_mirror(qdef)
                else:
                    qp.qdef = qdef
                    qp.leader_node = qdef["leader"] if qp.follow.epoch < 0 else qp.leader_node
        for name, qp in list(self.queues.items()):
            qdef = self.md.queues.get(name)
            if qdef is None:
                del self.queues[name]
                qp.stop("queue deleted")
            elif qdef["leader"] != me and me not in qdef.get("mirrors", ()):
                if qp.role == "mirror" and self.md.version < qp.min_version:
                    continue  # the leader already added us; our metadata will catch up
                del self.queues[name]
                qp.stop("queue moved", cancel_consumers=False)
        for s in list(self.sessions.values()):
            s.meta_changed()

    def _start_mirror(self, qdef: dict) -> QueueProcess:
        qp = QueueProcess(self, qdef, "mirror")
        self.queues[qdef["name"]] = qp
        self.app.start_soon(qp.run)
        return qp

    def to_replica(self, node: str, qname: str, op: list) -> None:
        """Replication traffic to the replica of `qname` on another node (dropped if it is down)."""
        link = self.links.get(node)
        if link is not None:
            link.send(m.ToQueue(qname, op))

    async def report_synced(self, qname: str, epoch: int, synced: list) -> None:
        try:
            await self.propose(["queue.synced", qname, epoch, synced])
        except (ProtocolError, trio.TooSlowError):
            pass

    def _running_changed(self, up: str | None = None, down: str | None = None) -> None:
        ev, self._meta_event = self._meta_event, trio.Event()
        ev.set()
        if down is not None:
            self._fail_pending(down)
            for qp in list(self.queues.values()):
                qp.node_down(down)
            # a non-mirrored queue is lost at once; a mirrored one waits for the coordinator's
            # decision (a promotion, or none), which arrives as a node.down metadata change
            lost = [q["name"] for q in self.md.queues_led_by(down) if not q.get("mirrors")]
            for s in list(self.sessions.values()):
                for qname in lost:
                    s.queue_lost(qname, f"home node '{down}' of queue '{qname}' in vhost '/' went down")
        if self.coordinator == self.name:
            self.spawn(self._sync_liveness)

    async def _sync_liveness(self) -> None:
        """Coordinator duty: record members going down and coming back, with the promotions,
        deletions and mirror placements that follow (mirroring/planner.py)."""
        running = self.running
        now = trio.current_time()
        if now - self._last_beat > min(1.0, self.config.net_ticktime / 2):
            # this process itself did not run for a while (SIGSTOP, a frozen VM): the silence
            # was ours, not the others'. Do not declare them down or promote anything; yield
            # to their metadata when the links come back, as a node that just booted does.
            self.log.warning("this node was paused; re-joining instead of declaring peers down",
                             paused_for=round(now - self._last_beat, 3))
            self._app_started_at = now
            self.booting = True
        self._last_beat = now
        booting = now < self._app_started_at + self.config.net_ticktime
        for node in list(self.md.members):
            if self.coordinator != self.name:
                return
            try:
                if node not in running and node not in self.md.down:
                    if booting:
                        # we just started: links are still forming (and duplicate links being
                        # resolved), so a member we do not reach yet is not a failure we saw (a
                        # restarted n2 linked to n3 before n1 must not declare n1 down and
                        # promote its mirrors); look again once net_ticktime has passed
                        self.spawn(self._sync_liveness_later)
                        continue
                    await self.propose(["node.down", node, "failure"])
                elif node in running and node in self.md.down:
                    await self.propose(["node.up", node])
            except (ProtocolError, trio.TooSlowError):
                continue
        # a member that was never down (it just joined) gets no node.up: place mirrors anyway
        # ("all" adds a mirror on a node that joins)
        if self.coordinator == self.name:
            try:
                await self.propose(["replan"])
            except (ProtocolError, trio.TooSlowError):
                pass

    async def _heartbeat(self) -> None:
        """Note the time every 100 ms: a long gap since the last note means this process was
        paused (see _sync_liveness)."""
        while True:
            self._last_beat = trio.current_time()
            await trio.sleep(0.1)

    async def _sync_liveness_later(self) -> None:
        if self._liveness_later:
            return
        self._liveness_later = True
        try:
            await trio.sleep_until(self._app_started_at + self.config.net_ticktime)
        finally:
            self._liveness_later = False
        if self.coordinator == self.name:
            await self._sync_liveness()

    def _plan_change(self, change: list) -> list | None:
        """Coordinator: turn a proposal into the change every node applies, with the decisions
        that depend on who is running made here, once (see mirroring/planner.py)."""
        kind = change[0]
        md, running = self.md, self.running
        if kind == "queue.declare":
            qdef = planner.plan_declare(md, change[1], sorted(running), self.config.queue_leader_locator)
            return ["queue.declare", qdef]
        if kind == "node.down":
            node, how = change[1], change[2] if len(change) > 2 else "failure"
            if node not in md.members:
                return change
            if node in md.down and md.down[node] == "shutdown":
                return ["node.down", node, md.down[node], planner.plan(md, running - {node})]
            shutdown = how == "shutdown"
            return ["node.down", node, how,
                    planner.plan(md, running - {node}, down=node, shutdown=shutdown)]
        if kind == "node.up":
            return ["node.up", change[1], planner.plan(md, running, up=change[1])]
        # a node that recorded its shutdown is still linked for a moment: place nothing on it
        live = running - set(md.down)
        if kind == "policy.set":
            policies = {**md.policies, change[1]["name"]: change[1]}
            return ["policy.set", change[1], planner.plan(md, live, policies=policies)]
        if kind == "policy.clear":
            policies = {k: v for k, v in md.policies.items() if k != change[1]}
            return ["policy.clear", change[1], planner.plan(md, live, policies=policies)]
        if kind == "replan":
            updates = planner.plan(md, live)
            return ["queues.update", updates] if updates else None
        if kind == "queue.synced":
            _, qname, epoch, synced = change
            q = md.queues.get(qname)
            if q is None or q.get("epoch") != epoch:
                return None
            return ["queues.update", planner.plan(md, live, synced=(qname, epoch, synced))]
        return change

    async def _hand_over_on_shutdown(self) -> None:
        """A controlled stop (stop_app, SIGTERM): let mirrors catch up with our leaders, then have
        the coordinator record the shutdown, promoting mirrors as ha-promote-on-shutdown allows."""
        if not self.links:
            return
        leaders = [qp for qp in self.queues.values() if qp.role == "leader" and qp.rep.mirrors]
        for qp in leaders:
            qp.flush()
        deadline = trio.current_time() + 1.0
        while trio.current_time() < deadline and any(
                t.acked < qp.rep.seq for qp in leaders for t in qp.rep.mirrors.values()):
            await trio.sleep(0.005)
        try:
            await self.propose(["node.down", self.name, "shutdown"])
        except (ProtocolError, trio.TooSlowError) as exc:
            self.log.warning("could not hand queues over before stopping", error=str(exc))

    # --- node-to-node calls ------------------------------------------------------------------
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
        if not box:
            raise NodeStopped(link.name)
        return box[0]

    def _resolve(self, rid: int, reply) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[2].append(reply)
            entry[1].set()

    def _fail_pending(self, node: str) -> None:
        for rid, (name, ev, box) in list(self._pending.items()):
            if name == node:
                del self._pending[rid]
                ev.set()

    async def call_node(self, node: str, name: str, args: dict):
        """A request to another running node (or this one); returns the value or raises."""
        if node == self.name:
            from .control import node_rpc
            return await node_rpc(self, name, args)
        link = self.links.get(node)
        if link is None:
            raise NodeStopped(node)
        reply = await self._call(link, lambda rid: m.NodeRpc(rid, name, args))
        if not reply.ok:
            raise ProtocolError(reply.code, reply.error)
        return reply.value

    async def _serve_rpc(self, link: PeerLink, msg: m.NodeRpc) -> None:
        from .control import node_rpc
        try:
            value = await node_rpc(self, msg.name, msg.args)
        except ProtocolError as exc:
            link.send(m.NodeRpcReply(msg.rid, False, None, exc.code, exc.text))
        except Exception as exc:
            self.log.exception("node rpc failed", rpc=msg.name)
            link.send(m.NodeRpcReply(msg.rid, False, None, INTERNAL_ERROR, repr(exc)))
        else:
            link.send(m.NodeRpcReply(msg.rid, True, value, 0, ""))

    # --- routing -----------------------------------------------------------------------------
    def queue_down_reason(self, qdef: dict) -> str:
        """Why operations on this queue fail now ("" if they do not). A mirrored queue whose
        leader just went down is not failed until the coordinator has decided (a promotion)."""
        leader = qdef["leader"]
        if leader == self.name or leader in self.links:
            return ""
        if qdef.get("mirrors") and leader not in self.md.down:
            return ""
        return (f"home node '{leader}' of durable queue '{qdef['name']}' in vhost '/' "
                "is down or inaccessible")

    def check_queue_available(self, qdef: dict, exc_type=ProtocolError) -> None:
        reason = self.queue_down_reason(qdef)
        if reason:
            raise exc_type(NOT_FOUND, reason)

    async def queue_op(self, qdef: dict, op: list) -> None:
        leader = qdef["leader"]
        if leader == self.name:
            await self._queue_op_local(qdef["name"], op)
            return
        link = self.links.get(leader)
        if link is None:
            return  # the leader is down: the session resends after a promotion, or fails
        await link.outbox.wait_below_watermark()
        now = self.md.queues.get(qdef["name"])
        if now is not None and now.get("epoch") != qdef.get("epoch"):
            return  # the leader changed while we waited: the session resends to the new one
        link.send(m.ToQueue(qdef["name"], op))

    def queue_op_nowait(self, qname: str, op: list) -> None:
        """For settlements and clean-up: never blocks (the queue inbox may grow past its bound)."""
        qdef = self.md.queues.get(qname)
        if qdef is None:
            return
        leader = qdef["leader"]
        if leader == self.name:
            qp = self.queues.get(qname)
            if qp is not None:
                self._to_inbox(qp, op)
        else:
            link = self.links.get(leader)
            if link is not None:
                link.send(m.ToQueue(qname, op))

    def _to_inbox(self, qp: QueueProcess, op: list) -> None:
        try:
            qp.inbox.send_nowait(op)
        except trio.WouldBlock:
            self.spawn(qp.inbox.send, op)

    async def _queue_op_local(self, qname: str, op: list) -> None:
        qp = self.queues.get(qname)
        if qp is not None:
            if op[0] == "sync_ok":  # beside the inbox: the leader is blocked in its sync
                qp.on_sync_ok(op)
                return
            await qp.inbox.send(op)
            return
        kind = op[0]
        if kind == "mstart" and self.app_running:  # a leader added us before our metadata did
            qdef = self.md.queues.get(qname) or {"name": qname, "leader": op[2]}
            qp = self._start_mirror(qdef)
            await qp.inbox.send(op)
            return
        if kind in ("rep", "rep_ok", "mstate", "mreset", "sync_ok", "sync_start", "sync_batch",
                    "sync_end") or qname in self.md.queues:
            return  # replication for a replica that is gone, or an op the session will resend
        # the sender knows a queue we do not (yet): its declaration may be on its way to us
        early = self._early.get(qname)
        if early is None:
            early = self._early[qname] = []
            self.spawn(self._expire_early, qname)
        early.append(op)

    async def _expire_early(self, qname: str) -> None:
        await trio.sleep(EARLY_OP_WAIT)
        for op in self._early.pop(qname, ()):
            owner = op[1] if len(op) > 1 and isinstance(op[1], list) else None
            if owner is not None and op[0] in ("consume", "cancel", "get", "purge", "declare_ok", "delete"):
                self.to_session(owner[0], owner[1], [["fail", op[2], owner[2], NOT_FOUND,
                                                      f"no queue '{qname}' in vhost '/'"]])

    def to_session(self, node: str, sid: int, events: list) -> None:
        if node == self.name:
            s = self.sessions.get(sid)
            if s is not None:
                s.inbox.send_nowait(events)
            return
        link = self.links.get(node)
        if link is not None:
            link.send(m.ToSession(sid, events))

    # --- client port -------------------------------------------------------------------------
    async def _on_client_conn(self, stream, peer: str) -> None:
        try:
            await self._serve_client(stream, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # one client's trouble must not bring the node down
            self.log.exception("client connection failed", peer=peer)

    async def _serve_client(self, stream, peer: str) -> None:
        framed = FramedStream(stream, self.config.max_frame)
        session = Session(self, framed, peer)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await session.handshake()
        except ProtocolError as exc:
            self.log.warning("client connection refused", peer=peer, reason=exc.text)
            await _send_error(framed, exc)
            return
        except trio.TooSlowError:
            return
        self.sessions[session.sid] = session
        try:
            await session.run()
        finally:
            del self.sessions[session.sid]
            self._session_gone(session)

    def _session_gone(self, session: Session) -> None:
        node, sid = self.name, session.sid
        for qname in {q for ch in session.channels.values() for q in ch.touched}:
            self.queue_op_nowait(qname, ["session_gone", node, sid])

    # --- queue declaration and deletion ------------------------------------------------------
    def _choose_leader(self, session: Session, arguments: dict) -> str:
        locator = arguments.get("x-queue-master-locator") or self.config.queue_leader_locator
        if locator == "balanced":
            counts = {n: 0 for n in sorted(self.running)}
            for q in self.md.queues.values():
                if q["leader"] in counts:
                    counts[q["leader"]] += 1
            return min(counts, key=lambda n: (counts[n], n))
        return self.name

    async def declare_queue(self, session: Session, msg: m.QueueDeclare):
        name = msg.queue
        if name.startswith("amq.") and not msg.passive:
            raise ChannelError(ACCESS_REFUSED,
                               f"queue name '{name}' contains reserved prefix 'amq.*'")
        if not name:
            if msg.passive:
                raise ChannelError(NOT_FOUND, "no queue '' in vhost '/'")
            name = f"amq.gen-{os.urandom(8).hex()}"
        if len(name) > 255:
            raise ChannelError(PRECONDITION_FAILED, "queue name is longer than 255 characters")
        _validate_queue_arguments(msg.arguments)
        existing = self.md.queues.get(name)
        if msg.passive:
            if existing is None:
                raise ChannelError(NOT_FOUND, f"no queue '{name}' in vhost '/'")
            session._queue(name)
        elif existing is not None:
            self.check_queue_available(existing, ChannelError)
        if not msg.passive:
            qdef = {
                "name": name,
                "durable": bool(msg.durable) and not msg.exclusive,
                "exclusive": bool(msg.exclusive),
                "auto_delete": bool(msg.auto_delete),
                "arguments": dict(msg.arguments),
                "leader": self.name if msg.exclusive else self._choose_leader(session, msg.arguments),
                "owner": session.conn_id if msg.exclusive else None,
                # the coordinator decides the leader (planner.plan_declare) from where the client
                # is and from this node's queue_leader_locator, not from its own setting
                "declared_on": self.name,
                "locator": self.config.queue_leader_locator,
            }
            if existing is not None and existing["exclusive"] and not msg.exclusive and existing.get("owner") == session.conn_id:
                qdef["durable"] = existing["durable"]
            if msg.exclusive and msg.durable:
                qdef["durable"] = False  # spec: exclusive queues are never durable
            try:
                result = await self.propose(["queue.declare", qdef])
            except MetaError as exc:
                raise ChannelError(exc.code, exc.text) from None
            except trio.TooSlowError:
                raise ChannelError(INTERNAL_ERROR, "timed out waiting for the cluster to record the queue") from None
            if result["created"]:
                if msg.exclusive:
                    session.exclusive_queues.add(name)
                self.log.info("queue declared", queue=name, leader=result["queue"]["leader"],
                              durable=qdef["durable"], exclusive=qdef["exclusive"])
                return [name, 0, 0]
        qdef = self.md.queues.get(name)
        if qdef is None:
            raise ChannelError(NOT_FOUND, f"no queue '{name}' in vhost '/'")
        ch = session.channels[msg.ch]
        await self.queue_op(qdef, ["declare_ok", [self.name, session.sid, ch.id], msg.rid])
        return None  # the queue answers the client itself

    async def delete_queue_then_reply(self, qname: str, owner: list, rid: int, count: int) -> None:
        try:
            await self.propose(["queue.delete", qname])
        except (ProtocolError, trio.TooSlowError) as exc:
            self.to_session(owner[0], owner[1], [["fail", rid, owner[2], INTERNAL_ERROR, str(exc)]])
            return
        self.log.info("queue deleted", queue=qname)
        self.to_session(owner[0], owner[1], [["reply", rid, count]])

    async def auto_delete_queue(self, qname: str) -> None:
        try:
            await self.propose(["queue.delete", qname, self.name])
        except (ProtocolError, trio.TooSlowError):
            return
        self.log.info("auto-delete queue deleted after its last consumer left", queue=qname)

    # --- membership commands -----------------------------------------------------------------
    async def join_cluster(self, host: str, port: int) -> list[str]:
        """Ask the node at host:port to add us; take its metadata. The app must be stopped."""
        if self.app_running:
            raise ProtocolError(NOT_ALLOWED, "stop the app first: run stop_app before join_cluster")
        from .control import ctl_call
        snap = await ctl_call(self.network, host, port, self.name, self.config.secret, "add_member",
                              {"name": self.name, "peer": self._peer_addr(), "client": self._client_addr()})
        md = Metadata.from_snapshot(snap)
        self.md = md
        self._save()
        self.log.info("joined cluster", cluster=md.cluster_name, members=list(md.members))
        return list(md.members)

    async def reset(self) -> None:
        """Leave the cluster and forget everything (the app must be stopped)."""
        if self.app_running:
            raise ProtocolError(NOT_ALLOWED, "stop the app first: run stop_app before reset")
        from .control import ctl_call
        md = self._load() if self.has_state() else self.md
        for name, rec in md.members.items():
            if name == self.name:
                continue
            try:
                with trio.fail_after(5):
                    await ctl_call(self.network, *rec["peer"], self.name, self.config.secret,
                                   "remove_member", {"name": self.name})
                break
            except (OSError, ProtocolError, trio.TooSlowError):
                continue
        if self.persist and self._meta_path.exists():
            self._meta_path.unlink()
        self.md = self._fresh_metadata()
        self.log.info("node reset")


def _validate_queue_arguments(arguments: dict) -> None:
    loc = arguments.get("x-queue-master-locator")
    if loc is not None and loc not in ("client-local", "balanced"):
        raise ChannelError(PRECONDITION_FAILED,
                           f"invalid arg 'x-queue-master-locator' for queue: {loc!r} "
                           "(expected 'client-local' or 'balanced')")
    for key in arguments:
        if not isinstance(key, str):
            raise ChannelError(PRECONDITION_FAILED, "queue argument names must be strings")


async def _send_error(framed: FramedStream, exc: ProtocolError) -> None:
    with trio.move_on_after(2):
        try:
            await framed.send_now(m.Error(exc.code, exc.text))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass
