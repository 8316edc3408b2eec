"""Big-model loading and dispatch at Accelerate's names (``accelerate.big_modeling``): build a
model without memory (``init_empty_weights``), load a checkpoint into it following a device map,
and run it with some submodules on the CPU or on disk, brought to the device that runs them for
their forward only (``dispatch_model``, ``cpu_offload``, ``disk_offload``,
``load_checkpoint_and_dispatch``). Device maps come from :mod:`nbaccel.training.device_map`,
offload folders are :mod:`nbaccel.training.offload`'s (Accelerate's format).

A device map is checked before anything moves or is written: every tensor has a device, every
device is one this machine has, an offload folder is writable and large enough.

>>> import torch
>>> with init_empty_weights():
...     model = torch.nn.Linear(4, 2)
>>> model.weight.device
device(type='meta')
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.training.device_map import (
    Device,
    _entry,
    check_device_map,
    find_tied_parameters,
    get_balanced_memory,
    infer_auto_device_map,
    named_tensors,
)
from nbaccel.training.model_files import load_checkpoint_in_model
from nbaccel.training.offload import (
    OffloadedWeightsLoader,
    extract_submodules_state_dict,
    has_offload_index,
    offload_state_dict,
)
from nbaccel.training.placement import (
    refuse_missing_devices,
    set_module_tensor_to_device,
)

_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_INCLUDE_BUFFERS_ENV = "ACCELERATE_INIT_INCLUDE_BUFFERS"  # Accelerate's variable, same meaning


def _include_buffers(include_buffers: bool | None) -> bool:
    if include_buffers is not None:
        return include_buffers
    return os.environ.get(_INCLUDE_BUFFERS_ENV, "").lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def init_on_device(
    device: torch.device | str, include_buffers: bool | None = None
) -> Iterator[None]:
    """Create the parameters of the modules built in the block on ``device`` (and their
    buffers too with ``include_buffers``, or ``ACCELERATE_INIT_INCLUDE_BUFFERS=1``).

    >>> with init_on_device("meta"):
    ...     layer = torch.nn.Linear(1000, 1000)
    >>> layer.weight.is_meta
    True
    """
    if _include_buffers(include_buffers):
        with torch.device(device):  # every tensor made in the block, buffers included
            yield
        return
    register = nn.Module.register_parameter

    def register_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        made = module._parameters[name]
        # A parameter already there (tying: ``lm_head.weight = embed.weight``) stays the same
        # object, so tied weights stay tied.
        if made is not None and made.device != torch.device(device):
            extra = dict(vars(made))  # e.g. transformers' _is_hf_initialized, kept
            moved = type(made)(made.to(device), requires_grad=made.requires_grad)
            vars(moved).update(extra)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_device  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models in the block with no memory for their parameters (on the meta device), to
    make a device map for them or load a checkpoint into them.

    >>> with init_empty_weights():
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(10_000, 10_000) for _ in range(100)])
    >>> sum(p.numel() for p in model.parameters())   # 10 billion numbers, no memory
    10001000000
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


# ---------------------------------------------------------------------------------------------
# Hooks: an offloaded module's tensors are brought to its execution device for its forward.


class _Loads:
    """What one module's forward needs: its tensors named ``names`` (full names in the model),
    read from ``weights`` onto ``device`` before it runs and put back on the meta device after
    (``offloaded``); its inputs moved to ``device``."""

    def __init__(
        self, names: dict[str, str], device: Device, weights: Mapping[str, torch.Tensor] | None
    ) -> None:
        self.names, self.device, self.weights = names, device, weights

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for local, full in self.names.items():
            assert self.weights is not None
            set_module_tensor_to_device(module, local, self.device, value=self.weights[full])
        return _to_device((args, kwargs), self.device)

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        for local in self.names:
            set_module_tensor_to_device(module, local, "meta")
        return output


def _to_device(obj: Any, device: Device) -> Any:
    from nbaccel.training.ops import send_to_device

    if isinstance(device, int):  # a device map's accelerator index
        device = torch.device("cuda", device)
    elif str(device) in ("cpu", "disk"):
        device = "cpu"
    return send_to_device(obj, torch.device(device))


def _attach(
    model: nn.Module,
    placement: dict[str, Device],
    main_device: Device,
    weights: Mapping[str, torch.Tensor] | None,
    offloaded: set[str],
    offload_buffers: bool,
    preload_module_classes: list[str] | None,
) -> None:
    """Hook every module whose own tensors are offloaded (or, for ``preload_module_classes``,
    whose subtree's are) so its forward finds them, and move the others to their device.
    ``placement``: each tensor's device map entry's device; ``offloaded``: the devices whose
    tensors stay out of the model between forwards."""
    buffers = {n for n, _ in model.named_buffers()}
    preload = set(preload_module_classes or [])
    covered: set[str] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        if any(_below(module_name, c) for c in covered):
            continue
        prefix = f"{module_name}." if module_name else ""
        recurse = type(module).__name__ in preload
        if recurse:
            covered.add(module_name)
        loads: dict[str, str] = {}
        for local, tensor in named_tensors(module, recurse=recurse):
            full = prefix + local
            device = placement[full]
            if device in offloaded and (offload_buffers or full not in buffers):
                loads[local] = full
                set_module_tensor_to_device(module, local, "meta")
            elif tensor.device.type != "meta" and tensor.device != torch.device(device):
                set_module_tensor_to_device(module, local, device)
        if loads:
            run_on = main_device
            hooks = _Loads(loads, "cpu" if run_on == "disk" else run_on, weights)
            module.register_forward_pre_hook(hooks.before, with_kwargs=True)
            module.register_forward_hook(hooks.after, with_kwargs=True)


def _hook_entries(model: nn.Module, device_map: Mapping[str, Device], main_device: Device) -> None:
    """Where modules run on different accelerators, each device map entry's inputs are moved
    to its device and the model's output back to where its input was (on the CPU alone,
    nothing moves)."""
    if {str(d) for d in device_map.values()} <= {"cpu", "disk", str(main_device)}:
        return

    def back_to_input(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
        return output if first is None else _to_device(output, first.device)

    for name, device in device_map.items():
        if str(device) in ("cpu", "disk"):
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:  # an entry for a parameter: its module's entry moves inputs
            continue
        module.register_forward_pre_hook(
            lambda m, a, k, d=device: _to_device((a, k), d), with_kwargs=True
        )
    model.register_forward_hook(back_to_input, with_kwargs=True)


def _below(name: str, ancestor: str) -> bool:
    return name != ancestor and (not ancestor or name.startswith(ancestor + "."))


def _placement(model: nn.Module, device_map: Mapping[str, Device]) -> dict[str, Device]:
    """Each tensor's device under ``device_map``."""
    found = {}
    for name, _ in named_tensors(model, remove_duplicate=False):
        entry = _entry(name, dict(device_map))
        assert entry is not None  # check_device_map ran
        found[name] = device_map[entry]
    return found


def _tied_weights(
    model: nn.Module, weights: Mapping[str, torch.Tensor] | None
) -> Mapping[str, torch.Tensor] | None:
    """``weights`` answering every name of a tied parameter with the one stored under another
    of its names (checkpoints store a tied weight once)."""
    groups = find_tied_parameters(model)
    if weights is None or not groups:
        return weights
    return _TiedNames(weights, groups)


class _TiedNames(Mapping[str, torch.Tensor]):
    def __init__(self, weights: Mapping[str, torch.Tensor], groups: list[list[str]]) -> None:
        self.weights = weights
        self.other = {name: group for group in groups for name in group}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.weights:
            return self.weights[key]
        for name in self.other.get(key, []):
            if name in self.weights:
                return self.weights[name]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def _refuse_moves(model: nn.Module) -> None:
    """A model with offloaded modules cannot be moved: ``model.to(...)`` says so."""
    to = model.to

    def guarded_to(*args: Any, **kwargs: Any) -> nn.Module:
        if any(p.is_meta for p in model.parameters()):
            raise RuntimeError(
                "This model has modules offloaded to the CPU or disk by dispatch_model; it cannot "
                "be moved with .to(). Dispatch it again with another device map instead."
            )
        return to(*args, **kwargs)

    model.to = guarded_to  # type: ignore[method-assign]


def dispatch_model(
    model: nn.Module,
    device_map: dict[str, Device],
    main_device: Device | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: dict[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Run ``model`` as ``device_map`` places it (Accelerate's ``dispatch_model``): modules on
    an accelerator move there; those on ``"disk"`` (and ``"cpu"`` when an accelerator runs the
    model) are written to ``offload_dir`` (unless it already holds them) or kept in CPU memory,
    and brought to ``main_device`` for their forward only. The outputs are the undispatched
    model's. ``model.hf_device_map`` records the map.

    >>> import tempfile
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> x = torch.randn(3, 4); expected = model(x)
    >>> model = dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=tempfile.mkdtemp())
    >>> model[1].weight.device, torch.equal(model(x), expected)
    (device(type='meta'), True)
    """
    check_device_map(model, device_map)
    refuse_missing_devices(device_map, "dispatch_model")
    devices = set(device_map.values())
    if not (len(devices) > 1 or "disk" in devices or force_hooks):
        model.to(next(iter(devices)))
        model.hf_device_map = dict(device_map)  # type: ignore[assignment]
        return model
    if main_device is None:
        on_devices = [d for d in device_map.values() if d not in ("cpu", "disk")]
        main_device = on_devices[0] if on_devices else "cpu"
    offloaded = {"disk"} if str(main_device) in ("cpu", "mps") else {"cpu", "disk"}
    state = model.state_dict()
    on_disk = [n for n, d in device_map.items() if d == "disk"]
    on_cpu = [n for n, d in device_map.items() if d == "cpu"]
    if "cpu" in offloaded and state_dict is None and on_cpu:
        state_dict = {
            k: v.to("cpu") for k, v in extract_submodules_state_dict(state, on_cpu).items()
        }
    save_folder = None
    if on_disk and offload_index is None:
        disk_state = extract_submodules_state_dict(state, on_disk)
        if not has_offload_index(offload_dir):
            if any(t.is_meta for t in disk_state.values()):
                raise ValueError(
                    "dispatch_model: modules for the disk have no weights (built under "
                    "init_empty_weights) and the offload folder holds none; load them with "
                    "load_checkpoint_and_dispatch(model, checkpoint, device_map, "
                    "offload_folder=...)."
                )
            offload_state_dict(offload_dir, disk_state, what="dispatch_model")  # type: ignore[arg-type]
        save_folder = offload_dir
    weights: Mapping[str, torch.Tensor] | None = None
    if state_dict is not None or save_folder is not None or offload_index is not None:
        weights = OffloadedWeightsLoader(
            state_dict=state_dict,
            save_folder=save_folder,
            index=offload_index,
            device=main_device if offload_index is not None else None,
        )
    _attach(
        model,
        _placement(model, device_map),
        main_device,
        _tied_weights(model, weights),
        offloaded,
        offload_buffers,
        preload_module_classes,
    )
    _hook_entries(model, device_map, main_device)
    _refuse_moves(model)
    model.hf_device_map = dict(device_map)  # type: ignore[assignment]
    return model


def cpu_offload(
    model: nn.Module,
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep one copy of the weights in CPU memory (``state_dict``, by default the model's)
    and bring each module's to ``execution_device`` for its forward only.

    >>> model = torch.nn.Linear(2, 1); x = torch.ones(1, 2); expected = model(x)
    >>> torch.equal(cpu_offload(model, "cpu")(x), expected)
    True
    """
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    if state_dict is None:
        state_dict = {k: v.to("cpu") for k, v in model.state_dict().items()}
    refuse_missing_devices({"": execution_device}, "cpu_offload")
    return _offload_whole(
        model, execution_device, state_dict, offload_buffers, preload_module_classes
    )


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Write the model's weights to the offload folder ``offload_dir`` (unless it already
    holds them, e.g. written by Accelerate) and read each module's from there for its forward.

    >>> import tempfile
    >>> model = torch.nn.Linear(2, 1); x = torch.ones(1, 2); expected = model(x)
    >>> torch.equal(disk_offload(model, tempfile.mkdtemp(), "cpu")(x), expected)
    True
    """
    if not has_offload_index(offload_dir):
        offload_state_dict(offload_dir, model.state_dict())
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
        if execution_device.type == "meta":
            execution_device = torch.device("cpu")
    refuse_missing_devices({"": execution_device}, "disk_offload")
    weights = OffloadedWeightsLoader(save_folder=offload_dir)
    return _offload_whole(model, execution_device, weights, offload_buffers, preload_module_classes)


def _offload_whole(
    model: nn.Module,
    execution_device: Device,
    weights: Mapping[str, torch.Tensor],
    offload_buffers: bool,
    preload_module_classes: list[str] | None,
) -> nn.Module:
    """Every tensor of ``model`` out of it between forwards, read from ``weights``."""
    placement: dict[str, Device] = dict.fromkeys(
        (n for n, _ in named_tensors(model, remove_duplicate=False)), "offloaded"
    )
    _attach(
        model,
        placement,
        execution_device,
        _tied_weights(model, weights),
        {"offloaded"},
        offload_buffers,
        preload_module_classes,
    )
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | dict[str, Device] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load a checkpoint (a file, a shard index or a ``save_model`` folder) into ``model``,
    typically built under :func:`init_empty_weights`, following ``device_map`` (a map, or
    ``"auto"``/``"balanced"``/``"balanced_low_0"``/``"sequential"`` to make one for
    ``max_memory``), then :func:`dispatch_model` it.

    >>> import tempfile
    >>> from nbaccel.training.model_files import save_model_files
    >>> folder = tempfile.mkdtemp()
    >>> save_model_files(torch.nn.Linear(4, 4).state_dict(), folder)
    >>> with init_empty_weights():
    ...     model = torch.nn.Linear(4, 4)
    >>> model = load_checkpoint_and_dispatch(model, folder, device_map="auto",
    ...                                      max_memory={"cpu": 10**6})
    >>> model.hf_device_map
    {'': 'cpu'}
    """
    placed: dict[str, Device] | None = None
    if isinstance(device_map, str):
        if device_map not in _STRATEGIES:
            raise ValueError(
                f"device_map={device_map!r} is not a device map; pass a dict or one of "
                f"{', '.join(map(repr, _STRATEGIES))}."
            )
        memory: Any = max_memory
        if device_map != "sequential":
            memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
            )
        placed = dict(
            infer_auto_device_map(
                model,
                max_memory=memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                offload_buffers=offload_buffers,
            )
        )
    elif device_map is not None:
        placed = dict(device_map)
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=placed,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    if placed is None:
        return model
    return dispatch_model(
        model,
        device_map=placed,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )
