"""The FSDP strategy: shard parameters, gradients and optimizer state with torch's FSDP2.

A :class:`~nbaccel.training.fsdp_plugin.FullyShardedDataParallelPlugin` says how: its wrap
policy picks the submodules that become their own ``fully_shard`` unit (bottom-up), then the
root is sharded; CPU offload, resharding after forward and the mixed-precision policy go to
every unit; activation checkpointing wraps the chosen blocks first. The optimizer built on the
unsharded parameters is pointed at the sharded ones. ``get_state_dict`` gathers full tensors;
``save_state`` writes full files or, with ``SHARDED_STATE_DICT``, torch.distributed.checkpoint
folders (each rank its own shard).

Example::

    acc = Accelerator(strategy="fsdp")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from nbaccel.training.distributed import DistributedType, ProcessState
from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.sharded_files import save_sharded_model, save_sharded_optimizer

_FULL = StateDictOptions(full_state_dict=True)


class FSDPStrategy(Strategy):
    """FSDP2 (``fully_shard``) over all ranks of this launch, configured by a plugin."""

    name = "fsdp"
    is_fsdp2 = True

    def __init__(
        self, state: ProcessState, plugin: FullyShardedDataParallelPlugin | None = None
    ) -> None:
        super().__init__(state)
        self.plugin = plugin if plugin is not None else FullyShardedDataParallelPlugin()
        self._mesh: DeviceMesh | None = None
        self._new_params: dict[int, torch.nn.Parameter] = {}

    def distributed_type(self) -> DistributedType | None:
        return DistributedType.FSDP if self.state.distributed else None

    def plugins(self) -> dict[str, Any]:
        return {"fsdp_plugin": self.plugin}

    @property
    def collective_checkpoint(self) -> bool:
        """Whether ``save_state`` writes per-rank shards (``SHARDED_STATE_DICT``)."""
        return self.plugin.state_dict_type == "SHARDED_STATE_DICT"

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        plugin = self.plugin
        policy = plugin.wrap_policy(module)
        blocks = _blocks(module, policy)
        if plugin.activation_checkpointing:
            if policy is None:
                raise ValueError(
                    "activation_checkpointing=True needs an auto_wrap_policy to say which blocks "
                    "to recompute (e.g. 'transformer_based_wrap' with transformer_cls_names_to_wrap)."
                )
            blocks = _checkpoint_outermost(module, blocks)
        if not self.state.distributed:
            return module.to(self.state.device)  # nothing to shard across
        before = dict(module.named_parameters())
        device = self.state.device
        if plugin.cpu_ram_efficient_loading:
            held = _hand_over(module, self.state.is_main_process)
            module.to(torch.device("meta"))  # rank 0's copy is in `held`; no second copy is made
        else:
            module.to(device)
            if plugin.sync_module_states:
                for tensor in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(tensor.data, src=0)
        if self._mesh is None:
            self._mesh = init_device_mesh(device.type, (self.state.num_processes,))
        kwargs = {
            "mesh": self._mesh,
            "reshard_after_forward": plugin.reshard_after_forward,
            "mp_policy": plugin.mixed_precision_policy,
            "offload_policy": self._offload_policy(),
            "ignored_params": plugin.ignored_params(module),
        }
        for block in blocks:
            if not isinstance(block, FSDPModule):
                fully_shard(block, **kwargs)
        # The root's own parameters are needed again at the start of backward; torch's default
        # (None) keeps them gathered, as Accelerate does.
        fully_shard(module, **{**kwargs, "reshard_after_forward": None})
        if plugin.cpu_ram_efficient_loading:
            _receive(module, held, device, plugin.offloads_to_cpu)
        after = dict(module.named_parameters())
        self._new_params.update({id(p): after[name] for name, p in before.items()})
        return module

    def _offload_policy(self) -> Any:
        offload = self.plugin.cpu_offload
        # Pinning needs an accelerator to pin for; on a CPU-only machine it would fail.
        if (
            isinstance(offload, CPUOffloadPolicy)
            and offload.pin_memory
            and not torch.cuda.is_available()
        ):
            return CPUOffloadPolicy(pin_memory=False)
        return offload

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # fully_shard replaced the parameters with sharded DTensors; an optimizer created before
        # prepare still holds the old ones and would update nothing.
        if optimizer.state:
            raise RuntimeError(
                "this optimizer has already taken steps; with strategy='fsdp' prepare it before "
                "training (its state cannot follow the parameters into their shards)."
            )
        for group in optimizer.param_groups:
            group["params"] = [self._new_params.get(id(p), p) for p in group["params"]]
        return optimizer

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        return _no_grad_sync(module) if isinstance(module, FSDPModule) else contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- full state dicts (get_state_dict, save_model, FULL_STATE_DICT checkpoints) ----------

    def holds_shards(self, module: torch.nn.Module | None) -> TypeGuard[torch.nn.Module]:
        """Whether ``module``'s full state is gathered from shards (torch's state-dict
        functions) rather than read as it is."""
        return isinstance(module, FSDPModule)

    def model_state_dict(self, module: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        if not self.holds_shards(module):
            return module.state_dict()
        # A collective: every rank calls it (rank 0 alone gets it with state_dict_config's
        # offload_to_cpu/rank0_only, as Accelerate's FSDP2 gathering).
        return get_model_state_dict(module, options=self.plugin.state_dict_options())

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        if not self.holds_shards(module):
            module.load_state_dict(state)
            return
        set_model_state_dict(module, state, options=_FULL)

    def optimizer_state_dict(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        if not self.holds_shards(module):
            return optimizer.state_dict()
        options = self.plugin.state_dict_options(optimizer=True)
        return get_optimizer_state_dict(module, optimizer, options=options)

    def load_optimizer_state_dict(
        self,
        module: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> None:
        if not self.holds_shards(module):
            optimizer.load_state_dict(state)
            return
        set_optimizer_state_dict(module, optimizer, state, options=_FULL)

    # -- save_state / load_state: full files, or with SHARDED_STATE_DICT a folder per object --

    def save_model(self, module: torch.nn.Module, target: Path) -> dict[str, Any] | None:
        if not self.collective_checkpoint:
            return super().save_model(module, target)
        save_sharded_model(module, target)
        return None

    def save_optimizer(
        self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer, target: Path
    ) -> dict[str, Any] | None:
        if not self.collective_checkpoint or module is None:
            return super().save_optimizer(module, optimizer, target)
        save_sharded_optimizer(module, optimizer, target)
        return None


def _blocks(
    root: torch.nn.Module, policy: Callable[[torch.nn.Module], bool] | None
) -> list[torch.nn.Module]:
    """The submodules ``policy`` picks, children before parents (the order fully_shard needs)."""
    if policy is None:
        return []
    below = list(root.modules())[1:]  # pre-order: a parent comes before its children
    return [m for m in reversed(below) if any(True for _ in m.parameters()) and policy(m)]


def _checkpoint_outermost(
    root: torch.nn.Module, blocks: list[torch.nn.Module]
) -> list[torch.nn.Module]:
    """Wrap the outermost chosen blocks in non-reentrant activation checkpointing (recomputing
    an outer block recomputes what is inside it) and return ``blocks`` with the wrappers."""
    chosen = {id(b) for b in blocks}
    wrapped: dict[int, torch.nn.Module] = {}

    def visit(parent: torch.nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if id(child) in chosen and id(child) not in wrapped:
                wrapped[id(child)] = checkpoint_wrapper(
                    child, checkpoint_impl=CheckpointImpl.NO_REENTRANT
                )
                setattr(parent, name, wrapped[id(child)])
            elif id(child) not in chosen:
                visit(child)

    visit(root)
    return [wrapped.get(id(b), b) for b in blocks]


def _hand_over(module: torch.nn.Module, main: bool) -> dict[str, Any]:
    """What rank 0 keeps before the model goes to the meta device: its state dict and the
    non-persistent buffers (not in any state dict, yet needed by forward)."""
    transient = {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in sub._non_persistent_buffers_set
    }
    buffers = {k: v for k, v in module.named_buffers() if k in transient}
    if not main:
        return {"state": {}, "transient": {k: (v.shape, v.dtype) for k, v in buffers.items()}}
    state = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
    return {"state": state, "transient": {k: v.detach().to("cpu") for k, v in buffers.items()}}


def _receive(module: torch.nn.Module, held: dict[str, Any], device: torch.device, offload: bool):
    """Broadcast rank 0's weights into the sharded meta model: each rank keeps its own shard."""
    main = dist.get_rank() == 0
    loaded: dict[str, torch.Tensor] = {}
    for key, empty in module.state_dict().items():
        local = empty.to_local() if isinstance(empty, DTensor) else empty
        if main:
            full = held["state"][key].to(device=device, dtype=local.dtype).contiguous()
        else:
            full = torch.empty(empty.shape, dtype=local.dtype, device=device)
        dist.broadcast(full, src=0)
        if isinstance(empty, DTensor):
            full = distribute_tensor(full, empty.device_mesh, empty.placements)
        loaded[key] = full.to("cpu") if offload and isinstance(empty, DTensor) else full
    module.load_state_dict(loaded, assign=True)
    for fqn, value in held["transient"].items():
        tensor = value.to(device) if main else torch.empty(value[0], dtype=value[1], device=device)
        dist.broadcast(tensor, src=0)
        parent, _, name = fqn.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        owner.register_buffer(name, tensor, persistent=False)


@contextlib.contextmanager
def _no_grad_sync(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
