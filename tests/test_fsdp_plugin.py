"""FSDP configured as Accelerate users configure it: ``FullyShardedDataParallelPlugin``'s fields
and spellings, the ``fsdp_*`` fields of LaunchConfig/YAML, and the ``nbaccel config``/``launch``
options that fill them. What FSDP2 does with them on 2 ranks is in test_fsdp_training.py."""

from __future__ import annotations

import pytest
import torch

from nbaccel.core.config import ConfigError, LaunchConfig
from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from tests.test_fsdp_training import Net


def test_plugin_takes_accelerate_spellings_and_launch_settings(monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    p = Plugin(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_names_to_wrap="Block, Other",
        cpu_offload=True,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
        mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": torch.float32},
        cpu_ram_efficient_loading=True,
    )
    assert p.auto_wrap_policy == "transformer_based_wrap"
    assert p.transformer_cls_names_to_wrap == ["Block", "Other"]
    assert isinstance(p.cpu_offload, CPUOffloadPolicy) and p.offloads_to_cpu
    assert p.state_dict_type == "SHARDED_STATE_DICT" and p.sync_module_states  # as Accelerate
    assert p.mixed_precision_policy.param_dtype == torch.bfloat16
    assert p.mixed_precision_policy.reduce_dtype == torch.float32
    default = Plugin()
    assert (default.auto_wrap_policy, default.state_dict_type) == ("no_wrap", "FULL_STATE_DICT")
    assert type(default.cpu_offload) is OffloadPolicy and default.reshard_after_forward is True

    # Unset fields come from the launch (what LaunchConfig.worker_env writes); set ones win.
    env = LaunchConfig(
        strategy="fsdp",
        fsdp_auto_wrap_policy="size_based_wrap",
        fsdp_min_num_params=123,
        fsdp_cpu_offload=True,
        fsdp_reshard_after_forward=False,
        fsdp_state_dict_type="sharded_state_dict",
        fsdp_activation_checkpointing=True,
    ).worker_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    p = Plugin()
    assert (p.auto_wrap_policy, p.min_num_params, p.offloads_to_cpu) == (
        "size_based_wrap",
        123,
        True,
    )
    assert (p.reshard_after_forward, p.activation_checkpointing) == (False, True)
    assert p.state_dict_type == "SHARDED_STATE_DICT"
    assert Plugin(state_dict_type="FULL_STATE_DICT", cpu_offload=False).offloads_to_cpu is False


def test_plugin_takes_fsdp1_settings_as_accelerate_does():
    from torch.distributed.fsdp import ShardingStrategy

    assert Plugin(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False
    assert Plugin(sharding_strategy=ShardingStrategy.FULL_SHARD).reshard_after_forward is True
    with pytest.raises(ValueError, match="strategy='ddp' for NO_SHARD"):
        Plugin(sharding_strategy="NO_SHARD")
    with pytest.warns(UserWarning, match="use_orig_params have no effect with FSDP2"):
        Plugin(use_orig_params=True)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"auto_wrap_policy": "layer_wrap"}, "auto_wrap_policy='layer_wrap'"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "not supported with FSDP2"),
        ({"fsdp_version": 1}, "FSDP2"),
        ({"min_num_params": -1}, "min_num_params"),
        ({"cpu_offload": "maybe"}, "cpu_offload must be true or false"),
        ({"mixed_precision_policy": {"buffer_dtype": "bf16"}}, "buffer_dtype was FSDP1's"),
        ({"mixed_precision_policy": {"param_dtype": "int8"}}, "param_dtype"),
    ],
)
def test_plugin_refuses_bad_values_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match="FullyShardedDataParallelPlugin") as info:
        Plugin(**kwargs)
    assert words in str(info.value)


def test_wrap_policy_names_missing_block_classes():
    with pytest.raises(ValueError, match=r"\['Missing'\].*Block, Linear, Net"):
        Plugin(
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap="Missing"
        ).wrap_policy(Net())
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs transformer_cls_names_to_wrap"):
        Plugin(auto_wrap_policy="transformer_based_wrap").wrap_policy(plain)


def test_launch_config_fsdp_fields_validate_and_round_trip(tmp_path):
    cfg = LaunchConfig(
        strategy="fsdp",
        fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        fsdp_transformer_cls_names_to_wrap="Block,Layer",
        fsdp_state_dict_type="sharded_state_dict",
        fsdp_cpu_offload="true",
    )
    assert cfg.fsdp_transformer_cls_names_to_wrap == ["Block", "Layer"]
    path = cfg.save(tmp_path / "cfg.yaml")
    assert "fsdp_state_dict_type: SHARDED_STATE_DICT" in path.read_text()
    assert LaunchConfig.load(path) == cfg
    env = cfg.worker_env()
    assert env["NBACCEL_FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Block,Layer"
    assert env["NBACCEL_FSDP_CPU_OFFLOAD"] == "true"
    bad = tmp_path / "bad.yaml"
    bad.write_text("strategy: fsdp\nfsdp_state_dict_type: LOCAL\n")
    with pytest.raises(ConfigError, match="line 2, key 'fsdp_state_dict_type'"):
        LaunchConfig.load(bad)


def test_cli_flags_and_questions_fill_the_fsdp_fields(tmp_path, monkeypatch):
    from nbaccel.cli import launch as cli_launch
    from nbaccel.cli.main import build_parser, main

    args = build_parser().parse_args(
        ["launch", "--strategy", "fsdp", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP"]
        + ["--fsdp_min_num_params", "1000", "--fsdp_cpu_offload", "true"]
        + ["--fsdp_state_dict_type", "sharded_state_dict", "train.py"]
    )
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    cfg = cli_launch.resolve_config(args)
    assert (cfg.fsdp_auto_wrap_policy, cfg.fsdp_min_num_params) == ("size_based_wrap", 1000)
    assert cfg.fsdp_cpu_offload is True and cfg.fsdp_state_dict_type == "SHARDED_STATE_DICT"

    # machines, processes, precision, strategy, accumulation, "change FSDP?"; wrap policy, classes,
    # offload, reshard (Enter: keep), activation checkpointing, checkpoint format
    answers = iter(
        ["1", "2", "no", "fsdp", "1", "yes", "transformer_based_wrap", "Block"]
        + ["yes", "", "no", "SHARDED_STATE_DICT"]
    )
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    assert main(["config", "--config_file", str(tmp_path / "asked.yaml")]) == 0
    asked = LaunchConfig.load(tmp_path / "asked.yaml")
    assert asked.fsdp_transformer_cls_names_to_wrap == ["Block"]
    assert (asked.fsdp_cpu_offload, asked.fsdp_reshard_after_forward) == (True, True)
    assert asked.fsdp_state_dict_type == "SHARDED_STATE_DICT"
