"""FSDP2 configured by FullyShardedDataParallelPlugin on 2 CPU ranks (gloo): which modules each
wrap policy shards, CPU offload, rank-0 loading, full and sharded checkpoints that resume
bitwise (also for two models with their own optimizers), activation checkpointing, mixed
precision; under notebook_launcher, `nbaccel launch` and plain torchrun."""

from __future__ import annotations

import functools
import os
import textwrap
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.core.config import LaunchConfig
from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from tests.test_cli_support import run_torchrun

REPO = Path(__file__).resolve().parent.parent


class Block(torch.nn.Module):
    """A residual block with a non-persistent buffer (kept out of every state dict)."""

    calls = 0  # forward calls, to see activation checkpointing recompute

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.register_buffer("gain", torch.full((width,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1  # not type(self): fully_shard swaps in a subclass
        return x + self.b(torch.tanh(self.a(x))) * self.gain.to(x.dtype)


class Net(torch.nn.Sequential):
    _no_split_modules = ["Block"]  # as Hugging Face models declare their blocks

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(4, 8), Block(), Block(), torch.nn.Linear(8, 1))


def _batch(step: int = 0, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 4, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def _full(acc, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in acc.get_state_dict(model).items()}


def _units(model) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


# -- the plugin and the config, without launching -------------------------------------------


# -- on 2 ranks ------------------------------------------------------------------------------


def _build(plugin: Plugin, seed: int = 0, meta: bool = False):
    from nbaccel import Accelerator

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
    acc = Accelerator(fsdp_plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, step: int) -> float:
    x, y = _batch(step, acc.device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def wrapping_and_loading() -> dict:
    """Which modules each wrap policy made FSDP units; rank-0 loading and state syncing."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    transformer = {"auto_wrap_policy": "transformer_based_wrap"}
    policies = {
        "none": {},
        "transformer": {**transformer, "transformer_cls_names_to_wrap": ["Block"]},
        "no_split_modules": transformer,
        "size": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 100},
        "callable": {"auto_wrap_policy": lambda m: isinstance(m, torch.nn.Linear)},
        "fsdp1_partial": {
            "auto_wrap_policy": functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={Block}
            )
        },
        "checkpointed": {**transformer, "activation_checkpointing": True},
    }
    out: dict = {"units": {}}
    for name, kwargs in policies.items():
        _, model, _ = _build(Plugin(**kwargs))
        out["units"][name] = _units(model)
    # ignored_modules (a regex of module names): left whole, outside every shard.
    acc, model, opt = _build(Plugin(ignored_modules=r"3"))
    _step(acc, model, opt, 0)
    out["ignored"] = {n: type(p.data).__name__ for n, p in model.named_parameters()}

    # Offload, resharding and precision reach every unit.
    _, model, _ = _build(
        Plugin(
            **transformer,
            cpu_offload=True,
            reshard_after_forward=False,
            mixed_precision_policy="bf16",
        )
    )
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in units]
    out["unit_settings"] = sorted(
        {
            (
                type(g.offload_policy).__name__,
                g.post_forward_mesh_info is None,  # None: parameters stay gathered after forward
                str(g.mp_policy.param_dtype),
            )
            for g in groups
            if g is not None
        }
    )

    # Rank 0 loads, the others receive: rank 1 builds its model on the meta device.
    rank = int(os.environ["RANK"])
    loading = Plugin(**transformer, cpu_ram_efficient_loading=True)
    acc, model, opt = _build(loading, seed=0, meta=rank == 1)
    out["ram_efficient"] = _full(acc, model)
    out["ram_efficient_gain"] = [m.gain.cpu() for m in model.modules() if isinstance(m, Block)]
    out["ram_efficient_loss"] = [_step(acc, model, opt, s) for s in range(3)]
    # sync_module_states: every rank built different weights; rank 0's win.
    acc, model, _ = _build(Plugin(sync_module_states=True), seed=rank + 5)
    out["synced"] = _full(acc, model)
    return out


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(Net().state_dict())


@pytest.mark.slow
def test_wrap_policies_offload_and_rank0_loading_on_two_ranks():
    r0, r1 = nbaccel.notebook_launcher(
        wrapping_and_loading, num_processes=2, progress=False, return_all=True
    )
    units = r0["units"]
    assert units == r1["units"]
    assert units["none"] == [""]  # root only, as Accelerate's NO_WRAP
    assert units["transformer"] == ["", "1", "2"]
    assert units["no_split_modules"] == ["", "1", "2"]  # the model's _no_split_modules
    # Blocks have 144 parameters, their Linears 72, the outer Linears 40 and 9.
    assert units["size"] == ["", "1", "2"]
    assert units["callable"] == ["", "0", "1.a", "1.b", "2.a", "2.b", "3"]
    assert units["fsdp1_partial"] == ["", "1", "2"]
    assert units["checkpointed"] == ["", "1", "2"]  # the checkpoint wrappers are the units
    assert r0["ignored"]["3.weight"] == "Tensor" and r0["ignored"]["0.weight"] == "DTensor"
    # Every block unit offloads, computes in bf16 and keeps its parameters gathered after
    # forward as asked (reshard_after_forward=False).
    assert r0["unit_settings"] == [("CPUOffloadPolicy", True, "torch.bfloat16")]

    for r in (r0, r1):
        _same(r["ram_efficient"], _weights(0))  # rank 0's; rank 1 had none (meta)
        assert all(torch.equal(g, torch.full((8,), 0.5)) for g in r["ram_efficient_gain"])
        _same(r["synced"], _weights(5))  # rank 0 built with seed 5, rank 1 with seed 6
    assert r0["ram_efficient_loss"] == r1["ram_efficient_loss"]
    assert r0["ram_efficient_loss"][-1] < r0["ram_efficient_loss"][0]


def numerics() -> dict:
    """CPU offload against none; activation checkpointing against none; a bf16 policy."""
    from torch.distributed.tensor import DTensor

    blocks = {"auto_wrap_policy": "transformer_based_wrap"}
    out: dict = {}
    for offload in (False, True):
        acc, model, opt = _build(Plugin(**blocks, cpu_offload=offload))
        losses, devices = [], set()
        for s in range(5):
            losses.append(_step(acc, model, opt, s))
            devices |= {p.device.type for p in model.parameters()}
            # (AdamW keeps its 0-d step counters on the CPU whatever the device)
            devices |= {t.device.type for st in opt.state.values() for t in st.values() if t.dim()}
        out[f"offload_{offload}"] = {"losses": losses, "devices": sorted(devices)}
        out[f"offload_{offload}_state"] = _full(acc, model)

    for checkpointing in (False, True):
        acc, model, _ = _build(Plugin(**blocks, activation_checkpointing=checkpointing))
        Block.calls = 0
        x, y = _batch(0, acc.device)
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        out[f"ac_{checkpointing}_calls"] = Block.calls
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name.replace("_checkpoint_wrapped_module.", "")] = g.clone()
        out[f"ac_{checkpointing}_grads"] = grads

    acc, model, opt = _build(Plugin(**blocks, mixed_precision_policy={"param_dtype": "bf16"}))
    out["bf16_losses"] = [_step(acc, model, opt, s) for s in range(5)]
    # Between steps (after backward resharded them) the parameters the optimizer sees are fp32.
    out["bf16_master"] = sorted({str(p.dtype) for p in model.parameters()})
    out["bf16_output"] = str(model(_batch(0, acc.device)[0]).dtype)
    return out


@pytest.mark.slow
def test_offload_checkpointing_and_precision_numerics():
    r = nbaccel.notebook_launcher(numerics, num_processes=2, progress=False)
    # CPU offload: parameters and optimizer state stay on the CPU between steps, and training
    # follows the same losses as without (on a CPU device both are CPU; exact equality).
    assert r["offload_True"]["devices"] == ["cpu"]
    assert r["offload_True"]["losses"] == r["offload_False"]["losses"]
    _same(r["offload_True_state"], r["offload_False_state"])
    # Activation checkpointing recomputes each block's forward in backward (2 blocks: 2 calls
    # without, 4 with) and gives the same gradients; measured identical, asserted to 1e-7.
    assert (r["ac_False_calls"], r["ac_True_calls"]) == (2, 4)
    _same(r["ac_True_grads"], r["ac_False_grads"], atol=1e-7)
    # bf16 parameters in forward, fp32 parameters kept for the optimizer.
    assert r["bf16_output"] == "torch.bfloat16"
    assert r["bf16_master"] == ["torch.float32"]
    assert r["bf16_losses"][-1] < r["bf16_losses"][0]


def resume(kind: str, folder: str, steps: int = 3) -> dict:
    """Train, save_state, train on; then a fresh model resumes from the checkpoint."""
    blocks = {"auto_wrap_policy": "transformer_based_wrap", "state_dict_type": kind}
    acc, model, opt = _build(Plugin(**blocks))
    first = [_step(acc, model, opt, s) for s in range(steps)]
    saved = _full(acc, model)
    acc.save_state(folder)
    after = [_step(acc, model, opt, s) for s in range(steps, 2 * steps)]
    final = _full(acc, model)

    acc2, model2, opt2 = _build(Plugin(**blocks), seed=1)  # other weights, no optimizer state
    acc2.load_state(folder)
    loaded = _full(acc2, model2)
    resumed = [_step(acc2, model2, opt2, s) for s in range(steps, 2 * steps)]
    acc2.save_model(model2, Path(folder).parent / f"{kind}_weights")  # gathered, safetensors
    return {
        "first": first,
        "saved": saved,
        "after": after,
        "final": final,
        "loaded": loaded,
        "resumed": resumed,
        "resumed_final": _full(acc2, model2),
        "files": sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_ckpt")

    def both(root: str) -> dict:
        return {
            kind: resume(kind, f"{root}/{kind}")
            for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
        }

    return {
        "root": root,
        **nbaccel.notebook_launcher(both, args=(str(root),), num_processes=2, progress=False),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_state_dicts_round_trip_and_resume_bitwise(checkpoints, kind):
    r = checkpoints[kind]
    _same(r["loaded"], r["saved"])  # bitwise
    assert r["resumed"] == r["after"]
    _same(r["resumed_final"], r["final"])
    if kind == "FULL_STATE_DICT":
        assert "model.safetensors" in r["files"] and "optimizer.bin" in r["files"]
    else:  # one torch.distributed.checkpoint folder per object, a shard file per rank
        for name in ("model_0", "optimizer_0"):
            assert {f"{name}/.metadata", f"{name}/__0_0.distcp", f"{name}/__1_0.distcp"} <= set(
                r["files"]
            )


@pytest.mark.slow
def test_sharded_checkpoint_from_two_ranks_loads_in_one_process(checkpoints):
    r = checkpoints["SHARDED_STATE_DICT"]
    from nbaccel.utils import load_checkpoint_in_model

    # The full weights save_model wrote from 2 ranks after resuming from the sharded checkpoint
    plain = Net()
    load_checkpoint_in_model(plain, checkpoints["root"] / "SHARDED_STATE_DICT_weights", strict=True)
    _same(dict(plain.state_dict()), r["resumed_final"])
    # ...and the sharded folder itself, read by one process (no process group at all).
    acc, model, _ = _build(Plugin(state_dict_type="SHARDED_STATE_DICT"), seed=3)
    assert acc.num_processes == 1
    acc.load_state(checkpoints["root"] / "SHARDED_STATE_DICT")
    _same(_full(acc, model), r["saved"])


def gan(folder: str, kind: str) -> dict:
    """Generator and discriminator, each with its own optimizer, checkpointed and resumed."""
    from nbaccel import Accelerator

    def build(seed: int):
        torch.manual_seed(seed)
        acc = Accelerator(fsdp_plugin=Plugin(state_dict_type=kind))
        g, d = (
            torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Linear(8, 4)),
            torch.nn.Linear(4, 1),
        )
        og = torch.optim.Adam(g.parameters(), lr=1e-2)
        od = torch.optim.SGD(d.parameters(), lr=1e-2, momentum=0.9)
        g, od, d, og = acc.prepare(g, od, d, og)  # mixed order: pairing is by parameters
        return acc, g, d, og, od

    def step(acc, g, d, og, od, s):
        z = torch.randn(8, 2, generator=torch.Generator().manual_seed(s))
        real = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 + s))
        d_loss = d(g(z).detach()).mean() - d(real).mean()
        acc.backward(d_loss)
        od.step()
        od.zero_grad()
        g_loss = -d(g(z)).mean()
        acc.backward(g_loss)
        og.step()
        og.zero_grad()
        od.zero_grad()
        return d_loss.item(), g_loss.item()

    acc, *objs = build(0)
    for s in range(3):
        step(acc, *objs, s)
    acc.save_state(folder)
    after = [step(acc, *objs, s) for s in range(3, 6)]
    acc2, *objs2 = build(7)
    acc2.load_state(folder)
    resumed = [step(acc2, *objs2, s) for s in range(3, 6)]
    return {
        "after": after,
        "resumed": resumed,
        "final": [_full(acc, objs[0]), _full(acc, objs[1])],
        "resumed_final": [_full(acc2, objs2[0]), _full(acc2, objs2[1])],
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_two_models_each_optimizer_resumes_with_its_own_model(tmp_path, kind):
    r = nbaccel.notebook_launcher(
        gan, args=(str(tmp_path / "ckpt"), kind), num_processes=2, progress=False
    )
    assert r["resumed"] == r["after"]
    for resumed, final in zip(r["resumed_final"], r["final"]):
        _same(resumed, final)


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {repo!r})
    from tests.test_fsdp_training import Plugin, _units, _build, _step, resume

    out = resume(None, sys.argv[1])
    _, model, _ = _build(Plugin())  # every field from the launch's NBACCEL_FSDP_* settings
    out = {{"units": _units(model), "files": out["files"],
           "bitwise": out["resumed"] == out["after"]}}
    with open(os.path.join(sys.argv[1], "..", f"rank{{os.environ['RANK']}}.json"), "w") as f:
        json.dump(out, f)
    """
)


@pytest.mark.slow
def test_settings_from_nbaccel_launch_config_and_plain_torchrun(tmp_path):
    import json

    from tests.test_cli_support import run_cli

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    config = tmp_path / "cfg.yaml"
    LaunchConfig(
        num_processes=2,
        strategy="fsdp",
        fsdp_auto_wrap_policy="transformer_based_wrap",
        fsdp_transformer_cls_names_to_wrap=["Block"],
        fsdp_state_dict_type="SHARDED_STATE_DICT",
    ).save(config)
    (tmp_path / "cli").mkdir()
    result = run_cli(
        "launch",
        "--config_file",
        str(config),
        str(script),
        str(tmp_path / "cli" / "ckpt"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads((tmp_path / "cli" / "rank0.json").read_text())
    assert out["units"] == ["", "1", "2"] and out["bitwise"]
    assert "model_0/__1_0.distcp" in out["files"]

    # Plain torchrun: no nbaccel settings at all, so the defaults apply (root only, full files).
    (tmp_path / "torchrun").mkdir()
    proc = run_torchrun(script, str(tmp_path / "torchrun" / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "torchrun" / "rank1.json").read_text())
    assert out["units"] == [""] and out["bitwise"] and "model.safetensors" in out["files"]


def _plugin_seen_by_the_rank() -> tuple[str, bool, str, str]:
    acc = nbaccel.Accelerator()
    plugin = acc.fsdp_plugin
    return (
        type(plugin).__name__,
        acc.state.fsdp_plugin is plugin,
        acc.strategy,
        plugin.state_dict_type,
    )


@pytest.mark.slow
def test_a_plugin_from_the_launch_config_is_readable_like_a_passed_one():
    cfg = LaunchConfig(num_processes=2, strategy="fsdp", fsdp_state_dict_type="SHARDED_STATE_DICT")
    name, shared, strategy, kind = nbaccel.notebook_launcher(
        _plugin_seen_by_the_rank, config=cfg, progress=False
    )
    assert (name, shared, strategy, kind) == (
        "FullyShardedDataParallelPlugin",
        True,
        "fsdp",
        "SHARDED_STATE_DICT",
    )
