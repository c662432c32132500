"""The failover chart of the analysis report (bench/analysis/report.py), on hand-made tables: no
Spark. A sub-second outage shows in the fine buckets around a fault, the last partial second does
not look like a drop, and the fault's label sits above the curves, not over them."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")

from bench.analysis import report  # noqa: E402

RATE = 1000.0


def _second(start: float, end: float, per_s: float = RATE, target: str = "warren", role: str = "deliver") -> dict:
    return {"run_id": "r", "scenario": "s", "target": target, "role": role, "t": 100.0 + start,
            "second": start, "n": round(per_s * (end - start)), "bytes": 0, "start_s": start,
            "end_s": end, "per_s": per_s}


def _fine(start: float, per_s: float, fault_s: float, width: float = 0.1, role: str = "deliver") -> dict:
    return {"run_id": "r", "scenario": "s", "target": "warren", "fault_s": fault_s, "role": role,
            "start_s": start, "end_s": start + width, "n": round(per_s * width), "per_s": per_s}


def _outage_tables(fault_s: float = 4.3, outage: float = 0.4):
    """10 s at RATE msgs/s that end 0.25 s into the last second; an outage of `outage` s after a
    fault at `fault_s`, made up for just after it (so each 1 s bucket still counts RATE)."""
    coarse = [_second(float(i), float(i + 1)) for i in range(10)] + [_second(10.0, 10.25)]
    fine = []
    for k in range(30):  # 1 s before to 2 s after the fault
        a = fault_s - 1.0 + k * 0.1
        if fault_s <= a < fault_s + outage - 1e-9:
            per_s = 0.0
        elif fault_s + outage - 1e-9 <= a < fault_s + 2 * outage - 1e-9:
            per_s = 2 * RATE
        else:
            per_s = RATE
        fine.append(_fine(a, per_s, fault_s))
    fault = {"run_id": "r", "scenario": "s", "target": "warren", "second": fault_s, "action": "kill",
             "node": "n1"}
    return coarse, fine, fault


def _value_at(segs, x: float) -> float:
    [v] = [v for a, b, v in segs if a <= x < b]
    return v


def test_the_outage_shows_in_the_fine_buckets_and_nowhere_else_is_zero():
    coarse, fine, fault = _outage_tables()
    segs = report.rate_segments(coarse, fine)
    assert _value_at(segs, 4.35) == 0.0 and _value_at(segs, 4.65) == 0.0
    assert _value_at(segs, 4.8) == 2 * RATE
    assert _value_at(segs, 2.0) == RATE and _value_at(segs, 8.5) == RATE
    # the segments tile the scenario without holes or overlaps
    assert segs[0][0] == 0.0 and segs[-1][1] == pytest.approx(10.25)
    assert all(b == pytest.approx(a2) for (_, b, _), (a2, _, _) in zip(segs, segs[1:]))
    zero = [(a, b) for a, b, v in segs if v == 0.0]
    assert sum(b - a for a, b in zero) == pytest.approx(0.4)
    # per second alone, nothing is zero: the outage is hidden
    assert min(report.rate_segments(coarse, []), key=lambda s: s[2])[2] == RATE


def test_the_last_partial_second_does_not_drop():
    coarse, _, _ = _outage_tables()
    segs = report.rate_segments(coarse, [])
    assert segs[-1][1] == pytest.approx(10.25)
    assert segs[-1][2] == pytest.approx(RATE)  # 250 events in 0.25 s, not a drop to 250/s
    # a sliver (the run ended 20 ms into a second, 5 events) joins the second before it
    sliver = [_second(float(i), float(i + 1)) for i in range(3)] + [_second(3.0, 3.02, per_s=250.0)]
    last = report.rate_segments(sliver, [])[-1]
    assert last[:2] == (2.0, pytest.approx(3.02))
    assert last[2] == pytest.approx((1000 + 5) / 1.02)


def test_a_second_without_events_is_zero_and_close_faults_share_their_window():
    coarse = [_second(0.0, 1.0), _second(2.0, 3.0)]  # nothing at all in [1, 2)
    assert report.rate_segments(coarse, [])[1] == (1.0, 2.0, 0.0)
    first = [_fine(0.5 + k * 0.1, RATE, fault_s=1.0) for k in range(10)]
    second = [_fine(0.95 + k * 0.1, 3 * RATE, fault_s=1.45) for k in range(10)]
    segs = report.rate_segments([_second(0.0, 1.0), _second(1.0, 2.0), _second(2.0, 3.0)], first + second)
    assert all(b == pytest.approx(a2) for (_, b, _), (a2, _, _) in zip(segs, segs[1:]))
    assert _value_at(segs, 1.2) == RATE  # the earlier fault's buckets keep the time both cover
    assert _value_at(segs, 1.7) == 3 * RATE


def test_the_fault_label_is_above_the_curves_and_the_legend_beside_them():
    coarse, fine, fault = _outage_tables()
    confirms = [dict(r, role="confirm") for r in coarse]
    fig = report.throughput_figure("r", "s", coarse + confirms, [fault], fine)
    fig.canvas.draw()
    ax = fig.axes[0]
    [label] = [t for t in ax.texts if "kill n1" in t.get_text()]
    box = label.get_window_extent()
    top = max(max(line.get_ydata()) for line in ax.lines if line.get_label() in ("deliver", "confirm"))
    top_px = ax.transData.transform((0, top))[1]
    assert box.y0 > top_px, "the label overlaps the curves"
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    # the plotted deliveries reach 0 during the outage
    [deliver] = [line for line in ax.lines if line.get_label() == "deliver"]
    assert min(deliver.get_ydata()) == 0.0
    report._png(fig)  # renders
