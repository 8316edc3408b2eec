"""CUDA checks (NCCL DDP, bf16/fp16 autocast, fp8): skipped with a reason where no GPU is
visible. ``gpu_checks/check_cuda.py`` runs the same checks as a script on a GPU machine."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import nbaccel
from tests.test_accelerator_training import train_linear, train_mixed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none visible"),
]


def _device_report() -> tuple:
    acc = nbaccel.Accelerator()
    return str(acc.device), acc.state.backend, acc.distributed_type.value


def test_one_gpu_per_rank_with_nccl():
    n = min(torch.cuda.device_count(), 2)
    reports = nbaccel.notebook_launcher(_device_report, num_processes=n, return_all=True)
    for rank, (device, backend, kind) in enumerate(reports):
        assert device == f"cuda:{rank}"
        if n > 1:
            assert backend == "nccl" and kind == "MULTI_GPU"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_gpu(precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    r = train_mixed(precision)
    assert sum(r["losses"][-3:]) < 0.5 * sum(r["losses"][:3])


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_fp8_trains_on_capable_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    result = train_linear(16, mixed_precision="fp8")
    assert result["losses"][-1] < result["losses"][0]
