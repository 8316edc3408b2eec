"""Accelerate's ``is_*_available`` checks: can this optional package, device or precision be
used here? Packages are found without importing them (``core.capabilities.package_available``),
and this module imports torch only when a device check runs, so ``nbaccel.utils`` stays light.

>>> is_pandas_available() in (True, False)
True
>>> is_fp8_available()           # no CUDA GPU of compute capability 8.9+ here
False
"""

from __future__ import annotations

import os
from collections.abc import Callable

from nbaccel.core import capabilities

# Accelerate's function name -> the packages any of which makes it True.
PACKAGES = {
    "is_aim_available": ("aim",),
    "is_bnb_available": ("bitsandbytes",),
    "is_boto3_available": ("boto3",),
    "is_clearml_available": ("clearml",),
    "is_comet_ml_available": ("comet_ml",),
    "is_datasets_available": ("datasets",),
    "is_deepspeed_available": ("deepspeed",),
    "is_dvclive_available": ("dvclive",),
    "is_matplotlib_available": ("matplotlib",),
    "is_mlflow_available": ("mlflow",),
    "is_pandas_available": ("pandas",),
    "is_pytest_available": ("pytest",),
    "is_schedulefree_available": ("schedulefree",),
    "is_peft_available": ("peft",),
    "is_swanlab_available": ("swanlab",),
    "is_tensorboard_available": ("tensorboard", "tensorboardX"),
    "is_timm_available": ("timm",),
    "is_torchao_available": ("torchao",),
    "is_torchdata_available": ("torchdata",),
    "is_torchvision_available": ("torchvision",),
    "is_trackio_available": ("trackio",),
    "is_transformers_available": ("transformers",),
    "is_triton_available": ("triton",),
    "is_wandb_available": ("wandb",),
}


def _package_check(name: str, packages: tuple[str, ...]) -> Callable[[], bool]:
    def check() -> bool:
        return any(capabilities.package_available(p) for p in packages)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"Whether {' or '.join(packages)} can be imported here."
    return check


globals().update({name: _package_check(name, pkgs) for name, pkgs in PACKAGES.items()})


def is_rich_available() -> bool:
    """Whether rich is installed and ``ACCELERATE_ENABLE_RICH`` is set: Accelerate uses rich's
    tracebacks and logging only on request, so an installed rich alone says False.

    >>> import os
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"ACCELERATE_ENABLE_RICH": "0"}):
    ...     is_rich_available()
    False
    """
    flag = os.environ.get("ACCELERATE_ENABLE_RICH", "").strip().lower()
    return capabilities.package_available("rich") and flag in ("1", "t", "true", "y", "yes", "on")


def is_cuda_available() -> bool:
    """Whether a CUDA device is visible (``torch.cuda.is_available()``)."""
    import torch

    return torch.cuda.is_available()


def is_mps_available() -> bool:
    """Whether Apple's Metal (MPS) backend can be used."""
    import torch

    return torch.backends.mps.is_available()


def is_xpu_available() -> bool:
    """Whether an Intel XPU is visible."""
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_npu_available() -> bool:
    """Whether an Ascend NPU is usable (the ``torch_npu`` package and a device)."""
    if not capabilities.package_available("torch_npu"):
        return False
    import torch
    import torch_npu  # noqa: F401 - registers torch.npu

    return torch.npu.is_available()


def is_hpu_available() -> bool:
    """Whether an Intel Gaudi (HPU) is usable: the ``habana_frameworks`` package and a device."""
    if not capabilities.package_available("habana_frameworks"):
        return False
    import habana_frameworks.torch.hpu as hpu

    return bool(hpu.is_available())


def is_rocm_available() -> bool:
    """Whether torch is a ROCm (AMD GPU) build."""
    import torch

    return torch.version.hip is not None


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed (with ``check_is_tpu``/``check_is_gpu``: and its
    ``PJRT_DEVICE`` names that kind of device)."""
    if not capabilities.package_available("torch_xla"):
        return False
    device = os.environ.get("PJRT_DEVICE", "").upper()
    if check_is_tpu:
        return device == "TPU"
    if check_is_gpu:
        return device in ("GPU", "CUDA")
    return True


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 can run here: on CUDA where the GPU supports it; on CPU always; on a TPU
    unless ``ignore_tpu``."""
    import torch

    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Whether fp16 mixed precision can run here (nbaccel runs it on CPU too, with a scaler)."""
    return capabilities.precision_verdict("fp16", _gpus(), False).allowed


def is_fp8_available() -> bool:
    """Whether fp8 (torchao's float8 training) can run here: a CUDA GPU of compute capability
    8.9+ and torchao."""
    verdict = capabilities.precision_verdict("fp8", _gpus(), capabilities.torchao_available())
    return verdict.allowed


def _gpus() -> tuple:
    from nbaccel.core import hardware

    return tuple(hardware.detect().gpus)


NAMES = (
    *PACKAGES,
    "is_rich_available",
    "is_cuda_available",
    "is_mps_available",
    "is_xpu_available",
    "is_npu_available",
    "is_hpu_available",
    "is_rocm_available",
    "is_torch_xla_available",
    "is_bf16_available",
    "is_fp16_available",
    "is_fp8_available",
)
