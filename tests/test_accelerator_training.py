"""The Accelerator trains the same model to the same weights in the kernel, under
notebook_launcher and under torchrun; FSDP matches DDP; bf16/fp16 train on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbaccel
from tests.test_cli_support import run_torchrun

REPO = Path(__file__).resolve().parent.parent
STEPS = 10


def _dataset(n: int = 320) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def train_linear(
    batch_size: int,
    accumulation: int | None = None,
    strategy: str | None = None,
    mixed_precision: str | None = None,
) -> dict:
    """Train a tiny MLP for STEPS optimizer steps; return its full state dict and the losses."""
    from nbaccel import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator(
        gradient_accumulation_steps=accumulation,
        strategy=strategy,
        mixed_precision=mixed_precision,
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # A seeded generator makes the order the same on 1 and N processes; without one, set_seed
    # gives Accelerate's own run, whose shuffle depends on the number of processes.
    order = torch.Generator().manual_seed(0)
    dl = DataLoader(_dataset(), batch_size=batch_size, shuffle=True, generator=order)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses, micro = [], 0
    while micro < STEPS * acc.gradient_accumulation_steps:
        for x, y in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            micro += 1
            if micro == STEPS * acc.gradient_accumulation_steps:
                break
    state = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    return {
        "state": state,
        "losses": losses,
        "accumulation": acc.gradient_accumulation_steps,
        "distributed_type": acc.distributed_type.value,
        "world": acc.num_processes,
        "scale": acc.scaler.get_scale() if acc.scaler is not None else None,
        "growth_tracker": acc.scaler.state_dict().get("_growth_tracker") if acc.scaler else None,
    }


def _assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape, key
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.mark.slow
def test_ddp_matches_one_process_in_kernel_launcher_and_torchrun(tmp_path):
    kernel = train_linear(16)  # called directly: one process, no process group
    assert kernel["world"] == 1 and kernel["distributed_type"] == "NO"
    launched = nbaccel.notebook_launcher(train_linear, args=(8,), num_processes=2, progress=False)
    assert launched["world"] == 2 and launched["distributed_type"] == "MULTI_CPU"
    _assert_same(launched["state"], kernel["state"], atol=1e-6)

    out = tmp_path / "torchrun.pt"
    script = tmp_path / "train_script.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.test_accelerator_training import train_linear\n"
        "result = train_linear(8)\n"
        "import os\n"
        "if os.environ['RANK'] == '0':\n"
        f"    torch.save(result['state'], {str(out)!r})\n"
    )
    proc = run_torchrun(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same(torch.load(out, weights_only=True), kernel["state"], atol=1e-6)


def test_accumulation_from_launcher_config_matches_big_batch():
    kernel = train_linear(32)
    cfg = nbaccel.LaunchConfig(num_processes=2, gradient_accumulation_steps=2)
    # The accumulation comes from the launch config, not the code: it must reach Accelerator().
    launched = nbaccel.notebook_launcher(train_linear, args=(8,), config=cfg, progress=False)
    assert launched["accumulation"] == 2
    _assert_same(launched["state"], kernel["state"], atol=1e-6)


def test_fsdp_matches_ddp_and_returns_full_state_dicts():
    ddp = nbaccel.notebook_launcher(train_linear, args=(8,), num_processes=2, progress=False)
    ranks = nbaccel.notebook_launcher(
        train_linear, args=(8, None, "fsdp"), num_processes=2, progress=False, return_all=True
    )
    for fsdp in ranks:
        assert fsdp["distributed_type"] == "FSDP"
        # Full tensors on every rank, equal to DDP's within float32 reduction-order noise.
        _assert_same(fsdp["state"], ddp["state"], atol=1e-5)


def train_mixed(mixed_precision: str) -> dict:
    """Train in reduced precision; for fp16 also force one overflow to see a skipped step."""
    from nbaccel import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator(mixed_precision=mixed_precision)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    inside = set()  # what the layers compute in (autocast), seen by a hook on the last one
    model[2].register_forward_hook(lambda _m, _i, out: inside.add(str(out.dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    dl = DataLoader(_dataset(), batch_size=16, shuffle=True)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    losses, skipped, dtypes = [], [], set()
    for step, (x, y) in enumerate(dl):
        out = model(x)
        dtypes.add(out.dtype)
        loss = torch.nn.functional.mse_loss(out, y)
        overflow = mixed_precision == "fp16" and step == 3
        acc.backward(loss * float("inf") if overflow else loss)
        acc.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
        losses.append(loss.item())
    seen_in_training = sorted(inside)
    inside.clear()
    unwrapped = acc.unwrap_model(model)(x)  # keeps the autocast and float32 outputs
    unwrapped_inside = sorted(inside)
    inside.clear()
    bare = acc.unwrap_model(model, keep_fp32_wrapper=False)(x)
    return {
        "losses": losses,
        "skipped": skipped,
        "dtypes": sorted(str(d) for d in dtypes),
        "inside": seen_in_training,
        "unwrapped": [str(unwrapped.dtype), unwrapped_inside],
        "bare": [str(bare.dtype), sorted(inside)],
        "sched_steps": sched.last_epoch,
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
    }


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(precision):
    r = nbaccel.notebook_launcher(train_mixed, args=(precision,), num_processes=2, progress=False)
    expected = "torch.bfloat16" if precision == "bf16" else "torch.float16"
    # The layers compute in half precision; the model hands back float32, as in Accelerate.
    assert r["inside"] == [expected] and r["dtypes"] == ["torch.float32"]
    assert r["unwrapped"] == ["torch.float32", [expected]]
    assert r["bare"] == ["torch.float32", ["torch.float32"]]  # no autocast left
    first, last = sum(r["losses"][:3]) / 3, sum(r["losses"][-3:]) / 3
    assert last < 0.5 * first, r["losses"]
    steps = len(r["losses"])
    if precision == "fp16":
        skipped = r["skipped"]
        # The forced overflow is skipped; early steps may overflow too while the scaler
        # searches for its scale (65536 is too large for this loss in fp16), each halving it.
        assert skipped[3] and not all(skipped)
        assert r["scaler"]["scale"] == 2.0**16 / 2 ** sum(skipped)
        last_skip = max(i for i, s in enumerate(skipped) if s)
        assert r["scaler"]["_growth_tracker"] == steps - 1 - last_skip
        # The scheduler advances once per process per real step, never on a skipped one.
        assert r["sched_steps"] == 2 * (steps - sum(skipped))
    else:
        assert r["scaler"] is None and not any(r["skipped"])
        assert r["sched_steps"] == 2 * steps
