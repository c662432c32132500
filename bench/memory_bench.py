"""`warren-bench memory`: how much memory a queued message costs on a queue's leader and on its
mirror.

Method: a 2-node cluster of real `warren-server` processes (a policy `ha-mode: all` on the
queue: n1 leads, n2 mirrors); the high watermark is set to all of memory so no alarm interferes.
A warm-up publishes and consumes `--warmup` messages first, so the buffers every busy node keeps
(socket reads, writers) exist before the baseline; it is kept small because the memory it frees
stays with the allocator and would be reused by the first messages measured (20,000 warm-up
messages make the first round look 10% cheaper than it is). Then, with no
consumer, `--messages` bodies of `--size` bytes are published with pipelined confirms; a confirm
means the mirror has the message too. After a pause (nothing in flight any more) each node's
resident set size is read from /proc/PID/statm, as the node's own alarm reads it: the growth over
the baseline divided by the messages is the memory per queued message, everything included (the
body, the per-message tuple and id, the queue's deque, and whatever the allocator keeps around).
Several rounds (`--rounds`) queue further batches on top, each measured from the previous one, so
a stray allocation shows as a round apart from the others; the headline figure is the growth over
all rounds divided by all the messages.

Where it goes (CPython 3.11, 64-bit, glibc): the body, a bytes object of 33 + 1024 bytes, is a
1072-byte malloc chunk; the message tuple (id, body, props, redelivered) is 72 bytes, 80 in
pymalloc's size classes; its id, an int, 32; the deque's slot 8. That is 1,192 bytes; props None
and redelivered False are shared objects and cost nothing.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

from broker.client.aio import open_connection
from broker.localcluster import LocalCluster

QUEUE = "mem.bench"
WINDOW = 5000  # unconfirmed publishes at most


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


async def _publish(addr: str, n: int, size: int, consume: bool) -> None:
    """n messages with confirms (and, with `consume`, take them all back off the queue)."""
    async with open_connection([addr]) as conn:
        ch = await conn.channel()
        await ch.queue_declare(QUEUE, durable=True)
        await ch.confirm_delivery()
        room = trio.Semaphore(WINDOW)

        def on_confirm(first, last, ok, reason):
            if not ok:
                raise RuntimeError(f"publish nacked: {reason}")
            for _ in range(last - first + 1):
                room.release()

        ch.on_confirm = on_confirm
        body = b"m" * size
        for _ in range(n):
            await room.acquire()
            ch.publish_nowait(QUEUE, body)
        if not await ch.wait_for_confirms(timeout=120):
            raise RuntimeError("some publishes were not confirmed")
        if consume:
            cch = await conn.channel()
            await cch.basic_qos(2000)
            consumer = await cch.basic_consume(QUEUE)
            got = 0
            with trio.fail_after(120):
                async for msg in consumer:
                    got += 1
                    if got % 500 == 0 or got == n:
                        cch.basic_ack(msg.delivery_tag, multiple=True)
                    if got == n:
                        break
            await cch.basic_cancel(consumer.tag)


def _wait_messages(c: LocalCluster, expected: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = c.ctl_json("n1", "list_queues", "name", "messages", "synchronised_mirror_pids")
        row = next((r for r in rows if r["name"] == QUEUE), None)
        if row is not None and row["messages"] == expected and row["synchronised_mirror_pids"]:
            return
        time.sleep(0.2)
    raise RuntimeError(f"queue {QUEUE} did not reach {expected} messages with a synchronised mirror")


def run_memory_bench(messages: int = 200_000, size: int = 1024, rounds: int = 2,
                     warmup: int = 2_000, settle: float = 2.0, out=sys.stdout) -> dict:
    home = Path(tempfile.mkdtemp(prefix="warren-membench-"))
    try:
        return _measure(home, messages, size, rounds, warmup, settle, out)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _measure(home: Path, messages: int, size: int, rounds: int, warmup: int, settle: float,
             out) -> dict:
    with LocalCluster(home, 2, free_ports=True, net_ticktime=30,
                      server_args=["--memory-high-watermark", "1"]) as c:
        c.ctl_ok("n1", "set_policy", "mem-all", f"^{QUEUE}$", '{"ha-mode":"all"}')
        pids = {"leader": c.procs["n1"].pid, "mirror": c.procs["n2"].pid}
        if warmup:
            trio.run(_publish, c.client_addr("n1"), warmup, size, True)
        _wait_messages(c, 0)
        time.sleep(settle)
        base = {role: rss(pid) for role, pid in pids.items()}
        print(f"baseline RSS: leader {base['leader'] / 2**20:.1f} MiB, mirror {base['mirror'] / 2**20:.1f} MiB",
              file=out, flush=True)
        result = {"messages": messages, "size": size, "rounds": [], "baseline": base}
        before = dict(base)
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            trio.run(_publish, c.client_addr("n1"), messages, size, False)
            elapsed = time.perf_counter() - t0
            _wait_messages(c, messages * r)
            time.sleep(settle)
            now = {role: rss(pid) for role, pid in pids.items()}
            row = {"round": r, "queued": messages * r, "publish_s": round(elapsed, 2)}
            for role in pids:
                row[f"{role}_bytes_per_msg"] = round((now[role] - before[role]) / messages, 1)
                row[f"{role}_rss_mib"] = round(now[role] / 2**20, 1)
            result["rounds"].append(row)
            print(f"round {r}: {messages:,} x {size} B queued (total {messages * r:,}): "
                  f"leader {row['leader_bytes_per_msg']:.0f} B/msg "
                  f"({row['leader_bytes_per_msg'] / 1024:.2f} KiB), "
                  f"mirror {row['mirror_bytes_per_msg']:.0f} B/msg "
                  f"({row['mirror_bytes_per_msg'] / 1024:.2f} KiB); RSS leader {row['leader_rss_mib']} MiB, "
                  f"mirror {row['mirror_rss_mib']} MiB", file=out, flush=True)
            before = now
        for role in pids:
            total = (before[role] - base[role]) / (messages * rounds)
            result[f"{role}_bytes_per_msg"] = round(total, 1)
            result[f"{role}_kib_per_msg"] = round(total / 1024, 3)
    return result
