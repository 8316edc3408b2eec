"""Accelerate 1.15's own multi-process test scripts, run from the installed (pinned, test-only)
wheel against nbaccel: one test function per 2-rank launch (``tests/accelerate_suite``).

CI runs every case that applies here with nbaccel (about a minute), and a sample with Accelerate
itself, which shows the runner measures both. ``NBACCEL_ACCELERATE_SUITE=full`` also runs every
case with Accelerate and checks that the deliberate differences still are ones; the table in
``docs/accelerate_suite.md`` comes from ``python -m tests.accelerate_suite``.
"""

from __future__ import annotations

import ast
import os

import pytest

pytest.importorskip("accelerate")

from tests.accelerate_suite.cases import CASES  # noqa: E402
from tests.accelerate_suite.redirect import scripts_dir  # noqa: E402
from tests.accelerate_suite.runner import launch, not_applicable  # noqa: E402

FULL = os.environ.get("NBACCEL_ACCELERATE_SUITE") == "full"
APPLICABLE = [c for c in CASES if not not_applicable(c)]
# Cases Accelerate itself passes on 2 CPU ranks, one or two per script (the CI sample).
ACCELERATE_SAMPLE = {
    "test_script::dl_preparation_check",
    "test_sync::test_gradient_accumulation[split=0,dispatch=0,sync_each=1]",
    "test_ops::test_op_checker",
    "test_distributed_data_loop::test_data_loader[batch_sampler]",
}


def _ids(cases):
    return [c.id for c in cases]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [c for c in APPLICABLE if not c.differs],
    ids=_ids([c for c in APPLICABLE if not c.differs]),
)
def test_case_passes_with_nbaccel(case):
    assert launch("nbaccel", case) == "pass"


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL, reason="the deliberate differences run with NBACCEL_ACCELERATE_SUITE=full"
)
@pytest.mark.parametrize(
    "case", [c for c in APPLICABLE if c.differs], ids=_ids([c for c in APPLICABLE if c.differs])
)
def test_deliberate_difference_still_differs(case):
    outcome = launch("nbaccel", case)
    assert outcome != "pass", f"{case.id} passes now: drop its `differs` note ({case.differs})"


@pytest.mark.slow
@pytest.mark.parametrize("case", APPLICABLE, ids=_ids(APPLICABLE))
def test_case_with_accelerate_itself(case):
    if not FULL and case.id not in ACCELERATE_SAMPLE:
        pytest.skip("CI runs a sample with Accelerate; NBACCEL_ACCELERATE_SUITE=full runs all")
    outcome = launch("accelerate", case)
    if case.id in ACCELERATE_SAMPLE:
        assert outcome == "pass"
    else:  # the full run records, it does not judge Accelerate
        print(f"{case.id}: {outcome}")


def _called_in_main(relative: str) -> set[str]:
    tree = ast.parse((scripts_dir() / relative).read_text())
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return set()
    names = {
        n.func.id
        for n in ast.walk(main)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    return {n for n in names if n.startswith(("test_", "check_")) or n.endswith("_check")}


@pytest.mark.parametrize("script", sorted({c.script for c in CASES}))
def test_every_test_function_main_calls_is_a_case(script):
    """A new accelerate pin with new test functions fails here until they are listed."""
    listed = {c.function for c in CASES if c.script == script}
    if listed & {"main", "__main__"}:
        return  # listed as a whole script
    assert _called_in_main(script) - listed == set()


def test_every_script_in_the_wheel_is_listed():
    shipped = {str(p.relative_to(scripts_dir())) for p in scripts_dir().rglob("test_*.py")}
    assert shipped - {c.script for c in CASES} == set()
