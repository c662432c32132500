"""Real network partitions: one Linux network namespace per node, cut with nftables.

This module owns the namespaces of one chaos cluster and nothing else on the machine:

- a bridge namespace `<tag>br` holding a Linux bridge, one namespace per node `<tag>n1`, ... and
  one for the clients and warrenctl `<tag>cl`; each of those has a veth pair whose other end is
  in the bridge namespace (both ends are created directly inside namespaces: the host's
  interfaces, routes and firewall are never touched, and a host whose iptables FORWARD policy
  is DROP, as with dockerd, does not matter since nothing crosses the host's stack);
- addresses 10.213.0.I/24 for node I and 10.213.0.200 for the clients;
- a partition is an nftables table `inet wchaos` in the node namespaces dropping packets to and
  from the other side's addresses (established connections hang, as in a real partition: the
  nodes notice through net_ticktime); healing deletes the rules.

`enter(ns)` moves the calling process's network namespace (setns(2) through libc: Python 3.11
has no os.setns) so that the clients it opens and the warrenctl it runs live in the client
namespace; `leave()` moves it back. Call it before any thread is started: threads created
afterwards inherit it. `unavailable()` says why namespaces cannot be made here (not root, no
`ip`, no `nft`), or returns None.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

CLONE_NEWNET = 0x40000000
SUBNET = "10.213.0"
CLIENT_HOST = 200
TABLE = "wchaos"


def unavailable() -> str | None:
    """Why partitions cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (apt-get install iproute2 nftables)"
    if not hasattr(ctypes.CDLL(None, use_errno=True), "setns"):
        return "libc has no setns()"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class Namespaces:
    """The namespaces of one cluster (`names`: node names), created by `create()` and removed
    by `destroy()` (also safe after a partial create)."""

    def __init__(self, tag: str, names: list[str]):
        self.tag = tag
        self.names = list(names)
        self.bridge_ns = f"{tag}br"
        self.client_ns = f"{tag}cl"
        self.created: list[str] = []
        self.cuts: set[frozenset] = set()
        self._home_fd: int | None = None

    def ns(self, name: str) -> str:
        return f"{self.tag}{name}"

    def addr(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    @property
    def client_addr(self) -> str:
        return f"{SUBNET}.{CLIENT_HOST}"

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program in node `name`'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)]

    def create(self) -> None:
        try:
            self._add(self.bridge_ns)
            _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
            _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", "br0", "up")
            hosts = [(self.ns(n), self.addr(n)) for n in self.names] + [(self.client_ns, self.client_addr)]
            for i, (ns, addr) in enumerate(hosts):
                self._add(ns)
                port = f"p{i}"
                _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "add", port, "type", "veth",
                     "peer", "name", "eth0", "netns", ns)
                _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", port, "master", "br0")
                _run("ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", port, "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            for n in self.names:
                self._nft(n, "add", "table", "inet", TABLE)
                for chain, hook in (("in", "input"), ("out", "output")):
                    self._nft(n, "add", "chain", "inet", TABLE, chain,
                              f"{{ type filter hook {hook} priority 0; policy accept; }}")
        except BaseException:
            self.destroy()
            raise

    def _add(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.created.append(ns)

    def _nft(self, name: str, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns(name), "nft", *args)

    # --- partitions ------------------------------------------------------------------------
    def cut(self, a: str, b: str) -> None:
        """Drop every packet between nodes a and b (both directions, on both sides)."""
        for x, y in ((a, b), (b, a)):
            self._nft(x, "add", "rule", "inet", TABLE, "in", "ip", "saddr", self.addr(y), "drop")
            self._nft(x, "add", "rule", "inet", TABLE, "out", "ip", "daddr", self.addr(y), "drop")
        self.cuts.add(frozenset((a, b)))

    def isolate(self, name: str) -> list[str]:
        """Cut `name` off from every other node (clients still reach every node)."""
        others = [n for n in self.names if n != name]
        for o in others:
            self.cut(name, o)
        return others

    def heal(self) -> None:
        for n in self.names:
            for chain in ("in", "out"):
                self._nft(n, "flush", "chain", "inet", TABLE, chain)
        self.cuts.clear()

    # --- the calling process -------------------------------------------------------------
    def enter(self, ns: str | None = None) -> None:
        """Move this process (its calling thread, and threads started later) into `ns`
        (default: the client namespace)."""
        libc = ctypes.CDLL(None, use_errno=True)
        if self._home_fd is None:
            self._home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        fd = os.open(f"/var/run/netns/{ns or self.client_ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {ns or self.client_ns}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def leave(self) -> None:
        if self._home_fd is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(self._home_fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns back: {os.strerror(err)}")
        os.close(self._home_fd)
        self._home_fd = None

    def destroy(self) -> None:
        """Delete every namespace this object created (their veths and rules go with them)."""
        try:
            self.leave()
        except OSError:
            pass
        for ns in reversed(self.created):
            _run("ip", "netns", "del", ns, check=False)
        self.created.clear()
