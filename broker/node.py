"""One warren node: its lifetime and app, its listeners, and the wiring between its parts.

Theory of operation:
* `run()` lives as long as the process. It listens on the peer port (needed even while the app
  is stopped: warrenctl speaks there) and starts the app.
* The app (`start_app`/`stop_app`, as in rabbitmqctl) is the cluster's part on this node
  (broker/cluster.py: links, the metadata log, liveness), the client listener with its sessions
  (broker/native.py, broker/session.py) and the queue replicas (broker/router.py). Every start
  of the app is a new *incarnation*: the cluster learns that whatever this node held before is
  gone. Stopping the app is a controlled shutdown: leaders hand over to synchronised mirrors
  (ha-promote-on-shutdown) before the node says it is going.
* The parts talk through this class only: the cluster tells it what changed (`meta_changed`,
  `link_up`, `link_down`, `peer_message`, `paused`), and it passes that on to the router and
  the sessions.
* `memory` (broker/memory.py) is the memory alarm: the app samples the process's memory and,
  while this node or a peer is above its high watermark, front ends hold publishing
  connections (`node.memory.blocked`, `wait_unblocked`, hooks).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random

import trio

from mirroring.access import CONFIGURE
from mirroring.exchanges import plain
from mirroring import changes as c
from mirroring.metadata import MetaError
from mirroring.records import VHOST_SEP, QueueDef, named
from mirroring.queue import SID_RUN_MASK
from mirroring.queue import check_arguments as check_queue_arguments
from mirroring.replica import LEADING
from mirroring.replica_leading import SYNCED_CHECK_EVERY
from wire.errors import (ACCESS_REFUSED, CONNECTION_FORCED, INTERNAL_ERROR, NOT_ALLOWED, NOT_FOUND,
                         PRECONDITION_FAILED, ProtocolError)
from wire import messages as m
from wire.handshake import NONCE_BYTES, new_nonce

from . import config as configmod
from . import log as logmod
from .backoff import Backoff
from .cluster import Cluster, NodeStopped
from .dead_letters import DeadLetters
from .framed import FramedStream
from .memory import NodeMemory, ProcessMemory
from .native import NativeConnection
from .peers import HANDSHAKE_TIMEOUT, accept_handshake
from .router import Router
from .session import ChannelError, Session
from .session.replyto import REPLY_TO, reply_queue_exists

SHUTDOWN_HANDOVER_TIMEOUT = 5.0


class Connections(dict):
    """The app's client connections by session id (each a NativeConnection or AmqpConnection,
    which the front ends add and remove; `force_close` ends one). A controlled stop closes them
    all, then waits until every one has gone (`wait_empty`)."""

    def __init__(self):
        super().__init__()
        self._emptied: trio.Event | None = None  # set once the last one has gone, if awaited

    def _maybe_emptied(self) -> None:
        if not self and self._emptied is not None:
            self._emptied.set()

    def pop(self, key, *default):
        value = super().pop(key, *default)
        self._maybe_emptied()
        return value

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._maybe_emptied()

    def clear(self) -> None:
        super().clear()
        self._maybe_emptied()

    async def wait_empty(self) -> None:
        while self:
            self._emptied = trio.Event()
            await self._emptied.wait()

    def close_deleted_users(self, users) -> None:
        """The connections of users no longer in `users` (deleted) are closed, as RabbitMQ
        closes them."""
        for conn in [conn for conn in self.values()
                     if conn.session is not None and conn.session.core.user not in users]:
            conn.force_close(CONNECTION_FORCED, f"user '{conn.session.core.user}' was deleted")


class Node:
    def __init__(self, config: configmod.NodeConfig, network, *, persist: bool = True,
                 rng: random.Random | None = None, memory_probe=None, check_planning_copy: bool = False,
                 tls=None):
        self.config = config
        self.tls = tls  # broker/tls.py's NodeTls, or None: every port plain
        self.name = config.name
        self.network = network
        self.persist = persist
        self.rng = rng or random.Random(os.urandom(16))
        # handshake challenges: fresh random bytes, or in a simulation a stream drawn from the
        # seeded rng's state without taking from it (one seed decides every byte a simulated
        # run sends, and the node's other draws stay what they were)
        if rng is not None:
            nonces = random.Random(hash(rng.getstate()))
            self.new_nonce = lambda: nonces.randbytes(NONCE_BYTES)
        else:
            self.new_nonce = new_nonce
        self.log = logmod.get(self.name)
        self.cluster = Cluster(self.name, config, network, self.log, self, persist=persist, rng=self.rng,
                               check_planning_copy=check_planning_copy)
        self.router = Router(self)
        self.dead_letters = DeadLetters(self, simulated=rng is not None)
        # the memory alarm (broker/memory.py); the probe is this process's RSS unless a
        # simulation gives its own
        self.memory = NodeMemory(self.name, config.memory_watermark,
                                 memory_probe if memory_probe is not None else ProcessMemory(),
                                 self.log, lambda: self.cluster.links)
        self.sessions: dict[int, Session] = {}
        # queue -> the sessions (by sid) that route operations to it (`Session.routes`): a
        # metadata change that names its queues is shown to these sessions only
        self.routing: dict[str, dict[int, Session]] = {}
        self.connections = Connections()
        self.client_sockets = 0  # client connections open, logged in or not (max_connections)
        # lines strangers can cause (refused logins and handshakes): at most one a second each
        self.stranger_log = logmod.Throttled(self.log, trio.current_time)
        self._refused_links: dict[str, str] = {}  # node -> the refusal last logged (_note_refusal)
        self.app_running = False
        self.joining_seed: str | None = None  # first boot: the seed being joined, until it answers
        self.peer_port = config.peer_port
        self.client_port = config.client_port
        self.amqp_port = config.amqp_port
        self.amqps_port = None  # AMQP over TLS, when self.tls
        self.http_port = config.http_port
        self.management = None  # broker/management: the HTTP API's view of the cluster, when served
        self._sids = itertools.count(1)
        self._counted_down = False  # the metadata records this very run of the node as down
        self._counted_up = False  # it records this very run up (as of the last change applied)
        self._times_down = 0  # the metadata's count of this node's runs recorded down, as of then
        self.stopping = False  # stop_app has begun (the app runs until it has handed over)
        # the shutdown record is on its way: deliveries are no longer shown (see _hand_over_on_shutdown)
        self.leaving = False
        self._app_scope: trio.CancelScope | None = None
        self._app_stopped = trio.Event()  # set when the app's present run has ended
        self.root = None
        self.app = None
        self.started = trio.Event()

    # --- shortcuts -----------------------------------------------------------------------------
    @property
    def md(self):
        return self.cluster.md

    @property
    def running(self) -> set[str]:
        return self.cluster.running

    @property
    def links(self):
        return self.cluster.links

    def clients(self) -> list[Session]:
        """The client sessions (not the node's own dead-letter publisher)."""
        return [s for s in self.sessions.values() if s.listed]

    def new_session_id(self) -> int:
        """Unique across restarts of this node (its incarnation is in the high bits), so a
        queue never mistakes a new session for one it knew (publish de-duplication)."""
        return ((self.cluster.incarnation & SID_RUN_MASK) << 32) | next(self._sids)

    def spawn(self, fn, *args) -> None:
        """Run a helper task in the app (dies with the app); nothing once the app is stopping."""
        if self.app is not None and not (self._app_scope and self._app_scope.cancel_called):
            try:
                self.app.start_soon(fn, *args)
            except RuntimeError:  # the app's nursery closed a moment ago
                pass

    def has_state(self) -> bool:
        return self.cluster.has_state()

    # --- process lifetime --------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as root:
            self.root = root
            self.peer_port = await root.start(self._serve(self.tls and self.tls.peer_server), self.config.host,
                                              self.config.peer_port, self._on_peer_conn)
            self.cluster.peer_addr = [self.config.advertise_host, self.peer_port]
            self.log.info("node listening", peer_port=self.peer_port)
            if self.config.http_port is not None:
                from .management import serve as serve_management
                self.http_port = await root.start(serve_management, self)
            if self.config.cluster_seed and not self.has_state():
                self.joining_seed = self.config.cluster_seed
                try:
                    await self._join_seed(self.config.cluster_seed)
                finally:
                    self.joining_seed = None
            await self.start_app()
            if self.persist:
                configmod.register(self.name, (self.config.advertise_host, self.peer_port),
                                   (self.config.advertise_host, self.client_port), os.getpid(),
                                   (self.config.advertise_host, self.amqp_port),
                                   None if self.http_port is None else (self.config.advertise_host, self.http_port))
            self.started.set()
            task_status.started(self)

    def _serve(self, tls):
        """The network's `serve` for one listener, speaking TLS with context `tls` if not None."""
        return functools.partial(self.network.serve, tls=tls or None)

    async def _join_seed(self, seed: str) -> None:
        """First boot with a cluster seed: keep trying to join until the seed answers."""
        host, port = configmod.lookup(seed)
        if (host, port) == (self.config.advertise_host, self.peer_port):
            return
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                await self.join_cluster(host, port)
                return
            except (OSError, ProtocolError, trio.TooSlowError) as exc:
                self.log.info("waiting for cluster seed", seed=seed, error=str(exc))
                await backoff.wait()

    async def start_app(self) -> None:
        if self.app_running:
            return
        if self.joining_seed is not None:
            # started now, the app would run a cluster of its own and the join could never
            # finish (it needs the app stopped): dst seed 54014, a stop_app/start_app during
            # the join left the node alone for good
            raise ProtocolError(NOT_ALLOWED, f"node {self.name} is still joining the cluster through "
                                             f"its seed {self.joining_seed}: its app starts once it "
                                             "has joined")
        await self.root.start(self._app)

    async def _app(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        stopped = self._app_stopped = trio.Event()
        with trio.CancelScope() as scope:
            self._app_scope = scope
            incarnation = self.rng.getrandbits(31) | 1
            try:
                async with trio.open_nursery() as app:
                    self.app = app
                    self.cluster.client_addr = [self.config.advertise_host, self.config.client_port]
                    await app.start(self.cluster.run, incarnation)
                    await app.start(self.memory.run)
                    self.client_port = await app.start(self._serve(self.tls and self.tls.clients), self.config.host,
                                                       self.config.client_port, self._on_client_conn)
                    self.cluster.client_addr = [self.config.advertise_host, self.client_port]
                    self.amqp_port = await app.start(self.network.serve, self.config.host,
                                                     self.config.amqp_port, self._on_amqp_conn)
                    if self.tls is not None:
                        self.amqps_port = await app.start(self._serve(self.tls.clients), self.config.host,
                                                          self.config.amqps_port, self._on_amqp_conn)
                    self.app_running = True
                    self.leaving = False
                    self.stopping = False
                    self.dead_letters.open()
                    self.router.reconcile()
                    self.log.info("app started", client_port=self.client_port, amqp_port=self.amqp_port,
                                  amqps_port=self.amqps_port,
                                  incarnation=incarnation, members=list(self.md.members))
                    task_status.started()
            finally:
                self.app_running = False
                self.app = None
                self.router.stop_all()
                self.sessions.clear()
                self.routing.clear()
                self.connections.clear()
                self.log.info("app stopped")
                stopped.set()

    async def stop_app(self) -> None:
        """A controlled stop: hand over what we lead, say we are going, then stop."""
        if not self.app_running or self._app_scope is None:
            return
        self.log.info("stopping app")
        self.stopping = True
        with trio.move_on_after(SHUTDOWN_HANDOVER_TIMEOUT):
            await self._hand_over_on_shutdown()
        for conn in list(self.connections.values()):
            conn.force_close(CONNECTION_FORCED, f"node {self.name} is stopping (stop_app or shutdown)")
        with trio.move_on_after(1.0):
            await self.connections.wait_empty()
        stopped = self._app_stopped
        self._app_scope.cancel()
        await stopped.wait()

    async def _hand_over_on_shutdown(self) -> None:
        """Let mirrors catch up with our leaders (and the log record which are synchronised),
        hand the metadata log's leadership over, then have the shutdown recorded, promoting
        mirrors as ha-promote-on-shutdown allows.

        All of it needs a majority of the members: it stops as soon as fewer of them are
        linked to us, since no commit can reach us then, and waiting out the timeouts would
        only hold the stop (a whole cluster stopped at once: its last nodes lose their links
        one by one as the others exit). Links come and go as the cluster's news."""
        cluster = self.cluster
        cut_off = False

        def majority_linked() -> bool:
            members = self.md.members
            return 2 * len(cluster.running & set(members)) > len(members)

        async with trio.open_nursery() as nursery:
            async def watch_links() -> None:
                nonlocal cut_off
                while majority_linked():
                    await cluster.wait_changed()
                cut_off = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_links)
            await self._hand_over(cluster)
            nursery.cancel_scope.cancel()
        if cut_off:
            self.log.warning("could not hand queues over before stopping: no majority of the members "
                             "is linked to this node", running=sorted(cluster.running))

    async def _hand_over(self, cluster) -> None:
        if not cluster.links:
            return
        with trio.move_on_after(1.0):
            await self._mirrors_caught_up()
        raft = cluster.raft
        if raft is not None and raft.leader == self.name:
            raft.transfer_leadership(trio.current_time())
            cluster._after_raft(trio.current_time())
            with trio.move_on_after(1.0):
                while cluster.raft is not None and cluster.raft.leader in (self.name, None):
                    await cluster.wait_changed()
        # From the moment the record may be applied, leaders elsewhere may requeue (flagged) and
        # deliver again what they sent our sessions; a delivery still on its way here must not
        # reach a client after that, unflagged (dst seed 30123: a delayed link brought six).
        # Nothing is lost: whatever is not shown stays unacknowledged and goes back with us.
        self.leaving = True
        try:
            await cluster.propose(c.NodeDown(self.name, cluster.incarnation, "shutdown"),
                                  timeout=SHUTDOWN_HANDOVER_TIMEOUT)
        except (ProtocolError, trio.TooSlowError) as exc:
            self.log.warning("could not hand queues over before stopping", error=str(exc))

    async def _mirrors_caught_up(self) -> None:
        """Return once every mirror of every queue we lead has acknowledged all it was sent,
        and the metadata lists as synchronised exactly the mirrors that are.

        What this waits for arrives in the leaders' rounds: a mirror's acknowledgement is taken
        in one, and so is the Assign that brings a queue's synchronised mirrors as the log
        committed them. So it waits for the next round of any leader still behind
        (`QueueProcess.watch_round`) and looks again. A leader reports its synchronised
        mirrors to the log in a round too, at most every SYNCED_CHECK_EVERY: one still behind
        is given a round of its own (a no-op input: the round flushes and reports) that
        often, since a round sooner would report nothing new."""
        nudged: dict = {}  # queue process -> when it was last given a round
        while True:
            now = trio.current_time()
            behind = []
            for qp in self.router.leaders():
                r = qp.replica
                if any(t.acked < r.rep.seq for t in r.rep.mirrors.values()) or \
                        r.synced_now() != sorted(r.assign.synced):
                    behind.append(qp)
            if not behind:
                return
            progress = trio.Event()
            for qp in behind:
                qp.watch_round(progress)
                if now >= nudged.get(qp, -math.inf) + SYNCED_CHECK_EVERY:
                    nudged[qp] = now
                    qp.deliver(lambda replica, now: None)
            with trio.move_on_at(min(nudged[qp] for qp in behind) + SYNCED_CHECK_EVERY):
                await progress.wait()

    # --- the cluster's news --------------------------------------------------------------------
    def _close_deleted_vhosts(self) -> None:
        """Close the connections into a vhost the log deleted, as RabbitMQ does (320)."""
        vhosts = self.md.vhosts
        for sid, core in list(self.sessions.items()):
            conn = self.connections.get(sid)
            if core.vhost not in vhosts and conn is not None:
                conn.force_close(CONNECTION_FORCED, f"vhost '{core.vhost}' is deleted")

    def meta_changed(self, change) -> None:
        self.router.reconcile(self.md.touched if change is not None else None)
        if change is None or type(change) is c.VHostDelete:
            self._close_deleted_vhosts()
        if self.management is not None:
            self.management.meta_changed(change)
        run = self.cluster.incarnation
        md = self.md
        counted = md.up.get(self.name) == run
        back = counted and self._counted_down
        was_up, self._counted_up = self._counted_up, counted
        self._counted_down = not counted and md.up.get(self.name) is None and self.name in md.down
        times_down = md.times_down.get(self.name, 0)
        went_down, self._times_down = times_down != self._times_down, times_down
        if not self.leaving:
            if change is not None:
                down_now = (type(change) is c.NodeDown and change.node == self.name
                            and change.incarnation == run)
            else:
                # a snapshot of the log (we lagged past its compaction): it holds no record, but
                # this run was up before it and was counted down since: it is down in it, or up
                # again (only a failure brings the same run back, which the count shows)
                down_now = was_up and (self._counted_down or counted and went_down)
                back = back or down_now and counted
            if down_now:
                self._counted_down_while_running()
        if change is None or type(change) is c.UserDelete:  # (None: a snapshot replaced it all)
            self.connections.close_deleted_users(self.md.users)
        asked = c.delete_asked_by(change, self.name) if change is not None else None
        if asked is not None:  # a client's delete through one of our sessions (Router.delete_for_client)
            asker = self.sessions.get(asked.session)
            if asker is not None:
                asker.answer_delete(asked.rid, asked.count)
        touched = self.md.touched if change is not None else None
        if touched is not None and not back:
            # the change names its queues: only the sessions routing to them can be concerned
            # (O(those), not O(sessions): 3,000 RPC clients each declaring a reply queue)
            concerned: dict[int, Session] = {}
            for qname in sorted(touched):
                concerned.update(self.routing.get(qname, ()))
            for s in list(concerned.values()):
                s.meta_changed(touched)
            return
        for s in list(self.sessions.values()):
            s.meta_changed()
            if back:
                # the cluster counted this node down (a link to the log's leader broke) and now
                # up again, the same run of it: queue leaders forgot its sessions meanwhile
                s.resend_all()

    def _counted_down_while_running(self) -> None:
        """The log records this very run of the node down (a freeze, a partition, a slow link
        outlived net_ticktime somewhere). Every queue leader requeues, flagged, what it had sent
        our sessions once it applies the same record, and closes its link to us; what the
        sessions were sent before it and still hold unseen is given back (Router.counted_down;
        dst seed 68350). They register their consumers again on the new links, and when the
        log records us up (`resend_all`)."""
        self.log.warning("the cluster counted this node down while it ran: deliveries held "
                         "for its sessions are given back unseen")
        self.router.counted_down()

    def link_up(self, node: str) -> None:
        self.memory.link_up(node)
        self.router.link_up(node)

    def link_down(self, node: str) -> None:
        if self.management is not None:
            self.management.link_down(node)
        self.memory.link_down(node)
        self.router.link_down(node)

    def link_replaced(self, node: str) -> None:
        self.router.link_replaced(node)

    def in_step(self) -> None:
        self.router.in_step()

    def peer_messages(self, link, msgs: list) -> None:
        self.router.peer_messages(link, msgs)

    def paused_reason(self) -> str:
        why = ""
        refused = self.cluster.refused_by
        if refused:  # e.g. the node was forgotten and started again without a reset
            peer, reason = min(refused.items())
            why = f" ({peer} refuses its link: {reason})"
        return (f"node {self.name} cannot reach a majority of the cluster (pause_minority){why}: "
                "connect to another node")

    def paused(self, paused: bool) -> None:
        if paused:
            for conn in list(self.connections.values()):
                conn.force_close(CONNECTION_FORCED, self.paused_reason())

    async def node_rpc(self, name: str, args: dict):
        from .control import node_rpc
        return await node_rpc(self, name, args)

    # --- peer port ---------------------------------------------------------------------------
    async def _on_peer_conn(self, stream, peer: str) -> None:
        try:
            await self._accept_peer(stream, peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except ProtocolError as exc:  # e.g. the dialer dropped a duplicate link during set-up
            self.log.debug("peer connection ended during set-up", peer=peer, reason=logmod.clip(exc.text, 255))
        except trio.TooSlowError:
            self.log.debug("peer link set-up timed out", peer=peer)
        except Exception:  # a bug in handling one connection must not bring the node down
            self.log.exception("peer connection failed", peer=peer)

    async def _accept_peer(self, stream, peer: str) -> None:
        framed = FramedStream(stream, self.config.max_frame)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                auth = await accept_handshake(framed, self.name, self.config.secret, self.new_nonce())
        except ProtocolError as exc:  # a stranger's line: bounded and throttled
            self.stranger_log.warning("peer connection refused", peer=peer, reason=logmod.clip(exc.text, 255))
            await _send_error(framed, exc)
            return
        except trio.TooSlowError:
            self.stranger_log.warning("peer handshake timed out", peer=peer)
            return
        if auth.role == "ctl":
            from .control import serve_ctl
            await serve_ctl(self, framed, auth.node)
            return
        refusal = None
        if not self.app_running:
            refusal = f"node {self.name} is not running (its app is stopped)"
        elif not self.cluster.accepts_link_from(auth.node):
            refusal = (f"node {auth.node} is not a member of cluster {self.md.cluster_name}; "
                       "run join_cluster on it first (after stop_app and reset, if it was a member once)")
        if refusal is not None:
            self._note_refusal(auth.node, refusal)
            await _send_error(framed, ProtocolError(NOT_ALLOWED, refusal))
            return
        self._refused_links.pop(auth.node, None)
        await self.cluster.run_link(auth.node, framed, dialer=auth.node)

    def _note_refusal(self, node: str, reason: str) -> None:
        """Log a refused peer link once per reason, not at each of the dialer's retries."""
        if self._refused_links.get(node) == reason:
            return
        if len(self._refused_links) >= 256:  # bounded, whatever names strangers dial with
            self._refused_links.clear()
        self._refused_links[node] = reason
        self.log.warning("peer link refused", peer=node, reason=reason)

    # --- client port -------------------------------------------------------------------------
    async def _on_client_conn(self, stream, peer: str) -> None:
        try:
            await NativeConnection(self, stream, peer).serve()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # one client's trouble must not bring the node down
            self.log.exception("client connection failed", peer=peer)

    async def _on_amqp_conn(self, stream, peer: str) -> None:
        from .amqp.server import AmqpConnection
        try:
            await AmqpConnection(self, stream, peer).serve()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # one client's trouble must not bring the node down
            self.log.exception("AMQP connection failed", peer=peer)

    # --- queues ------------------------------------------------------------------------------
    def queue_down_reason(self, qdef: QueueDef) -> str:
        """Why operations on this queue fail now ("" if they do not). A mirrored queue whose
        leader just went down is not failed until the log has decided (a promotion)."""
        leader = qdef.leader
        if leader == self.name or leader in self.cluster.links:
            return ""
        if qdef.mirrors and leader not in self.md.down:
            return ""
        if leader not in self.md.down and leader in self.md.up:
            return ""  # up as far as the log knows: our link to it is only being set up
        return (f"home node '{leader}' of durable queue '{qdef.name}' in vhost '{qdef.vhost}' "
                "is down or inaccessible")

    def check_queue_available(self, qdef: QueueDef, exc_type=ProtocolError) -> None:
        reason = self.queue_down_reason(qdef)
        if reason:
            raise exc_type(NOT_FOUND, reason)

    async def declare_queue(self, session: Session, msg: m.QueueDeclare):
        """Declare through the log in the session's vhost; returns [name, 0, 0] for a new
        queue, or None when it existed (the session then asks its leader for the counts)."""
        name = msg.queue
        vhost = session.vhost
        if name.startswith(REPLY_TO):  # direct reply-to's names: they exist or not, as they are
            if not reply_queue_exists(name, self.name, self.sessions, self.cluster.links.__contains__):
                raise ChannelError(NOT_FOUND, f"no queue '{name}' in vhost '{vhost}'")
            return [name, 0, 1]  # no message, its one consumer
        if name.startswith("amq.") and not msg.passive:
            raise ChannelError(ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'")
        if not name:
            if msg.passive:
                raise ChannelError(NOT_FOUND, f"no queue '' in vhost '{vhost}'")
            name = f"amq.gen-{self.rng.getrandbits(64):016x}"
            msg.queue = name
        if len(name) > 255:
            raise ChannelError(PRECONDITION_FAILED, "queue name is longer than 255 characters")
        if VHOST_SEP in name:
            raise ChannelError(PRECONDITION_FAILED, "queue name contains a NUL character")
        key = session.key(name)
        if not msg.passive:
            session.check_access(CONFIGURE, "queue", name)
        arguments = plain(msg.arguments)
        _validate_queue_arguments(arguments)
        try:
            check_queue_arguments(key, arguments)
        except ProtocolError as exc:
            raise ChannelError(exc.code, exc.text) from None
        existing = self.md.queues.get(key)
        if msg.passive:
            if existing is None:
                raise ChannelError(NOT_FOUND, f"no queue '{name}' in vhost '{vhost}'")
            session._queue(key)
            return None
        if existing is not None:
            self.check_queue_available(existing, ChannelError)
        durable = bool(msg.durable) and not msg.exclusive
        if existing is not None and existing.exclusive and not msg.exclusive \
                and existing.owner == session.conn_id:
            durable = existing.durable
        # the log's leader decides where it lives (planner.plan_declare) from where the client
        # is (the leader proposed) and from this node's queue_leader_locator
        qdef = QueueDef(name, durable, bool(msg.exclusive), bool(msg.auto_delete), arguments,
                        self.name, session.conn_id if msg.exclusive else None, vhost=vhost)
        try:
            result = await self.cluster.propose(c.QueueDeclare(qdef, self.config.queue_leader_locator))
        except MetaError as exc:
            raise ChannelError(exc.code, exc.text) from None
        except trio.TooSlowError:
            raise ChannelError(INTERNAL_ERROR, "timed out waiting for the cluster to record the queue") from None
        if result is None:
            raise ChannelError(INTERNAL_ERROR, "the cluster did not record the queue")
        if result["created"]:
            if msg.exclusive:
                session.exclusive_queues.add(key)
            await self.cluster.seen_everywhere(key)  # routable through every node from now on
            self.log.info("queue declared", **named(key), leader=result["leader"],
                          durable=qdef.durable, exclusive=qdef.exclusive)
            return [name, 0, 0]
        return None

    # --- membership commands -----------------------------------------------------------------
    async def join_cluster(self, host: str, port: int) -> list[str]:
        """Ask the node at host:port to add us; take its log. The app must be stopped."""
        if self.app_running:
            raise ProtocolError(NOT_ALLOWED, "stop the app first: run stop_app before join_cluster")
        from .control import ctl_call
        joined = await ctl_call(self.network, host, port, self.name, self.config.secret, "add_member",
                                {"name": self.name, "peer": self.cluster.peer_addr,
                                 "client": self.cluster.client_addr})
        self.cluster.adopt(joined)
        members = list(self.cluster.addresses())
        self.log.info("joined cluster", cluster=self.md.cluster_name, members=members)
        return members

    async def reset(self) -> None:
        """Leave the cluster and forget everything (the app must be stopped)."""
        if self.app_running:
            raise ProtocolError(NOT_ALLOWED, "stop the app first: run stop_app before reset")
        from .control import ctl_call
        md = self.cluster.load_metadata()
        for name, rec in md.members.items():
            if name == self.name:
                continue
            try:
                with trio.fail_after(5):
                    await ctl_call(self.network, *rec.peer, self.name, self.config.secret,
                                   "remove_member", {"name": self.name})
                break
            except (OSError, ProtocolError, trio.TooSlowError):
                continue
        self.cluster.forget_state()
        self.cluster.md = self.cluster.load_metadata()
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


__all__ = ["Node", "NodeStopped", "LEADING"]
