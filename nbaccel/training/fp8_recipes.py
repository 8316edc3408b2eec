"""Accelerate's FP8 recipe handlers, ``Accelerator(mixed_precision="fp8", kwargs_handlers=[...])``:
``AORecipeKwargs`` (torchao's float8 training: its ``Float8LinearConfig`` and which Linear
layers convert), ``TERecipeKwargs`` (TransformerEngine), ``MSAMPRecipeKwargs`` (MS-AMP) and the
deprecated ``FP8RecipeKwargs``, with Accelerate 1.15's fields, defaults (from the
``ACCELERATE_FP8_*`` variables), checks and errors. nbaccel trains fp8 with torchao: an
``AORecipeKwargs`` is applied; TransformerEngine and MS-AMP recipes are refused when the
Accelerator is made, saying what to choose instead.

>>> MSAMPRecipeKwargs().opt_level
'O2'
>>> MSAMPRecipeKwargs(opt_level="O3")
Traceback (most recent call last):
ValueError: MSAMPRecipeKwargs(opt_level='O3'): opt_level must be one of 'O1' or 'O2'.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

from nbaccel.core.capabilities import package_available
from nbaccel.training.kwargs_handlers import KwargsHandler

_ENV = "ACCELERATE_FP8_"  # Accelerate's variables, read the same way
FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_ALGORITHMS = ("max", "most_recent")
OPT_LEVELS = ("O1", "O2")
BACKENDS = ("MSAMP", "TE")


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(_ENV + name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "y", "on")


def _one_of(kind: str, field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{kind}({field}={value!r}): {field} must be one of {' or '.join(map(repr, allowed))}."
        )


@dataclasses.dataclass
class AORecipeKwargs(KwargsHandler):
    """torchao's float8 recipe: ``config`` (a ``torchao.float8.Float8LinearConfig``; without
    one, built from ``pad_inner_dim`` and ``enable_fsdp_float8_all_gather``, both on unless
    ``ACCELERATE_FP8_PAD_INNER_DIM``/``..._ENABLE_FSDP_FLOAT8_ALL_GATHER`` say otherwise) and
    ``module_filter_func(module, fqn) -> bool``, which Linear layers convert. Needs torchao
    (``pip install torchao``) and a GPU of compute capability 8.9+ to train.

    Example::

        from torchao.float8 import Float8LinearConfig
        handler = AORecipeKwargs(config=Float8LinearConfig(pad_inner_dim=True))
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
    """

    config: Any = None
    module_filter_func: Callable[..., bool] | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        if not package_available("torchao"):
            raise ImportError(
                "AORecipeKwargs: torchao is not installed; run `pip install torchao`, or drop "
                "the handler and use mixed_precision='bf16'."
            )
        if self.config is None:
            from torchao.float8 import Float8LinearConfig

            if self.pad_inner_dim is None:
                self.pad_inner_dim = _flag("PAD_INNER_DIM", default=True)
            if self.enable_fsdp_float8_all_gather is None:
                self.enable_fsdp_float8_all_gather = _flag(
                    "ENABLE_FSDP_FLOAT8_ALL_GATHER", default=True
                )
            self.config = Float8LinearConfig(
                pad_inner_dim=self.pad_inner_dim,
                enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather,
            )


@dataclasses.dataclass
class TERecipeKwargs(KwargsHandler):
    """TransformerEngine's fp8 recipe (Accelerate's fields and ``ACCELERATE_FP8_*`` defaults).
    Accepted and checked as Accelerate does; nbaccel does not train with TransformerEngine, so
    an Accelerator given one refuses it and names ``AORecipeKwargs`` (torchao) instead.

    Example::

        TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16)
    """

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None

    def __post_init__(self) -> None:
        if not package_available("transformer_engine"):
            raise ImportError(
                f"{type(self).__name__}: TransformerEngine is not installed, and nbaccel trains "
                "fp8 with torchao: use AORecipeKwargs (pip install torchao), or "
                "mixed_precision='bf16'."
            )
        self._fill_te()

    def _fill_te(self) -> None:
        kind = type(self).__name__
        if self.use_autocast_during_eval is None:
            self.use_autocast_during_eval = _flag("USE_AUTOCAST_DURING_EVAL")
        if self.margin is None:
            self.margin = int(os.environ.get(_ENV + "MARGIN", 0))
        if self.interval is None:
            self.interval = int(os.environ.get(_ENV + "INTERVAL", 1))
        self.fp8_format = (self.fp8_format or os.environ.get(_ENV + "FORMAT", "HYBRID")).upper()
        _one_of(kind, "fp8_format", self.fp8_format, FP8_FORMATS)
        algorithm = self.amax_compute_algo or os.environ.get(
            _ENV + "AMAX_COMPUTE_ALGO", "most_recent"
        )
        self.amax_compute_algo = algorithm.lower()
        _one_of(kind, "amax_compute_algo", self.amax_compute_algo, AMAX_ALGORITHMS)
        if self.amax_history_len is None:
            self.amax_history_len = int(os.environ.get(_ENV + "AMAX_HISTORY_LEN", 1024))
        if self.override_linear_precision is None:
            self.override_linear_precision = (
                _flag("OVERRIDE_FPROP"),
                _flag("OVERRIDE_DGRAD"),
                _flag("OVERRIDE_WGRAD"),
            )
        if self.use_mxfp8_block_scaling is None:
            self.use_mxfp8_block_scaling = _flag("USE_MXFP8_BLOCK_SCALING")


@dataclasses.dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP's fp8 recipe: ``opt_level`` ``"O1"`` or ``"O2"`` (``ACCELERATE_FP8_OPT_LEVEL``,
    else ``"O2"``). Accepted and checked as Accelerate does; nbaccel does not train with MS-AMP,
    so an Accelerator given one refuses it and names ``AORecipeKwargs`` (torchao) instead.

    >>> MSAMPRecipeKwargs(opt_level="O1").opt_level
    'O1'
    """

    opt_level: str | None = None

    def __post_init__(self) -> None:
        self._fill_msamp()

    def _fill_msamp(self) -> None:
        if self.opt_level is None:
            self.opt_level = os.environ.get(_ENV + "OPT_LEVEL", "O2")
        _one_of(type(self).__name__, "opt_level", self.opt_level, OPT_LEVELS)


@dataclasses.dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Accelerate's deprecated handler for either TransformerEngine or MS-AMP (``backend``
    ``"TE"`` or ``"MSAMP"``; by default MS-AMP where installed, else TE); it warns and needs
    TransformerEngine as Accelerate's does. Use ``AORecipeKwargs`` with nbaccel.

    Example::

        FP8RecipeKwargs(backend="msamp", opt_level="O1")
    """

    backend: str | None = None

    def __post_init__(self) -> None:
        warnings.warn(
            "FP8RecipeKwargs is deprecated (Accelerate will remove it in v2.0.0); nbaccel trains "
            "fp8 with torchao: use AORecipeKwargs.",
            FutureWarning,
            stacklevel=3,
        )
        if self.backend is None:
            self.backend = os.environ.get(
                _ENV + "BACKEND", "MSAMP" if package_available("msamp") else "TE"
            )
        self.backend = self.backend.upper()
        _one_of("FP8RecipeKwargs", "backend", self.backend, BACKENDS)
        TERecipeKwargs.__post_init__(self)  # as Accelerate's: needs TransformerEngine either way
        self._fill_msamp()


# Each handler class and the Accelerator attribute that holds it (Accelerate's names).
RECIPE_HANDLERS: dict[type, str] = {
    AORecipeKwargs: "ao_recipe_handler",
    TERecipeKwargs: "te_recipe_handler",
    MSAMPRecipeKwargs: "msamp_recipe_handler",
    FP8RecipeKwargs: "fp8_recipe_handler",
}


def check_recipes(given: dict[str, Any], mixed_precision: str, strategy: str) -> None:
    """Refuse, when the Accelerator is made, recipes nbaccel cannot apply: one without
    ``mixed_precision="fp8"`` (outside FSDP and DeepSpeed, as in Accelerate), and the
    TransformerEngine and MS-AMP ones (nbaccel trains fp8 with torchao).

    >>> check_recipes({"msamp_recipe_handler": object()}, "no", "ddp")
    Traceback (most recent call last):
    ValueError: An FP8 recipe (MSAMPRecipeKwargs) needs mixed_precision='fp8'; set it, or drop the handler.
    """
    present = {slot: h for slot, h in given.items() if h is not None}
    if not present:
        return
    names = ", ".join(_class_name(slot) for slot in present)
    if mixed_precision != "fp8" and strategy not in ("fsdp", "deepspeed"):
        raise ValueError(
            f"An FP8 recipe ({names}) needs mixed_precision='fp8'; set it, or drop the handler."
        )
    foreign = [_class_name(slot) for slot in present if slot != "ao_recipe_handler"]
    if foreign:
        raise ValueError(
            f"{', '.join(foreign)}: nbaccel trains fp8 with torchao, not TransformerEngine or "
            "MS-AMP; pass AORecipeKwargs(config=torchao.float8.Float8LinearConfig(...)) "
            "instead, or mixed_precision='bf16'."
        )


def _class_name(slot: str) -> str:
    return next(cls.__name__ for cls, name in RECIPE_HANDLERS.items() if name == slot)
