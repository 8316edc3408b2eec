"""The cases: every test function Accelerate 1.15's multi-process scripts run, one per launch.

A case runs its script's ``main()`` with every other listed test function of that script
silenced, so only its own call runs, with the arguments and set-up ``main()`` gives it
(``occurrence`` picks the n-th call where ``main()`` calls the function several times). Cases
that ``main()`` only calls on GPUs, but that Accelerate runs on CPU too, are called directly
with ``args`` (``"accelerator"`` stands for a fresh ``Accelerator()``, ``"datasets.Dataset"`` for
that class). A case with ``na`` is listed but not run, and says why; one with ``differs`` runs
but fails for nbaccel because of a deliberate difference, which it names.

>>> len({c.id for c in CASES}) == len(CASES)
True
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any


@dataclasses.dataclass(frozen=True)
class Case:
    script: str
    function: str
    label: str = ""
    occurrence: int = 0
    args: tuple[Any, ...] | None = None  # None: through main()
    na: str = ""  # why the case does not apply here (not run)
    differs: str = ""  # nbaccel's deliberate difference that makes the case fail for it
    where: str = "ranks"  # "ranks": 2 CPU ranks; "kernel": the test's own process launches
    needs: str = ""  # a module the case imports; missing -> not applicable
    cpu_ddp: bool = False  # the script's reference DDP passes device_ids (see runner)

    @property
    def id(self) -> str:
        stem = self.script.rsplit("/", 1)[-1].removesuffix(".py")
        return f"{stem}::{self.function}" + (f"[{self.label}]" if self.label else "")


def _main(script: str, *names: str) -> list[Case]:
    return [Case(script, name) for name in names]


_S, _Y, _O, _D, _H, _N = (
    "test_script.py",
    "test_sync.py",
    "test_ops.py",
    "test_distributed_data_loop.py",
    "test_ddp_comm_hook.py",
    "test_notebook.py",
)
_NCCL = "torch's BF16 compression hook needs NCCL 2.10+ (or XCCL): GPU only"
_RESET = "uses Accelerate's private AcceleratorState._reset_state() and its error text"
_GA = list(itertools.product([True, False], repeat=3))  # split, dispatch, sync_each_batch


def _ga_label(split: bool, dispatch: bool, sync_each: bool) -> str:
    return f"split={int(split)},dispatch={int(dispatch)},sync_each={int(sync_each)}"


_HOOKS = [
    "NO", "FP16", "BF16", "POWER_SGD", "POWER_SGD,FP16", "POWER_SGD,BF16", "POWER_SGD,rank=2",
    "BATCHED_POWER_SGD", "BATCHED_POWER_SGD,FP16", "BATCHED_POWER_SGD,BF16",
]  # fmt: skip

CASES: list[Case] = [
    *_main(
        _S,
        "init_state_check",
        "process_execution_check",
        "test_split_between_processes_list",
        "test_split_between_processes_nested_dict",
        "test_split_between_processes_tensor",
        "test_split_between_processes_evenly",
    ),
    Case(_S, "test_split_between_processes_dataset", args=("datasets.Dataset",), needs="datasets"),
    *_main(
        _S,
        "rng_sync_check",
        "dl_preparation_check",
        "central_dl_preparation_check",
        "custom_sampler_check",
        "check_seedable_sampler",
        "check_seedable_sampler_with_data_seed",
        "check_seedable_sampler_in_batch_sampler_shard",
    ),
    Case(_S, "training_check", "default sampler", 0),
    Case(_S, "training_check", "seedable sampler", 1),
    Case(_S, "test_trigger"),
    Case(_S, "test_reinstantiated_state", na=_RESET),
    Case(_Y, "test_dataloader_break"),
    Case(_Y, "test_noop_sync", na="one process only (DistributedType.NO); the runner runs 2"),
    *_main(_Y, "test_distributed_sync", "test_distributed_sync_multiple_fwd"),
    *[Case(_Y, "test_gradient_accumulation", _ga_label(*c), args=c) for c in _GA],
    Case(_Y, "test_gradient_accumulation_with_opt_and_scheduler", _ga_label(False, False, False)),
    *[
        Case(_Y, "test_gradient_accumulation_with_opt_and_scheduler", _ga_label(*c), args=c)
        for c in _GA
        if any(c)
    ],
    *_main(
        _O,
        "test_gather",
        "test_gather_object",
        "test_gather_non_contiguous",
        "test_broadcast",
        "test_pad_across_processes",
        "test_reduce_sum",
        "test_reduce_mean",
        "test_reduce_max",
        "test_op_checker",
        "test_copy_tensor_to_devices",
    ),
    *_main(
        _D,
        "test_default_ensures_even_batch_sizes",
        "test_can_disable_even_batches",
        "test_can_join_uneven_inputs",
        "test_join_can_override_even_batches",
        "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches",
        "test_join_raises_warning_for_non_ddp_distributed",
    ),
    Case(_D, "test_pickle_accelerator"),
    *[
        Case(_D, "test_data_loader", label, i)
        for i, label in enumerate(
            ["shuffle=False", "shuffle=True", "batch_sampler", "sampler=BatchSampler"]
        )
    ],
    *_main(_D, "test_stateful_dataloader", "test_stateful_dataloader_save_state"),
    *[
        Case(_H, "test_ddp_comm_hook", label, i, cpu_ddp=True, na=_NCCL if "BF16" in label else "")
        for i, label in enumerate(_HOOKS)
    ],
    *[
        Case(_N, name, where="kernel")
        for name in (
            "test_can_initialize",
            "test_clean_cuda_fork",
            "test_static_rdzv_backend",
            "test_c10d_rdzv_backend",
        )
    ],
    Case(
        _N,
        "test_fault_tolerant",
        where="kernel",
        differs="passes a fork-context multiprocessing.Queue as an argument; nbaccel's ranks "
        "come from a fork server, not forks of the caller, so arguments must pickle; the error "
        "says to make it with multiprocessing.Manager(), and with a manager's queue the case "
        "passes (tests/test_accelerate_ported_names.py)",
    ),
    Case(_N, "test_monitoring", where="kernel"),
    Case(_N, "test_problematic_imports", where="kernel", needs="bitsandbytes"),
    Case("test_cli.py", "main"),
    Case(
        "test_merge_weights.py",
        "__main__",
        na="FSDP1 (ShardingStrategy, SHARDED_STATE_DICT) on GPUs and Accelerate's own CLI "
        "(`accelerate merge-weights`); nbaccel's FSDP is FSDP2",
    ),
    Case(
        "external_deps/test_metrics.py",
        "main",
        na="imports transformers, evaluate and datasets and downloads GLUE/MRPC from the hub",
    ),
    *[
        Case(f"external_deps/{name}.py", "main", na=why)
        for name, why in [
            ("test_checkpointing", "transformers + hub downloads (GLUE/MRPC, bert-base-cased)"),
            ("test_performance", "transformers + hub downloads (GLUE/MRPC, bert-base-cased)"),
            ("test_peak_memory_usage", "measures CUDA memory (GPU only)"),
            ("test_pippy", "pipeline parallelism on GPUs, hub models"),
            ("test_ds_multiple_model", "DeepSpeed with several models on GPUs, hub models"),
            ("test_ds_alst_ulysses_sp", "DeepSpeed sequence parallelism on GPUs"),
            ("test_zero3_integration", "DeepSpeed ZeRO-3 on GPUs"),
        ]
    ],
]
