"""bench/wakeup.py: two real processes bounce a message over loopback TCP and each side's CPU
per round trip is measured: blocking, with a bare epoll, and through trio's run loop."""

from __future__ import annotations

import pytest

from bench.cli import main
from bench.wakeup import measure


@pytest.mark.parametrize("mode", ["blocking", "epoll", "trio"])
def test_each_side_of_a_round_trip_is_measured(mode):
    row = measure(mode, 300)
    assert row["mode"] == mode and row["round_trips"] == 300
    # each side read and wrote 300 times: that takes CPU, and a round trip takes longer on the
    # wall clock than the CPU either side spent on it
    assert 0 < row["starter_cpu_us"] <= row["wall_us"] * 1.5
    assert 0 < row["answerer_cpu_us"] <= row["wall_us"] * 1.5


def test_an_unknown_mode_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["wakeup", "--modes", "spin", "--round-trips", "10"])
    assert "unknown mode 'spin' (blocking, epoll, trio)" in str(exc.value.code)
