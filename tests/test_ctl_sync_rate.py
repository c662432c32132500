"""`warrenctl sync_queue` shows one rate: its progress bar ends on the figures of its closing
summary (a bar polled a moment before the end once said 17.8 MB/s next to a summary's 13.5), and
its help says what the rate is."""

from __future__ import annotations

import argparse

from broker import ctl


def test_the_bar_ends_on_the_summarys_rate(monkeypatch, capsys):
    def progress(messages, rate_bytes, elapsed):
        return {"messages": messages, "total_messages": 20_000, "bytes": messages * 1000,
                "total_bytes": 20_000_000, "elapsed": elapsed, "rate_msgs": messages / elapsed,
                "rate_bytes": rate_bytes, "eta": 0.0, "batches": 1}

    answers = iter([
        {"running": True, "progress": progress(19_000, 17.8e6, 1.07), "last": None},
        {"running": False, "progress": None,
         "last": {**progress(20_000, 13.5e6, 1.48), "status": "completed"}},
    ])

    async def fake_ctl_call(*args):
        return next(answers)

    monkeypatch.setattr(ctl, "ctl_call", fake_ctl_call)
    monkeypatch.setattr(ctl.time, "sleep", lambda seconds: None)
    args = argparse.Namespace(queue="two.orders", timeout=5.0)
    assert ctl._follow_sync(args, "127.0.0.1", 1, "me", b"s", {"started": True}) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "17.8 MB/s" in lines[1]  # the bar while it ran
    assert "20,000/20,000 msgs 13.5 MB/s" in lines[-2], lines  # the bar at the end
    assert lines[-1].startswith("sync completed: 20,000 messages") and "13.5 MB/s" in lines[-1]


def test_the_help_says_what_the_rate_is():
    sync = ctl.build_parser()._subparsers._group_actions[0].choices["sync_queue"]
    text = " ".join(sync.format_help().split())
    assert "in the progress bar and in the closing summary alike" in text
    assert "bytes of message bodies sent to the mirrors divided by the seconds since the sync started" in text
