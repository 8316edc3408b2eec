"""DeepSpeed settings without training: the plugin's config ("auto" values filled from the
prepared objects, mixed precision), LaunchConfig/CLI fields and variables, and the errors when
something is wrong or deepspeed is missing. Training on ranks: tests/test_deepspeed_training.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nbaccel.core.config import LaunchConfig


def _plugin(**kw):
    from nbaccel.training.deepspeed_plugin import DeepSpeedPlugin

    return DeepSpeedPlugin(**kw)


# -- the plugin and its config, without launching --------------------------------------------


def test_plugin_builds_accelerates_config_and_fills_auto_values():
    from nbaccel.training.deepspeed_plugin import fill_auto

    plugin = _plugin(zero_stage=3, offload_optimizer_device="cpu", gradient_clipping=1.0)
    config = fill_auto(
        plugin.deepspeed_config,
        micro_batch=8,
        accumulation_steps=2,
        world_size=2,
        mixed_precision="bf16",
        gradient_clipping=plugin.gradient_clipping,
    )
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 32
    assert config["gradient_clipping"] == 1.0
    assert config["bf16"] == {"enabled": True} and "fp16" not in config


def test_user_json_autos_come_from_the_prepared_objects(tmp_path):
    from nbaccel.training.deepspeed_plugin import fill_auto

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
                "zero_optimization": {"stage": 2},
            }
        )
    )
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.02, betas=(0.8, 0.9))
    plugin = _plugin(hf_ds_config=str(path), gradient_clipping=0.5)
    config = fill_auto(
        plugin.deepspeed_config,
        micro_batch=4,
        accumulation_steps=3,
        world_size=2,
        mixed_precision="no",
        gradient_clipping=plugin.gradient_clipping,
        optimizer=opt,
    )
    assert plugin.zero_stage_in_config == 2
    assert config["train_batch_size"] == 24 and config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": False}
    assert config["optimizer"]["params"] == {"lr": 0.02, "betas": [0.8, 0.9]}
    assert config["scheduler"]["params"]["warmup_max_lr"] == 0.02


def test_config_errors_say_what_to_do(tmp_path, monkeypatch):
    from nbaccel.training.deepspeed_plugin import fill_auto

    with pytest.raises(ValueError, match="no DataLoader was prepared"):
        fill_auto({}, micro_batch=None, accumulation_steps=1, world_size=1,
                  mixed_precision="no", gradient_clipping=None)  # fmt: skip
    with pytest.raises(ValueError, match="enables fp16 but mixed_precision='bf16'"):
        fill_auto({"fp16": {"enabled": True}}, micro_batch=1, accumulation_steps=1,
                  world_size=1, mixed_precision="bf16", gradient_clipping=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"still has 'auto' at scheduler.params.total_num_steps"):
        fill_auto({"scheduler": {"params": {"total_num_steps": "auto"}}}, micro_batch=1,
                  accumulation_steps=1, world_size=1, mixed_precision="no",
                  gradient_clipping=None)  # fmt: skip
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        _plugin(zero_stage=4)
    with pytest.raises(FileNotFoundError, match="no such DeepSpeed config file"):
        _plugin(hf_ds_config=str(tmp_path / "missing.json"))
    monkeypatch.setenv("NBACCEL_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("NBACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "CPU")
    plugin = _plugin()  # unset fields come from the launch's variables
    assert (plugin.zero_stage, plugin.offload_param_device) == (1, "cpu")


def test_launch_config_carries_deepspeed_settings_to_the_ranks(tmp_path):
    cfg = LaunchConfig(
        strategy="deepspeed", deepspeed_zero_stage="3", deepspeed_gradient_clipping=1
    )
    assert cfg.deepspeed_zero_stage == 3
    env = cfg.worker_env()
    assert env["NBACCEL_STRATEGY"] == "deepspeed"
    assert env["NBACCEL_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["NBACCEL_DEEPSPEED_GRADIENT_CLIPPING"] == "1.0"
    assert LaunchConfig.load(cfg.save(tmp_path / "c.yaml")).deepspeed_zero_stage == 3
    with pytest.raises(ValueError, match="deepspeed_offload_param_device"):
        LaunchConfig(deepspeed_offload_param_device="gpu")


def test_cli_flags_and_questions_fill_the_deepspeed_fields(tmp_path):
    from nbaccel.cli.launch import resolve_config
    from nbaccel.cli.main import build_parser
    from tests.test_cli_support import run_cli

    flags = ["launch", "--config_file", str(LaunchConfig().save(tmp_path / "c.yaml"))]
    flags += ["--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "CPU"]
    flags += ["--zero3_save_16bit_model", "true", "--gradient_clipping", "0.5", "train.py"]
    cfg = resolve_config(build_parser().parse_args(flags))
    assert (cfg.strategy, cfg.deepspeed_zero_stage) == ("deepspeed", 3)
    assert cfg.deepspeed_offload_optimizer_device == "cpu"
    assert cfg.deepspeed_zero3_save_16bit_model is True
    assert cfg.deepspeed_gradient_clipping == 0.5

    # machines, processes, precision, strategy, accumulation, ZeRO stage, optimizer offload
    answers = "1\n2\nno\ndeepspeed\n1\n3\ncpu\n"
    target = tmp_path / "asked.yaml"
    result = run_cli("config", "--config_file", str(target), cwd=tmp_path, stdin=answers)
    assert result.returncode == 0, result.stdout + result.stderr
    cfg = LaunchConfig.load(target)
    assert (cfg.strategy, cfg.deepspeed_zero_stage) == ("deepspeed", 3)
    assert cfg.deepspeed_offload_optimizer_device == "cpu"


@pytest.mark.slow
def test_missing_deepspeed_is_a_clear_error():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["deepspeed"] = None   # as if not installed
        import nbaccel
        from nbaccel import Accelerator
        try:
            Accelerator(strategy="deepspeed")
        except ImportError as exc:
            print(exc)
        cfg = nbaccel.LaunchConfig(num_processes=2, strategy="deepspeed")
        try:   # refused in the kernel, before any rank starts
            nbaccel.notebook_launcher(print, config=cfg)
        except nbaccel.ConfigError as exc:
            print(exc)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "strategy='deepspeed' needs the deepspeed package" in out.stdout, out.stderr[-2000:]
    assert "run `pip install deepspeed`" in out.stdout
    assert "strategy='deepspeed': DeepSpeed is not installed in this Python" in out.stdout


def test_strategy_verdicts():
    from nbaccel.core.capabilities import strategy_verdict

    assert strategy_verdict("deepspeed", "bf16", deepspeed=True).allowed
    assert strategy_verdict("ddp", "no", deepspeed=False).allowed
    assert "not 'fp8'" in strategy_verdict("deepspeed", "fp8", deepspeed=True).reason
    assert "pip install" in strategy_verdict("deepspeed", "no", deepspeed=False).reason
