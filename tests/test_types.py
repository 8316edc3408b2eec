"""The type check: mypy over the package (settings in pyproject's ``[tool.mypy]``), against a
checked-in baseline that may only shrink.

``tests/mypy_baseline.txt`` lists the errors still tolerated, one per line as
``path: message  [code]`` (no line numbers, so unrelated edits do not shift it). A new error
fails the test; so does a listed one that no longer occurs, with a request to delete its line.
Run ``python -m mypy`` for the full report with line numbers; a cold run takes about a minute
(it reads torch's annotations), later ones a few seconds from ``build/mypy_cache``.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "mypy_baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*)$")


def current_errors() -> collections.Counter[str]:
    """mypy's errors over nbaccel, each as its baseline line."""
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-pretty", "--no-error-summary", "--show-error-codes"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode not in (0, 1) or run.stderr.strip():
        pytest.fail(f"mypy did not run (exit {run.returncode}):\n{run.stderr}\n{run.stdout}")
    errors: collections.Counter[str] = collections.Counter()
    for line in run.stdout.splitlines():
        match = _ERROR.match(line)
        if match:
            errors[f"{match['path']}: {match['message']}"] += 1
    return errors


def baseline() -> collections.Counter[str]:
    lines = BASELINE.read_text().splitlines()
    return collections.Counter(line for line in lines if line.strip() and not line.startswith("#"))


@pytest.mark.slow
def test_no_type_errors_beyond_the_baseline():
    found, allowed = current_errors(), baseline()
    new = found - allowed
    gone = allowed - found
    assert not new, (
        f"{sum(new.values())} type error(s) not in {BASELINE.name}; fix them (run "
        "`python -m mypy` for line numbers), do not add them to the baseline:\n"
        + "\n".join(sorted(new.elements()))
    )
    assert not gone, (
        f"{sum(gone.values())} baseline entr(ies) no longer occur: delete these lines from "
        f"{BASELINE.relative_to(ROOT)} so the baseline only shrinks:\n"
        + "\n".join(sorted(gone.elements()))
    )


def test_the_package_ships_its_annotations():
    """PEP 561: users' type checkers read nbaccel's annotations only if py.typed is installed."""
    assert (ROOT / "nbaccel" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    data = re.search(r"\[tool\.setuptools\.package-data\]\n(?:#.*\n)*nbaccel = \[(.*)\]", pyproject)
    assert data and '"py.typed"' in data[1], "py.typed is not in pyproject's package data"
