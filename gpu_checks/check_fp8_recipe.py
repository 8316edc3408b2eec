"""torchao's FP8 recipe applied on a GPU (compute capability 8.9+, torchao installed):

    .venv/bin/python gpu_checks/check_fp8_recipe.py

On CPU, tests/test_fp8_recipes.py checks the handlers against Accelerate's and the refusals. Here:
``Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=..., module_filter_func=...)])``
converts exactly the Linear layers the filter picks to torchao's ``Float8Linear`` with the
recipe's config (not nbaccel's defaults), trains (the loss falls), and without a filter the
default (both dimensions divisible by 16) converts the others. Also big-model dispatch over
GPU 0, the CPU and the disk gives the CPU model's outputs.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import nbaccel  # noqa: E402
from nbaccel.utils import AORecipeKwargs  # noqa: E402


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 16),
    )


def check_recipe() -> None:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(pad_inner_dim=True, enable_fsdp_float8_all_gather=False)
    only_middle = AORecipeKwargs(config=config, module_filter_func=lambda m, fqn: fqn == "2")
    acc = nbaccel.Accelerator(mixed_precision="fp8", kwargs_handlers=[only_middle])
    assert acc.ao_recipe_handler is only_middle and acc.has_fp8_handler
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = acc.prepare(net, opt)
    inner = acc.unwrap_model(net)
    converted = [n for n, m in inner.named_modules() if isinstance(m, Float8Linear)]
    assert converted == ["2"], converted
    assert inner[2].config.pad_inner_dim is True, inner[2].config
    x, y = torch.randn(64, 64, device=acc.device), torch.randn(64, 16, device=acc.device)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(net(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    default = nbaccel.Accelerator(mixed_precision="fp8").prepare(model())
    converted = [n for n, m in default.named_modules() if isinstance(m, Float8Linear)]
    assert converted == ["0", "2", "4"], converted
    print("fp8 recipe: ok", losses[0], "->", losses[-1])


def check_dispatch() -> None:
    reference = model().eval()
    x = torch.randn(8, 64)
    expected = reference(x)
    with tempfile.TemporaryDirectory() as folder:
        dispatched = nbaccel.dispatch_model(
            model().eval(), {"0": 0, "1": 0, "2": "cpu", "3": 0, "4": "disk"}, offload_dir=folder
        )
        out = dispatched(x.cuda())
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    print("dispatch over cuda:0, cpu, disk: ok")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: nothing to check here")
    check_dispatch()
    if torch.cuda.get_device_capability() >= (8, 9):
        check_recipe()
    else:
        print(
            "fp8 recipe: skipped, compute capability", torch.cuda.get_device_capability(), "< 8.9"
        )
