"""nbaccel.Accelerator has Accelerate's surface: every public attribute and method of
``accelerate.Accelerator`` (read by introspection from the installed, pinned Accelerate) exists
with the same parameters, unless it sits in the reasoned exclusion list below, which is the
README's compatibility table. The names loops import from ``accelerate``/``accelerate.utils``
exist at ``nbaccel``/``nbaccel.utils``. nbaccel itself never imports accelerate."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

accelerate = pytest.importorskip("accelerate")  # pinned in the dev extra

import nbaccel  # noqa: E402
import nbaccel.utils  # noqa: E402

PACKAGE = Path(nbaccel.__file__).parent

# Not implemented, with the reason. Keep it short: everything else must exist.
EXCLUDED = {
    "pipeline parallelism's rank (Accelerate raises NotImplementedError too)": [
        "pipeline_parallel_rank",
    ],
    "DeepSpeed internals (nbaccel's engine lives in its DeepSpeed strategy; no Ulysses)": [
        "deepspeed_engine_wrapped",
        "deepspeed_ulysses_dl_adapter",
    ],
    "FP8 recipes of TransformerEngine / MS-AMP / custom torchao recipes; nbaccel's fp8 is "
    "torchao's float8 training with its defaults": [
        "fp8_recipe_handler",
        "te_recipe_handler",
        "msamp_recipe_handler",
        "ao_recipe_handler",
        "has_fp8_handler",
        "delayed_fp8_autocast",
    ],
    "LOMO optimizers (the `lomo-optim` package)": ["lomo_backward"],
    "big-model inference (device_map dispatch across devices)": ["verify_device_map"],
}
EXCLUDED_NAMES = {name for names in EXCLUDED.values() for name in names}

# What training loops import from the top-level package and from accelerate.utils.
TOP_LEVEL = [
    "Accelerator",
    "PartialState",
    "DistributedType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "AutocastKwargs",
    "ProfileKwargs",
    "DDPCommunicationHookType",
    "find_executable_batch_size",
    "skip_first_batches",
    "synchronize_rng_states",
    "load_checkpoint_in_model",
    "prepare_pippy",
    "is_rich_available",
    "notebook_launcher",
    "debug_launcher",
]
UTILS = [
    "DistributedType",
    "set_seed",
    "ProjectConfiguration",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "AutocastKwargs",
    "ProfileKwargs",
    "GradientAccumulationPlugin",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "find_executable_batch_size",
    "release_memory",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "pad_across_processes",
    "send_to_device",
    "recursively_apply",
    "synchronize_rng_states",
    "extract_model_from_parallel",
    "wait_for_everyone",
    "load_checkpoint_in_model",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "patch_environment",
    "save",
    "tqdm",
    "write_basic_config",
    "is_bf16_available",
    "is_torch_xla_available",
    "is_tensorboard_available",
    "is_wandb_available",
    "DummyOptim",
    "DummyScheduler",
    "ParallelismConfig",
    "TorchTensorParallelConfig",
    "TorchContextParallelConfig",
]


def accelerate_surface() -> set[str]:
    """Public class attributes plus the public attributes its __init__ assigns."""
    source = inspect.getsource(accelerate.Accelerator.__init__)
    assigned = re.findall(r"^\s+self\.([a-z][a-z0-9_]*)\s*(?::[^=\n]*)?=", source, re.M)
    public = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
    return public | set(assigned)


@pytest.fixture(scope="module")
def acc():
    return nbaccel.Accelerator(cpu=True)


def test_every_accelerate_attribute_exists_or_is_excluded_with_a_reason(acc):
    surface = accelerate_surface()
    missing = sorted(n for n in surface - EXCLUDED_NAMES if not _exists(acc, n))
    assert not missing, f"Accelerate names nbaccel lacks: {missing}"
    # The exclusion list stays honest: only real Accelerate names that nbaccel really lacks.
    assert surface >= EXCLUDED_NAMES, sorted(EXCLUDED_NAMES - surface)
    assert not [n for n in EXCLUDED_NAMES if _exists(acc, n)]


def _exists(acc, name: str) -> bool:
    # Not hasattr: some properties raise, as Accelerate's do (tensor_parallel_rank without a
    # parallelism_config raises RuntimeError).
    return inspect.getattr_static(acc, name, _ABSENT) is not _ABSENT


_ABSENT = object()


def _params(fn) -> dict[str, inspect.Parameter]:
    return {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _methods() -> list[str]:
    names = []
    for name in sorted(accelerate_surface() - EXCLUDED_NAMES):
        theirs = inspect.getattr_static(accelerate.Accelerator, name, None)
        if isinstance(theirs, staticmethod):
            theirs = theirs.__func__
        if inspect.isfunction(theirs):
            names.append(name)
    return ["__init__", *names]


def _assert_same_parameters(theirs: dict, ours: dict, label: str) -> None:
    """Every parameter of Accelerate's exists, positional ones in the same order (so positional
    calls mean the same thing), and nbaccel requires none that Accelerate does not."""
    missing = [p for p in theirs if p not in ours]
    assert not missing, f"{label} lacks parameters {missing}"
    positional = [p for p, v in theirs.items() if v.kind is v.POSITIONAL_OR_KEYWORD]
    assert list(ours)[: len(positional)] == positional, f"{label}: {list(ours)} vs {positional}"
    extra = [p for p, v in ours.items() if p not in theirs and v.default is v.empty]
    assert not extra, f"{label} requires parameters Accelerate does not: {extra}"


@pytest.mark.parametrize("name", _methods())
def test_methods_take_accelerates_parameters(name):
    theirs = _params(getattr(accelerate.Accelerator, name))
    ours = _params(getattr(nbaccel.Accelerator, name))
    if not theirs and name in ("log", "init_trackers"):
        # Accelerate wraps these in a decorator without functools.wraps; read the original.
        cells = getattr(accelerate.Accelerator, name).__closure__ or ()
        (inner,) = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
        theirs = _params(inner)
    _assert_same_parameters(theirs, ours, f"Accelerator.{name}")


def test_what_accelerate_lets_you_set_can_be_set():
    # Accelerate's examples/by_feature/automatic_gradient_accumulation.py sets
    # accelerator.gradient_accumulation_steps; nbaccel's read-only property raised
    # "property ... has no setter" in the rank.
    settable = [
        name
        for name, value in inspect.getmembers(accelerate.Accelerator)
        if isinstance(value, property) and value.fset is not None
    ]
    assert settable, "Accelerate's Accelerator has no setters any more: fix the test"
    for name in settable:
        ours = inspect.getattr_static(nbaccel.Accelerator, name, None)
        assert isinstance(ours, property) and ours.fset is not None, name


def _utils_functions() -> list[str]:
    import accelerate.utils

    return [n for n in UTILS if inspect.isfunction(getattr(accelerate.utils, n, None))]


@pytest.mark.parametrize("name", _utils_functions())
def test_utils_functions_take_accelerates_parameters(name):
    import accelerate.utils

    theirs = _params(inspect.unwrap(getattr(accelerate.utils, name)))
    _assert_same_parameters(theirs, _params(getattr(nbaccel.utils, name)), name)


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_names(name):
    assert hasattr(accelerate, name), f"accelerate has no {name}: fix the list"
    assert getattr(nbaccel, name) is not None


def test_state_classes():
    from accelerate.state import PartialState

    assert nbaccel.AcceleratorState and nbaccel.utils.AcceleratorState and nbaccel.PartialState
    ours = nbaccel.AcceleratorState(cpu=True)
    # Accelerate sets these per instance (shared-state dict), so only ours is checked here.
    for name in ("process_index", "num_processes", "device", "distributed_type", "mixed_precision"):
        assert hasattr(ours, name), name
    for name in ("wait_for_everyone", "main_process_first", "split_between_processes", "print"):
        assert hasattr(PartialState, name) and hasattr(ours, name), name


@pytest.mark.parametrize("cls", ["PartialState", "AcceleratorState"])
def test_state_classes_have_accelerates_public_names(cls):
    theirs = getattr(accelerate.state, cls)
    missing = [
        n for n in dir(theirs) if not n.startswith("_") and not hasattr(getattr(nbaccel, cls), n)
    ]
    assert not missing, f"nbaccel.{cls} lacks {missing}"


def test_ddp_kwargs_register_a_comm_hook_on_a_model_wrapped_by_hand():
    # In a rank, not in this process: freeing a DDP model whose gloo group ran a Python comm
    # hook can deadlock in gloo's destructor (it joins a thread that waits for the GIL the
    # freeing thread holds); it hung a pytest-xdist worker. Ranks leave by os._exit.
    name = nbaccel.notebook_launcher(
        _wrapped_hook_name, args=("FP16", "NO"), num_processes=1, progress=False
    )
    assert name == "fp16_compress_hook", name


def _wrapped_hook_name(hook: str, wrapper: str) -> str:
    """In a launched rank: DDP with the comm hook nbaccel registers; the hook's name."""
    import torch
    import torch.distributed as dist

    from nbaccel.utils import DDPCommunicationHookType as Types
    from nbaccel.utils import DistributedDataParallelKwargs

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    kwargs = DistributedDataParallelKwargs(
        comm_hook=getattr(Types, hook), comm_wrapper=getattr(Types, wrapper)
    )
    kwargs.register_comm_hook(model)
    model(torch.ones(2, 4)).sum().backward()
    assert model.module.weight.grad is not None
    return model._get_ddp_logging_data().get("comm_hook")


# BF16 is torch's too, but its wrapper refuses gloo ("requires CUDA 11+ and NCCL 2.10+").
@pytest.mark.slow  # real ranks: a PowerSGD group freed in the test process can deadlock in
# gloo's destructor (ranks never tear it down)
@pytest.mark.parametrize("hook, wrapper", [("POWER_SGD", "FP16"), ("BATCHED_POWER_SGD", "FP16")])
def test_ddp_kwargs_wrap_powersgd_in_a_compressing_cast(hook, wrapper):
    # torch names the casts fp16_compress_wrapper/bf16_compress_wrapper; a misspelt lookup
    # raised AttributeError for every PowerSGD hook with a wrapper.
    name = nbaccel.notebook_launcher(
        _wrapped_hook_name, args=(hook, wrapper), num_processes=2, progress=False
    )
    assert name.endswith(f"{wrapper.lower()}_compress_wrapper_hook"), name


@pytest.mark.parametrize("name", UTILS)
def test_utils_names(name):
    import accelerate.utils

    assert hasattr(accelerate.utils, name), f"accelerate.utils has no {name}: fix the list"
    assert getattr(nbaccel.utils, name) is not None


def test_distributed_type_has_accelerates_members():
    import accelerate.utils

    theirs = {m.name: m.value for m in accelerate.utils.DistributedType}
    ours = {m.name: m.value for m in nbaccel.utils.DistributedType}
    assert ours == theirs  # names and values: `== DistributedType.MULTI_XPU` ports unchanged


def test_config_dataclasses_have_accelerates_fields():
    import dataclasses

    import accelerate.utils

    for name in UTILS:
        theirs = getattr(accelerate.utils, name)
        if not dataclasses.is_dataclass(theirs):
            continue
        ours = getattr(nbaccel.utils, name)
        fields = {f.name: f.default for f in dataclasses.fields(theirs)}
        our_fields = {f.name: f.default for f in dataclasses.fields(ours)}
        assert fields.keys() <= our_fields.keys(), (name, fields.keys() - our_fields.keys())
        for field, default in fields.items():
            if isinstance(default, (bool, int, float, str, type(None))):
                assert our_fields[field] == default, (name, field)


def test_nbaccel_never_imports_accelerate():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "accelerate" or n.startswith("accelerate.") for n in names):
                offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders


def compatibility_table() -> str:
    """The README's table (printed by ``python -m tests.test_accelerate_surface``)."""
    rows = ["| Not supported | Why |", "|---|---|"]
    for reason, names in EXCLUDED.items():
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | {reason} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(compatibility_table())
