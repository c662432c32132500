"""The metadata log's state file (broker/statefile.py): saves that only add to the log append a
record; anything else writes the whole state; what is read back is what was saved last."""

from __future__ import annotations

import msgpack
import pytest

from broker import statefile
from broker.statefile import StateFile, StateFormatError
from mirroring.changes import NodeUp, Noop, QueueDeclare, QueueDelete
from mirroring.metadata import Metadata
from mirroring.raft import Persistent
from mirroring.records import QueueDef


def state(term=1, entries=(), snap_index=0, snap_data=None, voted_for=None) -> Persistent:
    return Persistent(term, voted_for, snap_index, 0, ("n1",), snap_data, list(entries))


def read_back(path) -> tuple[Persistent, int]:
    data = StateFile(path).load()
    return Persistent.from_dict(data["raft"]), data["commit"]


def records(path) -> list:
    return list(msgpack.Unpacker(open(path, "rb"), raw=False, strict_map_key=False))


def test_appending_entries_appends_a_record_and_reads_back_whole(tmp_path):
    f = StateFile(tmp_path / "raft.msgpack")
    snap = {"version": 1, "queues": {f"q{i}": {"leader": "n1", "mirrors": ["n2"]} for i in range(300)}}
    log = [(1, Noop())]
    f.save(state(entries=log, snap_index=1, snap_data=snap), 0)
    whole = f.path.stat().st_size  # the snapshot's 300 queues make a whole save large
    for i in range(5):
        log.append((1, QueueDelete(f"new{i}")))
        f.save(state(entries=log, snap_index=1, snap_data=snap), i)
    f.save(state(term=2, voted_for="n2", entries=log, snap_index=1, snap_data=snap), 5)  # a vote
    assert len(records(f.path)) == 7
    # six saves cost the file what they added, not six more copies of the snapshot
    assert f.path.stat().st_size < whole + 6 * 100
    got, commit = read_back(f.path)
    assert got == state(term=2, voted_for="n2", entries=log, snap_index=1, snap_data=snap) and commit == 5


def test_a_log_cut_back_or_a_new_snapshot_writes_the_whole_state(tmp_path):
    f = StateFile(tmp_path / "raft.msgpack")
    log = [(1, Noop()), (1, QueueDelete("a")), (1, QueueDelete("b"))]
    f.save(state(entries=log), 1)
    # a new leader's log replaces our last entry: the file must not keep it
    log = log[:2] + [(2, QueueDelete("c"))]
    f.save(state(term=2, entries=log), 1)
    assert len(records(f.path)) == 1
    assert read_back(f.path)[0].entries == log
    log.append((2, QueueDelete("a")))
    f.save(state(term=2, entries=log), 3)
    assert len(records(f.path)) == 2
    # compaction: a snapshot takes the log's place
    snap = {"version": 4, "queues": {"c": {}}}
    f.save(state(term=2, entries=[], snap_index=4, snap_data=snap), 4)
    assert len(records(f.path)) == 1
    got, commit = read_back(f.path)
    assert got.snap_data == snap and got.entries == [] and got.snap_index == 4 and commit == 4


def test_a_record_cut_short_at_the_end_is_ignored(tmp_path):
    f = StateFile(tmp_path / "raft.msgpack")
    log = [(1, Noop())]
    f.save(state(entries=log), 0)
    f.save(state(entries=log + [(1, QueueDelete("q"))]), 1)
    whole = f.path.read_bytes()
    f.path.write_bytes(whole[:-3])
    assert read_back(f.path) == (state(entries=log), 0)


def test_after_a_load_or_many_appends_the_whole_state_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setattr(statefile, "REWRITE_AFTER", 3)
    f = StateFile(tmp_path / "raft.msgpack")
    log = [(1, Noop())]
    f.save(state(entries=log), 0)
    for i in range(4):
        log.append((1, Noop()))
        f.save(state(entries=log), i)
    assert len(records(f.path)) == 1  # the whole, 3 appended, then the whole again
    again = StateFile(f.path)
    loaded = Persistent.from_dict(again.load()["raft"])
    again.save(loaded, 4)
    assert len(records(f.path)) == 1 and read_back(f.path)[0] == state(entries=log)


def test_forget_removes_the_file(tmp_path):
    f = StateFile(tmp_path / "raft.msgpack")
    f.save(state(), 0)
    f.forget()
    assert not f.exists() and f.load() is None


def test_typed_changes_and_a_snapshot_read_back_as_they_were_saved(tmp_path):
    md = Metadata()
    md.apply(NodeUp("n1", 3))
    snap = md.snapshot()
    declare = QueueDeclare(QueueDef("q", True, False, False, {"x-max-length": 5}, "n1",
                                    mirrors=("n2",), epoch=4))
    f = StateFile(tmp_path / "raft.msgpack")
    f.save(state(entries=[(1, Noop())], snap_data=snap), 0)
    f.save(state(entries=[(1, Noop()), (2, declare)], snap_data=snap), 1)  # an appended record
    got, commit = read_back(f.path)
    assert got.entries == [(1, Noop()), (2, declare)] and commit == 1
    assert Metadata.from_snapshot(got.snap_data).snapshot() == snap


def test_a_state_file_of_the_old_format_says_how_to_reset(tmp_path):
    """Before changes were typed, a file held them as lists and had no format number."""
    path = tmp_path / "raft.msgpack"
    old = {"term": 1, "voted_for": None, "snap_index": 0, "snap_term": 0, "snap_config": ["n1"],
           "snap_data": None, "entries": [[1, ["noop"]]]}
    path.write_bytes(msgpack.packb({"raft": old, "commit": 1}, use_bin_type=True))
    with pytest.raises(StateFormatError) as ei:
        StateFile(path).load()
    text = str(ei.value)
    assert "\n" not in text and str(path) in text
    assert "python -m broker.localcluster reset" in text and str(tmp_path) in text
