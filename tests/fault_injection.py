"""Fault injection for the tests (issue 10, "Tests that can catch what they claim"): plant one
known bug at a time in a copy of the work tree, run the tests that claim to catch it, and fail
if any planted bug survives (every one of its tests passes).

    python tests/fault_injection.py            # every mutant (a few minutes: process tests run)
    python tests/fault_injection.py --list     # the mutants and their tests
    python tests/fault_injection.py acks-not-replicated sync-limit-ignored

Each mutant is a literal replacement in one file. When the code it targets has changed so that
the text is no longer there, the mutant is reported as "does not apply" and counts as a failure
of this script: rewrite the mutant for the new code (the bug it stands for still has to be
caught). Not part of `make test` (it runs the process tests once per mutant).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("acks-not-replicated", "the leader stops replicating acks to its mirrors (after a failover "
           "the acknowledged messages come back as duplicates)",
           "mirroring/queue.py",
           '            self.effects.append(["ack", owner, ids])',
           '            pass',
           ("tests/test_sim_mirroring.py",
            "tests/test_process_mirroring.py::test_kill9_of_leader_under_load_promotes_oldest_mirror_and_loses_no_confirmed_message")),
    Mutant("no-requeue-on-promotion", "a promoted mirror neither requeues the unacknowledged messages "
           "nor sets redelivered",
           "mirroring/queue.py",
           "        for owner in sorted({o for (o, _, _) in self.unacked.values()}):",
           "        for owner in []:",
           ("tests/test_sim_mirroring.py",
            "tests/test_process_mirroring.py::test_kill9_of_leader_under_load_promotes_oldest_mirror_and_loses_no_confirmed_message")),
    Mutant("resends-not-deduplicated", "publishes resent to a new leader after a failover are enqueued "
           "again",
           "broker/queue_process.py",
           "            if not state.seen(owner, pseq):",
           "            if True:",
           ("tests/test_sim_mirroring.py", "tests/test_replication_property.py",
            "tests/test_process_mirroring.py::test_kill9_of_leader_under_load_promotes_oldest_mirror_and_loses_no_confirmed_message",
            "tests/test_process_mirroring.py::test_stop_app_of_leader_under_load_promotes_a_synchronised_mirror")),
    Mutant("client-keeps-lost-publishes", "the client no longer nacks the publishes lost with a "
           "connection (they stay unanswered)",
           "broker/client/aio.py",
           "            for s in lost:\n                ch.nacked.append((s, s, \"connection lost\"))",
           "            for s in []:\n                ch.nacked.append((s, s, \"connection lost\"))",
           ("tests/test_client_reconnect.py",
            "tests/test_process_mirroring.py::test_kill9_of_the_leader_the_publisher_is_connected_to_with_confirms_in_flight")),
    Mutant("sync-limit-ignored", "batch sync ignores mirroring_sync_max_throughput",
           "mirroring/sync.py",
           "        if not self.max_rate:\n            return 0.0",
           "        if True:\n            return 0.0",
           ("tests/test_sync_plan.py",
            "tests/test_process_sync.py::test_sync_queue_and_cancel_sync_queue")),
]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def run_mutant(m: Mutant, keep: bool) -> tuple[str, str]:
    """('caught' | 'SURVIVED' | 'does not apply', detail)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"warren-mutant-{m.name}-"))
    try:
        copy_tree(tmp)
        path = tmp / m.file
        text = path.read_text()
        if text.count(m.old) != 1:
            return "does not apply", f"{m.file}: the text to replace is found {text.count(m.old)} times"
        path.write_text(text.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=str(tmp))
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
                           cwd=tmp, env=env, capture_output=True, text=True)
        took = time.monotonic() - t
        last = (r.stdout.strip().splitlines() or ["?"])[-1]
        if r.returncode == 0:
            return "SURVIVED", f"{last} ({took:.0f} s)"
        failed = [line for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return "caught", f"{failed[0] if failed else last} ({took:.0f} s)"
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the mutated copies")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list or not chosen:
        for m in MUTANTS:
            print(f"{m.name}: {m.what}\n    {m.file}; tests: {' '.join(m.tests)}")
        return 0 if args.list else 2
    bad = 0
    for m in chosen:
        verdict, detail = run_mutant(m, args.keep)
        bad += verdict != "caught"
        print(f"{verdict:15} {m.name}: {detail}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} planted bugs caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
