"""The metadata log's persistent state on disk (data_dir/raft.msgpack), saved without rewriting
what has not changed.

The file is a run of msgpack records. The first is the whole state: `{"format": FORMAT, "raft":
Persistent as a dict, "commit": index}`. Each later one is what a save added to it: `{"term", "voted_for",
"commit", "at", "add"}`, the log entries `add` taking their place at position `at` of the log
after the snapshot. A save that only appended entries or changed the term, the vote or the commit
index appends such a record. Anything else (the first save, a snapshot taken or installed, a
follower's log cut back by a new leader) writes the whole state to a new file that replaces the
old one in one rename, as does a save after `REWRITE_AFTER` appended records.

Why: the whole state holds the metadata's snapshot (every queue's definition) and up to
`COMPACT_AFTER` entries, and it is saved for every change to the log on every node. Writing it
all each time made each queue declared with N queues present cost O(N): 1,000 queues took 24 s
to declare.

A save never waits for the disk (no fsync), as before: a node's state survives the kill of its
process, not the loss of its machine. A record cut short at the end of the file (a write the
process did not finish) is ignored on reading: it was never acted upon, since Raft sends nothing
until its save returns.

The log's entries are typed changes (mirroring/changes.py) and the snapshot typed records
(mirroring/records.py), written by msgspec and checked when read. `FORMAT` numbers the layout:
a file written in another one (by an older warren, whose changes were plain lists) is refused
with StateFormatError, whose text says how to reset the node.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import msgspec

from mirroring.raft import Persistent

REWRITE_AFTER = 1000  # appended records before the whole state is written afresh
FORMAT = 2  # the layout of the file; 1 (no "format" key) held the changes as plain lists

_encode = msgspec.msgpack.Encoder().encode


class StateFormatError(ValueError):
    """The file holds a saved state of another format: the node must be reset to start."""

    def __init__(self, path: Path, found):
        super().__init__(
            f"{path} holds cluster state in format {found}, and this warren reads format "
            f"{FORMAT}: reset the node (python -m broker.localcluster reset, or delete its data "
            f"directory {path.parent}) and join it to its cluster again")


class StateFile:
    def __init__(self, path: Path):
        self.path = path
        # what the file holds: (snap_index, snap_data, entries written, the last of them), or
        # None when the next save must write it whole
        self._written: tuple | None = None
        self._appended = 0

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict | None:
        """The saved state as `{"raft": dict, "commit": index}`, None without a file; raises
        StateFormatError for a state saved in another format, ValueError (or msgpack's errors)
        when the file is not a saved state."""
        if not self.path.exists():
            return None
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)
        unpacker.feed(self.path.read_bytes())
        data = None
        try:
            for record in unpacker:
                if data is None:
                    if not isinstance(record, dict) or "raft" not in record:
                        raise ValueError("the file does not start with a whole saved state")
                    if record.get("format", 1) != FORMAT:
                        raise StateFormatError(self.path, record.get("format", 1))
                    data = record
                    continue
                raft = data["raft"]
                raft["term"], raft["voted_for"] = record["term"], record["voted_for"]
                raft["entries"][record["at"]:] = record["add"]
                data["commit"] = record["commit"]
        except msgpack.OutOfData:
            pass  # a record cut short at the end: never acted upon (see the module docstring)
        self._written = None  # the next save writes what it has whole
        return data

    def save(self, state: Persistent, commit: int) -> None:
        entries = state.entries
        w = self._written
        if (w is not None and self._appended < REWRITE_AFTER and w[0] == state.snap_index
                and w[1] is state.snap_data and len(entries) >= w[2]
                and (w[2] == 0 or entries[w[2] - 1] is w[3])):
            # the file holds this log's first w[2] entries (Raft cuts a log back only by
            # dropping its tail, which takes the entry at w[2] - 1 with it)
            record = {"term": state.term, "voted_for": state.voted_for, "commit": commit,
                      "at": w[2], "add": [[t, c] for t, c in entries[w[2]:]]}
            with open(self.path, "ab") as f:
                f.write(_encode(record))
            self._appended += 1
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(_encode({"format": FORMAT, "raft": state.to_dict(), "commit": commit}))
            os.replace(tmp, self.path)
            self._appended = 0
        self._written = (state.snap_index, state.snap_data, len(entries),
                         entries[-1] if entries else None)

    def forget(self) -> None:
        self._written = None
        if self.path.exists():
            self.path.unlink()
