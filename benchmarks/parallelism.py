"""Section "parallelism": N-D parallelism on 4 CPU ranks, one small transformer, four layouts.

Each contender is one ``notebook_launcher`` launch of 4 ranks training the same stack of
transformer blocks (``tests.test_parallelism.Block``, width 256) with AdamW on the same global
batch (16 sequences of 32 tokens per step), split as: dp 4 (DDP, every rank a full replica),
dp_shard 2 × tp 2 (FSDP2 over 2 ranks, each block split over the other 2), HSDP 2 × 2
(replicated over 2, sharded over 2), and tp 4. Measured in each rank: samples per second over
the timed steps (after warm-up steps), the bytes of the parameters and optimizer state it holds
(its own shards), and its peak resident memory. Repetitions interleave the contenders; the
machine is shared, so compare medians and the ratios within one run. The point of splitting a
model is less memory per rank: the target is parameters + optimizer state at tp 2 ≤ 0.6× dp's.
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness as H

WIDTH, HEADS, LAYERS, SEQ, GLOBAL_BATCH = 256, 8, 4, 32, 16
WORLD = 4
CONTENDERS = {
    "dp 4 (DDP)": {"dp_replicate_size": 4},
    "dp_shard 2 × tp 2": {"dp_shard_size": 2, "tp_size": 2},
    "HSDP 2 × 2": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "tp 4": {"tp_size": 4},
}
PLAN = {
    f"*.{name}": style
    for name, style in (
        ("attn.q", "colwise"),
        ("attn.k", "colwise"),
        ("attn.v", "colwise"),
        ("attn.o", "rowwise"),
        ("up", "colwise"),
        ("down", "rowwise"),
    )
}


def _train(sizes: dict[str, int], warmup: int, steps: int) -> dict[str, float]:
    """On each rank: train, time the steps after ``warmup``, count what this rank holds."""
    import resource
    import time

    import torch
    from torch.distributed.tensor import DTensor

    from nbaccel import Accelerator, ParallelismConfig
    from nbaccel.utils import TorchTensorParallelConfig
    from tests.test_parallelism import Block

    plan = TorchTensorParallelConfig(plan=PLAN) if sizes.get("tp_size", 1) > 1 else None
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes, tp_handler=plan))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(WIDTH, HEADS) for _ in range(LAYERS)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    dp = accelerator.parallelism_config.data_parallel_size
    x = torch.randn(GLOBAL_BATCH // dp, SEQ, WIDTH)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - started

    def held(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    params = sum(held(p) for p in model.parameters())
    states = sum(
        held(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return {
        "samples_per_s": GLOBAL_BATCH * steps / seconds,
        "param_optimizer_mib": (params + states) / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _train_each(layouts: list[dict[str, int]], warmup: int, steps: int) -> list[dict]:
    return [_train(sizes, warmup, steps) for sizes in layouts]


def _launch(names: list[str], warmup: int, steps: int) -> dict[str, list[dict[str, float]]]:
    """Each rank's figures per layout, all ``names`` in one launch of 4 ranks."""
    import nbaccel

    ranks = nbaccel.notebook_launcher(
        _train_each,
        args=([CONTENDERS[n] for n in names], warmup, steps),
        num_processes=WORLD,
        view=H.QuietView(),
        return_all=True,
    )
    return {name: [rank[i] for rank in ranks] for i, name in enumerate(names)}


def _record(raw: dict[str, list[float]], ranks: list[dict[str, float]], load: float | None):
    raw["rate"].append(min(r["samples_per_s"] for r in ranks))
    raw["held"].append(sum(r["param_optimizer_mib"] for r in ranks) / WORLD)
    raw["held_max"].append(max(r["param_optimizer_mib"] for r in ranks))
    raw["rss"].append(max(r["peak_rss_mib"] for r in ranks))
    raw["load"].append(load if load is not None else float("nan"))


def run(reps: int, smoke: bool) -> dict[str, Any]:
    warmup, steps = (1, 2) if smoke else (3, 20)
    raw: dict[str, dict[str, list[float]]] = {
        name: {"rate": [], "held": [], "held_max": [], "rss": [], "load": []} for name in CONTENDERS
    }
    errors: list[str] = []
    # A launch per layout (its own peak memory); a smoke run checks the wiring in one launch.
    batches = [list(CONTENDERS)] if smoke else [[name] for name in CONTENDERS]
    for rep in range(reps):
        for batch in H.rotated(batches, rep):
            load = H.load_now()
            try:
                measured = _launch(batch, warmup, steps)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                errors.append(f"{', '.join(batch)}: {type(exc).__name__}: {str(exc)[-300:]}")
                continue
            for name, ranks in measured.items():
                _record(raw[name], ranks, load)
    contenders: dict[str, Any] = {}
    for name, r in raw.items():
        contenders[name] = {
            "samples_per_s": H.summary(r["rate"]),
            "param_optimizer_mib_per_rank": H.summary(r["held"]),
            "param_optimizer_mib_max_rank": H.summary(r["held_max"]),
            "peak_rss_mib": H.summary(r["rss"]),
            "load": H.summary(r["load"]),
        }
    dp, tp2 = raw["dp 4 (DDP)"]["held_max"], raw["dp_shard 2 × tp 2"]["held_max"]
    memory_ratio = H.ratio(
        H.summary(tp2).get("median") if tp2 else None, H.summary(dp).get("median") if dp else None
    )
    return {
        "what": f"{WORLD} CPU ranks, {LAYERS} transformer blocks of width {WIDTH}, AdamW, global "
        f"batch {GLOBAL_BATCH}×{SEQ} tokens; samples/s of the slowest rank over {steps} steps "
        "after warm-up; parameters + optimizer state each rank holds (MiB); peak RSS",
        "world_size": WORLD,
        "steps": steps,
        "contenders": contenders,
        "tp2_vs_dp_memory": memory_ratio,
        "target_met": memory_ratio is not None and memory_ratio <= 0.6,
        "errors_all": errors,
    }
