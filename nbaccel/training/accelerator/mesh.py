"""What an Accelerator knows of its ``DeviceMesh`` (``Accelerator(parallelism_config=...)``):
the mesh, each dimension's rank, and which ranks are data-parallel (they see different
batches; the ranks of one tensor-parallel group see the same ones).

Example::

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    accelerator.torch_device_mesh["tp"].get_local_rank(), accelerator.data_parallel_shard_rank
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nbaccel.core import parallelism_settings
from nbaccel.training.accelerator.parts import AcceleratorParts
from nbaccel.training.distributed import ProcessState

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from nbaccel.training.parallelism_config import ParallelismConfig


class MeshFacts(AcceleratorParts):
    """Accelerate's mesh properties, mixed into the Accelerator."""

    _parallelism: ParallelismConfig | None = None
    _mesh: DeviceMesh | None = None
    _cp_warned = False  # Accelerate warns once per process that the block does nothing

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The ``ParallelismConfig`` this Accelerator runs, or None."""
        return self._parallelism

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The ranks' ``DeviceMesh`` (dimensions ``dp_replicate, dp_shard, cp, tp``, the enabled
        ones, and the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``), or None."""
        return self._mesh

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Accelerate's: whether the run is FSDP2 (composable with tensor parallelism)."""
        return bool(self._strategy.is_fsdp2)

    def _mesh_rank(self, dim: str, what: str) -> int:
        config = self._parallelism
        if config is None:
            raise RuntimeError(f"{what} is not configured. Set `parallelism_config` first.")
        if self._mesh is None or dim not in config.active_mesh_dims:
            return 0
        return int(self._mesh.get_local_rank(dim))

    @property
    def tensor_parallel_rank(self) -> int:
        """This rank's index in its tensor-parallel group (0 where tp is not enabled)."""
        return self._mesh_rank("tp", "Tensor parallelism")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index along ``dp_replicate`` (0 where it is not enabled)."""
        return self._mesh_rank("dp_replicate", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's index along ``dp_shard`` (0 where it is not enabled)."""
        return self._mesh_rank("dp_shard", "Shard-based data parallelism")

    @property
    def context_parallel_rank(self) -> int:
        """Not supported, as in Accelerate."""
        raise NotImplementedError("Context parallelism is currently not supported in Accelerate.")

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate's: split ``buffers`` along their sequence dimensions over the ``cp``
        ranks for the block (torch's ``context_parallel``, on GPUs: a CPU launch refuses
        ``cp_size > 1`` when the Accelerator is made); without context parallelism it does
        nothing, with Accelerate's warning.

        Example::

            with accelerator.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1]):
                loss = model(ids, labels=labels).loss
        """
        config = self._parallelism
        if config is None or not config.cp_enabled or self._mesh is None:
            if not getattr(MeshFacts, "_cp_warned", False):
                MeshFacts._cp_warned = True
                warnings.warn(
                    "Context parallel training is not enabled. This context manager will have "
                    "no effect. To enable it, set `parallelism_config.cp_size` > 1 in the "
                    "`Accelerator` constructor.",
                    stacklevel=3,
                )
            yield
            return
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        assert config.cp_handler is not None  # set with cp_size > 1
        set_rotate_method(config.cp_handler.cp_comm_strategy or "allgather")
        with context_parallel(
            self._mesh["cp"],
            buffers=buffers,
            buffer_seq_dims=buffer_seq_dims,
            no_restore_buffers=no_restore_buffers,
        ):
            yield

    def mesh_coordinates(self) -> dict[str, int]:
        """nbaccel's: this rank's index along each enabled mesh dimension
        (``{"dp_shard": 1, "tp": 0}``); empty without a parallelism config.

        Example::

            accelerator.print(accelerator.mesh_coordinates())
        """
        config = self._parallelism
        if config is None:
            return {}
        return parallelism_settings.coordinates(config._sizes, self.process_index)

    def _mesh_report(self) -> dict[str, str]:
        """The mesh and this rank's place in it, for the launch's banner and role column."""
        config = self._parallelism
        if config is None or self._mesh is None:
            return {}
        place = ", ".join(f"{d} {i}" for d, i in self.mesh_coordinates().items())
        return {"parallelism": config.describe(), "coordinates": place}

    def _data_parallel_state(self) -> Any:
        """The facts a prepared loader shards by: the data-parallel ranks only, so the ranks of
        one tensor-parallel (or context-parallel) group load the same batches."""
        config = self._parallelism
        if config is None or not config.non_dp_dim_names:
            return self.state
        inner = config.non_data_parallel_size
        return dataclasses.replace(
            ProcessState(
                process_index=self.process_index,
                local_process_index=self.local_process_index,
                num_processes=self.num_processes,
                local_num_processes=self.state.local_num_processes,
                device=self.device,
                backend=self.state.backend,
            ),
            process_index=self.process_index // inner,
            num_processes=config.data_parallel_size,
        )

    def _data_parallel_ranks(self) -> list[int] | None:
        """The global ranks whose gathered data counts once each (the first of every
        tensor-parallel group), or None when every rank's does."""
        config = self._parallelism
        if config is None or not config.non_dp_dim_names:
            return None
        inner = config.non_data_parallel_size
        return list(range(0, self.num_processes, inner))
