"""Accelerate's ``ParallelismConfig``: data-parallel replicate × shard × context × tensor
parallel sizes, and the ``DeviceMesh`` built from them.

Fields, defaults (``PARALLELISM_CONFIG_*`` variables for a size left unset), validation, the
mesh's dimension order (``dp_replicate, dp_shard, cp, sp, tp``) and its flattened sub-meshes
(``dp``, ``dp_shard_cp``, ``dp_cp``) are Accelerate 1.15's. Two differences, both where
Accelerate raises: it runs on CPU ranks (gloo), and ``dp_replicate_size > 1`` with
``tp_size > 1`` and no sharding runs (gradients averaged over the replicas) where Accelerate
refuses it. ``TorchTensorParallelConfig(plan=...)`` is nbaccel's way to split any torch model.

>>> pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
>>> pc.total_size, pc.dp_dim_names, pc.non_dp_dim_names, pc.fsdp_dim_names
(4, ['dp_shard'], ['tp'], ['dp_shard_cp'])
>>> pc.describe()
'dp_shard 2 × tp 2'
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any

from nbaccel.core import parallelism_settings
from nbaccel.core.parallelism_settings import MESH_ORDER

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclasses.dataclass
class TorchTensorParallelConfig:
    """Accelerate's tensor-parallel handler, plus nbaccel's ``plan``: which submodules to split
    and how, for a model that brings no plan of its own (a transformers model brings one:
    ``from_pretrained(..., tp_plan="auto", device_mesh=accelerator.torch_device_mesh)``).

    ``plan`` maps module names (``*`` matches one level, as in ``parallelize_module``) to a
    ``torch.distributed.tensor.parallel`` style or ``"colwise"``/``"rowwise"``.

    >>> TorchTensorParallelConfig(plan={"mlp.up": "colwise", "mlp.down": "rowwise"}).plan
    {'mlp.up': 'colwise', 'mlp.down': 'rowwise'}
    """

    enable_async_tp: bool = False
    plan: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn(
                "Async tensor parallelism is not supported; enable_async_tp is ignored.",
                stacklevel=2,
            )


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Accelerate's context-parallel handler (``cp_comm_strategy``: allgather or alltoall).

    >>> TorchContextParallelConfig().cp_comm_strategy
    'allgather'
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(
                "PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather"
            )
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of "
                "'allgather' or 'alltoall'."
            )


@dataclasses.dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's DeepSpeed (Ulysses) sequence-parallel handler; nbaccel does not run
    sequence parallelism (``sp_size > 1`` is refused by the Accelerator).

    >>> DeepSpeedSequenceParallelConfig().sp_seq_length is None
    True
    """

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None


def _env_size(name: str) -> int:
    return int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))


@dataclasses.dataclass
class ParallelismConfig:
    """How ranks split the work: ``dp_replicate_size`` × ``dp_shard_size`` × ``cp_size`` ×
    ``tp_size`` (× ``sp_size``) ranks, as in Accelerate.

    ``dp_shard_size > 1`` is FSDP2 over those ranks, with ``dp_replicate_size > 1`` too HSDP;
    ``tp_size > 1`` splits layers over neighbouring ranks, which all see the same batches.

    Example::

        pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
        accelerator = Accelerator(parallelism_config=pc)
        accelerator.torch_device_mesh["tp"]      # this rank's tensor-parallel group

    >>> ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).fsdp_dim_names
    ['dp_replicate', 'dp_shard_cp']
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None

    device_mesh = None  # built by get_device_mesh (a class attribute in Accelerate too)
    _flattened: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        sizes: dict[str, int] = {}
        for dim in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            given = getattr(self, f"{dim}_size")
            sizes[dim] = _env_size(dim) if given is None else given
            setattr(self, f"{dim}_size", sizes[dim])
        if self.cp_backend is None:
            self.cp_backend = os.environ.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        if self.sp_backend is None:
            self.sp_backend = os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        if sizes["tp"] > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if sizes["cp"] > 1:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ValueError(
                    f"ParallelismConfig's cp_backend={self.cp_backend} requires "
                    f"TorchContextParallelConfig, but cp_handler was set to "
                    f"{type(self.cp_handler)}"
                )
        if sizes["sp"] > 1 and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()
        for dim, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{dim}_size must be at least 1, but got {size}")
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend must be one of ['torch'], but got {self.cp_backend}")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be one of ['deepspeed'], but got {self.sp_backend}")
        if sizes["cp"] > 1 and sizes["sp"] > 1:
            raise ValueError(
                "Context Parallelism (CP) and Sequence Parallelism (SP) are mutually exclusive. "
                f"Got cp_size={sizes['cp']} and sp_size={sizes['sp']}. "
                "Please set either cp_size=1 or sp_size=1."
            )
        # Accelerate refuses dp_replicate × tp without sharding (it cannot compose DDP with
        # TP); nbaccel averages the replicas' gradients itself, so that composition runs.
        self._sizes = {dim: sizes[dim] for dim in MESH_ORDER}

    def size(self, dim: str) -> int:
        """The size of dimension ``dim`` ("tp", "dp_shard", ...), 1 when it is not enabled.

        Example::

            config.size("tp")
        """
        return self._sizes[dim]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{dim}_size={self._sizes[dim]}" for dim in MESH_ORDER)
        return f"ParallelismConfig({sizes}, total_size={self.total_size})"

    def to_json(self) -> dict[str, Any]:
        """The fields as plain values (handlers as dicts), without the mesh."""
        return {
            k: copy.deepcopy(v.__dict__) if dataclasses.is_dataclass(v) else v
            for k, v in self.__dict__.items()
            if k not in ("device_mesh", "_sizes")
        }

    # -- which dimensions ------------------------------------------------------------------

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dimensions across which data parallelism is applied."""
        return [d for d in ("dp_replicate", "dp_shard") if self._sizes[d] > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose ranks receive the same batch."""
        return [d for d in ("tp", "cp", "sp") if self._sizes[d] > 1]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions flattened into the mesh FSDP shards the model over."""
        return [d for d in ("dp_shard", "cp") if self._sizes[d] > 1]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions across which the loss is averaged."""
        return [d for d in ("dp_replicate", "dp_shard", "cp") if self._sizes[d] > 1]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Dimensions FSDP is applied across (with replication: HSDP)."""
        return [*(["dp_replicate"] if self.dp_replicate_enabled else []), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    # -- sizes -----------------------------------------------------------------------------

    @property
    def total_size(self) -> int:
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def non_data_parallel_size(self) -> int:
        return self._sizes["tp"] * self._sizes["cp"] * self._sizes["sp"]

    @property
    def data_parallel_size(self) -> int:
        return self._sizes["dp_replicate"] * self._sizes["dp_shard"]

    dp_replicate_enabled = property(lambda self: self._sizes["dp_replicate"] > 1)
    dp_shard_enabled = property(lambda self: self._sizes["dp_shard"] > 1)
    tp_enabled = property(lambda self: self._sizes["tp"] > 1)
    cp_enabled = property(lambda self: self._sizes["cp"] > 1)
    sp_enabled = property(lambda self: self._sizes["sp"] > 1)

    def describe(self) -> str:
        """``"dp_shard 2 × tp 2"`` (the banner's words)."""
        return parallelism_settings.describe(self._sizes)

    def _set_size(self, parallelism: str, size: int) -> None:
        if parallelism not in self._sizes:
            raise ValueError(f"Parallelism must be one of {list(self._sizes)}")
        self._sizes[parallelism] = size
        setattr(self, f"{parallelism}_size", size)

    # -- the mesh --------------------------------------------------------------------------

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]] | tuple[()]:
        dims = [d for d in MESH_ORDER if d in self.active_mesh_dims]
        if not dims:
            return ()
        return tuple(dims), tuple(self._sizes[d] for d in dims)

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ``DeviceMesh`` of the enabled dimensions, with the flattened ``dp``,
        ``dp_shard_cp`` and ``dp_cp`` sub-meshes (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self._get_mesh()
        if not mesh:
            return None
        names, shape = mesh
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        # The flattened meshes are kept: torch deprecates slicing them out of the root again.
        self._flattened = {
            flat: device_mesh[tuple(dims)]._flatten(flat)
            for flat, dims in (
                ("dp", self.dp_dim_names),
                ("dp_shard_cp", self.dp_shard_cp_dim_names),
                ("dp_cp", self.dp_cp_dim_names),
            )
            if dims
        }
        return device_mesh

    def submesh(self, *names: str) -> DeviceMesh:
        """The mesh of dimensions ``names`` (a flattened one, e.g. ``dp_shard_cp``, as kept when
        it was made); build the mesh first (``get_device_mesh``).

        Example::

            config.submesh("dp_replicate", "dp_shard_cp")   # what HSDP shards over
        """
        assert self.device_mesh is not None, "build the mesh first (get_device_mesh)"
        if len(names) == 1 and names[0] in self._flattened:
            return self._flattened[names[0]]
        return self.device_mesh[names]

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh | None:
        """The mesh, built on first call for ``device_type`` ("cpu", "cuda")."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("You need to pass a device_type e.g cuda to build the device mesh")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device_mesh is already created with device type "
                f"{self.device_mesh.device_type}, not {device_type}."
            )
        return self.device_mesh

    def _validate_accelerator(self, num_processes: int, is_main_process: bool) -> None:
        """Accelerate's checks against the launch: sizes that fit the ranks; what nbaccel
        cannot run (sequence parallelism) refused with the reason."""
        if num_processes == 1 and self.total_size == 1:
            return
        if self.total_size == 1:
            self._set_size("dp_replicate", num_processes)
        problem = parallelism_settings.world_mismatch(self._sizes, num_processes)
        if problem:
            raise ValueError(
                f"ParallelismConfig total_size ({self.total_size}) does not match "
                f"num_processes ({num_processes}): {problem}."
            )
        if self.sp_enabled:
            raise NotImplementedError(
                f"sp_size={self.sp_size}: DeepSpeed's sequence parallelism (Ulysses) does not "
                "run in nbaccel; split long sequences with cp_size (context parallelism, on "
                "GPUs) or shorten them."
            )
        ignored = [
            f"ParallelismConfig.{dim}_handler is set, but {dim}_size is set to 1. This handler "
            "will be ignored."
            for dim in ("tp", "cp", "sp")
            if self._sizes[dim] == 1 and getattr(self, f"{dim}_handler") is not None
        ]
        if ignored and is_main_process:
            warnings.warn(
                "ParallelismConfig has the following warnings:\n" + "\n".join(ignored),
                UserWarning,
                stacklevel=3,
            )
