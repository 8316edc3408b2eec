"""N-D parallelism over a ``DeviceMesh`` (``Accelerator(parallelism_config=...)``): tensor
parallelism over the ``tp`` dimension, then FSDP2 over ``dp_shard_cp`` (HSDP with
``dp_replicate``), or replicas whose gradients are averaged over ``dp_replicate``.

The model's layers are split first: a model already holding ``DTensor`` parameters (a
transformers model loaded with ``tp_plan="auto"`` and the accelerator's mesh, or one the user
parallelized) keeps its split; any other model is split by the plan in
``ParallelismConfig(tp_handler=TorchTensorParallelConfig(plan=...))``. Every rank starts from rank
0's weights. Full state dicts (``get_state_dict``, ``save_model``, ``save_state``) gather the
``DTensor`` shards as the FSDP strategy's do, for a split model FSDP2 did not shard too;
loading them splits them again.

Example::

    pc = ParallelismConfig(dp_shard_size=2, tp_size=2,
                           tp_handler=TorchTensorParallelConfig(plan={"up": "colwise",
                                                                      "down": "rowwise"}))
    accelerator = Accelerator(parallelism_config=pc)
    model, optimizer = accelerator.prepare(model, optimizer)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from nbaccel.core.parallelism_settings import divisors
from nbaccel.training.accumulation import GradientState
from nbaccel.training.distributed import DistributedType, ProcessState
from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin
from nbaccel.training.parallelism_config import ParallelismConfig
from nbaccel.training.precision import Precision
from nbaccel.training.strategies.fsdp import FSDPStrategy

# A plan's words (transformers' names for the ones its models use) -> torch's split.
_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}


class MeshStrategy(FSDPStrategy):
    """Tensor parallel, then FSDP2/HSDP or averaged replicas, over a parallelism config's mesh."""

    name = "fsdp"  # what the settings report and the config panel name (FSDP2 underneath)

    def __init__(
        self,
        state: ProcessState,
        config: ParallelismConfig,
        mesh: DeviceMesh,
        plugin: FullyShardedDataParallelPlugin | None = None,
    ) -> None:
        super().__init__(state, plugin)
        self.config, self.device_mesh = config, mesh
        self.shards = config.dp_shard_enabled or config.cp_enabled
        if not self.shards:
            self.name = "tp"  # type: ignore[misc]  # tensor parallel, replicas averaged here
        self.is_fsdp2 = self.shards  # type: ignore[misc]  # per instance: FSDP2 only when sharding
        self._params: list[torch.nn.Parameter] = []

    def distributed_type(self) -> DistributedType | None:
        return DistributedType.FSDP if self.shards else None

    @property
    def full_state_on_every_rank(self) -> bool:
        return False

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module.to(self.state.device)
        before = dict(module.named_parameters())
        split = any(isinstance(p, DTensor) for p in before.values())
        if not split:  # every rank starts from rank 0's weights, as sync_module_states does
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
        if self.config.tp_enabled:
            _check_heads(module, self.config.size("tp"))
        if self.config.tp_enabled and not split:
            _split_layers(module, self.config, self.device_mesh["tp"])
        if self.shards:
            if self.plugin.cpu_ram_efficient_loading:
                raise ValueError(
                    "cpu_ram_efficient_loading=True cannot be combined with a "
                    "parallelism_config; load the model on every rank (it is split right after)."
                )
            self.plugin.sync_module_states = False  # done above, before the split
            self._mesh = _fsdp_mesh(self.config)
            module = super().setup_module(module)
        # Splitting and sharding replaced the parameters: an optimizer made before prepare is
        # pointed at the new ones (setup_optimizer).
        after = dict(module.named_parameters())
        self._new_params.update({id(p): after[name] for name, p in before.items()})
        return module

    def backward(
        self, loss: torch.Tensor, precision: Precision, gs: GradientState, **kwargs: Any
    ) -> None:
        super().backward(loss, precision, gs, **kwargs)
        if self.shards or not self.config.dp_replicate_enabled or not gs.sync_gradients:
            return
        # Replicas of a tensor-parallel model (dp_replicate × tp): average the gradients of
        # each rank's own shards over the ranks that hold the same shards.
        group = self.device_mesh["dp_replicate"].get_group()
        for param in self._params:
            if param.grad is not None:
                grad = param.grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                dist.all_reduce(local, op=dist.ReduceOp.AVG, group=group)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        return optimizer

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        params = [p for p in parameters if p.grad is not None]
        if all(isinstance(p, DTensor) for p in params) and self.shards:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        # A tensor-parallel model mixes split (DTensor) and replicated (plain) parameters:
        # the norm adds each split gradient's full norm to the replicated ones'.
        grads = [p.grad for p in params if p.grad is not None]
        norms = [
            (g.full_tensor() if isinstance(g, DTensor) else g).detach().float().norm(norm_type)
            for g in grads
        ]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    def holds_shards(self, module: torch.nn.Module | None) -> TypeGuard[torch.nn.Module]:
        # A split model holds DTensor shards whether or not FSDP2 sharded it further.
        return module is not None and any(isinstance(p, DTensor) for p in module.parameters())


def _fsdp_mesh(config: ParallelismConfig) -> DeviceMesh:
    """The mesh FSDP2 shards over (Accelerate's ``fsdp_dim_names``): ``dp_shard_cp``, with
    ``dp_replicate`` before it for HSDP. Without context parallelism ``dp_shard_cp`` is
    ``dp_shard`` itself, which the root mesh slices without torch's deprecation warning."""
    names = [
        "dp_shard" if name == "dp_shard_cp" and not config.cp_enabled else name
        for name in config.fsdp_dim_names
    ]
    return config.submesh(*names)


def _split_layers(module: torch.nn.Module, config: ParallelismConfig, mesh: DeviceMesh) -> None:
    """Split the model's layers by the user's plan, else by the model's own (a transformers
    model's ``tp_plan``), after checking that it names real layers whose sizes tp divides."""
    plan = getattr(config.tp_handler, "plan", None) or getattr(module, "tp_plan", None)
    if not plan:
        raise ValueError(
            f"tp_size={config.tp_size}, but {type(module).__name__} has no tensor-parallel "
            "plan; pass ParallelismConfig(tp_handler=TorchTensorParallelConfig(plan={"
            "'<layer>': 'colwise', '<next layer>': 'rowwise'})), or split it yourself with "
            "torch's parallelize_module(model, accelerator.torch_device_mesh['tp'], plan)."
        )
    names = [name for name, _ in module.named_modules()]
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(
                f"the tensor-parallel plan names {pattern!r}, which is no module of "
                f"{type(module).__name__}; its modules include "
                f"{', '.join(repr(n) for n in names[1:8])}."
            )
        if isinstance(style, str):
            if style not in _STYLES:
                raise ValueError(
                    f"plan[{pattern!r}] = {style!r} is not a split nbaccel knows; use one of "
                    f"{', '.join(map(repr, _STYLES))} or a torch.distributed.tensor.parallel "
                    "style."
                )
            style = _STYLES[style]()
        for name in matched:
            _check_divides(name, module.get_submodule(name), style, config.size("tp"))
        styles[pattern] = style
    parallelize_module(module, mesh, styles)


def _check_divides(name: str, layer: torch.nn.Module, style: ParallelStyle, tp: int) -> None:
    if isinstance(layer, torch.nn.Embedding) and layer.num_embeddings % tp:
        fits = [d for d in divisors(layer.num_embeddings) if d > 1]
        raise ValueError(
            f"tp_size={tp} does not divide {name}'s num_embeddings ({layer.num_embeddings}); "
            f"a tp_size of {' or '.join(map(str, fits)) or 'none above 1'} would."
        )
    if not isinstance(layer, torch.nn.Linear):
        return
    dim, size = (
        ("out_features", layer.out_features)
        if isinstance(style, ColwiseParallel)
        else ("in_features", layer.in_features)
    )
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and size % tp:
        fits = [d for d in divisors(size) if d > 1]
        raise ValueError(
            f"tp_size={tp} does not divide {name}'s {dim} ({size}); a tp_size of "
            f"{' or '.join(map(str, fits)) or 'none above 1'} would."
        )


def _check_heads(module: torch.nn.Module, tp: int) -> None:
    """A transformers-style config's heads and hidden size must split evenly over tp ranks."""
    config = getattr(module, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads", "hidden_size"):
        size = getattr(config, field, None)
        if isinstance(size, int) and size % tp:
            fits = [d for d in divisors(size) if d > 1]
            raise ValueError(
                f"tp_size={tp} does not divide the model's {field} ({size}); a tp_size of "
                f"{' or '.join(map(str, fits)) or 'none above 1'} would."
            )
