"""Unknown config keys: a "did you mean" for typos, a way on for files from `accelerate config`."""

from __future__ import annotations

import pytest

from nbaccel.core.config import ConfigError, LaunchConfig
from nbaccel.core.config_hints import accelerate_flags, looks_like_accelerate
from tests.test_cli_config import ACCELERATE_CONFIG


def test_typo_gets_the_closest_key():
    with pytest.raises(ConfigError) as info:
        LaunchConfig.from_yaml("num_proceses: 2\n", source="c.yaml")
    assert (
        str(info.value)
        == "c.yaml, line 1: unknown key 'num_proceses'; did you mean 'num_processes'?"
    )


def test_unrelated_key_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        LaunchConfig.from_yaml("strategy: ddp\nbanana: 1\n", source="c.yaml")
    message = str(info.value)
    assert message.startswith("c.yaml, line 2: unknown key 'banana'; known keys are ")
    assert "num_processes" in message and "did you mean" not in message


def test_accelerate_file_is_recognised_and_its_shared_settings_become_flags():
    with pytest.raises(ConfigError) as info:
        LaunchConfig.from_yaml(ACCELERATE_CONFIG, source="default_config.yaml")
    message = str(info.value)
    assert message.startswith(
        "default_config.yaml looks like a config file written by `accelerate config`"
    )
    assert "`nbaccel config`" in message
    # 4 processes over 2 machines is 2 per machine; null ip/port are left out.
    assert (
        "nbaccel launch --num_processes 2 --mixed_precision bf16 --num_machines 2 "
        "--machine_rank 0 --rdzv_backend static SCRIPT" in message
    )
    assert "main_process_ip" not in message


def test_only_accelerate_keys_mark_an_accelerate_file():
    assert looks_like_accelerate(["num_processes", "distributed_type"])
    assert not looks_like_accelerate(["num_processes", "mixed_precision", "rdzv_backend"])
    # An nbaccel config with a typo is still just a typo.
    with pytest.raises(ConfigError, match="did you mean 'machine_rank'"):
        LaunchConfig.from_yaml("machine_rnk: 0\n")


def test_flags_for_one_machine_and_odd_values():
    assert accelerate_flags({"num_processes": 3, "main_process_port": 29500}) == [
        "--num_processes",
        "3",
        "--main_process_port",
        "29500",
    ]
    assert accelerate_flags({"num_processes": None, "mixed_precision": ""}) == []
