"""Mixed precision as small objects: a forward context, a backward and an optimizer step.

``"no"`` does nothing; ``"bf16"`` runs the forward under autocast; ``"fp16"`` adds a GradScaler
(on CPU too) whose skipped steps are reported; ``"fp8"`` converts Linear layers with torchao's
float8 training on GPUs that support it. :func:`select_precision` refuses combinations the device
cannot run, saying why and what to pick instead.

>>> import torch
>>> p = select_precision("bf16", torch.device("cpu"))
>>> with p.forward_context():
...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
torch.bfloat16
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from nbaccel.core import capabilities
from nbaccel.core.config import MIXED_PRECISION_CHOICES
from nbaccel.core.hardware import GPU
from nbaccel.training.ops import recursively_apply


class Precision:
    """Full precision (``mixed_precision="no"``); the base the others change."""

    name = "no"
    scaler: torch.amp.GradScaler | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._unscaled: set[int] = set()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def forward_context(self, handler: Any = None) -> contextlib.AbstractContextManager:
        """The autocast context; ``handler`` is an ``AutocastKwargs`` (None: defaults)."""
        return contextlib.nullcontext()

    def autocast_forward(self, module: torch.nn.Module, handler: Any = None) -> None:
        """Make ``module``'s forward run under :meth:`forward_context`, so users need no
        ``with accelerator.autocast()``, and hand back its half-precision outputs in float32,
        as Accelerate does (metrics, ``.numpy()`` and losses outside the model see float32).
        Undone by :meth:`remove_autocast_forward`."""
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.forward_context(handler):
                outputs = original(*args, **kwargs)
            return convert_to_fp32(outputs)

        forward.__nbaccel_original__ = original
        module.forward = forward

    @staticmethod
    def remove_autocast_forward(module: torch.nn.Module) -> None:
        """Back to the class's own forward (``unwrap_model(keep_fp32_wrapper=False)``)."""
        if hasattr(module.__dict__.get("forward"), "__nbaccel_original__"):
            del module.__dict__["forward"]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before clipping (no-op without a scaler)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable | None) -> bool:
        """Step ``optimizer``; return False when the step was skipped (fp16 overflow)."""
        optimizer.step(closure) if closure is not None else optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def convert_to_fp32(tensor: Any) -> Any:
    """``tensor`` (or every tensor nested in lists, tuples, dicts) converted to float32 where it
    is float16 or bfloat16; other values unchanged (Accelerate's name).

    >>> convert_to_fp32({"logits": torch.ones(2, dtype=torch.bfloat16), "n": 3})["logits"].dtype
    torch.float32
    """
    return recursively_apply(
        lambda t: t.float(),
        tensor,
        test_type=lambda v: (
            isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16)
        ),
    )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward so its half-precision outputs come back in float32 (what a prepared
    model's forward does under ``mixed_precision``).

    >>> forward = convert_outputs_to_fp32(lambda x: x.bfloat16())
    >>> forward(torch.ones(1)).dtype
    torch.float32
    """

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


class AutocastPrecision(Precision):
    """bf16: the forward runs under ``torch.autocast``; gradients need no scaling."""

    def __init__(self, device: torch.device, dtype: torch.dtype, name: str) -> None:
        super().__init__(device)
        self.dtype, self.name = dtype, name

    def forward_context(self, handler: Any = None) -> contextlib.AbstractContextManager:
        enabled = getattr(handler, "enabled", True)
        cache = getattr(handler, "cache_enabled", None)
        return torch.autocast(
            self.device.type, dtype=self.dtype, enabled=enabled, cache_enabled=cache
        )


class Fp16Precision(AutocastPrecision):
    """fp16: autocast plus a GradScaler, so small gradients do not vanish in half precision."""

    scaler: torch.amp.GradScaler  # always one here (None in the other precisions)

    def __init__(self, device: torch.device, scaler_kwargs: Any = None) -> None:
        super().__init__(device, torch.float16, "fp16")
        options = scaler_kwargs.to_kwargs() if scaler_kwargs is not None else {}
        self.scaler = torch.amp.GradScaler(device.type, **options)
        self._mixed: set[int] = set()  # unscaled optimizers whose gradients a backward added to

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(**kwargs)
        self._mixed = set(self._unscaled)  # scaled gradients added to unscaled ones

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # GradScaler refuses a second unscale_ of the same optimizer before step(); clipping
        # twice (norm, then value) must still work, so remember who is already unscaled. A
        # backward since then (clipping every micro-step of an accumulation) added scaled
        # gradients to unscaled ones: refused, as torch refuses it under Accelerate.
        if id(optimizer) in self._mixed:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(), "
                "and a backward pass added scaled fp16 gradients since: clip (or unscale) only "
                "when accelerator.sync_gradients is True, once per optimizer step."
            )
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable | None) -> bool:
        before = self.scaler.get_scale()
        if closure is not None:
            self.scaler.step(optimizer, closure)
        else:
            self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        self._mixed.discard(id(optimizer))
        # The scaler only lowers its scale when it found inf/NaN gradients and skipped the step.
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


class Fp8Precision(AutocastPrecision):
    """fp8: torchao converts Linear layers to float8 matmuls; the rest runs in bf16 autocast."""

    def __init__(self, device: torch.device, recipe: Any = None) -> None:
        super().__init__(device, torch.bfloat16, "fp8")
        self.recipe = recipe  # an AORecipeKwargs: torchao's config and layer filter

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torchao.float8 import convert_to_float8_training

        def fits(layer: torch.nn.Module, _fqn: str) -> bool:
            # float8 matmuls need both dimensions divisible by 16; other layers stay in bf16.
            return (
                isinstance(layer, torch.nn.Linear)
                and layer.in_features % 16 == 0
                and layer.out_features % 16 == 0
            )

        recipe = self.recipe
        return convert_to_float8_training(
            module,
            module_filter_fn=(recipe and recipe.module_filter_func) or fits,
            config=recipe.config if recipe is not None else None,
        )


def select_precision(
    name: str, device: torch.device, scaler_kwargs: Any = None, fp8_recipe: Any = None
) -> Precision:
    """The precision object for ``mixed_precision=name`` on ``device``, or a clear error
    (``fp8_recipe``: an ``AORecipeKwargs`` for fp8).

    Example::

        precision = select_precision("fp16", torch.device("cpu"))   # autocast + GradScaler
    """
    if name not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={name!r} is not supported; choose one of "
            f"{', '.join(map(repr, MIXED_PRECISION_CHOICES))}."
        )
    gpus: tuple[GPU, ...] = ()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        gpus = (GPU(index, props.name, props.total_memory / 2**30, (props.major, props.minor)),)
    verdict = capabilities.precision_verdict(name, gpus, capabilities.torchao_available())
    if not verdict.allowed:
        where = f"this process runs on {device.type}" if not gpus else gpus[0].name
        raise ValueError(f"mixed_precision={name!r} cannot run here ({where}): {verdict.reason}")
    if name == "no":
        return Precision(device)
    if name == "fp16":
        return Fp16Precision(device, scaler_kwargs)
    if name == "bf16":
        return AutocastPrecision(device, torch.bfloat16, "bf16")
    return Fp8Precision(device, fp8_recipe)
