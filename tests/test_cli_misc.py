"""``nbaccel env``, ``nbaccel demo`` and the command line's own behaviour."""

from __future__ import annotations

import re
import sys

import pytest

from nbaccel.core.config import LaunchConfig
from tests.test_cli_support import run_cli


@pytest.mark.slow
def test_env_report(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    LaunchConfig(num_processes=2, mixed_precision="bf16").save(cfg)
    result = run_cli("env", "--config_file", str(cfg), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("nbaccel", "Python", "torch", "ipykernel", "ipywidgets", "hardware"):
        assert re.search(rf"^- {name}: \S", out, re.M), (name, out)
    assert f"- Python: {sys.version.split()[0]}" in out
    assert f"- config file: {cfg}" in out and "mixed_precision: bf16" in out


@pytest.mark.slow
def test_env_reports_a_broken_config_instead_of_failing(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("num_procs: 2\n")
    result = run_cli("env", "--config_file", str(cfg), cwd=tmp_path)
    assert result.returncode == 0
    assert "line 1: unknown key 'num_procs'" in result.stdout


@pytest.mark.slow
def test_demo_runs_two_ranks_and_prints_the_result(tmp_path):
    result = run_cli("demo", "--steps", "20", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("[rank0] data: ") for line in lines)
    assert any(line.startswith("[rank1] data: ") for line in lines)
    assert not any(line.startswith("[rank0] rank") for line in lines)  # no doubled "rank"
    assert "result from rank 0: {'world_size': 2, 'steps': 20" in result.stdout


def test_no_command_prints_help(tmp_path):
    result = run_cli(cwd=tmp_path)
    assert result.returncode == 2
    for command in ("config", "launch", "export", "env", "demo"):
        assert command in result.stdout


def test_console_script_entry_point():
    from importlib import metadata

    (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "nbaccel"]
    assert entry.value == "nbaccel.cli.main:main"
