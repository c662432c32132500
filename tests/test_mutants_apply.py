"""The mutants of tests/mutants.py still apply to the code: each one's text to replace is in its
file exactly once, and its tests exist. (Running them is `make mutants`, minutes long; this only
keeps their texts from going stale unnoticed when the code they break is rewritten.)"""

from __future__ import annotations

import pytest

from tests.mutants import MUTANTS, ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_mutant_still_applies(mutant):
    text = (ROOT / mutant.file).read_text()
    assert text.count(mutant.old) == 1, (
        f"mutant {mutant.name}: its text is not in {mutant.file} exactly once; mend it in tests/mutants.py")
    missing = [t for t in mutant.tests if not (ROOT / t.split("::")[0]).exists()]
    assert not missing, f"mutant {mutant.name}: its tests {missing} do not exist"


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
