"""A quick measure of the AMQP 0-9-1 port, shaped like `warren-bench throughput` (warren's own
protocol) so the two compare: one publisher with pipelined confirms (at most --window
unconfirmed) and one consumer with manual acks (prefetch --prefetch, acks with `multiple` every
--ack-every deliveries) on one queue, both at once, for --seconds.

    python -m bench.amqp_quick [--seconds 10] [--size 1024] [--nodes 1] [--policy all|exactly2|none]
                               [--protocol amqp|native]

starts its own cluster of real processes on free ports (the consumer connects to the last
node), and also reports the nodes' CPU time per message (from /proc: steadier than msgs/s on a
shared machine). `--protocol native` runs `warren-bench throughput`'s client instead, for the
comparison. The client is lean on purpose (frames pamqp encoded once, sent in bulk; only method
frames decoded), so that the broker, not the client, is what is measured. This is a check of
the AMQP front end's per-frame cost, not the benchmark: `warren-bench` drives warren and
RabbitMQ through one load generator.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import time
from pathlib import Path

import trio
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from broker import localcluster
from broker.amqp import codec

POLICIES = {"all": {"ha-mode": "all"}, "exactly2": {"ha-mode": "exactly", "ha-params": 2}}
_DELIVER = C.Basic.Deliver.index
_ACK = C.Basic.Ack.index
_NACK = C.Basic.Nack.index


class Conn:
    def __init__(self, stream):
        self.stream = stream
        self.reader = codec.FrameReader(1 << 20)
        self.pending: list = []

    @classmethod
    async def open(cls, port: int):
        self = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await self.stream.send_all(codec.PROTOCOL_HEADER)
        await self.method_of(C.Connection.Start)
        await self.send(frame.marshal(C.Connection.StartOk({}, "PLAIN", "\0guest\0guest"), 0))
        tune = await self.method_of(C.Connection.Tune)
        await self.send(frame.marshal(C.Connection.TuneOk(tune.channel_max, tune.frame_max, 0), 0)
                        + frame.marshal(C.Connection.Open("/"), 0)
                        + frame.marshal(C.Channel.Open(), 1))
        await self.method_of(C.Connection.OpenOk)
        await self.method_of(C.Channel.OpenOk)
        return self

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def frames(self) -> list:
        if self.pending:
            out, self.pending = self.pending, []
            return out
        data = await self.stream.receive_some(1 << 20)
        if not data:
            raise EOFError("the server closed the connection")
        return self.reader.feed(data)

    async def method_of(self, cls):
        while True:
            got = await self.frames()
            for i, (kind, ch, payload) in enumerate(got):
                if kind == codec.METHOD:
                    m = codec.decode_method(payload)
                    if isinstance(m, cls):
                        self.pending = got[i + 1:] + self.pending
                        return m
                    if isinstance(m, (C.Connection.Close, C.Channel.Close)):
                        raise RuntimeError(m.reply_text)


async def run(ports: list[int], seconds: float, size: int, window: int, prefetch: int,
              ack_every: int) -> dict:
    queue = "bench.amqp"
    pub = await Conn.open(ports[0])
    await pub.send(frame.marshal(C.Queue.Declare(0, queue, False, False), 1)
                   + frame.marshal(C.Confirm.Select(), 1))
    await pub.method_of(C.Queue.DeclareOk)
    await pub.method_of(C.Confirm.SelectOk)
    con = await Conn.open(ports[-1])
    await con.send(frame.marshal(C.Basic.Qos(0, prefetch, False), 1)
                   + frame.marshal(C.Basic.Consume(0, queue, "c"), 1))
    await con.method_of(C.Basic.QosOk)
    await con.method_of(C.Basic.ConsumeOk)
    one = (frame.marshal(C.Basic.Publish(0, "", queue), 1)
           + frame.marshal(header.ContentHeader(0, size, C.Basic.Properties()), 1)
           + frame.marshal(pbody.ContentBody(b"x" * size), 1))
    stats = {"published": 0, "confirmed": 0, "consumed": 0}
    room = trio.Semaphore(window)
    deadline = trio.current_time() + seconds
    burst = 100

    async def publish():
        chunk = one * burst
        while trio.current_time() < deadline:
            for _ in range(burst):
                await room.acquire()
            await pub.send(chunk)
            stats["published"] += burst

    async def confirms():
        confirmed = 0
        while True:
            for kind, _, payload in await pub.frames():
                if kind != codec.METHOD:
                    continue
                index = struct.unpack_from(">I", payload)[0]
                if index in (_ACK, _NACK):
                    tag, multiple, _ = codec.decode_ack(payload)
                    n = tag - confirmed if multiple else 1
                    confirmed = max(confirmed, tag)
                    stats["confirmed"] += n
                    for _ in range(n):
                        room.release()

    async def consume():
        unacked = 0
        last = 0
        while True:
            for kind, _, payload in await con.frames():
                if kind == codec.METHOD and struct.unpack_from(">I", payload)[0] == _DELIVER:
                    stats["consumed"] += 1
                    unacked += 1
                    n = payload[4]
                    last = struct.unpack_from(">Q", payload, 5 + n)[0]
            if unacked >= ack_every or (unacked and stats["consumed"] >= stats["published"]):
                await con.send(frame.marshal(C.Basic.Ack(last, True), 1))
                unacked = 0

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        n.start_soon(confirms)
        n.start_soon(consume)
        await publish()
        with trio.move_on_after(10):
            while stats["confirmed"] < stats["published"] or stats["consumed"] < stats["published"]:
                await trio.sleep(0.02)
        elapsed = time.perf_counter() - t0
        n.cancel_scope.cancel()
    for c in (pub, con):
        await c.stream.aclose()
    return {"size": size, "seconds": round(elapsed, 2), **stats,
            "publish_confirm_msgs_per_s": round(stats["confirmed"] / elapsed),
            "consume_ack_msgs_per_s": round(stats["consumed"] / elapsed)}


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these processes so far (Linux /proc)."""
    import os
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.amqp_quick", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--window", type=int, default=2000)
    p.add_argument("--prefetch", type=int, default=1000)
    p.add_argument("--ack-every", type=int, default=100)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--policy", choices=["none", *POLICIES], default="none")
    p.add_argument("--protocol", choices=["amqp", "native"], default="amqp")
    args = p.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="warren-amqp-quick-"))
    try:
        result = _measure(home, args)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"protocol": args.protocol, "nodes": args.nodes, "policy": args.policy, **result}))


def _measure(home: Path, args) -> dict:
    with localcluster.LocalCluster(home, args.nodes, free_ports=True) as cluster:
        if args.policy != "none":
            cluster.ctl_ok("n1", "set_policy", "bench", "^bench\\.", json.dumps(POLICIES[args.policy]))
        pids = [cluster.procs[n].pid for n in cluster.names]
        cpu0 = _cpu_seconds(pids)
        if args.protocol == "amqp":
            result = trio.run(run, [cluster.amqp_port(n) for n in cluster.names], args.seconds,
                              args.size, args.window, args.prefetch, args.ack_every)
        else:
            from bench.cli import throughput
            result = trio.run(throughput, cluster.all_client_addrs(), args.seconds, args.size,
                              args.window, args.prefetch)
        cpu = _cpu_seconds(pids) - cpu0
    result["node_cpu_us_per_msg"] = round(cpu * 1e6 / max(1, result["consumed"]), 1)
    return result


if __name__ == "__main__":
    main()
