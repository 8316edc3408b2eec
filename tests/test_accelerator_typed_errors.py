"""Errors the type check found in the Accelerator's own code, each pinned by the case that hit it."""

from __future__ import annotations

import pytest

from nbaccel import Accelerator
from nbaccel.utils import ProjectConfiguration


def test_load_state_with_automatic_naming_but_no_project_dir_says_what_to_set():
    # mypy: Path(self.project_dir) with project_dir None (it was a TypeError from pathlib).
    config = ProjectConfiguration(automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=config)
    with pytest.raises(ValueError, match=r"ProjectConfiguration\(project_dir=\.\.\.\)"):
        acc.load_state()
