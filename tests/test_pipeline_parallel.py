"""Pipeline parallelism on real gloo ranks: ``prepare_pippy`` (Accelerate's inference API) and
``prepare_pipeline`` (nbaccel's training API: GPipe, 1F1B, interleaved 1F1B, with data
parallelism) give the outputs, losses and gradients of the same model run in one process
(≤ 1e-5), on 2 and 4 ranks; bad input is refused naming the values. One launch per world size
runs every case (tracing and rank starts are the cost)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import nbaccel
from nbaccel.training import pipeline_stages, pipeline_training

VOCAB, WIDTH, SEQ = 16, 8, 4


class Block(torch.nn.Module):
    """A pre-norm residual block with causal attention and an MLP, nanoGPT's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.norm2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + torch.tanh(self.mlp(self.norm2(x)))


class TinyGPT(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(rows: int, steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _train(pipe_or_none, model, batches):
    """Two SGD steps (lr 0.5); the losses and the gradients of the last step by parameter name. With
    ``pipe_or_none`` None: the one-process reference, plain forward/backward on each batch."""
    if pipe_or_none is None:
        params = dict(model.named_parameters())
    else:
        params = dict(pipe_or_none.named_parameters())
    losses = []
    for step, (x, y) in enumerate(batches):
        for p in params.values():
            p.grad = None
        if pipe_or_none is None:
            loss = lm_loss(model(x), y)
            loss.backward()
        else:
            loss = pipe_or_none.train_step(x, target=y)
        losses.append(loss.item())
        if step < len(batches) - 1:
            with torch.no_grad():  # plain SGD by hand: torch.optim's first use imports dynamo
                for p in params.values():
                    p -= 0.5 * p.grad
    return losses, {name: p.grad.clone() for name, p in params.items()}


def _worst(diffs: list[float]) -> float:
    """The largest difference over every rank (each rank holds its own stages)."""
    import torch.distributed as dist

    worst = torch.tensor(max(diffs, default=0.0), device=nbaccel.PartialState().device)  # NCCL
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _compare_training(rows, microbatches, **options) -> tuple[dict, nbaccel.PipelineModel]:
    batches = _batches(rows)
    ref_losses, ref_grads = _train(None, _model(), batches)
    pipe = nbaccel.prepare_pipeline(
        _model(), example_batch=(batches[0][0],), loss_fn=lm_loss,
        num_microbatches=microbatches, **options,
    )  # fmt: skip
    losses, grads = _train(pipe, None, batches)
    return {
        "loss": _worst([abs(a - b) for a, b in zip(losses, ref_losses)]),
        "grad": _worst([(grads[n].cpu() - ref_grads[n]).abs().max().item() for n in grads]),
        "names": _worst([float(set(grads) - set(ref_grads) != set())]),
        "layout": (pipe.pipeline_size, pipe.data_parallel_size),
    }, pipe


def _compare_pippy(rows, **options) -> float:
    torch.manual_seed(1)
    x = torch.randint(0, VOCAB, (rows, SEQ))
    model = _model()
    with torch.no_grad():
        expected = model(x)
    world = torch.distributed.get_world_size()
    model = nbaccel.prepare_pippy(model, example_args=(x[: rows // world],), **options)
    with torch.no_grad():  # the inputs where the stages are, as with Accelerate's (GPU checks)
        output = model(x.to(nbaccel.PartialState().device))
    output = None if output is None else output.cpu()
    if not options.get("gather_output"):
        last = torch.distributed.get_rank() == world - 1
        assert (output is None) != last, "the output belongs to the last process only"
        return _worst([(output - expected).abs().max().item()] if last else [])
    return _worst([(output - expected).abs().max().item()])


def _beside_accelerate() -> list[dict] | None:
    """One row through nbaccel's and Accelerate's ``prepare_pippy`` on these ranks (padded to
    a row per process by both): what each rank got, shapes and differences, on every rank."""
    try:
        from accelerate import PartialState as AcceleratePartialState
        from accelerate.inference import prepare_pippy as accelerates
    except ImportError:
        return None
    if nbaccel.PartialState().device.type != "cpu":  # a CPU comparison (gpu_checks/ skip it)
        return None
    AcceleratePartialState(cpu=True)  # joins the process group nbaccel formed
    torch.manual_seed(2)
    row = torch.randint(0, VOCAB, (1, SEQ))
    outputs = []
    for prepare in (nbaccel.prepare_pippy, accelerates):
        model = prepare(_model(), split_points=["blocks.2"], example_args=(row,))
        with torch.no_grad():
            outputs.append(model(row))
    if outputs[0] is None:
        mine = {"last": False, "both_none": outputs[1] is None}
    else:
        mine = {"last": True, "shapes": [tuple(o.shape) for o in outputs],
                "diff": (outputs[0] - outputs[1]).abs().max().item()}  # fmt: skip
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return every


def _refusal(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "not refused"


def on_two_ranks() -> dict:
    batch = _batches(8)[0]
    gpipe, pipe = _compare_training(8, 4, split_points=["blocks.2"], schedule="GPipe")
    x, y = _batches(12)[0]
    return {
        "gpipe": gpipe,
        "interleaved": _compare_training(
            8,
            2,
            split_points=["blocks.1", "blocks.2", "blocks.3"],
            schedule="Interleaved1F1B",
            stages_per_rank=2,
        )[0],  # fmt: skip
        "pippy_gathered": _compare_pippy(2, split_points=["blocks.2"], gather_output=True),
        "beside_accelerate": _beside_accelerate(),
        "too_many_stages": _refusal(
            lambda: nbaccel.prepare_pipeline(
                _model(),
                ["blocks.1", "blocks.2"],
                example_batch=(batch[0],),
                loss_fn=lm_loss,
                num_microbatches=2,
            )
        ),  # fmt: skip
        "wrong_batch": _refusal(lambda: pipe.train_step(x, target=y)),
    }


def on_four_ranks() -> dict:
    return {
        "dp2_pp2_1f1b": _compare_training(8, 2, split_points=["blocks.2"], schedule="1F1B")[0],
        "pippy": _compare_pippy(4, split_points="auto", no_split_module_classes=["Block"]),
    }


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return nbaccel.notebook_launcher(on_two_ranks, num_processes=2, progress=False)


def _assert_matches(case: dict, layout: tuple[int, int]) -> None:
    assert case["layout"] == layout
    assert case["names"] == 0.0, "the stages' parameters keep the model's names"
    assert case["loss"] <= 1e-5 and case["grad"] <= 1e-5, case


@pytest.mark.slow
def test_gpipe_and_interleaved_training_on_two_ranks_match_one_process(two_ranks):
    _assert_matches(two_ranks["gpipe"], (2, 1))
    _assert_matches(two_ranks["interleaved"], (2, 1))


@pytest.mark.slow
def test_prepare_pippy_gathered_on_two_ranks_gives_the_one_process_output(two_ranks):
    assert two_ranks["pippy_gathered"] <= 1e-5


@pytest.mark.slow
def test_prepare_pippy_pads_and_answers_as_accelerates_on_the_same_ranks(two_ranks):
    result = two_ranks["beside_accelerate"]
    if result is None:
        pytest.skip("accelerate is not installed (a test-only dependency)")
    assert result[0] == {"last": False, "both_none": True}
    # one row, padded to one per process by both: Accelerate's output keeps the padding row
    assert result[1]["shapes"] == [(2, SEQ, VOCAB), (2, SEQ, VOCAB)]
    assert result[1]["diff"] == 0.0


@pytest.mark.slow
def test_bad_pipelines_are_refused_in_the_ranks_naming_the_values(two_ranks):
    assert "3 stages (2 split points)" in two_ranks["too_many_stages"]
    assert "on 2 processes use 1, 2 stages" in two_ranks["too_many_stages"]
    assert "a batch of 12 rows" in two_ranks["wrong_batch"]
    assert "micro-batches of 3 rows" in two_ranks["wrong_batch"]
    assert "traced with micro-batches of 2 rows" in two_ranks["wrong_batch"]


@pytest.mark.slow
def test_data_parallel_pipelines_and_pippy_on_four_ranks_match_one_process():
    result = nbaccel.notebook_launcher(on_four_ranks, num_processes=4, progress=False)
    _assert_matches(result["dp2_pp2_1f1b"], (2, 2))
    assert result["pippy"] <= 1e-5  # the last rank's; None on the others (checked there)


# -- the rules, without launching ------------------------------------------------------------


def test_a_split_point_that_is_no_module_is_refused_naming_what_fits():
    with pytest.raises(
        ValueError, match=r"'blocks\.9' is not a module .* did you mean 'blocks\.3'"
    ):
        pipeline_stages.check_split_points(TinyGPT(), ["blocks.9"])
    with pytest.raises(ValueError, match="'embed', 'blocks', 'head'"):
        pipeline_stages.check_split_points(TinyGPT(), ["decoder"])
    with pytest.raises(ValueError, match="more than once"):
        pipeline_stages.check_split_points(TinyGPT(), ["head", "head"])


def test_auto_split_points_balance_the_stages_and_keep_blocks_whole():
    assert pipeline_stages.balanced_split_points(TinyGPT(), 2, ["Block"]) == ["blocks.2"]
    four = pipeline_stages.balanced_split_points(TinyGPT(), 4, ["Block"])
    assert len(four) == 3 and all(p.startswith("blocks.") for p in four)
    with pytest.raises(ValueError, match="too few for 9 stages"):
        pipeline_stages.balanced_split_points(torch.nn.Sequential(torch.nn.Linear(2, 2)), 9)


def test_layouts_and_microbatches_are_checked_naming_what_would_fit():
    assert pipeline_training.pipeline_layout(4, 2, 2) == (2, 1)
    with pytest.raises(ValueError, match="more stages than ranks.*use 1, 2, 4 stages"):
        pipeline_training.pipeline_layout(8, 1, 4)
    with pytest.raises(ValueError, match="a whole number of times.*use 1, 3 stages"):
        pipeline_training.pipeline_layout(2, 1, 3)
    with pytest.raises(ValueError, match="multiple of 8, e.g. 8 or 16"):
        pipeline_training.micro_batch_rows(12, 2, 4)
    with pytest.raises(ValueError, match="not a pipeline schedule"):
        pipeline_training.schedule_class_name("zigzag", 1)
    with pytest.raises(ValueError, match="stages_per_rank=2"):
        pipeline_training.schedule_class_name("Interleaved1F1B", 1)


def test_prepare_pippy_has_accelerates_signature_at_its_path():
    accelerate_inference = pytest.importorskip("accelerate.inference")
    import nbaccel.inference

    def parameters(function):
        return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]

    assert parameters(nbaccel.inference.prepare_pippy) == parameters(
        accelerate_inference.prepare_pippy
    )
    assert nbaccel.prepare_pippy is nbaccel.inference.prepare_pippy


@pytest.mark.slow
def test_one_process_runs_every_stage_here_as_the_reference():
    batches = _batches(8)
    ref_losses, ref_grads = _train(None, _model(), batches)
    pipe = nbaccel.prepare_pipeline(
        _model(), ["blocks.2"], example_batch=(batches[0][0],), loss_fn=lm_loss, num_microbatches=4
    )
    losses, grads = _train(pipe, None, batches)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert grads.keys() == ref_grads.keys()
    # not torch.testing.assert_close: it imports torch.distributed.tensor (seconds) to compare
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) <= 1e-6
