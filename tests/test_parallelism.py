"""N-D parallelism (``Accelerator(parallelism_config=ParallelismConfig(...))``) on 4 CPU ranks:
``ParallelismConfig`` beside Accelerate's own (fields, variables, dimension names, refusals),
then one launch that trains a small transformer block with dp_replicate 2 × tp 2,
dp_shard 2 × tp 2 and HSDP 2 × 2 against the same model trained in one process on the same
global batches, checkpoints that resume bit for bit, loaders that give a tensor-parallel group
the same batches, and a tiny transformers model split by its own ``tp_plan``."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.core.config import ConfigError, LaunchConfig
from nbaccel.core.parallelism_settings import world_mismatch
from nbaccel.parallelism_config import ParallelismConfig
from nbaccel.utils import TorchTensorParallelConfig

WIDTH, HEADS, SEQ = 16, 4, 6
PLAN = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "up": "colwise",
    "down": "rowwise",
}
STEPS, BATCH = 4, 2  # optimizer steps; samples per data-parallel rank per step
CONFIGS = {  # every size given: the launch's PARALLELISM_CONFIG_* fill those left out
    "dp_replicate2_tp2": {"dp_replicate_size": 2, "dp_shard_size": 1, "tp_size": 2},
    "dp_shard2_tp2": {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2},
    "hsdp2x2": {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1},
}
LAUNCH = LaunchConfig(
    num_processes=4, parallelism_config_dp_shard_size=2, parallelism_config_tp_size=2
)


class Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(3))
        # no key bias: softmax cancels it, so its gradient is rounding noise that Adam would
        # turn into full-size steps, different in every summation order
        self.k = torch.nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: a tensor-parallel rank holds heads / tp of them
        q, k, v = (
            f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention and an MLP, each with a residual (also the
    benchmarks' model, ``benchmarks/parallelism.py``)."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def _data(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, SEQ, WIDTH, generator=g)
    return torch.utils.data.TensorDataset(x, x.roll(1, dims=1).tanh())


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _one_process(dp: int) -> dict[str, torch.Tensor]:
    """The same model trained in this process on the global batches of ``dp`` ranks."""
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_data(STEPS * BATCH * dp), batch_size=BATCH * dp)
    for x, y in loader:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def nd_parallel_train(args: argparse.Namespace) -> list[float]:
    """Accelerate's ``examples/torch_native_parallelism/nd_parallel.py`` training function,
    step for step (its calls, in its order), written against nbaccel: a config-built tiny
    Llama from ``args.model_name``, generated token data instead of TinyStories, no wandb. One
    change beyond the import: the model is saved as Accelerate documents for sharded models
    (``unwrap_model(model).save_pretrained(..., state_dict=accelerator.get_state_dict(model))``),
    since transformers 5.24's ``save_pretrained`` gathers only models it sharded itself."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from nbaccel import Accelerator
    from nbaccel.utils import FullyShardedDataParallelPlugin, set_seed

    set_seed(42)
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )
    accelerator = Accelerator(
        mixed_precision="bf16", parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name, dtype=torch.bfloat16, use_cache=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    tokens = torch.randint(
        0, 64, (16, args.sequence_length + 1), generator=torch.Generator().manual_seed(0)
    )
    dataset = [{"input_ids": t[:-1], "shift_labels": t[1:], "labels": t[1:]} for t in tokens]
    dataloader = DataLoader(dataset, batch_size=1)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    losses = []
    for step, batch in enumerate(dataloader):
        if step >= args.num_steps:
            break
        batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1)).unsqueeze(0)
        buffers = [
            batch["input_ids"],
            batch["shift_labels"],
            batch["labels"],
            batch["position_ids"],
        ]
        with accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
        ):
            loss_reduce_grp = (
                accelerator.torch_device_mesh["dp_cp"].get_group()
                if accelerator.parallelism_config.dp_cp_dim_names
                else None
            )
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)
        losses.append(loss.item())
        if (
            step % args.checkpoint_frequency == 0
            and step > 0
            and parallelism_config.dp_shard_enabled
        ):
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")
    accelerator.unwrap_model(model).save_pretrained(
        args.save_dir + "/model", state_dict=accelerator.get_state_dict(model)
    )
    accelerator.end_training()
    return losses


def _llama_by_its_own_plan(path: str) -> dict:
    """A config-built Llama split by its own ``tp_plan`` over dp_shard 2 × tp 2, two SGD steps;
    rank 0 then trains the same model in its process alone on the same global batches."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from nbaccel import Accelerator

    config = ParallelismConfig(dp_replicate_size=1, dp_shard_size=2, tp_size=2)
    acc = Accelerator(parallelism_config=config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    split = sum(
        isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names for p in model.parameters()
    )
    batches = [
        torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)
    ]
    mine = slice(2 * acc.data_parallel_shard_rank, 2 * acc.data_parallel_shard_rank + 2)
    for ids in batches:
        acc.backward(model(input_ids=ids[mine], labels=ids[mine]).loss)
        opt.step()
        opt.zero_grad()
    full = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    worst = 0.0
    if dist.get_rank() == 0:
        alone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.SGD(alone.parameters(), lr=0.1)
        for ids in batches:
            alone(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        want = alone.state_dict()
        worst = max((full[k] - want[k]).abs().max().item() for k in full)
    return {"split_parameters": split, "worst": worst}


def _train_all(folder: str) -> dict:
    """On each rank: every configuration in turn; full weights, checkpoint round trips, the
    batches each rank saw."""
    import torch.distributed as dist

    from nbaccel import Accelerator

    out: dict = {"from_launch": Accelerator().parallelism_config.describe()}
    if dist.get_rank() == 0:  # a config-built tiny Llama, as from_pretrained would find one
        from transformers import LlamaConfig, LlamaForCausalLM

        tiny = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(tiny).save_pretrained(Path(folder) / "tiny-llama")
    dist.barrier()
    out["llama"] = _llama_by_its_own_plan(str(Path(folder) / "tiny-llama"))
    for name, sizes in CONFIGS.items():
        plan = TorchTensorParallelConfig(plan=PLAN) if sizes["tp_size"] > 1 else None
        config = ParallelismConfig(**sizes, tp_handler=plan)
        acc = Accelerator(parallelism_config=config)
        dp = config.data_parallel_size
        torch.manual_seed(acc.process_index)  # rank 0's initial weights must win
        model = Block()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(_data(STEPS * BATCH * dp), batch_size=BATCH)
        model, opt, loader = acc.prepare(model, opt, loader)
        batches = list(loader)
        first = [x[0, 0, 0].item() for x, _ in batches]
        target = Path(folder) / name
        after: dict = {}
        for step, (x, y) in enumerate(batches):
            if step == STEPS // 2:
                acc.save_state(str(target))
            acc.backward(_loss(model, x, y))
            opt.step()
            opt.zero_grad()
        full = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
        acc.load_state(str(target))
        for x, y in batches[STEPS // 2 :]:
            acc.backward(_loss(model, x, y))
            opt.step()
            opt.zero_grad()
        after = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
        acc.save_model(model, str(target / "model"))
        predictions = acc.gather_for_metrics(batches[0][0][:, 0, 0])
        out[name] = {
            "full": full,
            "resumed": after,
            "first": first,
            "mesh": acc.torch_device_mesh.mesh_dim_names,
            "ranks": (
                acc.data_parallel_rank,
                acc.data_parallel_shard_rank,
                acc.tensor_parallel_rank,
            ),
            "coordinates": acc.mesh_coordinates(),
            "gathered": predictions.tolist(),
            "distributed_type": str(acc.distributed_type),
            "composable": acc.is_composable_parallelism_enabled,
        }
        dist.barrier()
    port = Path(folder) / "nd_parallel"
    out["nd_parallel"] = nd_parallel_train(
        argparse.Namespace(
            dp_replicate_size=2,
            dp_shard_size=2,
            tp_size=1,
            cp_size=1,
            sequence_length=8,
            num_steps=3,
            save_dir=str(port),
            checkpoint_frequency=2,
            model_name=str(Path(folder) / "tiny-llama"),
        )
    )
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nd")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = nbaccel.notebook_launcher(
            _train_all, (str(folder),), config=LAUNCH, return_all=True
        )
    return results, folder, printed.getvalue()


# -- ParallelismConfig beside Accelerate's, without launching ---------------------------------

SIZES = [
    {"dp_shard_size": 4},
    {"dp_shard_size": 2, "tp_size": 2},
    {"dp_replicate_size": 2, "dp_shard_size": 2},
    {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2},
    {"dp_shard_size": 2, "cp_size": 2},
    {},
]


@pytest.mark.parametrize(
    "sizes", SIZES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "none"
)
def test_dimensions_are_accelerates(sizes):
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    ours, theirs = ParallelismConfig(**sizes), Theirs(**sizes)
    for name in (
        "dp_dim_names",
        "non_dp_dim_names",
        "dp_shard_cp_dim_names",
        "dp_cp_dim_names",
        "fsdp_dim_names",
        "active_mesh_dims",
        "total_size",
        "data_parallel_size",
        "non_data_parallel_size",
        "tp_enabled",
        "cp_enabled",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert tuple(ours._get_mesh()) == tuple(theirs._get_mesh())


def test_sizes_come_from_accelerates_variables(monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    ours, theirs = ParallelismConfig(), Theirs()
    assert (ours.dp_shard_size, ours.tp_size) == (theirs.dp_shard_size, theirs.tp_size) == (2, 2)


@pytest.mark.parametrize(
    "bad", [{"tp_size": 0}, {"cp_backend": "ring"}, {"cp_size": 2, "sp_size": 2}]
)
def test_bad_sizes_refused_as_accelerate_refuses(bad):
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    with pytest.raises(ValueError) as theirs:
        Theirs(**bad)
    with pytest.raises(ValueError) as ours:
        ParallelismConfig(**bad)
    assert str(ours.value).split(",")[0] == str(theirs.value).split(",")[0]


def test_sizes_that_do_not_make_the_world_say_what_fits():
    message = world_mismatch({"dp_shard": 3, "tp": 2}, 4)
    assert "make 6 ranks" in message and "4 processes" in message
    assert "dp_shard_size=2" in message  # what would fit with tp_size=2
    assert "tp_size=3 must divide" in world_mismatch({"tp": 3}, 4)
    assert world_mismatch({"dp_shard": 2, "tp": 2}, 4) is None


def test_a_tp_size_that_does_not_split_the_model_says_what_would():
    import types

    from nbaccel.training.strategies.mesh import _check_divides, _check_heads

    llama = Block()  # with a transformers-style config: the sizes a tp group splits
    llama.config = types.SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=32
    )
    with pytest.raises(
        ValueError,
        match=r"tp_size=3 does not divide the model's num_attention_heads \(4\); a tp_size of 2 or 4 would",
    ):
        _check_heads(llama, 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\); a tp_size of 2 would"):
        _check_heads(llama, 4)
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ValueError, match=r"tp_size=3 does not divide up's out_features \(64\)"):
        _check_divides("up", Block().up, ColwiseParallel(), 3)


def test_launch_config_carries_the_sizes_and_refuses_a_bad_world(tmp_path):
    cfg = LaunchConfig(
        num_processes=4, parallelism_config_dp_shard_size=2, parallelism_config_tp_size=2
    )
    env = cfg.worker_env()
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["PARALLELISM_CONFIG_TP_SIZE"]) == (
        "2",
        "2",
    )
    assert LaunchConfig.load(cfg.save(tmp_path / "c.yaml")) == cfg
    with pytest.raises(ConfigError, match=r"dp_shard 3 × tp 2 make 6 ranks.*dp_shard_size=2"):
        LaunchConfig(
            num_processes=4, parallelism_config_dp_shard_size=3, parallelism_config_tp_size=2
        )


def test_nbaccel_launch_flags_carry_the_sizes_and_refuse_context_parallel_on_cpu(
    tmp_path, monkeypatch, capsys
):
    from nbaccel.cli import launch as cli_launch
    from nbaccel.cli.main import build_parser, main

    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    flags = ["--num_processes", "4", "--parallelism-config-dp-shard-size", "2"]
    args = build_parser().parse_args(
        ["launch", *flags, "--parallelism_config_tp_size", "2", "train.py"]
    )
    env = cli_launch.resolve_config(args).worker_env()
    assert (env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["PARALLELISM_CONFIG_TP_SIZE"]) == (
        "2",
        "2",
    )
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a rank started')\n")
    cp = ["--parallelism-config-cp-size", "2", "--parallelism-config-dp-shard-size", "2"]
    assert main(["launch", "--num_processes", "4", *cp, str(script)]) != 0
    assert "cp_size=2: context parallelism" in capsys.readouterr().err


def test_the_config_panel_edits_and_saves_the_sizes(tmp_path):
    from nbaccel.core.hardware import Hardware
    from nbaccel.ui.config_panel import ConfigPanel, panel_text
    from tests.test_config_panel import frontend_click, frontend_update

    cpus = Hardware(cpu_count=8, gpus=())
    cfg = LaunchConfig(num_processes=4)
    panel = ConfigPanel(cfg, cpus, tmp_path / "cfg.yaml", torchao=False)
    frontend_update(panel.parallelism["parallelism_config_dp_shard_size"], value=2)
    frontend_update(panel.parallelism["parallelism_config_tp_size"], value=2)
    assert (cfg.parallelism_config_dp_shard_size, cfg.parallelism_config_tp_size) == (2, 2)
    frontend_update(panel.num_processes, value=2)  # the sizes make 4: saving says so
    frontend_click(panel.save_button)
    assert "not saved" in panel.status.value and "make 4 ranks" in panel.status.value
    frontend_update(panel.num_processes, value=4)
    frontend_click(panel.save_button)
    assert LaunchConfig.load(tmp_path / "cfg.yaml") == cfg
    assert "dp_shard_size=2, tp_size=2" in panel_text(cfg, cpus, [], tmp_path)


# -- on 4 ranks: one launch, every configuration -----------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trains_to_the_one_process_weights(trained, name):
    results, _, _ = trained
    dp = math.prod(v for k, v in CONFIGS[name].items() if k.startswith("dp"))
    want = _one_process(dp)
    for rank, result in enumerate(results):
        got = result[name]["full"]
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(
                got[key], want[key], atol=1e-5, rtol=0, msg=f"rank {rank} {key}"
            )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoints_resume_bit_for_bit(trained, name):
    results, folder, _ = trained
    for result in results:
        full, resumed = result[name]["full"], result[name]["resumed"]
        assert all(torch.equal(full[k], resumed[k]) for k in full)
    from safetensors.torch import load_file

    saved = load_file(str(folder / name / "model" / "model.safetensors"))
    assert all(torch.equal(saved[k], results[0][name]["full"][k]) for k in saved)


def test_a_tensor_parallel_group_sees_the_same_batches(trained):
    results, _, _ = trained
    first = [r["dp_shard2_tp2"]["first"] for r in results]
    assert first[0] == first[1] and first[2] == first[3]  # one tp group each
    assert first[0] != first[2]  # the two data-parallel ranks differ
    hsdp = [r["hsdp2x2"]["first"] for r in results]
    assert len({tuple(f) for f in hsdp}) == 4  # no tp: four data-parallel ranks
    # gather_for_metrics counts each data-parallel rank once: 2 ranks × BATCH samples
    gathered = results[0]["dp_shard2_tp2"]["gathered"]
    assert len(gathered) == 2 * BATCH
    assert (gathered[0], gathered[BATCH]) == (first[0][0], first[2][0])


def test_mesh_names_and_ranks_are_accelerates(trained):
    results, _, _ = trained
    assert results[0]["dp_shard2_tp2"]["mesh"] == ("dp_shard", "tp")
    assert results[0]["hsdp2x2"]["mesh"] == ("dp_replicate", "dp_shard")
    assert [r["dp_shard2_tp2"]["ranks"] for r in results] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    assert [r["dp_replicate2_tp2"]["coordinates"] for r in results][3] == {
        "dp_replicate": 1,
        "tp": 1,
    }
    assert results[0]["dp_shard2_tp2"]["distributed_type"] == "DistributedType.FSDP"
    assert results[0]["dp_shard2_tp2"]["composable"] is True
    assert results[0]["dp_replicate2_tp2"]["composable"] is False


def test_the_launch_says_the_mesh_and_each_ranks_place(trained):
    results, _, printed = trained
    assert all(r["from_launch"] == "dp_shard 2 × tp 2" for r in results)  # PARALLELISM_CONFIG_*
    banner = next(line for line in printed.splitlines() if "launching" in line)
    assert "strategy=ddp (unless set in code), dp_shard 2 × tp 2," in banner
    table = printed[printed.index(" role ") :]
    assert "dp_replicate 1, dp_shard 1" in table  # rank 3 in the last mesh (HSDP 2 × 2)


def test_a_launch_refuses_sizes_that_cannot_run_before_any_rank_starts():
    def never():
        raise AssertionError("a rank started")

    bad = LAUNCH.replace(parallelism_config_tp_size=1, parallelism_config_cp_size=2)
    with pytest.raises(ValueError, match=r"cp_size=2: context parallelism .* use cp_size=1"):
        nbaccel.notebook_launcher(never, config=bad)
    with pytest.raises(ValueError, match=r"dp_shard 2 × tp 2 make 4 ranks, but the launch has 2"):
        nbaccel.notebook_launcher(never, config=LAUNCH, num_processes=2)


def test_accelerates_nd_parallel_example_runs(trained):
    results, folder, _ = trained
    losses = [r["nd_parallel"] for r in results]
    assert all(len(ls) == 3 and all(math.isfinite(x) for x in ls) for ls in losses)
    assert losses[0] == losses[1] == losses[2] == losses[3]  # the dp_cp-averaged loss
    assert (folder / "nd_parallel" / "checkpoint-2").is_dir()
    import json

    from safetensors.torch import load_file

    config = json.loads((folder / "nd_parallel" / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    saved = load_file(str(folder / "nd_parallel" / "model" / "model.safetensors"))
    assert saved["model.embed_tokens.weight"].shape == (64, 32)  # full, not a shard


def test_a_transformers_model_is_split_by_its_own_tp_plan(trained):
    results, _, _ = trained
    assert results[0]["llama"]["split_parameters"] > 0  # DTensors over the tp mesh
    assert results[0]["llama"]["worst"] <= 1e-5  # the one-process weights
