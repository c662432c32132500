"""The node's memory alarm, RabbitMQ style: measure, decide, tell the peers, hold publishers.

Theory of operation:
* `NodeMemory` (`node.memory`) samples the process's memory every CHECK_EVERY seconds in a task
  of its own, never per message: one `pread` of /proc/self/statm (a few microseconds; the
  resident set is what the system, and its OOM killer, counts against the node). The decision is
  mirroring/alarm.py's: on above the high watermark, off below 90% of it. Near the mark it first
  asks the C allocator to give freed memory back (`malloc_trim`), at most once a second: a
  drained queue's memory is otherwise kept by the allocator and RSS would never fall. A trim
  costs about 0.2 ms per MB freed since the last one (0.1 ms when nothing was), so while a
  consumer drains 100 MB/s under an alarm it takes some 2% of the loop.
* A sample is also taken as soon as publishing connections have read READ_BUDGET bytes since
  the last one (`took(nbytes)`, one addition per read), so the node passes its mark by at most
  about that much whatever the publishers' rate and however late the loop runs the timer: a busy
  loop delays the timer first, exactly when publishes pour in.
* Publishers are blocked while this node or any running peer has an alarm, as RabbitMQ does
  cluster-wide. A node tells its peers with a `NodeAlarm` peer message whenever its own alarm
  changes, and on every new link while it is on; a peer's alarm is forgotten when the link to it
  goes (its node is down or cut off, and tells again when it is back).
* The state front ends use: `blocked`, `reason`, `await wait_unblocked()`, and `hooks`
  (callables `hook(blocked, reason)`, run when `blocked` changes). `PublisherGate` wraps them
  for one client connection: its reader calls `hold()` before each read, which returns at once
  unless the connection publishes and publishers are blocked, and again after a read that finds
  them blocked (the alarm went on while the read waited): what that read brought is handled only
  once the alarm is over. So a connection takes at most one read (256 KiB) past the alarm, and
  no wait for the client needs a cancel scope of its own (one per read cost a busy node a few
  percent of its CPU). The gate tells its client through the front end's `tell(blocked,
  reason)` (warren's protocol: `Blocked`/`Unblocked` frames; AMQP: connection.blocked/unblocked).
  A connection that only consumes and acks is never held.
* `full_collection` is `warrenctl force_gc`: the interpreter's full collection on demand (the
  node's own thresholds run one rarely), then a trim, to tell the node's state from garbage
  awaiting a collection and from memory the allocators keep.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
import time
from pathlib import Path

import trio

from mirroring.alarm import Alarms, MemoryAlarm, Watermark, format_bytes
from wire import messages as m

CHECK_EVERY = 0.1  # seconds between two samples of the process's memory
READ_BUDGET = 4 << 20  # publishing bytes read that bring the next sample forward
RESOURCE = "memory"


class ProcessMemory:
    """This process's memory as the system sees it (Linux: /proc and the cgroup limits)."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None
        self._trim = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self._trim = libc.malloc_trim  # glibc only (musl has none: nothing to trim then)
            self._trim.argtypes = [ctypes.c_size_t]
            self._trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            pass

    @property
    def available(self) -> bool:
        return self._fd is not None

    def used(self) -> int:
        """Resident set size in bytes (statm's second field is resident pages)."""
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def total(self) -> int:
        """The memory the node may count on: the machine's, or its cgroup's limit if lower (a
        container's `--memory`), as a fraction-of-RAM watermark should be read."""
        total = os.sysconf("SC_PHYS_PAGES") * self._page
        limit = cgroup_limit()
        return min(total, limit) if limit else total

    def trim(self) -> None:
        """Hand the memory the allocator keeps free back to the system."""
        if self._trim is not None:
            self._trim(0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes), if any."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            candidates += [Path("/sys/fs/cgroup" + path) / "memory.max", Path("/sys/fs/cgroup/memory.max")]
        elif "memory" in controllers.split(","):
            candidates += [Path("/sys/fs/cgroup/memory" + path) / "memory.limit_in_bytes",
                           Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")]
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # v1 says "no limit" with a huge number
            return int(text)
        if text == "max":
            return None
    return None


class SimMemory:
    """A memory probe whose numbers a test sets (the simulation's nodes share one process)."""

    def __init__(self, used: int = 0, total: int = 8 << 30):
        self.used_bytes = used
        self.total_bytes = total
        self.trims = 0
        self.available = True

    def used(self) -> int:
        return self.used_bytes

    def total(self) -> int:
        return self.total_bytes

    def trim(self) -> None:
        self.trims += 1

    def close(self) -> None:
        pass


class NodeMemory:
    """`node.memory`: this node's alarm, the peers' alarms, and whether publishers are blocked."""

    def __init__(self, name: str, watermark: Watermark, probe, log, links):
        self.name = name
        self.probe = probe
        self.log = log
        self._links = links  # () -> {node: PeerLink}: the links to tell
        self.watermark = watermark
        self.total = probe.total() if probe is not None else 0
        self.alarm = MemoryAlarm(watermark.limit(self.total))
        self.alarms = Alarms(name)
        self.hooks: dict = {}  # hook -> None: insertion-ordered, O(1) removal for many connections
        self._unblocked = trio.Event()
        self._unblocked.set()
        self._read = 0  # publishing bytes read since the last sample

    # --- what front ends use -------------------------------------------------------------------
    @property
    def blocked(self) -> bool:
        """Publishers are held: this node or a running peer has a memory alarm."""
        return self.alarms.blocked

    @property
    def reason(self) -> str:
        return self.alarms.reason

    async def wait_unblocked(self) -> None:
        await self._unblocked.wait()

    def add_hook(self, hook) -> None:
        self.hooks[hook] = None

    def remove_hook(self, hook) -> None:
        self.hooks.pop(hook, None)

    def took(self, nbytes: int) -> None:
        """A publishing connection read `nbytes`: sample now if READ_BUDGET has come in since
        the last sample (a publisher told it is blocked stops at its next read)."""
        self._read += nbytes
        if self._read >= READ_BUDGET and self.probe is not None and self.probe.available:
            self.check(trio.current_time())

    def status(self) -> dict:
        """For `warrenctl status`."""
        return {"memory_used": self.alarm.used, "memory_limit": self.alarm.limit,
                "memory_high_watermark": str(self.watermark), "memory_total": self.total,
                "memory_alarm": self.alarm.on, "alarms": self.alarms.nodes,
                "publishers_blocked": self.blocked,
                # what the interpreter holds live (objects and buffers), as opposed to the
                # resident set, which also counts what the allocators keep after a burst
                "memory_python_blocks": sys.getallocatedblocks()}

    # --- the monitor ---------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Sample and decide every CHECK_EVERY seconds, for as long as the app runs."""
        if self.probe is None or not self.probe.available:
            self.log.warning("cannot measure this process's memory (no /proc/self/statm): "
                             "the memory alarm is off")
            task_status.started()
            return
        self.log.info("memory high watermark set", high_watermark=str(self.watermark),
                      limit=format_bytes(self.alarm.limit), total=format_bytes(self.total))
        self.check(trio.current_time())
        task_status.started()
        try:
            while True:
                await trio.sleep(CHECK_EVERY)
                self.check(trio.current_time())
        finally:
            # the app stops: its links are gone, and so are the peers' alarms we knew
            if self.alarms.forget_peers():
                self._changed()

    def check(self, now: float) -> None:
        self._read = 0
        alarm = self.alarm
        used = self.probe.used()
        if alarm.wants_trim(used, now):
            self.probe.trim()
            alarm.trimmed(now)
            used = self.probe.used()
        if not alarm.observe(used):
            return
        if alarm.on:
            detail = alarm.detail(self.name)
            self.log.warning("memory resource limit alarm set on this node: publishers will be "
                             "blocked", used=format_bytes(used), limit=format_bytes(alarm.limit))
        else:
            detail = None
            self.log.warning("memory resource limit alarm cleared on this node",
                             used=format_bytes(used), limit=format_bytes(alarm.limit))
        msg = m.NodeAlarm(RESOURCE, alarm.on, detail or "")
        for link in list(self._links().values()):
            link.send(msg)
        if self.alarms.set_local(detail):
            self._changed()

    def set_watermark(self, watermark: Watermark) -> int:
        """A new high watermark (warrenctl set_vm_memory_high_watermark); returns the limit."""
        self.watermark = watermark
        if self.probe is not None:
            self.total = self.probe.total()
        self.alarm.set_limit(watermark.limit(self.total))
        self.log.info("memory high watermark set", high_watermark=str(watermark),
                      limit=format_bytes(self.alarm.limit))
        return self.alarm.limit

    # --- peers ---------------------------------------------------------------------------------
    def link_up(self, node: str) -> None:
        """A new link: it starts knowing nothing of our alarm."""
        if self.alarm.on:
            link = self._links().get(node)
            if link is not None:
                link.send(m.NodeAlarm(RESOURCE, True, self.alarms.local or ""))

    def link_down(self, node: str) -> None:
        if node in self.alarms.remote:
            self.log.info("memory alarm of a node that went away no longer blocks publishers", peer=node)
        if self.alarms.forget(node):
            self._changed()

    def peer_alarm(self, node: str, msg: m.NodeAlarm) -> None:
        if msg.resource != RESOURCE:
            return
        if msg.on:
            self.log.warning("memory resource limit alarm set on another node: publishers will be "
                             "blocked", peer=node, detail=msg.detail)
        else:
            self.log.info("memory resource limit alarm cleared on another node", peer=node)
        if self.alarms.set_remote(node, (msg.detail or f"node {node} is low on memory") if msg.on else None):
            self._changed()

    # --- telling the front ends ----------------------------------------------------------------
    def _changed(self) -> None:
        blocked = self.blocked
        if blocked:
            if self._unblocked.is_set():
                self._unblocked = trio.Event()
        else:
            self._unblocked.set()
        reason = self.reason
        for hook in list(self.hooks):
            hook(blocked, reason)


class PublisherGate:
    """One client connection's view of the alarm (see the module docstring): `await hold()`
    before each read, and after one that finds publishers blocked; `close()` when the
    connection ends. `tell(blocked, reason)` sends the
    front end's notification; it is called once when the connection is held and once when it
    is released."""

    __slots__ = ("memory", "session", "tell", "told")

    def __init__(self, memory: NodeMemory, session, tell):
        self.memory = memory
        self.session = session
        self.tell = tell
        self.told = False  # the client was told it is blocked
        memory.add_hook(self._on_change)

    def _on_change(self, blocked: bool, reason: str) -> None:
        if blocked:
            if self.session.publisher and not self.told:
                self.told = True
                self.tell(True, reason)
        elif self.told:
            self.told = False
            self.tell(False, "")

    @property
    def state(self) -> str:
        """RabbitMQ's words: `blocked` (held), `blocking` (would be held once it publishes),
        `running`."""
        if not self.memory.blocked:
            return "running"
        return "blocked" if self.session.publisher else "blocking"

    async def hold(self) -> None:
        """Return at once unless this connection publishes and publishers are blocked; then
        tell the client (if not yet told) and wait until the alarm is over."""
        memory = self.memory
        while self.session.publisher and memory.blocked:
            if not self.told:
                self.told = True
                self.tell(True, memory.reason)
            await memory.wait_unblocked()

    def close(self) -> None:
        self.memory.remove_hook(self._on_change)


def full_collection(probe) -> dict:
    """`warrenctl force_gc` (rabbitmqctl's command of that name): a full pass of the
    interpreter's cyclic collector now, then the C allocator asked to give back what it keeps
    free (`probe.trim`), and what that freed. The node runs a full collection rarely on its own
    (broker/server.py `tune_gc`): what an ended connection leaves in a reference cycle waits
    for it, so the live blocks after this call are the node's state, not its garbage."""
    available = probe is not None and probe.available
    blocks, rss = sys.getallocatedblocks(), probe.used() if available else None
    started = time.perf_counter()
    collected = gc.collect()
    if available:
        probe.trim()
    return {"collected_objects": collected, "python_blocks_before": blocks,
            "python_blocks_after": sys.getallocatedblocks(),
            "rss_before": rss, "rss_after": probe.used() if available else None,
            "seconds": round(time.perf_counter() - started, 4)}
