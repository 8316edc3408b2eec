"""``nbaccel config``: questions answered through stdin, --default, --show, bad files."""

from __future__ import annotations

import pytest

from nbaccel.core import hardware
from nbaccel.core.config import LaunchConfig
from tests.test_cli_support import run_cli

# As written by `accelerate config` (accelerate 1.x) for 2 machines of 2 GPUs.
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_interactive_answers_are_written(tmp_path):
    target = tmp_path / "cfg.yaml"
    # machines, processes, precision, strategy (Enter = default), accumulation
    answers = "1\n3\nbf16\n\n4\n"
    result = run_cli("config", "--config_file", str(target), cwd=tmp_path, stdin=answers)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "How many processes on this machine? [1]" in result.stdout
    cfg = LaunchConfig.load(target)
    assert (cfg.num_processes, cfg.mixed_precision, cfg.strategy) == (3, "bf16", "ddp")
    assert cfg.gradient_accumulation_steps == 4


def test_interactive_reasks_bad_answers_and_uses_the_shared_file(tmp_path):
    shared = tmp_path / "shared.yaml"
    LaunchConfig(num_processes=2, strategy="fsdp").save(shared)
    # 2 machines, rank 7 (refused) then 1, ip, port, backend, procs, precision "half"
    # (refused) then fp16, strategy kept, accumulation kept, FSDP options kept.
    answers = "2\n7\n1\n10.0.0.1\n29501\nc10d\n\nhalf\nfp16\n\n\n\n"
    result = run_cli("config", cwd=tmp_path, stdin=answers, NBACCEL_CONFIG_FILE=str(shared))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "at most 1" in result.stdout and "choose one of no, fp16, bf16, fp8" in result.stdout
    cfg = LaunchConfig.load(shared)
    assert cfg == LaunchConfig(
        num_processes=2,
        mixed_precision="fp16",
        strategy="fsdp",
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=29501,
        rdzv_backend="c10d",
    )


def test_input_ending_early_writes_nothing(tmp_path):
    target = tmp_path / "cfg.yaml"
    result = run_cli("config", "--config_file", str(target), cwd=tmp_path, stdin="1\n")
    assert result.returncode == 2
    assert "nothing was written" in result.stderr
    assert not target.exists()


def test_default_and_show(tmp_path):
    target = tmp_path / "sub" / "cfg.yaml"
    result = run_cli("config", "--default", "--config_file", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = hardware.detect().gpu_count or 1
    assert LaunchConfig.load(target).num_processes == expected
    shown = run_cli("config", "--show", "--config_file", str(target), cwd=tmp_path)
    assert shown.returncode == 0
    assert f"num_processes: {expected}" in shown.stdout
    assert shown.stdout.startswith(f"# {target}")


def test_malformed_files_name_file_line_and_key(tmp_path):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("num_processes: 2\nmixed_precison: bf16\n")
    bad_value = tmp_path / "value.yaml"
    bad_value.write_text("num_processes: 2\nstrategy: zero3\n")
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("num_processes: 2\n  strategy: [ddp\n")
    for path, expected in [
        (
            unknown,
            f"{unknown}, line 2: unknown key 'mixed_precison'; did you mean 'mixed_precision'?",
        ),
        (bad_value, f"{bad_value}, line 2, key 'strategy'"),
        (not_yaml, f"{not_yaml}, line "),
    ]:
        shown = run_cli("config", "--show", "--config_file", str(path), cwd=tmp_path)
        assert shown.returncode == 2
        assert expected in shown.stderr
        assert "Traceback" not in shown.stderr
        # The interactive mode refuses too, rather than overwrite the user's file.
        before = path.read_text()
        asked = run_cli("config", "--config_file", str(path), cwd=tmp_path, stdin="\n" * 8)
        assert asked.returncode == 2 and expected in asked.stderr
        assert path.read_text() == before


def test_show_without_a_file_says_how_to_make_one(tmp_path):
    result = run_cli("config", "--show", "--config_file", str(tmp_path / "none.yaml"), cwd=tmp_path)
    assert result.returncode == 2
    assert "nbaccel config" in result.stderr


def test_accelerate_config_is_named_with_a_way_on(tmp_path):
    accel = tmp_path / "default_config.yaml"
    accel.write_text(ACCELERATE_CONFIG)
    result = run_cli("launch", "--config_file", str(accel), str(tmp_path / "x.py"), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "written by `accelerate config`" in result.stderr
    assert "nbaccel config" in result.stderr
    # Accelerate counts processes over all machines; nbaccel per machine.
    assert "--num_processes 2 --mixed_precision bf16 --num_machines 2" in result.stderr


def test_files_that_are_no_config_at_all_are_named_without_a_traceback(tmp_path):
    cases = {
        "binary.yaml": (b"\xff\xfe\x00\x01", "is not a text (UTF-8) file"),
        "listkey.yaml": (b"[1, 2]: 3\n", "line 1: a key must be a name"),
        "twice.yaml": (b"num_processes: 2\nnum_processes: 3\n", "given twice (also on line 1)"),
        "no.yaml": (b"mixed_precision: no\n", "write mixed_precision: 'no' (quoted)"),
    }
    for name, (content, _) in cases.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "folder.yaml").mkdir()
    cases["folder.yaml"] = (b"", "is a folder, not a config file")
    for name, (_, expected) in cases.items():
        shown = run_cli("config", "--show", "--config_file", str(tmp_path / name), cwd=tmp_path)
        assert shown.returncode == 2, (name, shown.stderr)
        assert expected in shown.stderr and "Traceback" not in shown.stderr, shown.stderr


def test_version(tmp_path):
    shown = run_cli("--version", cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.strip().startswith("nbaccel 0.")


def test_a_choice_this_machine_cannot_run_is_kept_and_named_by_config_and_env(tmp_path):
    from nbaccel.core import capabilities, hardware

    if not capabilities.unrunnable_here("fp8", "ddp", hardware.detect().gpus):
        pytest.skip("this machine can run fp8 (a GPU of compute capability 8.9+ and torchao)")
    target = tmp_path / "cfg.yaml"
    # machines, processes, precision, strategy (Enter = default), accumulation
    result = run_cli("config", "--config_file", str(target), cwd=tmp_path, stdin="1\n2\nfp8\n\n1\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert LaunchConfig.load(target).mixed_precision == "fp8"  # kept: meant for another machine
    assert "note: this machine cannot launch it: mixed_precision='fp8': fp8 needs" in result.stdout
    env = run_cli("env", "--config_file", str(target), cwd=tmp_path)
    assert "(this machine cannot launch it: mixed_precision='fp8'" in env.stdout, env.stdout
