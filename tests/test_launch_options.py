"""LaunchOptions is the one declaration of a launch's options: the entry points match it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import nbaccel
from nbaccel.core.config import LaunchConfig
from nbaccel.launch.options import CONFIG_FILE_NAMES, UNSET, LaunchOptions
from nbaccel.launch.plan import resolve_plan

FIELDS = {f.name: f for f in dataclasses.fields(LaunchOptions)}
NOT_LAUNCHER_KEYWORDS = {"cpu", "strategy"}  # debug_launcher's cpu; %ranks start's strategy


def _same_default(a: object, b: object) -> bool:
    return a is b if UNSET in (a, b) else a == b


def test_notebook_launcher_keywords_are_the_options_field_for_field():
    params = list(inspect.signature(nbaccel.notebook_launcher).parameters.values())
    assert [p.name for p in params[:2]] == ["function", "args"]
    keywords = [p for p in params[2:] if p.name != "kwargs"]  # the function's, not the launch's
    assert [p.name for p in keywords] == [n for n in FIELDS if n not in NOT_LAUNCHER_KEYWORDS]
    for p in keywords:
        field = FIELDS[p.name]
        assert p.annotation == field.type, p.name
        assert _same_default(p.default, field.default), p.name


def test_ranks_start_options_are_launch_options():
    params = inspect.signature(nbaccel.Ranks.__init__).parameters
    # Ranks' timeout is per cell (a launch's is for the whole launch): not the option
    shared = [n for n in params if n in FIELDS and n != "timeout"]
    assert shared == [
        "num_processes",
        "mixed_precision",
        "strategy",
        "start_method",
        "env",
        "progress",
    ]
    for name in shared:
        assert params[name].annotation == FIELDS[name].type, name
        assert _same_default(params[name].default, FIELDS[name].default), name
    ranks = nbaccel.Ranks(num_processes=2, mixed_precision="bf16", start=False)
    assert ranks.options == LaunchOptions(num_processes=2, mixed_precision="bf16")


def test_every_option_has_its_doc():
    assert all(LaunchOptions.doc(name).strip() for name in FIELDS)


def test_the_config_file_spells_the_options_it_holds_one_way():
    config_fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    for option, config_name in CONFIG_FILE_NAMES.items():
        assert option in FIELDS and config_name in config_fields
        assert option not in config_fields  # not two names for one setting
    shared = {"num_processes", "mixed_precision", "max_restarts", "start_method", "strategy"}
    assert shared <= config_fields & set(FIELDS)


def test_accelerates_config_spellings_are_aliases():
    options = LaunchOptions.accepting_aliases(
        main_process_port=29511, main_process_ip="localhost", num_machines=1, machine_rank=0
    )
    assert (options.use_port, options.master_addr) == (29511, "localhost")
    with pytest.raises(TypeError, match="main_process_port= and use_port= name the same"):
        LaunchOptions.accepting_aliases(main_process_port=1, use_port=2)


def test_options_are_read_by_name_into_the_plan():
    plan = resolve_plan(
        print,
        (),
        {},
        LaunchOptions(num_processes=3, mixed_precision="no", use_port=29517, strategy="fsdp"),
    )
    assert (plan.info.num_processes, plan.info.master_port, plan.info.strategy) == (
        3,
        29517,
        "fsdp",
    )
    assert all(s.env["NBACCEL_MIXED_PRECISION"] == "no" for s in plan.specs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LaunchOptions().timeout = 1  # type: ignore[misc]


def test_the_cli_documents_the_settings_it_shares_with_the_options():
    from nbaccel.cli.main import build_parser
    from nbaccel.launch.options import ALIASES

    launch = build_parser()._subparsers._group_actions[0].choices["launch"]
    helps = {flag: a.help for a in launch._actions for flag in a.option_strings}
    for name in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "strategy"):
        assert helps[f"--{name}"] == LaunchOptions.doc(ALIASES.get(name, name)), name
    assert {f"--{n}" for n in ALIASES} <= set(helps)  # the config file's spellings are flags
