"""Which AMQP client can the load generator be built on? Measure, don't guess.

    python -m bench.clientcheck --null                     against the null broker (started here)
    python -m bench.clientcheck --address 127.0.0.1:5701   against any AMQP 0-9-1 broker

For each client (`lean`: bench/amqp.py on pamqp; `aiormq`: the asyncio client built on pamqp,
where installed) it runs one publisher with confirms and at most --window unconfirmed messages
and one consumer with prefetch --window and one ack per message, both in this one process, on
one queue, for --seconds, and prints msgs/s and the CPU microseconds this process spent per
message (publish + confirm + delivery + ack). Against the null broker the rate is what the client
alone can do; the CPU per message is what it would take from a broker on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def lean(address: str, seconds: float, size: int, window: int) -> dict:
    from bench.amqp import parse_address, Connection

    host, port = parse_address(address)
    queue = f"clientcheck.lean.{os.getpid()}"
    pconn = await Connection.connect(host, port, name="clientcheck-pub")
    cconn = await Connection.connect(host, port, name="clientcheck-con")
    pch = await pconn.channel()
    await pch.confirm_select()
    await pch.queue_declare(queue)
    cch = await cconn.channel()
    await cch.basic_qos(window)
    state = {"sent": 0, "confirmed": 0, "got": 0}
    room = asyncio.Event()

    def on_confirm(tag, multiple, ok):
        state["confirmed"] = max(state["confirmed"], tag)
        room.set()

    def on_delivery(tag, red, body):
        state["got"] += 1
        cch.ack(tag)

    pch.on_confirm = on_confirm
    cch.on_delivery = on_delivery
    await cch.basic_consume(queue)
    head, tail = pch.publish_template(queue, size)
    t0, c0 = time.perf_counter(), _cpu()
    end = t0 + seconds
    while time.perf_counter() < end:
        n = min(250, window - (state["sent"] - state["confirmed"]))
        if n <= 0:
            room.clear()
            await room.wait()
            continue
        s = state["sent"]
        pconn.send_many([head + i.to_bytes(8, "big") + tail for i in range(s, s + n)])
        state["sent"] = s + n
        await asyncio.sleep(0)
    return await _finish(state, t0, c0, lambda: pch.queue_delete(queue), [pconn, cconn])


async def aiormq_client(address: str, seconds: float, size: int, window: int) -> dict:
    import aiormq

    queue = f"clientcheck.aiormq.{os.getpid()}"
    pconn = await aiormq.connect(f"amqp://guest:guest@{address}/")
    cconn = await aiormq.connect(f"amqp://guest:guest@{address}/")
    pch = await pconn.channel(publisher_confirms=True)
    await pch.queue_declare(queue)
    cch = await cconn.channel()
    await cch.basic_qos(prefetch_count=window)
    state = {"sent": 0, "confirmed": 0, "got": 0}
    gate = asyncio.Semaphore(window)
    body = bytes(size)

    async def on_message(message):
        state["got"] += 1
        await message.channel.basic_ack(message.delivery.delivery_tag)

    await cch.basic_consume(queue, on_message)

    async def publish_one():
        try:
            await pch.basic_publish(body, routing_key=queue)  # returns once the broker confirmed
            state["confirmed"] += 1
        finally:
            gate.release()

    t0, c0 = time.perf_counter(), _cpu()
    end = t0 + seconds
    tasks = set()
    while time.perf_counter() < end:
        await gate.acquire()
        t = asyncio.ensure_future(publish_one())
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        state["sent"] += 1
    return await _finish(state, t0, c0, lambda: pch.queue_delete(queue), [pconn, cconn])


async def _finish(state, t0, c0, delete, conns) -> dict:
    deadline = time.perf_counter() + 10
    while (state["got"] < state["sent"] or state["confirmed"] < state["sent"]) and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    el, cpu = time.perf_counter() - t0, _cpu() - c0
    try:
        await delete()
    except Exception:  # noqa: BLE001 - a best-effort clean-up
        pass
    for c in conns:
        try:
            await c.close()
        except Exception:  # noqa: BLE001
            pass
    n = max(1, state["got"])
    return {"published": state["sent"], "confirmed": state["confirmed"], "delivered": state["got"],
            "seconds": round(el, 2), "msgs_per_s": round(state["got"] / el),
            "client_cpu_us_per_msg": round(cpu * 1e6 / n, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.clientcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="HOST:PORT of an AMQP 0-9-1 broker")
    ap.add_argument("--null", action="store_true", help="start the null broker (bench/nullbroker.py) and use it")
    ap.add_argument("--clients", default="lean,aiormq")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=1000)
    args = ap.parse_args(argv)
    proc = None
    address = args.address
    if args.null:
        from broker.localcluster import free_port
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "bench.nullbroker", "--ports", str(port)],
                                stdout=subprocess.DEVNULL)
        time.sleep(1.0)
        address = f"127.0.0.1:{port}"
    if not address:
        ap.error("give --address HOST:PORT or --null")
    try:
        for name in args.clients.split(","):
            fn = {"lean": lean, "aiormq": aiormq_client}[name]
            try:
                result = asyncio.run(fn(address, args.seconds, args.size, args.window))
            except ImportError as exc:
                result = {"skipped": str(exc)}
            print(json.dumps({"client": name, "broker": "null" if args.null else address, **result}), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
