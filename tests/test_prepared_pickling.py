"""A prepared optimizer pickles and deep-copies like Accelerate's AcceleratedOptimizer: the
copy wraps a copy of the optimizer, with its state, and still steps."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import nbaccel


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_prepared_optimizer_round_trips(how):
    acc = nbaccel.Accelerator(cpu=True)
    model, opt = acc.prepare(
        torch.nn.Linear(3, 1), torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    )
    del model
    param = opt.param_groups[0]["params"][0]
    param.sum().backward()
    opt.step()
    copied = pickle.loads(pickle.dumps(opt)) if how == "pickle" else copy.deepcopy(opt)
    assert type(copied) is type(opt) and copied is not opt
    assert copied.optimizer is not opt.optimizer
    assert copied.param_groups[0]["lr"] == 0.1
    ours, theirs = opt.state_dict()["state"][0], copied.state_dict()["state"][0]
    assert torch.equal(ours["exp_avg"], theirs["exp_avg"])
    new_param = copied.param_groups[0]["params"][0]
    assert torch.equal(new_param, param)
    new_param.grad = torch.ones(2)
    copied.step()  # the copy steps its own parameter, not the original's
    assert not torch.equal(new_param, param)
