"""The Binder image installs what pyproject.toml asks for, at the versions the tests use."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def pins(path: Path) -> dict[str, Version]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
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
