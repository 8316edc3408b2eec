"""What an Accelerate user imports beyond the Accelerator: module paths (``accelerate.logging``,
``accelerate.tracking``, ``accelerate.state``), ``accelerate.utils`` helpers, the launchers'
parameters, each doing what Accelerate's does. Launch tests run real ranks (gloo on CPU);
``is_*_available`` is compared with the pinned Accelerate itself (a test-only dependency).
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys

import pytest
import torch

import nbaccel
import nbaccel.utils as U
from nbaccel import RankFailedError
from tests.test_accelerate_surface import _assert_same_parameters, _params

accelerate = pytest.importorskip("accelerate")

MODULE_PATHS = {
    "logging": ["get_logger"],
    "tracking": ["GeneralTracker", "on_main_process", "TensorBoardTracker", "WandBTracker"],
    "state": ["PartialState", "AcceleratorState", "DistributedType"],
    "local_sgd": ["LocalSGD"],
    "optimizer": ["AcceleratedOptimizer"],
    "scheduler": ["AcceleratedScheduler"],
}


@pytest.mark.parametrize("module", sorted(MODULE_PATHS))
def test_accelerates_module_paths_exist(module):
    import importlib

    theirs = importlib.import_module(f"accelerate.{module}")
    ours = importlib.import_module(f"nbaccel.{module}")
    for name in MODULE_PATHS[module]:
        assert hasattr(theirs, name), f"accelerate.{module} has no {name}: fix the list"
        assert hasattr(ours, name), f"nbaccel.{module} lacks {name}"


@pytest.mark.parametrize("name", ["notebook_launcher", "debug_launcher"])
def test_launchers_take_accelerates_parameters_in_its_order(name):
    theirs = _params(getattr(accelerate, name))
    _assert_same_parameters(theirs, _params(getattr(nbaccel, name)), name)


def test_availability_checks_agree_with_accelerate():
    import accelerate.utils

    from nbaccel.training.availability import NAMES

    # Accelerate returns None for some missing packages: compare truth values.
    pairs = {n: (getattr(U, n)(), bool(getattr(accelerate.utils, n)())) for n in NAMES}
    differ = {n: pair for n, pair in pairs.items() if pair[0] != pair[1]}
    assert not differ, f"(nbaccel, accelerate) differ: {differ}"


# -- accelerate.utils helpers, in one process ---------------------------------------------------


def test_send_to_device_leaves_skipped_keys_alone():
    meta = torch.ones(1)
    batch = {"x": torch.ones(2), "meta": meta}
    moved = U.send_to_device(batch, "meta", skip_keys="meta")
    assert moved["x"].device.type == "meta" and moved["meta"] is meta


def test_recursively_apply_with_test_type_and_extra_arguments():
    data = {"a": 2, "b": [3, "x"]}
    doubled = U.recursively_apply(
        lambda v, k: v * k, data, 10, test_type=lambda v: isinstance(v, int)
    )
    assert doubled == {"a": 20, "b": [30, "x"]}
    with pytest.raises(TypeError, match="only nested lists, tuples and dicts"):
        U.recursively_apply(lambda t: t, [torch.ones(1), "x"], error_on_other_type=True)


def test_concatenate_joins_nested_tensors_and_refuses_others():
    joined = U.concatenate([{"x": (torch.ones(1),)}, {"x": (torch.zeros(2),)}])
    assert joined["x"][0].tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(TypeError, match="can only join tensors"):
        U.concatenate([1, 2])


def test_convert_to_fp32_and_the_forward_wrapper():
    out = U.convert_to_fp32({"h": torch.ones(1, dtype=torch.float16), "i": torch.ones(1).long()})
    assert out["h"].dtype == torch.float32 and out["i"].dtype == torch.int64
    forward = U.convert_outputs_to_fp32(lambda x: (x.bfloat16(), x.half()))
    assert [t.dtype for t in forward(torch.ones(1))] == [torch.float32, torch.float32]


def test_patch_environment_restores_what_was_there():
    os.environ["NBACCEL_TEST_KEPT"] = "before"
    try:
        with U.patch_environment(nbaccel_test_kept=1, nbaccel_test_new="x"):
            assert os.environ["NBACCEL_TEST_KEPT"] == "1"
            assert os.environ["NBACCEL_TEST_NEW"] == "x"
        assert os.environ["NBACCEL_TEST_KEPT"] == "before"
        assert "NBACCEL_TEST_NEW" not in os.environ
    finally:
        os.environ.pop("NBACCEL_TEST_KEPT", None)


def test_tqdm_shows_on_the_local_main_process_only():
    with U.patch_environment(local_rank=1):
        assert U.tqdm(range(3)).disable
        assert not U.tqdm(range(3), main_process_only=False).disable
    with pytest.raises(ValueError, match="main_process_only=False"):
        U.tqdm(True, range(3))


def test_save_writes_on_the_main_process_only(tmp_path):
    U.save({"w": torch.ones(2)}, tmp_path / "main.pt")
    assert torch.load(tmp_path / "main.pt")["w"].tolist() == [1.0, 1.0]
    with U.patch_environment(rank=1, local_rank=0):
        U.save({"w": torch.ones(2)}, tmp_path / "other.pt")
        U.save({"w": torch.ones(2)}, tmp_path / "node.safetensors", True, True)
    assert not (tmp_path / "other.pt").exists()
    assert (tmp_path / "node.safetensors").exists()  # save_on_each_node: local rank 0 writes


def test_load_checkpoint_in_model_loads_as_accelerate_does_and_refuses_a_map_strategys_name(
    tmp_path,
):
    from accelerate.utils import load_checkpoint_in_model as accelerate_load

    saved = torch.nn.Linear(2, 2)
    U.save(saved.state_dict(), tmp_path / "w.pt")
    ours, theirs = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    # dtype without a device_map changes nothing in Accelerate 1.15: the weights load exactly
    # (nbaccel rounded them through bfloat16, keeping float32 parameters: other numbers).
    U.load_checkpoint_in_model(ours, tmp_path / "w.pt", dtype="bfloat16")
    accelerate_load(theirs, str(tmp_path / "w.pt"), dtype="bfloat16")
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(ours.weight, saved.weight)
    model = ours
    # A device map strategy's name is not a map: the error says what to pass instead
    with pytest.raises(ValueError, match="device_map='auto' names .*infer_auto_device_map"):
        U.load_checkpoint_in_model(model, tmp_path / "w.pt", device_map="auto")


def test_set_seed_deterministic_turns_on_deterministic_algorithms():
    try:
        U.set_seed(3, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_write_basic_config_writes_once(tmp_path):
    path = tmp_path / "config.yaml"
    assert U.write_basic_config("bf16", save_location=path) == path
    assert nbaccel.LaunchConfig.load(path).mixed_precision == "bf16"
    assert U.write_basic_config("fp16", save_location=path) is False  # left as it is
    assert nbaccel.LaunchConfig.load(path).mixed_precision == "bf16"


def test_elastic_options_a_notebook_cannot_honour_are_refused_before_any_rank_starts():
    across = r"rdzv_backend='c10d' across machines: .* nbaccel launch --rdzv_backend c10d"
    with pytest.raises(ValueError, match=across):
        nbaccel.notebook_launcher(print, num_processes=2, num_nodes=2, rdzv_backend="c10d")
    with pytest.raises(ValueError, match="nbaccel launch --rdzv_backend etcd"):
        nbaccel.notebook_launcher(print, num_processes=2, rdzv_backend="etcd")
    with pytest.raises(ValueError, match="monitor_interval must be positive"):
        nbaccel.notebook_launcher(print, num_processes=2, monitor_interval=0)


# -- in real ranks -------------------------------------------------------------------------------


def ranks_that_met() -> int:
    import torch.distributed as dist

    nbaccel.PartialState()  # joins the launch's rendezvous
    count = torch.ones(1)
    dist.all_reduce(count)
    return int(count.item())


@pytest.mark.slow
def test_c10d_on_one_machine_launches_as_accelerate_does():
    # Accelerate's notebook_launcher(rdzv_backend="c10d") on one machine: the same local ranks.
    assert nbaccel.notebook_launcher(ranks_that_met, num_processes=2, rdzv_backend="c10d") == 2


def logs_three_ways():
    from nbaccel import Accelerator
    from nbaccel.logging import get_logger

    logging.basicConfig(format="%(message)s", level=logging.INFO, force=True)
    acc = Accelerator()
    logger = get_logger("ported")
    logger.info("ONCE from %d", acc.process_index)
    logger.info("EVERY from %d", acc.process_index, main_process_only=False)
    logger.info("ORDERED from %d", acc.process_index, in_order=True)
    logger.warning_once("WARNED")
    logger.warning_once("WARNED")
    return acc.process_index


@pytest.mark.slow
def test_get_logger_logs_once_or_on_every_rank(capfd):
    nbaccel.notebook_launcher(logs_three_ways, num_processes=2, progress="text")
    err = capfd.readouterr().err
    assert err.count("ONCE from") == 1 and "[rank0] ONCE from 0" in err
    for rank in (0, 1):
        assert f"[rank{rank}] EVERY from {rank}" in err
        assert f"[rank{rank}] ORDERED from {rank}" in err
    assert err.count("WARNED") == 1  # main process only, and only once


def fails_the_first_time(marker_dir):
    import pathlib

    from nbaccel import Accelerator

    acc = Accelerator()
    marker = pathlib.Path(marker_dir, f"tried-{acc.process_index}")
    if not marker.exists():
        marker.touch()
        if acc.process_index == 1:
            raise RuntimeError("transient failure")
    acc.wait_for_everyone()
    return "done"


@pytest.mark.slow
def test_max_restarts_relaunches_every_rank_after_a_failure(tmp_path, capfd):
    assert (
        nbaccel.notebook_launcher(
            fails_the_first_time, args=(str(tmp_path),), num_processes=2, max_restarts=1
        )
        == "done"
    )
    assert "rank 1 failed (RuntimeError); restarting all 2 ranks (restart 1 of 1)" in (
        capfd.readouterr().err
    )
    for marker in tmp_path.iterdir():
        marker.unlink()
    with pytest.raises(RankFailedError, match="transient failure"):
        nbaccel.notebook_launcher(fails_the_first_time, args=(str(tmp_path),), num_processes=2)


def rank_0_fails():
    if nbaccel.PartialState().process_index == 0:
        raise ValueError("bad batch 7")


@pytest.mark.slow
def test_a_failed_rank_is_caught_as_torch_elastics_child_failed_error_too():
    # Accelerate's launches fail with torch elastic's ChildFailedError; code written for that
    # catches nbaccel's failure too, which keeps its own message: the rank's exception first.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError, match="bad batch 7") as info:
        nbaccel.notebook_launcher(rank_0_fails, num_processes=2, progress=False)
    error = info.value
    assert isinstance(error, RankFailedError) and type(error).__name__ == "RankFailedError"
    assert str(error).startswith("rank 0 (of 2) raised ValueError: bad batch 7")
    rank, failure = error.get_first_failure()
    assert (rank, failure.message, error.name) == (0, error.summary, "notebook_launcher")


def test_without_torch_elastic_loaded_a_rank_failure_imports_no_torch():
    code = (
        "import sys; from nbaccel.core.errors import RankFailedError; "
        "error = RankFailedError(0, 2, 'raised ValueError: x'); "
        "assert type(error) is RankFailedError, type(error).__mro__; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def cracks_on_the_last_try(queue):
    if os.environ["RANK"] != "0":
        return None
    trial = queue.get()
    if trial > 0:
        queue.put(trial - 1)
        raise RuntimeError("not yet")
    return "cracked"


@pytest.mark.slow
def test_accelerates_fault_tolerant_case_runs_with_a_manager_queue():
    # Accelerate's test_fault_tolerant passes a forked-context Queue; nbaccel's error names a
    # manager's queue instead (test_launcher_inputs), and this is that advice working.
    import multiprocessing

    with multiprocessing.Manager() as manager:
        queue = manager.Queue()
        queue.put(1)
        got = nbaccel.notebook_launcher(
            cracks_on_the_last_try,
            (queue,),
            num_processes=2,
            max_restarts=1,
            progress=False,
            timeout=60,
        )
        assert queue.empty()
    assert got == "cracked"  # on the restart, from what the first try put back


def sees_gpus():
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


@pytest.mark.slow
def test_debug_launcher_runs_cpu_ranks_and_lines_take_the_prefix_template(capfd):
    assert nbaccel.debug_launcher(sees_gpus, num_processes=2) == ("", False)
    nbaccel.notebook_launcher(
        print, args=("hello",), num_processes=2, log_line_prefix_template="${role_name}${rank}| "
    )
    out = capfd.readouterr().out
    assert "default0| hello" in out and "default1| hello" in out


def test_signature_lists_keyword_only_what_accelerate_lacks():
    # nbaccel's own options come after Accelerate's, as keywords: positional calls port as-is.
    params = inspect.signature(nbaccel.notebook_launcher).parameters
    ours_only = [n for n in params if n not in _params(accelerate.notebook_launcher)]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ours_only), ours_only
