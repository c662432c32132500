"""The conformance cases warren fails today, each with what it lacks. Against warren (and only
there) conftest.py marks these cases xfail(strict=True): a case that starts to pass fails the run
until its line here is removed. A key is a test function's name (every parametrisation of it is
expected to fail) or one parametrised case's full name, e.g. `test_x[string]`."""

GAPS: dict[str, str] = {}  # none today: every case passes against warren
