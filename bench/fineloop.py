"""Event loops whose timers wake on time, for the open-loop load generators (asyncio's, and trio's
through `fine_trio_timers`).

Theory: asyncio waits for its next timer in `epoll_wait`, whose timeout is whole milliseconds;
Python rounds a wait up to the next millisecond, so a producer that owes its next message in
0.3 ms sleeps 1 ms and sends it 0.7 ms late. At 2,000 msgs/s (one message every 0.5 ms) that
lag is in every latency the generator reports, for every broker alike, and it was the largest
part of a quiet run's p50 (bench/README.md, "How the load is generated").

`select()` takes microseconds. An epoll instance is itself a file descriptor that is readable
when any of its descriptors is ready, so a short wait is done as `select()` on that one
descriptor with the exact timeout, and the ready events are then collected with a zero-timeout
`epoll_wait`. Waits of LONG_WAIT or more, or with no timeout, stay a plain `epoll_wait` (the
millisecond does not matter there). One descriptor in `select()`, so no FD_SETSIZE limit on the
connections the loop holds, and no spinning: the process sleeps in the kernel either way.
"""

from __future__ import annotations

import asyncio
import select
import selectors

LONG_WAIT = 0.02  # seconds: from here on, epoll's millisecond rounding is not worth a syscall


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
    """A select.epoll stand-in whose short `poll` timeouts are kept to the microsecond."""

    def __init__(self, epoll):
        self._epoll = epoll
        self._fd = epoll.fileno()

    def poll(self, timeout=-1, maxevents=-1):
        timeout = _wait_short(self._fd, timeout)
        return [] if timeout is _NOTHING else self._epoll.poll(timeout, maxevents)

    def __getattr__(self, name):  # register, modify, unregister, close, fileno
        return getattr(self._epoll, name)


def fine_trio_timers() -> bool:
    """Call inside `trio.run`: the loop's short waits then end on time (see above). False when
    this trio's I/O manager is not the epoll one this knows."""
    from trio._core import _run  # private: trio has no public hook for its wait

    runner = getattr(_run.GLOBAL_RUN_CONTEXT, "runner", None)
    io_manager = getattr(runner, "io_manager", None)
    epoll = getattr(io_manager, "_epoll", None)
    if isinstance(epoll, _FineEpoll):
        return True
    if not isinstance(epoll, getattr(select, "epoll", ())):
        return False
    io_manager._epoll = _FineEpoll(epoll)
    return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(FineEpollSelector())


def run(coro):
    """`asyncio.run` on a loop with fine timers."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
