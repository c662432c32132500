"""The run record every benchmark folder starts with: its id, and `run.json` (when, on what
machine, at which commit), written atomically so a reader never sees half a file."""

from __future__ import annotations

import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except OSError:
        return None


def machine() -> dict:
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "mem_gib": mem, "platform": platform.platform(),
            "hostname": platform.node()}


def new_meta(run_id: str, workloads: list[str], targets: list[str]) -> dict:
    """The fields every run.json has; callers add their own."""
    return {"run_id": run_id, "started_at": time.time(), "finished_at": None, "git_commit": git_commit(),
            "python": sys.version.split()[0], "warren_version": None, "rabbitmq_version": None,
            "machine": machine(), "workloads": workloads, "targets": targets, "skipped": [],
            "notes": "2-core shared machine: numbers are noisy" if (os.cpu_count() or 0) <= 2 else ""}


def write_meta(folder: Path, meta: dict) -> None:
    tmp = folder / "run.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(folder / "run.json")
