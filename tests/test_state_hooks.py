"""save_state/load_state pre-hooks keep Accelerate's contract: hooks get the user's modules (not
DDP wrappers), the state dicts and the folder; what a save hook writes there is part of the
checkpoint, a state it pops is not written, a model a load hook pops is not loaded, and the
prepared models stay as they were. The same hook code runs under ``accelerate.Accelerator``
side by side, and a diffusers-style loop whose hooks save its UNet and EMA resumes bit for bit."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import nbaccel


def _fill(module: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


def _values(module: torch.nn.Module) -> list[float]:
    return sorted({v for p in module.parameters() for v in p.detach().flatten().tolist()})


def contract(lib: str, folder: str) -> dict:
    """Two plain modules; the hooks save and load the second one themselves."""
    acc = importlib.import_module(lib).Accelerator(cpu=True)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    _fill(a, 1.0)
    _fill(b, 2.0)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    acc.prepare(a, b, opt)
    seen: dict = {}

    def save_hook(models, weights, output_dir):
        seen["save_models"] = [m is mine for m, mine in zip(models, (a, b), strict=True)]
        seen["weights"] = [sorted(w) for w in weights]
        seen["save_folder_exists"] = os.path.isdir(output_dir)
        if acc.is_main_process:
            torch.save(models[1].state_dict(), os.path.join(output_dir, "b_by_hook.pt"))
            os.makedirs(os.path.join(output_dir, "notes"))
            with open(os.path.join(output_dir, "notes", "a.txt"), "w") as f:
                f.write("kept")
        weights.pop()  # b is saved by this hook: no model file for it

    def load_hook(models, input_dir):
        seen["load_models"] = [m is mine for m, mine in zip(models, (a, b), strict=True)]
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "b_by_hook.pt")))

    handles = [acc.register_save_state_pre_hook(save_hook)]
    handles.append(acc.register_load_state_pre_hook(load_hook))
    acc.save_state(folder)
    acc.wait_for_everyone()
    seen["files"] = sorted(os.listdir(folder))
    seen["notes"] = sorted(os.listdir(os.path.join(folder, "notes")))
    _fill(a, 9.0)
    _fill(b, 9.0)
    acc.load_state(folder)
    seen["loaded"] = (_values(a), _values(b))  # a by the library, b by the hook
    for handle in handles:
        handle.remove()
    # The load hook's pop left the prepared models as they were: both are saved again.
    again = os.path.join(folder, "again")
    acc.save_state(again)
    acc.wait_for_everyone()
    seen["files_again"] = sorted(os.listdir(again))
    return seen


def _model_files(files: list[str]) -> list[str]:
    return [f for f in files if f.startswith("model")]


def _check_contract(seen: dict, ranks: int) -> None:
    assert seen["save_models"] == [True, True]  # the user's modules, not DDP wrappers
    assert seen["load_models"] == [True, True]
    assert seen["weights"] == [["bias", "weight"]] * 2  # no "module." prefix
    assert seen["save_folder_exists"]
    # What the hook wrote is in the checkpoint; the state it popped is not.
    assert len(_model_files(seen["files"])) == 1
    assert {"b_by_hook.pt", "notes"} <= set(seen["files"])
    assert seen["notes"] == ["a.txt"]
    assert seen["loaded"] == ([1.0], [2.0])
    assert len(_model_files(seen["files_again"])) == 2
    assert sum(f.startswith("random_states") for f in seen["files"]) == ranks


def test_hooks_keep_accelerates_contract_in_one_process(tmp_path):
    """The kernel case (one process): pops, the hook's files, a compiled model, random numbers
    a hook draws, and a failing hook."""
    _check_contract(contract("nbaccel", str(tmp_path / "ckpt")), ranks=1)
    acc = nbaccel.Accelerator(cpu=True, dynamo_backend="eager")
    plain = torch.nn.Linear(2, 1)
    model = acc.prepare(plain)
    assert model is not plain  # torch.compile's wrapper; the hooks get the module itself
    got = []

    def write_then_fail(models, weights, output_dir):
        open(os.path.join(output_dir, "half.txt"), "w").close()
        raise RuntimeError("disk quota")

    def keep(models, weights, output_dir):
        got.append(models[0] is plain)
        open(os.path.join(output_dir, "kept.txt"), "w").close()
        torch.randn(10)  # as diffusers' EMAModel.save_pretrained draws, building a model

    handle = acc.register_save_state_pre_hook(keep)
    torch.manual_seed(5)
    acc.save_state(tmp_path / "two")
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))  # the run goes on from the states saved
    assert got == [True]
    handle.remove()
    acc.register_save_state_pre_hook(write_then_fail)
    with pytest.raises(RuntimeError, match="disk quota"):
        acc.save_state(tmp_path / "two")
    # The failed save left the previous checkpoint whole and no staging folder.
    assert "kept.txt" in os.listdir(tmp_path / "two")
    assert "half.txt" not in os.listdir(tmp_path / "two")
    assert not (tmp_path / ".two.partial").exists()


@pytest.mark.slow  # real 2-rank launches
@pytest.mark.parametrize("lib", ["nbaccel", "accelerate"])
def test_hooks_see_and_do_what_they_do_under_accelerate(lib, tmp_path):
    pytest.importorskip(lib)
    outs = nbaccel.notebook_launcher(
        contract,
        args=(lib, str(tmp_path / "ckpt")),
        num_processes=2,
        progress=False,
        return_all=True,
    )
    for seen in outs:
        _check_contract(seen, ranks=2)


def diffusion(folder: str, total: int, save_at: tuple[int, ...] = (), resume: bool = False):
    """diffusers' unconditional training example in small: a UNet from a config, an EMA copy,
    hooks that save both with ``save_pretrained`` and pop them from the lists."""
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.training_utils import EMAModel
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator()
    unet = UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(4, 8),
        norm_num_groups=2,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    ema = EMAModel(unet.parameters(), decay=0.9, model_cls=UNet2DModel, model_config=unet.config)

    def save_model_hook(models, weights, output_dir):
        if acc.is_main_process:
            ema.save_pretrained(os.path.join(output_dir, "unet_ema"))
            for model in models:
                model.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()

    def load_model_hook(models, input_dir):
        saved_ema = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
        ema.load_state_dict(saved_ema.state_dict())
        ema.to(acc.device)
        while models:
            model = models.pop()
            saved = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**saved.config)
            model.load_state_dict(saved.state_dict())

    acc.register_save_state_pre_hook(save_model_hook)
    acc.register_load_state_pre_hook(load_model_hook)
    images = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(images), batch_size=2, shuffle=True)  # 4 steps an epoch
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-2)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    unet, optimizer, loader = acc.prepare(unet, optimizer, loader)
    ema.to(acc.device)
    step, losses = 0, []
    if resume:
        acc.load_state(folder)
        step = max(save_at)
    while step < total:
        for (clean,) in loader:
            noise = torch.randn_like(clean)
            timesteps = torch.randint(0, 100, (clean.shape[0],))
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            loss = torch.nn.functional.mse_loss(unet(noisy, timesteps).sample, noise)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            ema.step(unet.parameters())
            losses.append(loss.item())
            step += 1
            if step in save_at and not resume:
                acc.save_state(folder)
                if step == max(save_at):
                    return losses, sorted(os.listdir(folder))
            if step == total:
                break
    weights = {k: v.clone() for k, v in acc.unwrap_model(unet).state_dict().items()}
    return losses, weights, [p.clone() for p in ema.shadow_params], ema.optimization_step


def uninterrupted_then_stopped(folder: str) -> tuple:
    """The uninterrupted run, then one that checkpoints at steps 2 and 3 and stops (one launch:
    diffusers takes seconds to import in every rank)."""
    return diffusion(folder, 6), diffusion(folder, 6, (2, 3))


@pytest.mark.slow  # two 2-rank launches
def test_a_diffusers_loop_saving_through_hooks_resumes_bit_for_bit(tmp_path):
    pytest.importorskip("diffusers")
    folder = str(tmp_path / "checkpoint")
    run = nbaccel.notebook_launcher
    outs = run(
        uninterrupted_then_stopped, args=(folder,), num_processes=2, progress=False, return_all=True
    )
    full, first = [out[0] for out in outs], [out[1] for out in outs]
    files = first[0][1]
    # The hooks' folders are in the checkpoint (the second save replaced the first); the UNet
    # they saved has no weights file of its own in the folder.
    assert {"unet", "unet_ema", "optimizer.bin", "random_states_1.pkl"} <= set(files)
    assert not [f for f in files if f.startswith(("model", "pytorch_model"))]
    assert sorted(os.listdir(os.path.join(folder, "unet"))) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]
    resumed = run(
        diffusion, args=(folder, 6, (2, 3), True), num_processes=2, progress=False, return_all=True
    )
    for rank in range(2):
        assert first[rank][0] + resumed[rank][0] == full[rank][0], rank  # the losses, exactly
    _, weights, shadow, ema_steps = full[0]
    assert resumed[0][3] == ema_steps == 6
    for key, value in weights.items():
        assert torch.equal(resumed[0][1][key], value), key
    for mine, theirs in zip(resumed[0][2], shadow, strict=True):
        assert torch.equal(mine, theirs)
