"""`warren-bench wakeup`: what one wake-up costs on this machine, the floor under latency.

At a steady 2,000 msgs/s a mirrored publish goes alone: each hop (client, leader, mirrors,
leader, client) is a process that sleeps in the kernel, is woken by a loopback write, reads,
works, writes to the next and sleeps again. The work is warren's; the sleeping and waking is
the kernel's (and, on a virtual machine, the hypervisor's), and no broker code can make it
cheaper, only rarer. This measures it: two processes bounce a 100-byte message over loopback
TCP, N round trips, each side waking once per round trip, and report CPU time per round trip
of each side and wall time per round trip.

Three ways, so the differences are an event loop's share and trio's:
* `blocking`: a blocking `read` and a `write`, no event loop (the least any Python process pays);
* `epoll`: a bare `epoll_wait` on that one socket, then a non-blocking `os.read`: the system
  calls any event loop makes, with no loop around them;
* `trio`: the way warren's nodes read (broker/framed.py `Reader`): a non-blocking `os.read`,
  and on EAGAIN `trio.lowlevel.wait_readable`, so each wake-up is a pass of trio's run loop.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time

import trio

MESSAGE = b"x" * 100


def _blocking_side(fd: int, first: bool, n: int) -> tuple[float, float]:
    t0, w0 = time.process_time(), time.monotonic()
    for _ in range(n):
        if first:
            os.write(fd, MESSAGE)
        os.read(fd, 65536)
        if not first:
            os.write(fd, MESSAGE)
    return time.process_time() - t0, time.monotonic() - w0


async def _trio_side(sock: socket.socket, first: bool, n: int) -> tuple[float, float]:
    fd = sock.fileno()
    t0, w0 = time.process_time(), time.monotonic()
    for _ in range(n):
        if first:
            os.write(fd, MESSAGE)
        while True:
            try:
                os.read(fd, 65536)
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
        if not first:
            os.write(fd, MESSAGE)
    return time.process_time() - t0, time.monotonic() - w0


def _epoll_side(fd: int, first: bool, n: int) -> tuple[float, float]:
    poller = select.epoll()
    poller.register(fd, select.EPOLLIN)
    t0, w0 = time.process_time(), time.monotonic()
    try:
        for _ in range(n):
            if first:
                os.write(fd, MESSAGE)
            poller.poll()  # returns at once when the answer is already there
            os.read(fd, 65536)
            if not first:
                os.write(fd, MESSAGE)
        return time.process_time() - t0, time.monotonic() - w0
    finally:
        poller.close()


MODES = ("blocking", "epoll", "trio")


def _side(mode: str, sock: socket.socket, first: bool, n: int) -> tuple[float, float]:
    if mode == "blocking":
        sock.setblocking(True)
        return _blocking_side(sock.fileno(), first, n)
    sock.setblocking(False)
    if mode == "epoll":
        return _epoll_side(sock.fileno(), first, n)
    return trio.run(_trio_side, sock, first, n)


def measure(mode: str, round_trips: int) -> dict:
    """One run of `mode` (one of MODES): microseconds of CPU per round trip for each side (the
    side that starts each round trip, and the one that answers) and of wall time."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} ({', '.join(MODES)})")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the answering side
        try:
            a.close()
            os.close(r)
            cpu, _ = _side(mode, b, False, round_trips)
            os.write(w, json.dumps(cpu).encode())
        finally:
            os._exit(0)
    b.close()
    os.close(w)
    try:
        cpu, wall = _side(mode, a, True, round_trips)
    finally:
        a.close()
        answer = b""
        while chunk := os.read(r, 4096):
            answer += chunk
        os.close(r)
        os.waitpid(pid, 0)
    if not answer:
        raise RuntimeError("the answering process failed")
    us = 1e6 / round_trips
    return {"mode": mode, "round_trips": round_trips, "starter_cpu_us": round(cpu * us, 1),
            "answerer_cpu_us": round(json.loads(answer) * us, 1), "wall_us": round(wall * us, 1)}


def run(round_trips: int, modes: list[str]) -> list[dict]:
    rows = [measure(mode, round_trips) for mode in modes]
    for row in rows:
        print(f"{row['mode']:8s} CPU per round trip: {row['starter_cpu_us']} us (starter), "
              f"{row['answerer_cpu_us']} us (answerer); wall {row['wall_us']} us per round trip")
    return rows
