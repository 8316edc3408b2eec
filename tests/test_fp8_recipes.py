"""Accelerate's FP8 recipe handlers: accepted as Accelerate 1.15 accepts them (fields,
``ACCELERATE_FP8_*`` defaults, the values each refuses), side by side with Accelerate itself, and
refused by the Accelerator with the reason and what to choose instead where nbaccel cannot apply
them (no fp8, TransformerEngine or MS-AMP recipes, no torchao or GPU). torchao's recipe applied on
a GPU: gpu_checks/check_fp8_recipe.py."""

from __future__ import annotations

import dataclasses

import pytest

accelerate = pytest.importorskip("accelerate")  # pinned in the dev extra

import accelerate.utils as acc_utils  # noqa: E402

import nbaccel  # noqa: E402
import nbaccel.utils as nb_utils  # noqa: E402
from nbaccel.core.capabilities import package_available  # noqa: E402

NAMES = ["AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs"]


@pytest.mark.parametrize("name", NAMES)
def test_the_handlers_have_accelerates_fields_and_refuse_what_it_refuses(name, monkeypatch):
    ours, theirs = getattr(nb_utils, name), getattr(acc_utils, name)
    assert [f.name for f in dataclasses.fields(ours)] == [
        f.name for f in dataclasses.fields(theirs)
    ]
    assert issubclass(ours, nb_utils.KwargsHandler)
    # Made with defaults, with an environment override, and with a bad value: both libraries
    # build the same handler or both refuse with the same kind of error.
    monkeypatch.setenv("ACCELERATE_FP8_OPT_LEVEL", "O1")
    cases = [{}, {"opt_level": "O3"}, {"fp8_format": "e4m3"}, {"backend": "nope"}]
    for kwargs in cases:
        kwargs = {
            k: v for k, v in kwargs.items() if k in {f.name for f in dataclasses.fields(theirs)}
        }
        outcomes = []
        for cls in (ours, theirs):
            try:
                with pytest.warns(FutureWarning) if name == "FP8RecipeKwargs" else _nothing():
                    outcomes.append(dataclasses.asdict(cls(**kwargs)))
            except (ImportError, ValueError) as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1], (name, kwargs, outcomes)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_recipe_without_fp8_or_that_nbaccel_cannot_run_is_refused_with_what_to_choose():
    with pytest.raises(
        ValueError, match=r"MSAMPRecipeKwargs\) needs mixed_precision='fp8'; set it"
    ):
        nbaccel.Accelerator(cpu=True, kwargs_handlers=[nb_utils.MSAMPRecipeKwargs()])
    # Accelerate refuses the same.
    with pytest.raises(ValueError, match="requires setting `mixed_precision='fp8'`"):
        accelerate.Accelerator(cpu=True, kwargs_handlers=[acc_utils.MSAMPRecipeKwargs()])
    # With fp8 on a CPU: the precision is refused first, naming what runs here.
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU.*use 'bf16' on CPU"):
        nbaccel.Accelerator(cpu=True, mixed_precision="fp8")
    # MS-AMP's recipe with fp8 (before the hardware is looked at): torchao's instead.
    with pytest.raises(
        ValueError, match=r"MSAMPRecipeKwargs: nbaccel trains fp8 with torchao.*AORecipeKwargs"
    ):
        nbaccel.Accelerator(
            cpu=True, mixed_precision="fp8", kwargs_handlers=[nb_utils.MSAMPRecipeKwargs()]
        )


@pytest.mark.skipif(
    package_available("torchao"), reason="checks the refusal where torchao is missing"
)
def test_torchaos_recipe_without_torchao_says_how_to_install_it_or_what_else_to_use():
    with pytest.raises(ImportError, match=r"pip install torchao.*mixed_precision='bf16'"):
        nb_utils.AORecipeKwargs()


def test_an_accelerator_without_recipes_has_accelerates_attributes():
    accelerator = nbaccel.Accelerator(cpu=True)
    theirs = accelerate.Accelerator(cpu=True)
    for name in (
        "ao_recipe_handler",
        "te_recipe_handler",
        "msamp_recipe_handler",
        "fp8_recipe_handler",
        "has_fp8_handler",
        "delayed_fp8_autocast",
        "fp8_enabled",
    ):
        assert getattr(accelerator, name) == getattr(theirs, name), name
