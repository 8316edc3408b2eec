"""GPU checks for the Accelerator, to run by hand on a CUDA machine (not collected by pytest).

    .venv/bin/python gpu_checks/check_cuda.py

Checks, in under 3 minutes: launching after this process initialised CUDA; in a real kernel, a
fork server forked from the kernel before CUDA (ranks use the GPU though the kernel initialised
CUDA afterwards) and a fresh-interpreter one where CUDA (or just ``torch.cuda.is_available()``)
came first; NCCL DDP (one GPU per rank) gives the same weights as one process
with the whole batch; bf16 and fp16 autocast train; fp8 through torchao trains where the GPU
(compute capability 8.9+) and torchao allow, and otherwise fails with the documented message.
Prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import nbaccel  # noqa: E402
from gpu_checks.check_fsdp_cuda import check_fsdp  # noqa: E402
from gpu_checks.check_pipeline_cuda import check_pipeline  # noqa: E402
from tests.test_accelerator_training import train_linear, train_mixed  # noqa: E402


def _cuda_rank_report() -> dict:
    import os

    import torch

    x = torch.ones(1, device=f"cuda:{int(os.environ['LOCAL_RANK'])}")
    return {"rank": int(os.environ["RANK"]), "sum": float(x.sum())}


def check_launch_after_cuda_init() -> str:
    """The launcher's promise: ranks start fine after the launching process touched CUDA."""
    torch.zeros(1, device="cuda")
    assert torch.cuda.is_initialized()
    n = min(torch.cuda.device_count(), 2)
    reports = nbaccel.notebook_launcher(
        _cuda_rank_report, num_processes=n, return_all=True, progress="text", timeout=120
    )
    assert [r["rank"] for r in reports] == list(range(n)) and all(r["sum"] == 1.0 for r in reports)
    return f"{n} rank(s) used CUDA after the parent initialised it (forkserver)"


MIRROR_CELL = """
def report():
    import os, torch
    x = torch.ones(1, device=f"cuda:{int(os.environ['LOCAL_RANK'])}")
    return float(x.sum())
torch.zeros(1, device="cuda")  # CUDA in the kernel, after (or before) import nbaccel
import nbaccel.forkserver.server as _fs
first = nbaccel.notebook_launcher(report, num_processes=1, timeout=120)
_fs.current_mirror().wait()  # the server has imported every package the kernel has
print(first, nbaccel.notebook_launcher(report, num_processes=1, timeout=120),
      sorted(n for n, a in _fs.current_mirror().answers.items() if a["cuda"]))
"""


def check_kernel_cuda_and_the_mirror() -> str:
    """Ranks use the GPU whatever the kernel did with CUDA before or after ``import nbaccel``,
    also once the fork server has mirrored the kernel's packages (none loads CUDA there)."""
    from tests.kernel_helpers import KernelSession

    for startup in (
        "import torch, nbaccel",
        "import torch\ntorch.zeros(1, device='cuda')\nimport nbaccel",
        # is_available() loads CUDA's driver without is_initialized() saying so
        "import torch\ntorch.cuda.is_available()\nimport nbaccel",
    ):
        with KernelSession(env={"NBACCEL_VIEW": "text"}, startup=startup) as kernel:
            cell = kernel.execute(MIRROR_CELL, timeout=300)
            assert cell.error is None, cell.error_text
            assert "1.0 1.0 []" in cell.stdout, cell.stdout
    return "ranks used CUDA in 3 kernels, before and after the mirror imported their packages"


def check_ddp_nccl() -> str:
    n = min(torch.cuda.device_count(), 2)
    reports = nbaccel.notebook_launcher(
        train_linear, args=(16 // n,), num_processes=n, return_all=True, progress="text"
    )
    single = train_linear(16)
    for r in reports:
        assert r["world"] == n
        for k, v in single["state"].items():
            torch.testing.assert_close(r["state"][k].cpu(), v.cpu(), atol=1e-5, rtol=0)
    kind = reports[0]["distributed_type"]
    return f"{n} rank(s), {kind}, weights equal to 1 process within 1e-5"


def check_autocast(precision: str) -> str:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        try:
            nbaccel.Accelerator(mixed_precision="bf16")
        except ValueError as exc:
            return f"refused as expected: {exc}"
        raise AssertionError("bf16 on a GPU without bf16 was not refused")
    r = train_mixed(precision)
    assert r["dtypes"] == [f"torch.{'bfloat16' if precision == 'bf16' else 'float16'}"], r
    first, last = sum(r["losses"][:3]), sum(r["losses"][-3:])
    assert last < 0.5 * first, r["losses"]
    return f"loss {first / 3:.3f} -> {last / 3:.3f}, skipped steps {sum(r['skipped'])}"


def check_fp8() -> str:
    capable = torch.cuda.get_device_capability() >= (8, 9)
    has_torchao = importlib.util.find_spec("torchao") is not None
    if not (capable and has_torchao):
        try:
            nbaccel.Accelerator(mixed_precision="fp8")
        except (ValueError, ImportError) as exc:
            return f"not available here, refused clearly: {exc}"
        raise AssertionError("fp8 was accepted without a capable GPU and torchao")
    acc = nbaccel.Accelerator(mixed_precision="fp8")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    converted = sorted({type(m).__name__ for m in acc.unwrap_model(model).modules()})
    assert any("Float8" in name for name in converted), converted
    x = torch.randn(256, 64, device=acc.device)
    target = x.flip(-1)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    return f"layers {converted}, loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device visible; nothing to check")
        return 1
    print(
        f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): "
        f"{torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability()}"
    )
    checks = [
        ("launch after cuda init", check_launch_after_cuda_init),
        ("kernel CUDA and the mirror", check_kernel_cuda_and_the_mirror),
        ("ddp/nccl", check_ddp_nccl),
        ("bf16", lambda: check_autocast("bf16")),
        ("fp16", lambda: check_autocast("fp16")),
        ("fp8", check_fp8),
        ("fsdp", check_fsdp),  # gpu_checks/check_fsdp_cuda.py: offload, bf16, rank-0 loading
        ("pipeline", check_pipeline),  # gpu_checks/check_pipeline_cuda.py: stages over NCCL
    ]
    failed = 0
    for name, check in checks:
        start = time.monotonic()
        try:
            detail = check()
            print(f"PASS {name:9s} ({time.monotonic() - start:.1f} s): {detail}")
        except Exception:
            failed += 1
            print(f"FAIL {name:9s} ({time.monotonic() - start:.1f} s)")
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
