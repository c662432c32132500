"""Event loops whose timers wake on time, for the open-loop load generators (asyncio's, and trio's
through `fine_trio_timers`).

Theory: asyncio waits for its next timer in `epoll_wait`, whose timeout is whole milliseconds;
Python rounds a wait up to the next millisecond, so a producer that owes its next message in
0.3 ms sleeps 1 ms and sends it 0.7 ms late. At 2,000 msgs/s (one message every 0.5 ms) that
lag would be in every latency the generator reports, for every broker alike, and the largest
part of a quiet run's p50.

`select()` takes microseconds. An epoll instance is itself a file descriptor that is readable
when any of its descriptors is ready, so a short wait is done as `select()` on that one
descriptor with the exact timeout, and the ready events are then collected with a zero-timeout
`epoll_wait`. Waits of LONG_WAIT or more, or with no timeout, stay a plain `epoll_wait` (the
millisecond does not matter there). One descriptor in `select()`, so no FD_SETSIZE limit on the
connections the loop holds, and no spinning: the process sleeps in the kernel either way.

A trio sleep costs more than its wait: `trio.sleep` opens a cancel scope with a deadline, and
when the deadline passes trio cancels the scope and raises Cancelled through the sleeping task to
end it; that costs tens of microseconds of CPU per sleep more than the wait itself, about as
much as the generator's own work for a message. A paced producer sleeps before nearly every message, so `trio_sleep` keeps its sleeps
in a heap of its own inside the wrapped epoll: `poll` shortens its timeout to the earliest one and
wakes the tasks whose time has come with `trio.lowlevel.reschedule`, as trio's I/O manager wakes a
task whose descriptor is ready (it runs at the same point of trio's loop).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import select
import selectors
import time

import trio

LONG_WAIT = 0.02  # seconds: from here on, epoll's millisecond rounding is not worth a syscall
EARLY = 0.002  # a `trio_sleep` this long or longer wakes in epoll this much before its time


_NOTHING = object()  # a short wait ended with nothing ready


def _wait_short(fd: int, timeout):
    """The timeout to hand on to epoll: a short one is first waited out in `select()` on the
    epoll descriptor `fd` (then 0 if something is ready, else _NOTHING); others pass unchanged."""
    if timeout is not None and 0 < timeout < LONG_WAIT:
        ready, _, _ = select.select([fd], [], [], timeout)
        return 0 if ready else _NOTHING
    return timeout


class FineEpollSelector(selectors.EpollSelector):
    """An epoll selector whose short timeouts are kept to the microsecond (see above)."""

    def select(self, timeout=None):
        timeout = _wait_short(self._selector.fileno(), timeout)
        return [] if timeout is _NOTHING else super().select(timeout)


class _FineEpoll:
    """A select.epoll stand-in whose short `poll` timeouts are kept to the microsecond, and which
    keeps `trio_sleep`'s timers (see above)."""

    def __init__(self, epoll):
        self._epoll = epoll
        self._fd = epoll.fileno()
        self.timers: list = []  # heap of [deadline (time.monotonic), sequence, task or None]

    def poll(self, timeout=-1, maxevents=-1):
        timers = self.timers
        if timers:
            wait = timers[0][0] - time.monotonic()
            if wait >= LONG_WAIT:  # wake before it, in epoll, and wait out the rest exactly
                wait -= EARLY
            if timeout is None or timeout < 0 or wait < timeout:
                timeout = wait if wait > 0 else 0
        timeout = _wait_short(self._fd, timeout)
        events = [] if timeout is _NOTHING else self._epoll.poll(timeout, maxevents)
        if timers:
            now = time.monotonic()
            while timers and timers[0][0] <= now:
                task = heapq.heappop(timers)[2]
                if task is not None:  # None: the sleep was cancelled
                    trio.lowlevel.reschedule(task)
        return events

    def __getattr__(self, name):  # register, modify, unregister, close, fileno
        return getattr(self._epoll, name)


_sequence = itertools.count()


def _io_manager():
    """This trio run's I/O manager (None outside a run). Private: trio has no public hook for
    its wait."""
    from trio._core import _run

    return getattr(getattr(_run.GLOBAL_RUN_CONTEXT, "runner", None), "io_manager", None)


def _fine_epoll():
    """This trio run's wrapped epoll, or None."""
    epoll = getattr(_io_manager(), "_epoll", None)
    return epoll if isinstance(epoll, _FineEpoll) else None


async def trio_sleep(seconds: float) -> None:
    """`trio.sleep(seconds)` in a run with `fine_trio_timers`, without a cancel scope (see
    above); it can still be cancelled. Outside such a run, trio's own sleep. A long sleep ends
    on time too: the loop wakes EARLY before it and waits out the rest exactly. (Short sleeps
    were the only ones once; 500 paced producers in one process, each sleeping half a second
    between sends, spent a sixth of their CPU on trio's cancel scopes: py-spy on
    `scale-q1000-2k`.)"""
    fine = _fine_epoll() if seconds > 0 else None
    if fine is None:
        await trio.sleep(seconds)
        return
    entry = [time.monotonic() + seconds, next(_sequence), trio.lowlevel.current_task()]
    heapq.heappush(fine.timers, entry)

    def abort(_raise_cancel):
        entry[2] = None  # poll drops it when its time comes
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)


def fine_trio_timers() -> bool:
    """Call inside `trio.run`: the loop's short waits then end on time, and `trio_sleep` is cheap
    (see above). False when this trio's I/O manager is not the epoll one this knows."""
    io_manager = _io_manager()
    epoll = getattr(io_manager, "_epoll", None)
    if isinstance(epoll, _FineEpoll):
        return True
    if not isinstance(epoll, getattr(select, "epoll", ())):
        return False
    io_manager._epoll = _FineEpoll(epoll)
    return True


PR_SET_TIMERSLACK = 29


def tight_timer_slack() -> bool:
    """Ask Linux to end this process's timed waits on time: by default it may let a wait run up
    to 50 us long (the timer slack, to batch wake-ups), which adds to a paced producer's send lag.
    False where that is not possible."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def new_event_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(FineEpollSelector())


def run(coro):
    """`asyncio.run` on a loop with fine timers (and a tight timer slack)."""
    tight_timer_slack()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
