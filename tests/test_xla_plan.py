"""How a launch is shaped for torch_xla's PJRT runtime, decided in the kernel from the
environment alone (no torch_xla needed: tests/test_xla.py runs the real thing)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from nbaccel.core import hardware, xla_runtime
from nbaccel.launch import xla
from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import resolve_plan

HAS_XLA = importlib.util.find_spec("torch_xla") is not None


def work() -> int:
    return 1


def _plan(n: int, env: dict[str, str | None]):
    return resolve_plan(work, (), {}, LaunchOptions(num_processes=n, env=env))


def test_plain_launch_is_left_alone():
    plan = _plan(2, {"PJRT_DEVICE": None})
    assert (plan.info.device, plan.info.backend, plan.xla_threads) == ("cpu", "gloo", False)
    assert "CPU_NUM_DEVICES" not in plan.specs[0].env


@pytest.mark.skipif(HAS_XLA, reason="checks the message where torch_xla is missing")
def test_pjrt_device_without_torch_xla_says_what_to_install():
    with pytest.raises(RuntimeError, match="torch_xla is not installed"):
        _plan(2, {"PJRT_DEVICE": "CPU"})


def _specs(n: int, env: dict[str, str]):
    plan = _plan(n, {"PJRT_DEVICE": None})
    specs = [dataclasses.replace(s, env={**s.env, **env}) for s in plan.specs]
    return plan.info, specs


@pytest.mark.skipif(not HAS_XLA, reason="adapt_plan refuses PJRT_DEVICE without torch_xla")
def test_cpu_devices_are_threads_of_one_host():
    info, specs = _specs(2, {"PJRT_DEVICE": "cpu"})
    info, specs, threads = xla.adapt_plan(info, specs)
    assert threads and (info.device, info.backend) == ("xla", "xla")
    env = specs[1].env
    assert (env["PJRT_DEVICE"], env["CPU_NUM_DEVICES"], env["PJRT_CPU_ASYNC_CLIENT"]) == (
        "CPU",
        "2",
        "0",
    )
    assert isinstance(xla.make_group(specs, "forkserver", threads), xla.ThreadHostGroup)


@pytest.mark.skipif(not HAS_XLA, reason="adapt_plan refuses PJRT_DEVICE without torch_xla")
def test_one_device_is_one_process_that_starts_its_own_runtime():
    info, specs = _specs(1, {"PJRT_DEVICE": "CPU"})
    info, specs, threads = xla.adapt_plan(info, specs)
    assert not threads
    assert specs[0].env["PJRT_LOCAL_PROCESS_RANK"] == "0"
    assert specs[0].env["CPU_NUM_DEVICES"] == "1"


def test_which_tpus_run_cores_as_threads():
    assert xla_runtime.uses_threads("TPU", 8, {"TPU_ACCELERATOR_TYPE": "v3-8"})  # Kaggle
    assert xla_runtime.uses_threads("TPU", 8, {"TPU_ACCELERATOR_TYPE": "v2-8"})  # Colab
    assert not xla_runtime.uses_threads("TPU", 4, {"TPU_ACCELERATOR_TYPE": "v4-8"})
    assert not xla_runtime.uses_threads("TPU", 8, {"TPU_ACCELERATOR_TYPE": "v5litepod-8"})
    assert not xla_runtime.uses_threads("CPU", 1, {})


def test_requested_reads_pjrt_device_and_tpu_hosts(monkeypatch):
    assert xla_runtime.requested({"PJRT_DEVICE": "tpu"}) == "TPU"
    assert xla_runtime.tpu_present({"TPU_ACCELERATOR_TYPE": "v3-8"})
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    assert hardware.detect(refresh=True).has_tpu
    monkeypatch.delenv("COLAB_TPU_ADDR")
    hardware.detect(refresh=True)
