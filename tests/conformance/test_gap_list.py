"""warren_gaps.GAPS names only cases that exist, so an entry cannot outlive its case unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

from warren_gaps import GAPS

HERE = Path(__file__).resolve().parent


def case_functions() -> set[str]:
    found = set()
    for module in HERE.glob("test_*.py"):
        for node in ast.parse(module.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found.add(node.name)
    return found


def test_every_gap_names_a_case():
    cases = case_functions()
    assert sorted(key for key in GAPS if key.split("[")[0] not in cases) == []


def test_every_gap_gives_a_reason():
    assert all(isinstance(reason, str) and reason for reason in GAPS.values())
