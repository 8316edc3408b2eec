"""DeepSpeed ZeRO-3 offload to NVMe (a folder on disk) on 2 CPU ranks trains to the losses of
ZeRO-3 offload to the CPU; what it needs is refused before any engine starts, naming the missing
piece: ZeRO below stage 3, no folder, a folder that cannot be written (a read-only tmpfs), and
libaio/DeepSpeed's async_io op (`NBACCEL_NVME_DEPS=1 bash scripts/test.sh` installs libaio-dev and
builds the op)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import nbaccel  # noqa: E402
from nbaccel import DeepSpeedPlugin  # noqa: E402
from tests.disk_helpers import small_tmpfs  # noqa: E402

TOL = 1e-6


def test_nvme_offload_below_zero_3_or_without_a_writable_folder_is_refused_first(tmp_path):
    with pytest.raises(
        ValueError, match=r'offload_optimizer to "nvme" needs ZeRO stage 3 \(zero_stage=3\), not 2'
    ):
        nbaccel.Accelerator(
            cpu=True,
            deepspeed_plugin=DeepSpeedPlugin(
                zero_stage=2,
                offload_optimizer_device="nvme",
                offload_optimizer_nvme_path=str(tmp_path),
            ),
        )
    with pytest.raises(
        ValueError, match=r'offload_param to "nvme" needs a folder.*offload_param_nvme_path='
    ):
        nbaccel.Accelerator(
            cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, offload_param_device="nvme")
        )
    with small_tmpfs(tmp_path / "ro", "1m") as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        plugin = DeepSpeedPlugin(
            zero_stage=3, offload_param_device="nvme", offload_param_nvme_path=str(ro / "swap")
        )
        with pytest.raises(
            ValueError, match=r"offload_param_nvme_path=.*/ro/swap' cannot be written"
        ):
            nbaccel.Accelerator(cpu=True, deepspeed_plugin=plugin)
        assert not (ro / "swap").exists()


def aio_op_built() -> bool:
    """Whether DeepSpeed's async_io op is in torch's extension cache (building it takes
    minutes: scripts/test.sh does it once)."""
    from torch.utils.cpp_extension import _get_build_directory

    return any(Path(_get_build_directory("async_io", verbose=False)).glob("async_io*.so"))


def train(device: str, folder: str) -> list[float]:
    """In a rank: a few ZeRO-3 AdamW steps with parameters and optimizer state offloaded to
    ``device`` ("cpu", or "nvme": files under ``folder``)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, DeepSpeedPlugin

    paths = {}
    if device == "nvme":
        paths = {"offload_param_nvme_path": folder, "offload_optimizer_nvme_path": folder}
    plugin = DeepSpeedPlugin(
        zero_stage=3, offload_param_device=device, offload_optimizer_device=device, **paths
    )
    acc = Accelerator(deepspeed_plugin=plugin)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for xb, yb in dl:
        loss = F.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    acc.wait_for_everyone()
    return losses


@pytest.mark.slow
def test_zero3_nvme_offload_trains_to_the_losses_of_cpu_offload(tmp_path):
    from nbaccel.training.nvme_offload import aio_op_problem

    if not os.environ.get("NBACCEL_NVME_DEPS") or not aio_op_built():
        pytest.skip(
            "DeepSpeed's async_io op is built only on request (minutes of compiling per "
            "virtual environment): NBACCEL_NVME_DEPS=1 bash scripts/test.sh builds it and runs this"
        )
    problem = aio_op_problem()
    assert problem is None, problem
    swap = tmp_path / "nvme"

    def both() -> dict:
        return {d: train(d, str(swap)) for d in ("cpu", "nvme")}

    r = nbaccel.notebook_launcher(both, num_processes=2, progress=False)
    assert len(r["nvme"]) == 4  # 64 samples, 2 ranks x batch 8
    assert r["nvme"] == pytest.approx(r["cpu"], abs=TOL)
    assert any(swap.rglob("*.swp")) or any(swap.rglob("*")), "nothing was swapped to the folder"
