"""XLA (torch_xla's PJRT runtime) on XLA's CPU devices: launches and the Accelerator, for real.

Needs torch_xla 2.9 with torch 2.9, which the main environment does not have: run
``scripts/test_xla.sh`` (it builds ``.venv-xla`` and runs this module with ``PJRT_DEVICE=CPU``).
One device runs as one rank process; two devices run as two threads of one host process (the
only way XLA's CPU devices exist), each still its own rank to nbaccel. Real TPUs are not tested.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip(
    "torch_xla",
    reason="needs torch_xla 2.9 (with torch 2.9); scripts/test_xla.sh builds .venv-xla and runs this",
)

import nbaccel  # noqa: E402
from nbaccel.core.errors import RankFailedError  # noqa: E402

XLA_CPU = {"PJRT_DEVICE": "CPU"}


def train_with_accelerator(epochs: int = 3, mixed_precision: str = "no") -> dict:
    """A real loop: prepare, sharded shuffled loader, backward, step, reduce (Accelerate's API)."""
    from nbaccel import Accelerator

    acc = Accelerator(mixed_precision=mixed_precision)
    # Different initial weights per replica: prepare() must start every replica from rank 0's.
    torch.manual_seed(1234 + acc.process_index)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # built before prepare, as people do
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(256, 4, generator=g)
    y_all = x_all @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    dataset = torch.utils.data.TensorDataset(x_all, y_all)
    dl = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for _ in range(epochs):
        total = torch.zeros((), device=acc.device)
        for x, t in dl:
            loss = torch.nn.functional.mse_loss(model(x).float(), t)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.detach()
        losses.append(acc.reduce(total, "mean").item() / len(dl))
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return {
        "rank": acc.process_index,
        "world": acc.num_processes,
        "type": acc.distributed_type.value,
        "main": acc.is_main_process,
        "device": str(acc.device),
        "batches": len(dl),
        "losses": losses,
        "weights": flat.cpu(),
        "gathered": acc.gather(flat[None]).cpu(),  # every replica's weights, one row each
    }


def collectives(path: str) -> dict:
    """Accelerate's collectives and process control on XLA devices; rank 0 saves a tensor."""
    from nbaccel import Accelerator

    acc = Accelerator()
    r = acc.process_index
    x = torch.tensor([float(r), 10.0 + r]).to(acc.device)
    out = {
        "gather": acc.gather(x).cpu().tolist(),
        "sum": acc.reduce(x, "sum").cpu().tolist(),
        "max": acc.reduce(x, "max").cpu().tolist(),
        "broadcast": acc.broadcast(torch.tensor([r + 5.0]).to(acc.device), 1).cpu().tolist(),
        "objects": acc.gather_for_metrics([f"rank{r}"], use_gather_object=True),
    }
    acc.wait_for_everyone()
    acc.save({"x": x}, path)  # on the main process only, tensors moved to the CPU first
    return out


def train_with_torch_xla(epochs: int = 2) -> dict:
    """The same kind of loop written with torch_xla's own API (MpDeviceLoader, optimizer_step)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    device, rank = torch_xla.device(), xr.global_ordinal()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = model.to(device)
    xm.broadcast_master_param(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x_all = torch.randn(640, 8, generator=g)
    dataset = torch.utils.data.TensorDataset(x_all, x_all.sum(1, keepdim=True))
    dl = torch.utils.data.DataLoader(dataset, batch_size=32)
    losses = []
    for _ in range(epochs):
        for x, t in pl.MpDeviceLoader(dl, device):
            loss = torch.nn.functional.mse_loss(model(x), t)
            opt.zero_grad()
            loss.backward()
            xm.optimizer_step(opt)
            losses.append(loss)
    torch_xla.sync()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    return {
        "rank": rank,
        "world": xr.world_size(),
        "losses": [v.item() for v in losses],
        "weights": weights,
    }


def fail_on_rank_one() -> int:
    import torch_xla.runtime as xr

    if xr.global_ordinal() == 1 or xr.world_size() == 1:
        raise ValueError(f"bad batch on device {xr.global_ordinal()}")
    return xr.global_ordinal()


@pytest.mark.slow
def test_one_device_accelerator_trains_and_returns_to_the_kernel():
    out = nbaccel.notebook_launcher(train_with_accelerator, num_processes=1, env=XLA_CPU)
    assert (out["rank"], out["world"], out["type"], out["main"]) == (0, 1, "XLA", True)
    assert out["device"].startswith("xla")
    assert out["batches"] == 16
    assert out["losses"][-1] < out["losses"][0] / 4, out["losses"]


@pytest.mark.slow
def test_one_device_bf16_autocasts_and_trains():
    out = nbaccel.notebook_launcher(
        train_with_accelerator, kwargs={"mixed_precision": "bf16"}, num_processes=1, env=XLA_CPU
    )
    plain = nbaccel.notebook_launcher(train_with_accelerator, num_processes=1, env=XLA_CPU)
    assert out["losses"][-1] < out["losses"][0] / 4, out["losses"]
    assert out["losses"] != plain["losses"]  # bf16 matmuls: close, but not bit-equal


@pytest.mark.slow
def test_two_cpu_devices_accelerator_keeps_replicas_equal():
    outs = nbaccel.notebook_launcher(
        train_with_accelerator, num_processes=2, env=XLA_CPU, return_all=True
    )
    assert [(o["rank"], o["world"], o["type"], o["main"]) for o in outs] == [
        (0, 2, "XLA", True),
        (1, 2, "XLA", False),
    ]
    assert [o["device"] for o in outs] == ["xla:0", "xla:1"]
    assert [o["batches"] for o in outs] == [8, 8]  # each device reads half the data
    # Gradients were averaged at every step from equal starts: the replicas are the same model.
    assert torch.equal(outs[0]["weights"], outs[1]["weights"])
    assert outs[0]["losses"] == outs[1]["losses"]  # reduce(): the same mean on both
    assert torch.equal(outs[0]["gathered"], torch.stack([o["weights"] for o in outs]))
    assert outs[0]["losses"][-1] < outs[0]["losses"][0] / 4, outs[0]["losses"]


@pytest.mark.slow
def test_collectives_and_save_on_two_cpu_devices(tmp_path):
    path = tmp_path / "x.pt"
    outs = nbaccel.notebook_launcher(
        collectives, args=(str(path),), num_processes=2, env=XLA_CPU, return_all=True
    )
    for out in outs:
        assert out == {
            "gather": [0.0, 10.0, 1.0, 11.0],
            "sum": [1.0, 21.0],
            "max": [1.0, 11.0],
            "broadcast": [6.0],  # rank 1's value
            "objects": ["rank0", "rank1"],
        }
    saved = torch.load(path)
    assert saved["x"].device.type == "cpu" and saved["x"].tolist() == [0.0, 10.0]


@pytest.mark.slow
def test_two_cpu_devices_torch_xla_loop_under_the_launcher():
    outs = nbaccel.notebook_launcher(
        train_with_torch_xla, num_processes=2, env=XLA_CPU, return_all=True
    )
    assert [(o["rank"], o["world"]) for o in outs] == [(0, 2), (1, 2)]
    assert torch.equal(outs[0]["weights"], outs[1]["weights"])
    for o in outs:
        assert o["losses"][-1] < o["losses"][0] / 10, o["losses"]


@pytest.mark.slow
def test_a_failing_device_thread_is_reported_as_its_rank():
    with pytest.raises(RankFailedError) as info:
        nbaccel.notebook_launcher(fail_on_rank_one, num_processes=2, env=XLA_CPU)
    message = str(info.value)
    assert "rank 1" in message and "bad batch on device 1" in message, message


@pytest.mark.slow
def test_a_failing_single_device_rank_shows_only_the_users_frames():
    with pytest.raises(RankFailedError) as info:
        nbaccel.notebook_launcher(fail_on_rank_one, num_processes=1, env=XLA_CPU)
    assert "bad batch on device 0" in str(info.value)
    assert "_start_then_call" not in str(info.value)  # the runtime's start-up wrapper is hidden


@pytest.mark.slow
def test_notebook_cell_gets_the_result_and_per_rank_output():
    from tests.kernel_helpers import KernelSession

    code = textwrap.dedent(
        """
        import nbaccel, torch

        def train():
            import torch_xla, torch_xla.runtime as xr
            import torch_xla.core.xla_model as xm
            rank = xr.global_ordinal()
            print(f"device thread {rank} of {xr.world_size()}")
            total = xm.all_reduce(xm.REDUCE_SUM, torch.full((2,), rank + 1.0).to(torch_xla.device()))
            torch_xla.sync()
            return total.cpu()

        result = nbaccel.notebook_launcher(train, num_processes=2, progress="text")
        print("kernel got", result.tolist())
        """
    )
    with KernelSession(env=XLA_CPU) as kernel:
        cell = kernel.execute(code, timeout=240)
    assert cell.error is None, cell.error_text
    assert "[rank0] device thread 0 of 2" in cell.stdout, cell.stdout
    assert "[rank1] device thread 1 of 2" in cell.stdout, cell.stdout
    assert "kernel got [3.0, 3.0]" in cell.stdout, cell.stdout
