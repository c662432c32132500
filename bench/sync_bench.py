"""`warren-bench sync`: how fast a batch sync fills a new mirror; `warren-bench sync-load`: what a
sync does to a steady publisher's confirms (`run_sync_under_load`).

For each `--max-throughput` value a 2-node cluster of real processes starts with that
`mirroring_sync_max_throughput`; a queue led by n1 gets `--messages` bodies of `--size` bytes;
then for each `--batch-sizes` value a policy (`exactly 2`, manual sync, that `ha-sync-batch-size`)
adds a mirror on n2, which starts empty, and `sync_queue` copies the backlog to it. The numbers
are the leader's own measurement of the sync (messages and body bytes over the sync's duration),
read back with `sync_status`; between batch sizes the policy is cleared so the next mirror starts
empty again.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import trio

from broker.client.aio import open_connection
from broker.control import ctl_call
from broker.localcluster import LocalCluster
from broker.network import TcpNetwork

QUEUE = "sync.bench"


async def _fill(addr: str, n: int, size: int) -> None:
    async with open_connection([addr]) as conn:
        ch = await conn.channel()
        await ch.queue_declare(QUEUE, durable=True)
        await ch.confirm_delivery()
        body = b"s" * size
        for i in range(n):
            ch.publish_nowait(QUEUE, body)
            if i % 1000 == 999:
                await ch.wait_for_confirms()
        await ch.wait_for_confirms()


async def _sync(peer_port: int, secret: bytes) -> dict:
    """sync_queue, then the leader's summary of it once it is over."""
    async def call(cmd):
        return await ctl_call(TcpNetwork(), "127.0.0.1", peer_port, "warren-bench", secret, cmd,
                              {"queue": QUEUE})
    started = await call("sync_queue")
    if not started["started"]:
        raise RuntimeError(f"sync_queue did not start: {started}")
    while True:
        st = await call("sync_status")
        if not st["running"]:
            return st["last"]
        await trio.sleep(0.2)


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def run_sync_bench(messages: int, size: int, batch_sizes: list[int], limits: list[int]) -> list[dict]:
    rows = []
    for limit in limits:
        home = Path(tempfile.mkdtemp(prefix="warren-syncbench-"))
        with LocalCluster(home, 2, free_ports=True, net_ticktime=30,
                          server_args=["--mirroring-sync-max-throughput", str(limit)]) as c:
            trio.run(_fill, c.client_addr("n1"), messages, size)
            for batch in batch_sizes:
                c.ctl_ok("n1", "set_policy", "sync-bench", f"^{QUEUE}$",
                         f'{{"ha-mode":"exactly","ha-params":2,"ha-sync-batch-size":{batch}}}')
                _wait(lambda: any(r["name"] == QUEUE and r["mirror_pids"] for r in
                                  c.ctl_json("n1", "list_queues", "name", "mirror_pids")), 30, "the mirror")
                last = trio.run(_sync, c.peer_port("n1"), c.env["WARREN_SECRET"].encode())
                row = {"max_throughput": limit, "batch_size": batch, "messages": last["messages"],
                       "seconds": last["elapsed"], "msgs_per_s": last["rate_msgs"],
                       "mb_per_s": round(last["rate_bytes"] / 1e6, 2), "status": last["status"]}
                if limit:
                    row["rate_vs_limit"] = round(last["rate_bytes"] / limit, 3)
                rows.append(row)
                print("\t".join(f"{k}={v}" for k, v in row.items()), flush=True)
                c.ctl_ok("n1", "clear_policy", "sync-bench")
                _wait(lambda: all(not r["mirror_pids"] for r in
                                  c.ctl_json("n1", "list_queues", "name", "mirror_pids")
                                  if r["name"] == QUEUE), 30, "the mirror to go")
    return rows


# --- a sync under load: blocking (the spec) against background (ha-sync-mode background) -------

async def _load_during_sync(addr: str, peer_port: int, secret: bytes, mode: str, rate: int,
                            size: int, settle: float) -> dict:
    """Publish at `rate` msgs/s with confirms (each message's latency measured from the time it
    was due, so a blocked queue cannot hide its pause), switch the policy that adds a mirror
    and syncs it, and return the confirm latencies and rate while the sync ran."""
    import bisect

    async def ctl(cmd, **args):
        return await ctl_call(TcpNetwork(), "127.0.0.1", peer_port, "warren-bench", secret, cmd, args)

    due: list[float] = []
    done: dict[int, float] = {}
    async with open_connection([addr]) as conn:
        ch = await conn.channel()
        await ch.confirm_delivery()
        ch.on_confirm = lambda a, b, ok, why: done.update((s, time.monotonic()) for s in range(a, b + 1))
        body = b"L" * size
        stop = trio.Event()
        window: dict = {}

        async def publisher():
            t0 = time.monotonic()
            n = 0
            while not stop.is_set():
                target = int((time.monotonic() - t0) * rate)
                while n < target:
                    n += 1
                    due.append(t0 + n / rate)
                    ch.publish_nowait(QUEUE, body)
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher)
            await trio.sleep(settle)
            definition = f'{{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"{mode}"}}'
            await ctl("set_policy", name="sync-load", pattern=f"^{QUEUE}$", definition=definition)
            while True:  # until the sync has run and ended
                st = await ctl("sync_status", queue=QUEUE)
                if st["last"] is not None and not st["running"]:
                    break
                await trio.sleep(0.05)
            last = st["last"]
            window["end"] = time.monotonic()
            window["start"] = window["end"] - last["elapsed"]
            await trio.sleep(settle)
            stop.set()
        await ch.wait_for_confirms(timeout=60)
    lo = bisect.bisect_left(due, window["start"])
    hi = bisect.bisect_right(due, window["end"])
    lat = sorted(done[s + 1] - due[s] for s in range(lo, hi) if s + 1 in done)
    confirmed_in = sum(1 for t in done.values() if window["start"] <= t <= window["end"])

    def pct(p):
        return round(1000 * lat[min(len(lat) - 1, int(p / 100 * len(lat)))], 2) if lat else None

    return {"mode": "blocking" if mode == "automatic" else mode, "sync_s": last["elapsed"],
            "synced_messages": last["messages"], "published_during": hi - lo,
            "confirms_per_s_during": round(confirmed_in / max(last["elapsed"], 1e-9)),
            "confirm_p50_ms": pct(50), "confirm_p99_ms": pct(99),
            "confirm_max_ms": round(1000 * lat[-1], 1) if lat else None}


def run_sync_under_load(messages: int, size: int, rate: int, modes: list[str], limit: int = 0,
                        settle: float = 2.0) -> list[dict]:
    """For each mode ("blocking" = ha-sync-mode automatic, the spec; "background"): a fresh
    2-node cluster, a backlog of `messages` on n1, a publisher at `rate` msgs/s, then a policy
    that adds a mirror on n2 and syncs it that way."""
    rows = []
    for mode in modes:
        policy_mode = "automatic" if mode == "blocking" else mode
        home = Path(tempfile.mkdtemp(prefix="warren-syncload-"))
        with LocalCluster(home, 2, free_ports=True, net_ticktime=30,
                          server_args=["--mirroring-sync-max-throughput", str(limit)]) as c:
            trio.run(_fill, c.client_addr("n1"), messages, size)
            row = trio.run(_load_during_sync, c.client_addr("n1"), c.peer_port("n1"),
                           c.env["WARREN_SECRET"].encode(), policy_mode, rate, size, settle)
            rows.append(row)
            print("\t".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows
