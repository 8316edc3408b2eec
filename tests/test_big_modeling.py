"""Big-model loading and dispatch side by side with Accelerate 1.15 (a test-only dependency):
the same device maps and balanced memories for the same ``max_memory`` on config-built tiny
transformers and plain torch models (built on the meta device by both libraries'
``init_empty_weights``), the same outputs once loaded and dispatched over ``"cpu"`` and
``"disk"``, and offload folders written by one library read by the other. Bad input (a device
that is not there, an offload folder that cannot be written or is too small) is refused before
anything is written."""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")  # pinned in the dev extra
transformers = pytest.importorskip("transformers")

import accelerate.utils as acc_utils  # noqa: E402

import nbaccel  # noqa: E402
import nbaccel.utils as nb_utils  # noqa: E402
from nbaccel.core.disk_space import OutOfSpaceError  # noqa: E402
from nbaccel.training.model_files import save_model_files  # noqa: E402
from tests.disk_helpers import small_tmpfs  # noqa: E402


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        n_layer=3,
        n_embd=32,
        n_head=2,
        vocab_size=128,
        n_positions=16,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )


CONFIGS = {
    "gpt2": (gpt2_config, ["GPT2Block"], "GPT2LMHeadModel"),
    "llama": (llama_config, ["LlamaDecoderLayer"], "LlamaForCausalLM"),
}


class Plain(torch.nn.Module):
    """A torch model with a parameter of its own, a buffer, a nested block and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.embed = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.Sequential(
            *[
                torch.nn.Sequential(
                    torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)
                )
                for _ in range(3)
            ]
        )
        self.register_buffer("shift", torch.zeros(16))
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids) * self.scale + self.shift))


def empty(build, library) -> torch.nn.Module:
    with library.init_empty_weights():
        model = build()
    if hasattr(model, "tie_weights"):
        # Accelerate's init_empty_weights unties what transformers ties while building (its
        # own warning says to tie again); nbaccel's keeps them tied. Tied in both for the
        # comparison.
        model.tie_weights()
    return model


def hf_model(name: str):
    make_config, _, class_name = CONFIGS[name]
    config = make_config()
    return lambda: getattr(transformers, class_name)(config)


def sizes(model: torch.nn.Module) -> int:
    return int(nb_utils.compute_module_sizes(model)[""])


# max_memory as fractions of the model's size: accelerators (indexes 0, 1: pure arithmetic, no
# GPU needed), the CPU, both, small enough to send modules to the disk.
MEMORIES = [
    {"cpu": 2.0},
    {"cpu": 0.5},
    {"cpu": 0.25},
    {0: 0.3, "cpu": 0.4},
    {0: 0.3, 1: 0.3, "cpu": 0.6},
    {0: 0.2, 1: 0.5, "cpu": 0.1},
    {0: 0.45, 1: 0.45},
]


def concrete(memory: dict, total: int) -> dict:
    return {k: int(v * total) for k, v in memory.items()}


@pytest.mark.parametrize("name", ["gpt2", "llama", "plain"])
def test_device_maps_balanced_memory_and_sizes_are_accelerates(name):
    build = Plain if name == "plain" else hf_model(name)
    no_split = [] if name == "plain" else CONFIGS[name][1]
    ours, theirs = empty(build, nbaccel), empty(build, accelerate)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(p.is_meta for p in ours.parameters())
    assert dict(nb_utils.compute_module_sizes(ours)) == dict(acc_utils.compute_module_sizes(theirs))
    assert dict(nb_utils.compute_module_sizes(ours, dtype="float16")) == dict(
        acc_utils.compute_module_sizes(theirs, dtype="float16")
    )
    assert sorted(nb_utils.find_tied_parameters(ours)) == sorted(
        acc_utils.find_tied_parameters(theirs)
    )
    total = sizes(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # devices 0 and 1 are not here: both libraries say so
        for memory in MEMORIES:
            for split in ([], no_split):
                for dtype in (None, torch.float16):
                    given = concrete(memory, total)
                    args = {"no_split_module_classes": split, "dtype": dtype}
                    ours_map = nbaccel.infer_auto_device_map(ours, max_memory=dict(given), **args)
                    theirs_map = accelerate.infer_auto_device_map(
                        theirs, max_memory=dict(given), **args
                    )
                    assert dict(ours_map) == dict(theirs_map), (memory, split, dtype)
                    for low_zero in (False, True):
                        balanced = nb_utils.get_balanced_memory(
                            ours, dict(given), low_zero=low_zero, **args
                        )
                        expected = acc_utils.get_balanced_memory(
                            theirs, dict(given), low_zero=low_zero, **args
                        )
                        assert balanced == expected, (memory, split, dtype, low_zero)
            fallback = {"max_memory": concrete(memory, total), "fallback_allocation": True}
            ours_map = nbaccel.infer_auto_device_map(ours, **fallback)
            try:
                theirs_map = accelerate.infer_auto_device_map(theirs, **fallback)
            except IndexError:  # Accelerate 1.15's fallback looks for a tied module already placed
                nb_utils.check_device_map(ours, ours_map)
                continue
            assert dict(ours_map) == dict(theirs_map), (memory, "fallback")


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = hf_model("gpt2")().eval()
    folder = tmp_path_factory.mktemp("gpt2")
    save_model_files(model.state_dict(), folder, max_shard_size="60KB")  # several shards
    return folder, model


def cpu_and_disk_map(model: torch.nn.Module) -> dict:
    total = sizes(model)
    return dict(
        accelerate.infer_auto_device_map(
            model, max_memory={"cpu": int(total * 0.5)}, no_split_module_classes=["GPT2Block"]
        )
    )


IDS = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 1, 6]])


def test_loaded_and_dispatched_over_cpu_and_disk_give_the_models_outputs(gpt2_checkpoint, tmp_path):
    folder, model = gpt2_checkpoint
    with torch.no_grad():
        expected = model(IDS).logits
    outputs = {}
    for library in (nbaccel, accelerate):
        empty_model = empty(hf_model("gpt2"), library)
        device_map = cpu_and_disk_map(empty_model)
        assert set(device_map.values()) == {"cpu", "disk"}, device_map
        offload = tmp_path / library.__name__
        dispatched = library.load_checkpoint_and_dispatch(
            empty_model, str(folder), device_map=device_map, offload_folder=str(offload)
        )
        assert dispatched.hf_device_map == device_map
        with torch.no_grad():
            outputs[library.__name__] = dispatched(IDS).logits
        assert (offload / "index.json").is_file()
    torch.testing.assert_close(outputs["nbaccel"], expected, rtol=0, atol=0)
    torch.testing.assert_close(outputs["accelerate"], expected, rtol=0, atol=0)
    # The same folder, file for file: an offload folder is the same thing in either library.
    ours, theirs = tmp_path / "nbaccel", tmp_path / "accelerate"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    assert (ours / "index.json").read_text() == (theirs / "index.json").read_text()
    for file in os.listdir(theirs):
        assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file


@pytest.mark.parametrize("writer", ["nbaccel", "accelerate"])
def test_an_offload_folder_written_by_one_library_is_read_by_the_other(
    gpt2_checkpoint, tmp_path, writer
):
    folder, model = gpt2_checkpoint
    with torch.no_grad():
        expected = model(IDS).logits
    write, read = (nbaccel, accelerate) if writer == "nbaccel" else (accelerate, nbaccel)
    offload = tmp_path / "offload"
    # The writer's disk_offload writes the whole model to the folder...
    write.disk_offload(hf_model_loaded(folder), str(offload), execution_device="cpu")
    written = {p: p.stat().st_mtime_ns for p in offload.iterdir()}
    # ...the reader runs a fresh, empty model from it, rewriting nothing.
    reader_model = read.disk_offload(
        empty(hf_model("gpt2"), read), str(offload), execution_device="cpu"
    )
    with torch.no_grad():
        torch.testing.assert_close(reader_model(IDS).logits, expected, rtol=0, atol=0)
    assert {p: p.stat().st_mtime_ns for p in offload.iterdir()} == written
    # dispatch_model reads the folder for its disk modules the same way.
    empty_model = empty(hf_model("gpt2"), read)
    device_map = {k: "disk" for k in cpu_and_disk_map(empty_model)}
    dispatched = read.dispatch_model(empty_model, device_map, offload_dir=str(offload))
    with torch.no_grad():
        torch.testing.assert_close(dispatched(IDS).logits, expected, rtol=0, atol=0)


def hf_model_loaded(folder: Path) -> torch.nn.Module:
    model = hf_model("gpt2")()
    nbaccel.load_checkpoint_in_model(model, folder)
    return model.eval()


def test_cpu_offload_and_auto_maps_give_the_models_outputs(gpt2_checkpoint, tmp_path):
    folder, model = gpt2_checkpoint
    with torch.no_grad():
        expected = model(IDS).logits
        offloaded = nbaccel.cpu_offload(hf_model_loaded(folder), execution_device="cpu")
        torch.testing.assert_close(offloaded(IDS).logits, expected, rtol=0, atol=0)
        for strategy in ("auto", "sequential"):
            auto = nbaccel.load_checkpoint_and_dispatch(
                empty(hf_model("gpt2"), nbaccel),
                str(folder),
                device_map=strategy,
                max_memory={"cpu": sizes(model) // 2},
                no_split_module_classes=["GPT2Block"],
                offload_folder=str(tmp_path / strategy),
            )
            assert "disk" in auto.hf_device_map.values()
            torch.testing.assert_close(auto(IDS).logits, expected, rtol=0, atol=0)
    accelerator = nbaccel.Accelerator(cpu=True)
    assert accelerator.verify_device_map(auto) and not accelerator.verify_device_map(model)


def test_a_device_that_is_not_here_is_refused_before_anything_is_written(gpt2_checkpoint, tmp_path):
    folder, _ = gpt2_checkpoint
    offload = tmp_path / "offload"
    model = empty(hf_model("gpt2"), nbaccel)
    device_map = {"transformer": 0, "lm_head": "disk"}
    with pytest.raises(
        ValueError,
        match=r"sends modules to 0, which this machine does not have.*infer_auto_device_map",
    ):
        nbaccel.load_checkpoint_and_dispatch(
            model, str(folder), device_map=device_map, offload_folder=str(offload)
        )
    assert not offload.exists()
    assert all(p.is_meta for p in model.parameters())  # nothing loaded half-way either
    with pytest.raises(ValueError, match="gives no device to lm_head.weight"):
        nbaccel.dispatch_model(hf_model_loaded(folder), {"transformer": "cpu"})
    with pytest.raises(ValueError, match="no offload folder was given"):
        nbaccel.dispatch_model(hf_model_loaded(folder), {"transformer": "cpu", "lm_head": "disk"})
    with pytest.raises(ValueError, match=r"max_memory names \['gpu'\]"):
        nbaccel.infer_auto_device_map(model, max_memory={"gpu": 10})


def test_an_offload_folder_too_small_or_read_only_is_refused_before_anything_is_written(
    gpt2_checkpoint, tmp_path
):
    folder, model = gpt2_checkpoint
    disk_map = {"transformer": "cpu", "lm_head": "disk"}  # lm_head: 16 KB
    with small_tmpfs(tmp_path / "small", "8k") as small:
        with pytest.raises(OutOfSpaceError, match="it needs about 16.4 kB.*Nothing was written"):
            nbaccel.load_checkpoint_and_dispatch(
                empty(hf_model("gpt2"), nbaccel),
                str(folder),
                device_map=disk_map,
                offload_folder=str(small / "o"),
            )
        with pytest.raises(OutOfSpaceError, match="dispatch_model"):
            nbaccel.dispatch_model(hf_model_loaded(folder), disk_map, offload_dir=str(small / "o"))
        assert os.listdir(small) == []
        subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
        with pytest.raises(PermissionError, match="cannot be written"):
            nbaccel.disk_offload(hf_model_loaded(folder), str(small / "o"))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        nbaccel.disk_offload(hf_model_loaded(folder), str(not_a_folder))
    assert not_a_folder.read_text() == ""
