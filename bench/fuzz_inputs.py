"""The inputs of `warren-bench fuzz` (bench/fuzz.py), drawn from one `random.Random`: for each
port, what a stranger sends before logging in and what a logged-in client (or a node that
proved the cluster secret) sends after. Bytes at random, frames of the port's protocol with
random fields, well-formed frames in the wrong order or on the wrong channel, lengths past
every limit. Names come from a pool that never holds the well-behaved client's queue, and the
control commands drawn are those that read or touch only that pool's queues.
"""

from __future__ import annotations

import base64
import json
import random
import struct

import msgpack
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from broker.native import CLIENT_KINDS
from wire import messages as m
from wire.schema import REGISTRY

NAMES = ["", "fuzz", "fuzz.a", "amq.gen-fuzz", "amq.direct", "amq.fanout", "fuzz" + "x" * 300, "\x00",
         "é☃", "fuzz.q", "amq.topic", "x"]
INTS = [0, 1, 2, 3, -1, 255, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]
ARG_KEYS = ["x-max-length", "x-message-ttl", "x-expires", "x-overflow", "x-queue-mode", "x-max-priority",
            "x-dead-letter-exchange", "queue", "name", "node", "columns", "vhost", "x"]
INDEXES = sorted(C.INDEX_MAPPING)
# control commands safe to throw anything at: they read, or touch only queues of the fuzz pool
CTL_COMMANDS = ["status", "cluster_status", "list_queues", "list_connections", "list_consumers",
                "list_exchanges", "list_bindings", "list_channels", "list_policies",
                "list_operator_policies", "sync_status", "maintenance_status",
                "node_is_mirror_sync_critical", "delete_queue", "purge_queue", "sync_queue",
                "cancel_sync_queue", "no_such_command", ""]
HTTP_PATHS = ["/", "/metrics", "/ui/app.js", "/ui/../../etc/passwd", "/api/overview", "/api/nodes",
              "/api/nodes/n1", "/api/vhosts", "/api/whoami", "/api/queues", "/api/queues/%2F",
              "/api/queues/%2F/{q}", "/api/queues/%2F/{q}/contents", "/api/queues/%2F/{q}/get",
              "/api/queues/%2F/{q}/actions", "/api/queues/%2F/{q}/bindings", "/api/queues/%zz/{q}",
              "/api/exchanges", "/api/exchanges/%2F/{q}", "/api/exchanges/%2F/amq.direct/publish",
              "/api/bindings", "/api/policies", "/api/policies/%2F/{q}", "/api/connections",
              "/api/connections/{q}", "/api/channels", "/api/consumers", "/api/health/checks/alarms",
              "/api/aliveness-test/%2F", "/api/warren/cluster", "/api/nope", "/" + "a" * 9000]


def value(r: random.Random, depth: int = 0):
    """Any msgpack value, small, with edge cases."""
    pick = r.randrange(9 if depth < 2 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return r.random() < 0.5
    if pick == 2:
        return r.choice(INTS)
    if pick == 3:
        return r.choice(NAMES)
    if pick == 4:
        return r.randbytes(r.randrange(16))
    if pick == 5:
        return r.choice([0.5, float("nan"), float("inf"), -0.0])
    if pick == 6:
        return [value(r, depth + 1) for _ in range(r.randrange(4))]
    return {r.choice(ARG_KEYS): value(r, depth + 1) for _ in range(r.randrange(4))}


def _typed(r: random.Random, annotation) -> object:
    """A field's value of its own type most of the time (so frames pass validation and go deep)."""
    if r.random() < 0.15:
        return value(r)
    name = getattr(annotation, "__name__", str(annotation))
    if annotation is int or name == "int":
        return r.choice([1, 1, 2, r.choice(INTS)])
    if annotation is str or name == "str":
        return r.choice(NAMES)
    if annotation is bool or name == "bool":
        return r.random() < 0.5
    if annotation is bytes or name == "bytes":
        return r.randbytes(r.randrange(64))
    return value(r)


def msgpack_frame(payload) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def native_message(r: random.Random, kinds) -> bytes:
    """One frame of warren's protocol: a kind of `kinds` with typed fields, or any value."""
    if r.random() < 0.1:
        return msgpack_frame(value(r))
    kind = r.choice(kinds)
    cls = REGISTRY.get(kind)
    fields = cls.__annotations__ if cls is not None else {}
    return msgpack_frame([kind, *[_typed(r, t) for t in fields.values()]])


def garbage(r: random.Random) -> bytes:
    pick = r.randrange(4)
    if pick == 0:
        return r.randbytes(r.randrange(1, 300))
    if pick == 1:  # a frame announcing more than any limit
        return struct.pack(">I", r.choice([2**31, 2**32 - 1, 1 << 26])) + r.randbytes(8)
    if pick == 2:
        return b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    return b"AMQP" + bytes(r.choice([[0, 0, 9, 1], [1, 1, 0, 9], [0, 0, 8, 0]]))


# --- AMQP ------------------------------------------------------------------------------------------

def _raw_amqp(kind: int, ch: int, payload: bytes, end: bytes = b"\xce") -> bytes:
    return struct.pack(">BHI", kind, ch, len(payload)) + payload + end


def amqp_frame(r: random.Random, ch: int) -> bytes:
    """One AMQP frame on channel `ch` (or another): well-formed methods of every sort, random
    arguments to real method ids, content out of place, broken frame ends."""
    name = r.choice(NAMES[:6])
    makers = [
        lambda: C.Channel.Open(), lambda: C.Channel.Close(200, "", 0, 0), lambda: C.Channel.Flow(r.random() < .5),
        lambda: C.Queue.Declare(0, name, False, False, False, r.random() < .5),
        lambda: C.Queue.Purge(0, name), lambda: C.Queue.Delete(0, name),
        lambda: C.Queue.Bind(0, name, r.choice(NAMES[:6]), name),
        lambda: C.Exchange.Declare(0, name, r.choice(["direct", "fanout", "topic", "headers", "x-nope"])),
        lambda: C.Basic.Qos(0, r.choice([0, 1, 65535]), False),
        lambda: C.Basic.Consume(0, name, "", False, r.random() < .5),
        lambda: C.Basic.Cancel(r.choice(["", "ctag", "amq.ctag-x"])), lambda: C.Basic.Get(0, name, r.random() < .5),
        lambda: C.Basic.Ack(r.choice([0, 1, 2, 99]), r.random() < .5), lambda: C.Basic.Nack(1, False, True),
        lambda: C.Basic.Reject(r.choice([0, 1, 7]), False), lambda: C.Basic.Recover(True),
        lambda: C.Confirm.Select(), lambda: C.Tx.Select(), lambda: C.Tx.Commit(), lambda: C.Tx.Rollback(),
        lambda: C.Basic.Publish(0, r.choice(["", "amq.direct", "nope"]), name, r.random() < .3),
    ]
    pick = r.randrange(10)
    if pick < 5:
        try:
            return frame.marshal(r.choice(makers)(), ch)
        except ValueError:  # pamqp refuses to write it (a name too long): the raw bytes instead
            return _raw_amqp(1, ch, struct.pack(">I", r.choice(INDEXES)) + name.encode()[:300])
    if pick == 5:
        return frame.marshal(header.ContentHeader(0, r.choice([0, 1, 3, 10, 2**40]), C.Basic.Properties(
            delivery_mode=r.choice([None, 1, 2]), user_id=r.choice([None, "guest", "eve"]))), ch)
    if pick == 6:
        return frame.marshal(pbody.ContentBody(r.randbytes(r.randrange(1, 12))), ch)
    if pick == 7:
        return _raw_amqp(1, ch, struct.pack(">I", r.choice(INDEXES)) + r.randbytes(r.randrange(40)))
    if pick == 8:
        return _raw_amqp(r.randrange(256), r.choice([0, ch, 65535]), r.randbytes(r.randrange(64)),
                         r.choice([b"\xce", b"\x00"]))
    return r.choice([frame.marshal(C.Connection.Close(200, "bye", 0, 0), 0), _raw_amqp(8, 0, b""),
                     struct.pack(">BHI", 1, ch, r.choice([1 << 20, 2**32 - 1]))])


def amqp_publish(ch: int, body: bytes) -> bytes:
    return (frame.marshal(C.Basic.Publish(0, "", "fuzz"), ch)
            + frame.marshal(header.ContentHeader(0, len(body), C.Basic.Properties()), ch)
            + frame.marshal(pbody.ContentBody(body), ch))


def amqp_before_login(r: random.Random) -> bytes:
    """Bytes from the first one on: garbage, other headers, a header then frames of any kind."""
    if r.random() < 0.4:
        return garbage(r)
    out = b"AMQP\x00\x00\x09\x01"
    if r.random() < 0.5:
        user, password = r.choice([("guest", "guest"), ("guest", "nope"), ("u" * r.randrange(2000), "x")])
        start_ok = C.Connection.StartOk({"capabilities": {"authentication_failure_close": r.random() < .5}},
                                        r.choice(["PLAIN", "AMQPLAIN", "EXTERNAL", "x"]),
                                        f"\0{user}\0{password}")
        out += frame.marshal(start_ok, 0)
        if r.random() < 0.5:
            out += frame.marshal(C.Connection.TuneOk(r.choice([0, 1, 2047, 65535]),
                                                     r.choice([0, 4096, 131072, 1 << 20]), r.choice([0, 1, 60])), 0)
            if r.random() < 0.5:
                out += frame.marshal(C.Connection.Open(r.choice(["/", "other", "x" * 120])), 0)
    return out + b"".join(amqp_frame(r, r.choice([0, 1])) for _ in range(r.randrange(3)))


def amqp_after_login(r: random.Random) -> bytes:
    """Frames on an open connection whose channel 1 is open: mostly on channel 1."""
    frames = []
    for _ in range(r.randrange(1, 7)):
        if r.random() < 0.15:
            frames.append(amqp_publish(1, r.randbytes(r.randrange(64))))
        else:
            frames.append(amqp_frame(r, r.choice([1, 1, 1, 1, 2, 0])))
    return b"".join(frames)


# --- warren's protocol and the peer port -------------------------------------------------------------

NATIVE_KINDS = sorted(CLIENT_KINDS)
PEER_KINDS = ["peer.auth", "client.auth", "hello", "error", "link.hello", "ctl.command"]


def native_before_login(r: random.Random) -> bytes:
    if r.random() < 0.3:
        return garbage(r)
    if r.random() < 0.5:
        user = r.choice(["guest", "nobody", "u" * r.randrange(5000)])
        auth = m.ClientAuth(r.choice([m.PROTOCOL_VERSION, m.PROTOCOL_VERSION, 0, 99]), user,
                            r.choice(["guest", "wrong"]), r.choice(NAMES),
                            r.choice(["/", "/", "nope", ""]))
        first = msgpack_frame(["client.auth", *[getattr(auth, f) for f in auth.__struct_fields__]])
    else:
        first = native_message(r, NATIVE_KINDS + ["client.auth", "hello"])
    return first + b"".join(native_message(r, NATIVE_KINDS) for _ in range(r.randrange(3)))


def native_after_login(r: random.Random) -> bytes:
    return b"".join(native_message(r, NATIVE_KINDS) for _ in range(r.randrange(1, 7)))


def peer_before_auth(r: random.Random) -> bytes:
    if r.random() < 0.4:
        return garbage(r)
    if r.random() < 0.5:  # an auth that cannot prove the secret
        return msgpack_frame(["peer.auth", r.choice([m.PROTOCOL_VERSION, 0]), r.choice(NAMES + ["n" * 3000]),
                              r.choice(["peer", "ctl", "x" * 2000]), r.randbytes(32), r.randbytes(16)])
    return b"".join(native_message(r, PEER_KINDS) for _ in range(r.randrange(1, 4)))


def ctl_after_auth(r: random.Random) -> bytes:
    """Control commands (the safe ones, and unknown ones) with any arguments, and other frames."""
    frames = []
    for rid in range(1, r.randrange(2, 6)):
        if r.random() < 0.8:
            args = {r.choice(ARG_KEYS): value(r) for _ in range(r.randrange(3))}
            if r.random() < 0.5:
                args["queue"] = r.choice(NAMES)
            frames.append(msgpack_frame(["ctl.command", r.choice([rid, -1, 2**64 - 1]), r.choice(CTL_COMMANDS),
                                         args if r.random() < 0.9 else value(r)]))
        else:
            frames.append(native_message(r, PEER_KINDS + NATIVE_KINDS))
    return b"".join(frames)


def link_after_auth(r: random.Random) -> bytes:
    """What follows a peer's proven auth (the node refuses a link from a non-member)."""
    return b"".join(native_message(r, ["link.hello", "q.publish", "hello", "error"]) for _ in range(r.randrange(1, 3)))


# --- HTTP ---------------------------------------------------------------------------------------------

def http_request(r: random.Random, authenticated: bool) -> bytes:
    """One request, well-formed or not; authenticated ones as guest (PUT, POST and DELETE only
    name the fuzz pool's queues, and policies only match them)."""
    if r.random() < 0.1:
        return garbage(r) + b"\r\n\r\n"
    method = r.choice(["GET", "GET", "PUT", "POST", "DELETE", "HEAD", "OPTIONS", "PATCH", "BREW", "G\x00T"])
    path = r.choice(HTTP_PATHS).replace("{q}", r.choice(["fuzz", "fuzz.q", "%2Ffuzz", "fuzz%00", "fuzz" * 500]))
    if r.random() < 0.2:
        path += "?" + r.choice(["columns=name", "page=-1", "x=%", "lengths_age=99999999999"])
    body = b""
    if method in ("PUT", "POST", "PATCH") or r.random() < 0.1:
        doc = {r.choice(["durable", "arguments", "count", "ackmode", "routing_key", "payload",
                         "payload_encoding", "properties", "definition", "apply-to", "priority",
                         "action", "encoding", "truncate"]): value(r) for _ in range(r.randrange(5))}
        if "policies" in path:
            doc["pattern"] = r.choice(["^fuzz", "^fuzz\\.", "^fuzz(("])
        body = json.dumps(doc, default=repr).encode() if r.random() < 0.8 else r.randbytes(r.randrange(40))
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if authenticated:
        lines.append("Authorization: Basic " + base64.b64encode(b"guest:guest").decode())
    elif r.random() < 0.5:
        lines.append("Authorization: " + r.choice(["Basic !!!", "Basic " + base64.b64encode(
            b"guest:" + r.randbytes(4)).decode(), "Bearer x", "Basic " + "A" * 5000]))
    length = len(body) if r.random() < 0.9 else r.choice([0, len(body) + 10, 2**40])
    lines.append(f"Content-Length: {length}")
    if r.random() < 0.1:
        lines.append(r.choice(["Transfer-Encoding: chunked", "X: " + "y" * 20000, "Bad Header"]))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
