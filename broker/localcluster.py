"""A local cluster of real `warren-server` processes on 127.0.0.1, and the demo that the README's
first command runs.

    python -m broker.localcluster start [--nodes 3]   # start n1..nN and join them to n1
    python -m broker.localcluster stop
    python -m broker.localcluster demo                # start, publish/consume, show, stop

State lives under ./var/warren (WARREN_HOME): node data, logs and the pid file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CLIENT_BASE = 5690
PEER_BASE = 25690
DEFAULT_HOME = Path("var/warren")


def _env(home: Path) -> dict:
    env = dict(os.environ)
    env["WARREN_HOME"] = str(home.resolve())
    env.setdefault("WARREN_SECRET", "warren-local-demo-secret")
    return env


def ctl(home: Path, node: str, *args: str, check: bool = True) -> str:
    out = subprocess.run(["warrenctl", "-n", node, *args], env=_env(home), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"warrenctl -n {node} {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def _wait(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def start(home: Path, nodes: int = 3, ticktime: float = 10.0) -> list[str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    pids = {}
    names = [f"n{i}" for i in range(1, nodes + 1)]
    for i, name in enumerate(names, 1):
        log = open(home / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen(
            ["warren-server", "--name", name, "--client-port", str(CLIENT_BASE + i),
             "--peer-port", str(PEER_BASE + i), "--net-ticktime", str(ticktime)],
            env=_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        pids[name] = proc.pid
    (home / "pids.json").write_text(json.dumps(pids))
    for name in names:
        _wait(lambda: ctl(home, name, "status", check=False) != "", f"node {name} to answer")
    for name in names[1:]:
        status = json.loads(ctl(home, name, "cluster_status", "--formatter", "json"))
        if "n1" in status["members"]:
            continue  # already clustered (data kept from an earlier run)
        ctl(home, name, "stop_app")
        ctl(home, name, "join_cluster", "n1")
        ctl(home, name, "start_app")
    _wait(lambda: len(json.loads(ctl(home, "n1", "cluster_status", "--formatter", "json"))["running_nodes"]) == nodes,
          "all nodes running")
    return names


def stop(home: Path) -> None:
    path = home / "pids.json"
    if not path.exists():
        return
    pids = json.loads(path.read_text())
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in pids.values():
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    path.unlink()


def client_addr(i: int) -> str:
    return f"127.0.0.1:{CLIENT_BASE + i}"


def demo(home: Path) -> None:
    import trio

    from broker.client.aio import open_connection

    print("== starting a 3-node cluster (logs in", home / "logs", ")")
    start(home)
    try:
        print(ctl(home, "n1", "cluster_status"))

        async def run():
            n = 10_000
            async with open_connection([client_addr(1)]) as pub_conn, \
                    open_connection([client_addr(3), client_addr(2)]) as sub_conn:
                pub = await pub_conn.channel()
                await pub.queue_declare("demo.orders", durable=True)
                await pub.confirm_delivery()
                t0 = time.perf_counter()
                for i in range(n):
                    await pub.basic_publish("", "demo.orders", b"order-%d" % i + b"." * 1000)
                ok = await pub.wait_for_confirms()
                t1 = time.perf_counter()
                print(f"published {n} x 1 KiB to demo.orders via n1 with confirms: all confirmed={ok}, "
                      f"{n / (t1 - t0):,.0f} msgs/s")
                print(ctl(home, "n1", "list_queues", "name", "durable", "pid", "messages", "consumers"))
                sub = await sub_conn.channel()
                await sub.basic_qos(500)
                consumer = await sub.basic_consume("demo.orders")
                got = 0
                async for msg in consumer:
                    got += 1
                    sub.basic_ack(msg.delivery_tag)
                    if got == n:
                        break
                t2 = time.perf_counter()
                print(f"consumed {got} via n3 (leader is n1) with manual acks: {got / (t2 - t1):,.0f} msgs/s")
                await trio.sleep(0.2)
                print(ctl(home, "n3", "list_queues", "name", "durable", "policy", "pid", "mirror_pids",
                          "synchronised_mirror_pids", "messages", "messages_unacknowledged", "consumers"))

        trio.run(run)
    finally:
        print("== stopping the cluster")
        stop(home)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m broker.localcluster")
    p.add_argument("action", choices=["start", "stop", "demo"])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--home", type=Path, default=Path(os.environ.get("WARREN_HOME", DEFAULT_HOME)))
    args = p.parse_args(argv)
    try:
        if args.action == "start":
            names = start(args.home, args.nodes)
            print(f"started {', '.join(names)}; client ports "
                  f"{', '.join(str(CLIENT_BASE + i) for i in range(1, args.nodes + 1))}; "
                  f"use: WARREN_HOME={args.home} warrenctl -n n1 cluster_status")
        elif args.action == "stop":
            stop(args.home)
        else:
            demo(args.home)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
