"""DeepSpeed ZeRO on 2 CPU ranks (gloo): stages 1, 2 and 3 train to DDP's losses and weights on
the same data, resume from a checkpoint, save_model under ZeRO-3 writes the full weights; a
user JSON, zero3_init_context and CPU offload; one process in the kernel with bf16; under
notebook_launcher, `nbaccel launch` and plain torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.core.config import LaunchConfig
from tests.test_cli_support import run_torchrun

REPO = Path(__file__).resolve().parent.parent
# DDP and DeepSpeed run the same float32 AdamW math, but DeepSpeed sums gradients over flat
# buffers in another order; measured differences are ~1e-7, so 1e-5 is a wide margin that
# still catches a missed step, a wrong accumulation scale or an unsynchronised gradient.
TOL = 1e-5


ONE_PROCESS = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from nbaccel import Accelerator, DeepSpeedPlugin, DistributedType
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # not in DeepSpeed's tested list
    x = torch.randn(32, 4)
    dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for _ in range(3):
        for xb, yb in dl:
            loss = F.mse_loss(model(xb.to(torch.bfloat16)).float(), yb)
            acc.backward(loss)
            opt.step(); opt.zero_grad()
            losses.append(loss.item())
    engine = acc.prepared().strategy.engine
    print("RESULT", acc.mixed_precision, acc.distributed_type == DistributedType.DEEPSPEED,
          engine.bfloat16_enabled(), next(model.parameters()).dtype,
          losses[-1] < losses[0] / 2, acc.get_state_dict(model)["weight"].dtype)
    """
)


@pytest.mark.slow
def test_one_process_in_the_kernel_with_bf16():
    # What a notebook cell does without notebook_launcher: no torchrun variables, one rank.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "RANK", "WORLD"))}
    out = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS],
        capture_output=True, text=True, env=env, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT bf16 True True torch.bfloat16 True torch.bfloat16"], out.stdout


# -- on 2 ranks ------------------------------------------------------------------------------


def train(kind: str, epochs: int = 2, folder: str | None = None, resume: bool = False) -> dict:
    """Train a small net on fixed data with accumulation 2, clipping 1.0 and a StepLR; ``kind``
    is "ddp" or "zero<stage>". With ``folder``, save_state after the first epoch, then (when
    ``resume``) continue in a fresh Accelerator from that checkpoint."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator
    from nbaccel.training.deepspeed_plugin import DeepSpeedPlugin

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=g)
        dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
        if kind == "ddp":
            acc = Accelerator(gradient_accumulation_steps=2, strategy="ddp")
        elif kind == "from_launch":  # everything from the launch's NBACCEL_* variables
            acc = Accelerator()
        else:
            plugin = DeepSpeedPlugin(
                zero_stage=int(kind[-1]), gradient_accumulation_steps=2, gradient_clipping=1.0
            )
            acc = Accelerator(deepspeed_plugin=plugin)
        return (acc, *acc.prepare(model, opt, dl, sched))

    def epoch(acc, model, opt, dl, sched, losses):
        for x, y in dl:
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(acc.gather(loss.detach()).mean().item())

    acc, model, opt, dl, sched = build()
    losses: list[float] = []
    for e in range(epochs):
        epoch(acc, model, opt, dl, sched, losses)
        if folder and e == 0:
            acc.save_state(folder)
    out = {
        "losses": losses,
        "weights": acc.get_state_dict(model),
        "lr": sched.get_last_lr()[0],
        "strategy": acc.strategy,
        "accumulation": acc.gradient_accumulation_steps,
        "zero_stage": acc.state.deepspeed_plugin.zero_stage if acc.strategy != "ddp" else None,
    }
    if kind == "zero3" and folder:
        inner = acc.unwrap_model(model)
        out["local_numel"] = sum(p.numel() for p in inner.parameters())
        acc.save_model(model, f"{folder}/model")
    if resume:
        acc, model, opt, dl, sched = build()
        acc.load_state(folder)
        resumed: list[float] = []
        epoch(acc, model, opt, dl, sched, resumed)
        out.update(resumed=resumed, resumed_weights=acc.get_state_dict(model))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepspeed")

    def all_kinds(root: str) -> dict:
        out = {"ddp": train("ddp")}
        for kind in ("zero1", "zero2", "zero3"):
            out[kind] = train(kind, folder=f"{root}/{kind}", resume=kind != "zero1")
        return out

    return {
        "root": root,
        **nbaccel.notebook_launcher(all_kinds, args=(str(root),), num_processes=2, progress=False),
    }


def _close(a: dict, b: dict, atol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=atol, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3"])
def test_zero_stages_train_like_ddp(runs, kind):
    ddp, ds = runs["ddp"], runs[kind]
    assert ds["strategy"] == "deepspeed" and ds["accumulation"] == 2
    assert len(ds["losses"]) == len(ddp["losses"]) == 8  # 2 epochs x 4 batches per rank
    assert ds["losses"] == pytest.approx(ddp["losses"], abs=TOL)
    assert ds["losses"][-1] < ds["losses"][0]  # it learned something
    assert ds["lr"] == pytest.approx(ddp["lr"])  # the scheduler stepped as under DDP
    _close(ds["weights"], ddp["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_resume_from_checkpoint_continues_the_same_run(runs, kind):
    r = runs[kind]
    # The resumed second epoch repeats the uninterrupted one: weights, optimizer, scheduler,
    # RNG and loader position all came back.
    assert r["resumed"] == pytest.approx(r["losses"][4:], abs=1e-6)
    _close(r["resumed_weights"], r["weights"], atol=1e-6)
    files = {p.name for p in (runs["root"] / kind / "model_0").rglob("*")}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files  # fmt: skip


@pytest.mark.slow
def test_save_model_under_zero3_writes_the_full_weights(runs):
    from safetensors.torch import load_file

    r = runs["zero3"]
    assert r["local_numel"] < 16 * 4 + 16 + 16 + 1  # each rank holds only its shard
    saved = load_file(str(runs["root"] / "zero3" / "model" / "model.safetensors"))
    _close(saved, r["weights"], atol=0)  # the gathered weights, bitwise
    _close(saved, runs["zero1"]["weights"])  # which are the unsharded run's


def variants(case: str) -> dict:
    """One epoch of plain AdamW steps with a plugin variant: a user JSON whose optimizer section
    has "auto" values, a model built inside zero3_init_context, or ZeRO-Offload to the CPU."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, DeepSpeedPlugin

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    if case == "json":
        optimizer = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
        optimizer["params"]["torch_adam"] = True  # torch's AdamW inside: no compiled op
        config = {"train_micro_batch_size_per_gpu": "auto", "optimizer": optimizer}
        plugin = DeepSpeedPlugin(hf_ds_config={**config, "zero_optimization": {"stage": 2}})
    elif case == "zero3_init":
        plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    else:
        plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu")
    if case.startswith("dummy"):  # Accelerate's stand-ins for the config's optimizer/scheduler
        optimizer = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
        optimizer["params"]["torch_adam"] = True
        config = {"train_micro_batch_size_per_gpu": "auto", "optimizer": optimizer}
        if case == "dummy_scheduler":
            warmup = {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
            config["scheduler"] = {
                "type": "WarmupLR",
                "params": {**warmup, "warmup_type": "linear"},
            }
        plugin = DeepSpeedPlugin(hf_ds_config={**config, "zero_optimization": {"stage": 2}})
    acc = Accelerator(deepspeed_plugin=plugin)
    with plugin.zero3_init_context():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    local_numel = sum(p.numel() for p in model.parameters())
    if case.startswith("dummy"):
        from nbaccel.utils import DummyOptim, DummyScheduler

        opt = DummyOptim(model.parameters(), lr=0.05, weight_decay=0.02)
        if case == "dummy_scheduler":
            sched = DummyScheduler(opt, warmup_num_steps=4)
            model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
        elif case == "dummy_callable":  # no scheduler section: the engine calls this instead
            halve = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)  # noqa: E731
            sched = DummyScheduler(opt, lr_scheduler_callable=halve)
            model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
        else:
            model, opt, dl = acc.prepare(model, opt, dl)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.02)
        model, opt, dl = acc.prepare(model, opt, dl)
    losses, lrs = [], []
    for xb, yb in dl:
        loss = F.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        if case in ("dummy_scheduler", "dummy_callable"):
            sched.step()  # a ported loop's call: the engine stepped it already
            lrs.append(sched.get_last_lr()[0])
        opt.zero_grad()
        losses.append(loss.item())
    strategy = acc.prepared().strategy
    return {
        "losses": losses,
        "lrs": lrs,
        "local_numel": local_numel,
        "optimizer": strategy.config.get("optimizer"),
        "offload": strategy.config["zero_optimization"].get("offload_optimizer"),
    }


@pytest.mark.slow
def test_user_json_zero3_init_and_cpu_offload_train_the_same():
    def all_cases() -> dict:
        return {case: variants(case) for case in ("json", "zero3_init", "offload")}

    r = nbaccel.notebook_launcher(all_cases, num_processes=2, progress=False)
    # The JSON's "auto"s came from the torch optimizer passed to prepare().
    assert r["json"]["optimizer"]["params"] == {
        "lr": 0.05,
        "weight_decay": 0.02,
        "torch_adam": True,
    }
    assert r["zero3_init"]["local_numel"] == 0  # partitioned while being built
    assert r["offload"]["offload"] == {"device": "cpu"}
    for case in ("zero3_init", "offload"):
        assert r[case]["losses"] == pytest.approx(r["json"]["losses"], abs=TOL)
    assert r["json"]["losses"][-1] < r["json"]["losses"][0]


@pytest.mark.slow
def test_dummy_optim_and_scheduler_stand_for_the_configs_own():
    def cases() -> dict:
        cases = ("json", "dummy_optim", "dummy_scheduler", "dummy_callable")
        return {case: variants(case) for case in cases}

    r = nbaccel.notebook_launcher(cases, num_processes=2, progress=False)
    # DummyOptim's lr and weight_decay filled the config's "auto"s: the same run as the JSON's.
    assert r["dummy_optim"]["optimizer"] == r["json"]["optimizer"]
    assert r["dummy_optim"]["losses"] == pytest.approx(r["json"]["losses"], abs=TOL)
    # The config's WarmupLR took warmup_num_steps=4 from DummyScheduler, lr from DummyOptim.
    # (linear warmup from 0 to 0.05 in 4 steps: +0.0125 per step, as the engine steps it)
    lrs = r["dummy_scheduler"]["lrs"]
    assert [b - a for a, b in zip(lrs, lrs[1:])] == pytest.approx([0.0125] * 3), lrs
    assert lrs[0] >= 0 and lrs[-1] <= 0.05
    assert r["dummy_callable"]["lrs"] == pytest.approx([0.025, 0.0125, 0.00625, 0.003125])


def test_stand_ins_need_deepspeed_and_their_config_section():
    from nbaccel import Accelerator
    from nbaccel.utils import DummyOptim

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="does not use DeepSpeed"):
        Accelerator(cpu=True).prepare(model, DummyOptim(model.parameters()))
    with pytest.raises(RuntimeError, match="only stands for what the DeepSpeed config defines"):
        DummyOptim(model.parameters()).step()


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {repo!r})
    from tests.test_deepspeed_training import train
    out = train(kind=sys.argv[1])
    out["weights"] = {{k: v.tolist() for k, v in out["weights"].items()}}
    out["env"] = {{k: v for k, v in os.environ.items() if k.startswith("NBACCEL_DEEPSPEED")}}
    with open(os.path.join(sys.argv[2], f"rank{{os.environ['RANK']}}.json"), "w") as f:
        json.dump(out, f)
    """
)


@pytest.mark.slow
def test_under_nbaccel_launch_and_plain_torchrun(tmp_path, runs):
    from tests.test_cli_support import run_cli

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    config = tmp_path / "cfg.yaml"
    # No plugin in the script: strategy, stage, clipping and accumulation come from the file.
    LaunchConfig(
        num_processes=2,
        strategy="deepspeed",
        gradient_accumulation_steps=2,
        deepspeed_zero_stage=3,
        deepspeed_gradient_clipping=1.0,
    ).save(config)
    (tmp_path / "cli").mkdir()
    result = run_cli(
        "launch", "--config_file", str(config), str(script), "from_launch", str(tmp_path / "cli"),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    cli = json.loads((tmp_path / "cli" / "rank1.json").read_text())
    assert cli["env"] == {
        "NBACCEL_DEEPSPEED_ZERO_STAGE": "3",
        "NBACCEL_DEEPSPEED_GRADIENT_CLIPPING": "1.0",
    }
    assert (cli["strategy"], cli["zero_stage"], cli["accumulation"]) == ("deepspeed", 3, 2)
    assert cli["losses"] == pytest.approx(runs["zero3"]["losses"], abs=TOL)

    (tmp_path / "torchrun").mkdir()
    proc = run_torchrun(script, "zero3", str(tmp_path / "torchrun"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "torchrun" / "rank0.json").read_text())
    assert out["losses"] == pytest.approx(runs["ddp"]["losses"], abs=TOL)
