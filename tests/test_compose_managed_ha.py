"""Checks of docker-compose.managed-ha.yml that need no Docker engine: it turns the managed HA
on for every node of docker-compose.yml, in a form the node's configuration accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from broker import config as configmod

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "docker-compose.yml"
OVERRIDE = REPO / "docker-compose.managed-ha.yml"


def _services(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def test_the_override_turns_managed_ha_on_for_every_node():
    nodes = [name for name, s in _services(BASE).items()
             if "WARREN_NODE_NAME" in (s.get("environment") or {})]
    override = _services(OVERRIDE)
    assert sorted(override) == sorted(nodes)
    for name in nodes:
        value = override[name]["environment"]["WARREN_MANAGED_HA"]
        cfg = configmod.load({"name": name, "secret": "s"}, {"WARREN_MANAGED_HA": value})
        assert cfg.managed_ha is True, name


def test_the_override_is_valid_with_the_cluster_file():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed "
                    "(`apt-get install docker-compose` or `make docker-engine`)")
    proc = subprocess.run([exe, "-f", str(BASE), "-f", str(OVERRIDE), "config"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("WARREN_MANAGED_HA") == 3
