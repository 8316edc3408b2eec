"""Accelerate's FSDP docs snippet (FSDP1 state dict configs) works: offload_to_cpu/rank0_only
gather full state dicts in CPU memory on rank 0 only, and save_state/load_state still work."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

import nbaccel
from nbaccel.training.fsdp_plugin import FullyShardedDataParallelPlugin as Plugin
from tests.test_fsdp_training import _build, _full, _step


def _plugin(**kwargs) -> Plugin:
    return Plugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
        **kwargs,
    )


def test_the_docs_snippet_is_accepted():
    plugin = _plugin(state_dict_type="FULL_STATE_DICT")
    assert plugin.state_dict_options().cpu_offload
    assert plugin.state_dict_options(optimizer=True).cpu_offload
    assert not Plugin().state_dict_options().cpu_offload  # default: every rank gets it


def rank0_gathering(folder: str) -> dict:
    acc, model, opt = _build(_plugin())
    _step(acc, model, opt, 0)
    state = acc.get_state_dict(model)
    acc.save_state(folder)
    before = _full(acc, model)  # a collective: every rank calls it, rank 0 gets the weights
    _step(acc, model, opt, 1)
    acc.load_state(folder)
    after = _full(acc, model)
    return {
        "keys": sorted(state),
        "devices": sorted({str(v.device) for v in state.values()}),
        "restored": before.keys() == after.keys()
        and all(torch.equal(before[k], after[k]) for k in before),
    }


@pytest.mark.slow
def test_rank0_only_cpu_state_dicts_on_two_ranks(tmp_path):
    r0, r1 = nbaccel.notebook_launcher(
        rank0_gathering, args=(str(tmp_path),), num_processes=2, return_all=True, progress=False
    )
    assert r0["keys"] and r0["devices"] == ["cpu"]
    assert r1["keys"] == []  # rank0_only: the other ranks get an empty dict, as with Accelerate
    assert r0["restored"] and r1["restored"]
