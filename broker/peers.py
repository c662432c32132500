"""Peer links: the authenticated, heartbeat-checked connection between two nodes.

Handshake on the peer port (the accepting side speaks first):
  acceptor -> Hello(version, node, nonce)
  dialer   -> PeerAuth(version, node, role, proof=HMAC(secret, acceptor nonce), nonce)
  acceptor -> PeerWelcome(node, proof=HMAC(secret, dialer nonce))   or Error and close
Role "peer" opens a link between nodes; role "ctl" is warrenctl (or a node asking another to
add it to the cluster). A link is down when its stream breaks, or when nothing was heard for
net_ticktime (ticks are sent every net_ticktime/4).

A link also goes down when its reader finds that nothing was read for STALE_AFTER x net_ticktime
before the read it just made: this node was frozen (SIGSTOP, a VM paused) or its loop stalled.
What waits in the socket then was sent before or during the freeze, and the peer may have
counted this node down meanwhile (it does after net_ticktime of silence, and this node's last
words before the freeze may be a tick interval older than the freeze): its deliveries may have
been requeued and given, flagged redelivered, to other consumers, and its metadata may be old.
So those bytes are dropped with the link, as if the tick check had run first, and both sides
start again from a fresh link. A healthy link reads a tick at least every net_ticktime/4.
"""

from __future__ import annotations

import trio

from wire import messages as m
from wire.errors import ACCESS_REFUSED, VERSION_MISMATCH, ProtocolError
from wire.handshake import check_proof, new_nonce, proof

from .framed import FramedStream, Outbox

HANDSHAKE_TIMEOUT = 10.0
STALE_AFTER = 0.7  # of net_ticktime: a read after a longer silence is a freeze's (see above)


def _ctx(direction: str, role: str, name: str) -> str:
    return f"warren/{direction}/{role}/{name}"


async def accept_handshake(framed: FramedStream, me: str, secret: bytes, nonce: bytes | None = None) -> m.PeerAuth:
    """Run the acceptor's side; returns the dialer's PeerAuth or raises ProtocolError. `nonce`:
    the challenge (a fresh random one by default; the simulation's come from its seed)."""
    nonce = nonce or new_nonce()
    await framed.send_now(m.Hello(m.PROTOCOL_VERSION, me, nonce, framed.max_frame))
    auth = await framed.receive(frozenset({"peer.auth"}))
    if auth is None:
        raise ProtocolError(ACCESS_REFUSED, "connection closed during the handshake")
    if auth.version != m.PROTOCOL_VERSION:
        raise ProtocolError(VERSION_MISMATCH,
                            f"protocol version {auth.version} not supported (this node speaks {m.PROTOCOL_VERSION})")
    if auth.role not in ("peer", "ctl"):
        raise ProtocolError(ACCESS_REFUSED, f"unknown role {auth.role!r}")
    if not check_proof(secret, nonce, _ctx("in", auth.role, auth.node), auth.proof):
        raise ProtocolError(ACCESS_REFUSED,
                            f"{auth.node!r} did not prove the cluster secret (wrong cookie/secret)")
    await framed.send_now(m.PeerWelcome(me, proof(secret, auth.nonce, _ctx("out", auth.role, me))))
    return auth


async def dial_handshake(framed: FramedStream, me: str, secret: bytes, role: str,
                         nonce: bytes | None = None) -> str:
    """Run the dialer's side; returns the acceptor's node name."""
    hello = await framed.receive(frozenset({"hello", "error"}))
    if hello is None:
        raise ProtocolError(ACCESS_REFUSED, "connection closed before the handshake")
    if isinstance(hello, m.Error):
        raise ProtocolError(hello.code, hello.text)
    nonce = nonce or new_nonce()
    await framed.send_now(m.PeerAuth(m.PROTOCOL_VERSION, me, role,
                                     proof(secret, hello.nonce, _ctx("in", role, me)), nonce))
    reply = await framed.receive(frozenset({"peer.welcome", "error"}))
    if reply is None:
        raise ProtocolError(ACCESS_REFUSED, "connection closed during the handshake")
    if isinstance(reply, m.Error):
        raise ProtocolError(reply.code, reply.text)
    if not check_proof(secret, nonce, _ctx("out", role, reply.node), reply.proof):
        raise ProtocolError(ACCESS_REFUSED, f"node {reply.node!r} did not prove the cluster secret")
    return reply.node


async def exchange_link_hellos(framed: FramedStream, incarnation: int) -> m.LinkHello | None:
    """Open a link both sides have authenticated: each sends its LinkHello without waiting, then
    reads the other's. Returns it, or None if the other side closed without a word; raises
    ProtocolError with the other side's reason if it refused the link (`warren-server` refuses
    a node its cluster does not list, or while its app is stopped).

    The refusal may beat our hello: the other side has sent its reason and closed, and our send
    then finds the connection broken (the simulated network says so at once; TCP does once the
    reset is back). The reason is still there to read, so it is read before giving up, and the
    dialer can log why instead of "connection is broken"."""
    try:
        await framed.send_now(m.LinkHello(incarnation))
    except trio.BrokenResourceError:
        with trio.move_on_after(1.0):
            try:
                await framed.receive(frozenset({"link.hello"}))  # an Error raises its reason
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        raise
    return await framed.receive(frozenset({"link.hello"}))


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class PeerLink:
    """An established link to node `name`. The node reads `inbound` batches via `run`."""

    def __init__(self, name: str, framed: FramedStream, dialer: str, ticktime: float):
        self.name = name
        self.framed = framed
        self.dialer = dialer  # which node dialed: decides which of two duplicate links survives
        self.outbox = Outbox(framed)
        self.ticktime = ticktime
        self.last_heard = trio.current_time()
        self.superseded = False
        self.incarnation = 0  # the peer's app run, from its LinkHello
        self.cancel_scope = trio.CancelScope()

    def send(self, msg) -> None:
        self.outbox.put(msg)

    async def run(self, on_messages) -> str:
        """Serve the link until it breaks; returns why it ended. `on_messages(link, batch)` is
        called with each read's messages: a plain function, for nothing may await inside a
        batch. The stream is closed however it ends (cancelled too), so the peer sees the link
        go at once."""
        reason = "closed"
        try:
            with self.cancel_scope:
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._writer)
                        nursery.start_soon(self._ticker)
                        stale_after = self.ticktime * STALE_AFTER
                        while True:
                            batch = await self.framed.receive_batch()
                            if not batch:
                                reason = "connection closed by peer"
                                break
                            now = trio.current_time()
                            if now - self.last_heard > stale_after:
                                reason = (f"nothing read for {now - self.last_heard:.1f} s (this node "
                                          f"was frozen or stalled): what waited is stale")
                                break
                            self.last_heard = now
                            on_messages(self, batch)
                        nursery.cancel_scope.cancel()
                # trio groups the tasks' errors, possibly with the Cancelled of a closing link:
                # take the reasons out and let the Cancelled go on to the scope that caused it
                except* ProtocolError as group:
                    reason = f"protocol error: {_leaf(group)}"
                except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
                    reason = f"connection broken ({type(_leaf(group)).__name__})"
            if self.cancel_scope.cancelled_caught and reason == "closed":
                reason = getattr(self, "_close_reason", "closed")
            return reason
        finally:
            self.outbox.close()
            with trio.CancelScope(shield=True):
                with trio.move_on_after(1):
                    try:
                        await self.framed.stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass

    def close(self, reason: str) -> None:
        self._close_reason = reason
        self.cancel_scope.cancel()

    async def _writer(self):
        await self.outbox.run()

    async def _ticker(self):
        interval = self.ticktime / 4
        while True:
            await trio.sleep(interval)
            if trio.current_time() - self.last_heard > self.ticktime:
                self.close(f"no sign of life for net_ticktime ({self.ticktime:g} s)")
                return
            self.send(m.Tick())
