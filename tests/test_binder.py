"""The Binder image installs what pyproject.toml asks for, at the versions the tests use."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # 3.10: pytest's own TOML reader there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# The Python Binder builds with (binder/runtime.txt, "python-3.11"): the pins' markers are read
# for it, whichever Python runs this test (scripts/test_pythons.sh runs it on 3.10 too).
BINDER_PYTHON = (ROOT / "binder" / "runtime.txt").read_text().strip().removeprefix("python-")


def pins(path: Path) -> dict[str, Version]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"python_version": BINDER_PYTHON}):
            continue  # a pin for another Python than Binder's
        (spec,) = req.specifier  # every line is an exact pin
        assert spec.operator == "==", f"{path.name}: {line} is not pinned with =="
        found[canonicalize_name(req.name)] = Version(spec.version)
    return found


def test_binder_pins_satisfy_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["notebooks"]
    binder = pins(ROOT / "binder" / "requirements.txt")
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in binder, f"binder/requirements.txt does not install {req.name}"
        assert req.specifier.contains(binder[name], prereleases=True), (
            f"binder pins {req.name}=={binder[name]}, outside pyproject's {req.specifier}"
        )


def test_binder_installs_the_tested_versions():
    binder = pins(ROOT / "binder" / "requirements.txt")
    tested = pins(ROOT / "constraints.txt")
    assert set(binder) == set(tested)
    for name, version in binder.items():
        assert version.public == tested[name].public, (
            f"{name}: binder {version}, tests {tested[name]}"
        )
    assert binder["torch"].local == "cpu", "Binder should install the small CPU-only torch"


def test_every_claimed_python_has_one_pin_of_each_package():
    """constraints.txt is what the README's install uses on every Python requires-python
    claims: on 3.10 its numpy pin had no build (pip: ResolutionImpossible), so markers pick a
    release there; each Python must still get exactly one pin of each package."""
    lines = [
        Requirement(line.split("#", 1)[0].strip())
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.split("#", 1)[0].strip()
    ]
    names = {canonicalize_name(r.name) for r in lines}
    for python in ("3.10", "3.11", "3.12", "3.13"):
        chosen = [
            canonicalize_name(r.name)
            for r in lines
            if not r.marker or r.marker.evaluate({"python_version": python})
        ]
        assert sorted(chosen) == sorted(names), (python, chosen)
    numpy = [r for r in lines if r.name == "numpy"]
    assert any(r.marker and r.marker.evaluate({"python_version": "3.10"}) for r in numpy)
