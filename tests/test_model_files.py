"""save_model replaces a folder's weights all at once: killed at lines all through the write and
the swap, out of disk space, failing midway, or switching between sharded and unsharded, the
folder loads as the previous save or the new one, never a mix, and the user's other files stay.
Tied tensors are stored once and tied on load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from nbaccel.core import atomic
from nbaccel.core.disk_space import OutOfSpaceError
from nbaccel.training import model_files, model_folder
from nbaccel.training.model_files import load_checkpoint_in_model, save_model_files
from tests.disk_helpers import hidden_leftovers, small_tmpfs

REPO = Path(__file__).resolve().parent.parent
USER_FILES = {"config.json": '{"hidden_size": 4}', "README.md": "# my model\n"}


def weights(value: float, n: int = 3, numel: int = 1000) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((numel,), value) for i in range(n)}


def folder_with_user_files(path: Path) -> Path:
    path.mkdir()
    for name, text in USER_FILES.items():
        (path / name).write_text(text)
    return path


def assert_user_files(folder: Path) -> None:
    for name, text in USER_FILES.items():
        assert (folder / name).read_text() == text, name


def assert_loads_as(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    state = model_files.load_state_dict_files(folder)
    assert sorted(state) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key


class Tied(torch.nn.Module):
    """A language-model shape: the output layer is the embedding (one Parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.body = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.embed.weight


# (previous save, new save): each changes the layout, so stale shards/index would show.
LAYOUTS = {
    "sharded-to-single": ({"max_shard_size": 5000}, {"safe_serialization": False}),
    "single-to-sharded": ({}, {"max_shard_size": 5000}),
    "bin-sharded-to-safetensors": ({"max_shard_size": 5000, "safe_serialization": False}, {}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_new_save_leaves_no_file_of_the_previous_one(tmp_path, layout):
    before, after = LAYOUTS[layout]
    folder = folder_with_user_files(tmp_path / "out")
    save_model_files(weights(1.0), folder, **before)
    save_model_files(weights(2.0), folder, **after)
    assert_loads_as(folder, weights(2.0))
    model = torch.nn.ModuleDict({f"layer{i}": torch.nn.Module() for i in range(3)})
    for layer in model.values():
        layer.weight = torch.nn.Parameter(torch.zeros(1000))
    index = [folder / n for n in os.listdir(folder) if n.endswith(".index.json")]
    for checkpoint in [folder, *index]:  # the folder, or its index as Accelerate allows
        load_checkpoint_in_model(model, checkpoint, strict=True)
        assert torch.equal(model["layer2"].weight, torch.full((1000,), 2.0))
    assert_user_files(folder)
    expected = set(USER_FILES)
    sharded, binary = "max_shard_size" in after, after.get("safe_serialization") is False
    stem, ext = ("pytorch_model", "bin") if binary else ("model", "safetensors")
    if sharded:
        expected |= {f"{stem}-0000{i}-of-00003.{ext}" for i in (1, 2, 3)}
        expected.add(f"{stem}.{ext}.index.json")
    else:
        expected.add(f"{stem}.{ext}")
    assert set(os.listdir(folder)) == expected


def test_tied_weights_are_stored_once_and_tied_again_on_load(tmp_path):
    import safetensors.torch

    torch.manual_seed(0)
    model = Tied()
    save_model_files(model.state_dict(), tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["body.bias", "body.weight", "embed.weight"]
    for folder in ("ours", "theirs"):
        if folder == "theirs":  # what Accelerate and safetensors write: the tie left out, unsaid
            (tmp_path / folder).mkdir()
            safetensors.torch.save_model(model, str(tmp_path / folder / "model.safetensors"))
        fresh = Tied()
        load_checkpoint_in_model(fresh, tmp_path / folder, strict=True)
        assert fresh.lm_head.weight is fresh.embed.weight
        for key, tensor in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], tensor), (folder, key)
    # An untied model gets both names right from the file's record of the tie.
    untied = Tied()
    untied.lm_head.weight = torch.nn.Parameter(torch.zeros(50, 8))
    load_checkpoint_in_model(untied, tmp_path / "ours", strict=True)
    assert torch.equal(untied.lm_head.weight, model.embed.weight)
    # Sharded, and pytorch_model.bin: stored once there too.
    save_model_files(model.state_dict(), tmp_path / "bin", safe_serialization=False)
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert loaded["lm_head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
    save_model_files(model.state_dict(), tmp_path / "sharded", max_shard_size=300)
    fresh = Tied()
    load_checkpoint_in_model(fresh, tmp_path / "sharded", strict=True)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


# Where a kill can land between two file operations: the writes (atomic) and the swap.
TRACED = {model_folder.__file__, atomic.__file__}


@pytest.mark.slow  # importing Accelerate takes seconds
def test_accelerate_loads_a_model_saved_with_tied_weights(tmp_path):
    import accelerate.utils

    model = Tied()
    save_model_files(model.state_dict(), tmp_path)
    theirs = Tied()
    accelerate.utils.load_checkpoint_in_model(theirs, str(tmp_path / "model.safetensors"))
    assert theirs.lm_head.weight is theirs.embed.weight
    assert torch.equal(theirs.lm_head.weight, model.lm_head.weight)


def _save_killed_at_line(k: int, state: dict, folder: Path, options: dict) -> int:
    """Fork a child that saves ``state`` and SIGKILLs itself at the ``k``-th line the save runs
    in :data:`TRACED`; the child's wait status (it exits 3 when the save had fewer lines)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = 0

            def tracer(frame, event, arg):
                nonlocal count
                if frame.f_code.co_filename not in TRACED:
                    return None
                if event == "line":
                    count += 1
                    if count == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                return tracer

            sys.settrace(tracer)
            save_model_files(state, folder, **options)
            sys.settrace(None)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.slow  # a fork per line tried: every third of the save's ~100, from `first`
@pytest.mark.parametrize(("layout", "first"), [("sharded-to-single", 1), ("single-to-sharded", 2)])
def test_a_save_killed_at_any_line_leaves_a_loadable_model(tmp_path, layout, first):
    before, after = LAYOUTS[layout]
    old, new = weights(1.0), weights(2.0)
    folder = folder_with_user_files(tmp_path / "out")
    save_model_files(old, folder, **before)
    listing = sorted(os.listdir(folder))
    seen = []
    for k in range(first, 2000, 3):
        status = _save_killed_at_line(k, new, folder, after)
        if os.WIFEXITED(status):  # k is past the save's last line
            assert os.WEXITSTATUS(status) == 3
            break
        assert os.WTERMSIG(status) == signal.SIGKILL
        state = model_files.load_state_dict_files(folder)
        value = state["layer0.weight"][0].item()
        assert value in (1.0, 2.0), k
        assert_loads_as(folder, old if value == 1.0 else new)
        assert_user_files(folder)
        seen.append(value)
        save_model_files(old, folder, **before)  # the next save cleans up after the kill
        assert sorted(os.listdir(folder)) == listing, k
        assert hidden_leftovers(folder) == []
    # Killed before the commit point: the previous model; after it: the new one.
    assert seen == sorted(seen) and seen[0] == 1.0 and seen[-1] == 2.0, seen
    assert len(seen) > 25


_KEEP_SAVING = """
import sys, torch
sys.path.insert(0, {repo!r})
from nbaccel.training.model_files import save_model_files
from tests.test_model_files import weights
print("ready", flush=True)
for i in range(1, 10**6):
    save_model_files(weights(float(i), n=8, numel=200_000), {folder!r}, max_shard_size="2MB")
"""


@pytest.mark.slow
def test_a_writer_killed_from_outside_leaves_a_whole_save(tmp_path):
    folder = folder_with_user_files(tmp_path / "out")
    save_model_files(weights(0.0, n=8, numel=200_000), folder, max_shard_size="2MB")
    script = _KEEP_SAVING.format(repo=str(REPO), folder=str(folder))
    for delay in (0.3, 0.9):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert child.stdout.readline() == b"ready\n"
        time.sleep(delay)  # somewhere in a save: writing a shard, or swapping
        child.send_signal(signal.SIGKILL)
        child.wait()
        state = model_files.load_state_dict_files(folder)
        values = {v for t in state.values() for v in t.unique().tolist()}
        assert len(state) == 8 and len(values) == 1, values  # one save, whole
        assert_user_files(folder)


def test_a_full_disk_keeps_the_previous_model_and_says_how_much_room_is_needed(tmp_path):
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        folder = folder_with_user_files(disk / "out")
        old = weights(1.0, n=3, numel=50_000)  # 600 kB of a 1 MiB disk
        save_model_files(old, folder)
        with pytest.raises(OutOfSpaceError) as raised:  # 1.2 MB: more than the whole disk
            save_model_files(weights(2.0, n=3, numel=100_000), folder, max_shard_size="500kB")
        message = str(raised.value)
        assert message.startswith(f"save_model: no space left to write {folder}: it needs about")
        assert "1.2 MB" in message and "Free space on that disk" in message
        assert "unexpected pos" not in message
        assert_loads_as(folder, old)
        assert_user_files(folder)
        assert hidden_leftovers(folder) == []


def test_a_save_that_fails_midway_keeps_the_previous_model_and_leaves_nothing(tmp_path):
    folder = folder_with_user_files(tmp_path / "out")
    save_model_files(weights(1.0), folder, max_shard_size=5000)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # quantized tensors are deprecated; safetensors refuses them
        unsavable = torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)
    with pytest.raises(KeyError):  # after the first shard was written
        save_model_files({**weights(2.0), "q": unsavable}, folder, max_shard_size=5000)
    assert_loads_as(folder, weights(1.0))
    assert hidden_leftovers(folder) == []


def _save_tied_under_ddp(folder: str) -> dict:
    import nbaccel

    acc = nbaccel.Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(Tied())
    acc.save_model(model, folder, max_shard_size="1kB")  # 2 shards: embed, body
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


@pytest.mark.slow
def test_accelerator_save_model_on_two_ranks_stores_tied_weights_once(tmp_path):
    import nbaccel

    folder = folder_with_user_files(tmp_path / "out")
    save_model_files(weights(1.0), folder)  # an earlier, unsharded save to replace
    expected = nbaccel.notebook_launcher(_save_tied_under_ddp, args=(str(folder),), num_processes=2)
    stored = model_files.load_state_dict_files(folder)
    assert "lm_head.weight" in stored and not any(k.startswith("layer") for k in stored)
    index = (folder / "model.safetensors.index.json").read_text()
    assert "lm_head.weight" not in index and "embed.weight" in index  # stored once
    fresh = Tied()
    load_checkpoint_in_model(fresh, folder, strict=True)
    assert fresh.lm_head.weight is fresh.embed.weight
    for key, tensor in expected.items():
        assert torch.equal(fresh.state_dict()[key], tensor), key
    assert_user_files(folder)
