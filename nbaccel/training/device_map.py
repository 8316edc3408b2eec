"""Device maps for models bigger than one device, with Accelerate's rules and answers: how many
bytes each submodule takes, how much each device may hold, and which submodule goes where
(accelerators first, then ``"cpu"``, then ``"disk"``). Pure arithmetic on the model's shapes:
a model built under ``init_empty_weights()`` (on the meta device) works as well as a real one.

>>> import torch
>>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])  # 288 bytes each
>>> dict(infer_auto_device_map(model, max_memory={"cpu": 700}))  # 288 + room for one: 576
{'0': 'cpu', '1': 'disk', '2': 'disk'}
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from nbaccel.core.disk_space import parse_size

Device = int | str | torch.device
# Where a device map may send a submodule besides an accelerator's index.
HOST_DEVICES = ("mps", "cpu", "disk")
# A module list entry: a submodule or a parameter, by its full name.
Named = tuple[str, nn.Module | torch.Tensor]


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes one element of ``dtype`` takes, as Accelerate counts them (a bool is one bit).

    >>> dtype_byte_size(torch.bfloat16), dtype_byte_size(torch.bool)
    (2, 0.125)
    """
    if dtype == torch.bool:
        return 1 / 8
    return dtype.itemsize


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype


def _keeps_its_dtype(dtype: torch.dtype) -> bool:
    """Integer and bool tensors are loaded as they are whatever ``dtype`` a load asks for."""
    return not (dtype.is_floating_point or dtype.is_complex)


def named_tensors(
    module: nn.Module, recurse: bool = True, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's parameters, then its buffers, by name (a tied tensor once, unless
    ``remove_duplicate=False``: under each of its names)."""
    yield from module.named_parameters(recurse=recurse, remove_duplicate=remove_duplicate)
    yield from module.named_buffers(recurse=recurse, remove_duplicate=remove_duplicate)


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, float]:
    """Bytes of each submodule (parameters and buffers, or buffers only), by name; ``""`` is the
    whole model. ``dtype`` is the one weights will be loaded in (never a wider one than theirs);
    ``special_dtypes`` overrides it for given tensor names.

    >>> compute_module_sizes(torch.nn.Linear(4, 2))[""]   # 8 + 2 float32 numbers
    40
    """
    size_of = dtype_byte_size(_as_dtype(dtype)) if dtype is not None else None
    special = {k: dtype_byte_size(_as_dtype(v)) for k, v in (special_dtypes or {}).items()}
    tensors = model.named_buffers() if buffers_only else named_tensors(model)
    sizes: dict[str, float] = defaultdict(int)
    for name, tensor in tensors:
        own = dtype_byte_size(tensor.dtype)
        if name in special:
            each = special[name]
        elif size_of is None or _keeps_its_dtype(tensor.dtype):
            each = own
        else:
            each = min(size_of, own)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += tensor.numel() * each
    return sizes


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of names under which the model holds one same parameter (tied weights), each
    group sorted.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> model[1].weight = model[0].weight
    >>> find_tied_parameters(model)
    [['0.weight', '1.weight']]
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [sorted(group) for group in names.values() if len(group) > 1]


def get_max_memory(
    max_memory: dict[int | str, int | str] | None = None,
) -> dict[int | str, Any]:
    """``max_memory`` in bytes, accelerators first (by index) then ``"mps"``, ``"cpu"``,
    ``"disk"``; without it, the free memory of each visible GPU and the available RAM.

    >>> get_max_memory({"cpu": "1GB", 0: "2GiB"})
    {0: 2147483648, 'cpu': 1000000000}
    """
    if max_memory is None:
        import psutil

        found: dict[int | str, Any] = {}
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                found[index] = torch.cuda.mem_get_info(index)[0]
        found["cpu"] = psutil.virtual_memory().available
        return found
    unknown = [k for k in max_memory if not isinstance(k, int) and k not in HOST_DEVICES]
    if unknown:
        raise ValueError(
            f"max_memory names {unknown}, which is no device; use accelerator indexes (0, 1, "
            f"...) and {', '.join(map(repr, HOST_DEVICES))}."
        )
    missing = [k for k in max_memory if isinstance(k, int) and not 0 <= k < _accelerators()]
    if missing:
        warnings.warn(
            f"max_memory names device {missing}, which this machine does not have (it has "
            f"{_accelerators()} accelerators); a device map made with it cannot be dispatched "
            "here.",
            stacklevel=2,
        )
    sizes = {k: _memory(k, v) for k, v in max_memory.items()}
    order = sorted(k for k in sizes if isinstance(k, int)) + [d for d in HOST_DEVICES if d in sizes]
    return {k: sizes[k] for k in order}


def _memory(device: int | str, size: int | float | str) -> int | float:
    if isinstance(size, (int, float)):  # get_balanced_memory's 90% is a float, kept as is
        return size
    return parse_size(size, what=f"max_memory[{device!r}]")


def _accelerators() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _children(module: nn.Module | torch.Tensor) -> list[Named]:
    """What a module splits into: its own parameters, then its submodules (tensors: nothing)."""
    if not isinstance(module, nn.Module):
        return []
    return [*module.named_parameters(recurse=False), *module.named_children()]


def _splittable(module: nn.Module | torch.Tensor, no_split: list[str]) -> bool:
    return (
        isinstance(module, nn.Module)
        and any(True for _ in module.children())
        and type(module).__name__ not in no_split
    )


def _largest_layer(
    modules: list[Named], sizes: dict[str, float], no_split: list[str]
) -> tuple[float, list[str]]:
    """The size of the largest layer (a module with no submodules, or one never split) among
    ``modules`` and their descendants, with the names of the layers that size."""
    largest, names = 0.0, []
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        if _splittable(module, no_split):
            assert isinstance(module, nn.Module)
            queue = [(f"{name}.{n}", m) for n, m in module.named_children()] + queue
        elif sizes[name] > largest:
            largest, names = sizes[name], [name]
        elif sizes[name] == largest:
            names.append(name)
    return largest, names


def _inside(name: str, full: str) -> bool:
    return full == name or full.startswith(name + ".")


def _ties_outside(name: str, tied: list[list[str]]) -> list[str]:
    """The tied parameters outside ``name`` that are tied to one inside it."""
    outside: list[str] = []
    for group in tied:
        inner = [_inside(name, p) for p in group]
        if any(inner) and not all(inner):
            outside += [p for p, is_in in zip(group, inner) if not is_in]
    return outside


def _with_ties(
    size: float, ties: list[str], sizes: dict[str, float], queue: list[Named]
) -> tuple[float, list[Named]]:
    """A module's size counting the modules (still to place) holding the parameters tied to
    it, less those parameters (counted once), and those modules."""
    holders: list[Named] = []
    for param in ties:
        holder = next((entry for entry in queue if param.startswith(entry[0] + ".")), None)
        if holder is None:  # placed already, with its size (Accelerate 1.15 fails here)
            continue
        holders.append(holder)
        size += sizes[holder[0]] - sizes[param]
    return size, holders


def _no_split(no_split_module_classes: list[str] | str | None) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> OrderedDict[str, int | str]:
    """Where each submodule goes, Accelerate's map for the same arguments: submodules in order
    fill the accelerators, then ``"cpu"``, then ``"disk"``, each device up to its
    ``max_memory``; a submodule too big for what is left is split into its children unless its
    class is in ``no_split_module_classes``; the first accelerator and the CPU keep room for the
    largest layer (an offloaded layer is brought there to run); tied parameters go with the
    module they are tied to. ``fallback_allocation``: a device that would get nothing takes the
    first later submodule that fits.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    >>> dict(infer_auto_device_map(model, max_memory={"cpu": 10**6}))
    {'': 'cpu'}
    """
    memory = get_max_memory(max_memory)
    no_split = _no_split(no_split_module_classes)
    devices: list[int | str] = [*memory, *(["disk"] if "disk" not in memory else [])]
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    # The devices an offloaded layer is brought to in order to run: they keep room for one.
    main = ["mps"] if "mps" in gpus else [gpus[0], "cpu"] if gpus else ["cpu"]
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied = find_tied_parameters(model)
    queue: list[Named] = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    device_map: OrderedDict[str, int | str] = OrderedDict()
    used = dict.fromkeys(devices, 0.0)
    buffers: dict[int | str, float] = {}
    index = 0
    largest, largest_names = _largest_layer(queue, sizes, no_split)

    def note(text: str) -> None:
        if verbose:
            print(text)

    while queue:
        name, module = queue.pop(0)
        note(f"\nTreating module {name}.")
        largest_names = [n for n in largest_names if not _inside(name, n)]
        if not largest_names:  # the largest layer was placed: the next largest is kept room for
            largest, largest_names = _largest_layer(
                [e for e in queue if isinstance(e[1], nn.Module)], sizes, no_split
            )
        size = sizes[name]
        ties = _ties_outside(name, tied)
        device = devices[index]
        reserved = largest if device in main else 0
        room = None if device == "disk" else memory[device] - reserved
        total, holders = _with_ties(size, ties, sizes, queue)

        if room is None or used[device] + total <= room:
            note(f"Putting {name} (size={size}) on {device}.")
            used[device] += total
            device_map[name] = device
            for holder, _ in holders:
                queue = [e for e in queue if e[0] != holder]
                device_map[holder] = device
            if not offload_buffers and isinstance(module, nn.Module):
                buffer_size = compute_module_sizes(
                    module, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True
                ).get("", 0)
                buffers[device] = buffers.get(device, 0) + buffer_size
            continue

        if ties and used[device] + size <= room:
            # The module fits without what is tied to it: split a module it is tied to.
            split = next((h for h in holders if _splittable(h[1], no_split)), None)
            if split is not None:
                note(f"Splitting {split[0]}.")
                at = queue.index(split)
                parts = [(f"{split[0]}.{n}", m) for n, m in _children(split[1])]
                queue = [(name, module), *queue[:at], *parts, *queue[at + 1 :]]
                largest, largest_names = _largest_layer(
                    [e for e in queue if isinstance(e[1], nn.Module)], sizes, no_split
                )
                continue

        if used[device] + size >= room and _splittable(module, no_split):
            note(f"Splitting {name}.")
            queue = [(f"{name}.{n}", m) for n, m in _children(module)] + queue
            largest, largest_names = _largest_layer(
                [e for e in queue if isinstance(e[1], nn.Module)], sizes, no_split
            )
            continue

        if fallback_allocation and used[device] == 0 and device != "disk":
            limit = memory[device] - max(largest, total)
            found = _fallback(queue, sizes, limit, no_split, tied)
            if found is not None:
                queue = [found[0], (name, module), *found[1]]
                continue

        note(f"{name} does not fit on {device}: next device.")
        used[device] += reserved
        index += 1
        queue.insert(0, (name, module))

    if clean_result:
        clean_device_map(device_map)  # in place
    _warn_buffers_fit_no_gpu(buffers, memory, used, gpus, offload_buffers)
    return device_map


def _warn_buffers_fit_no_gpu(
    buffers: dict[int | str, float],
    memory: dict[int | str, int],
    used: dict[int | str, float],
    gpus: list[int | str],
    offload_buffers: bool,
) -> None:
    """Offloaded layers keep their buffers on the accelerator that runs them: say so when they
    fit on none."""
    held = buffers.get("cpu", 0) + buffers.get("disk", 0)
    if offload_buffers or not held or not gpus:
        return
    if any(memory[g] >= held + used.get(g, 0) for g in gpus):
        return
    warnings.warn(
        f"The offloaded layers' buffers take {int(held)} bytes, which fit on no accelerator "
        "next to its share of the model; pass offload_buffers=True if it runs out of memory.",
        stacklevel=3,
    )


def _fallback(
    queue: list[Named],
    sizes: dict[str, float],
    limit: float,
    no_split: list[str],
    tied: list[list[str]],
) -> tuple[Named, list[Named]] | None:
    """The first submodule (breadth first through ``queue``) that fits in ``limit``, and the
    queue without it (its parents replaced by their other children)."""
    search = list(queue)
    while search:
        name, module = search.pop(0)
        total, _ = _with_ties(sizes[name], _ties_outside(name, tied), sizes, search)
        if total <= limit:
            break
        if not _splittable(module, no_split):
            continue
        search = [(f"{name}.{n}", m) for n, m in _children(module)] + search
    else:
        return None
    rest = list(queue)
    for depth in range(1, name.count(".") + 1):
        parent = ".".join(name.split(".")[:depth])
        at = next((i for i, e in enumerate(rest) if e[0] == parent), None)
        if at is not None:
            parts = [(f"{parent}.{n}", m) for n, m in _children(rest[at][1])]
            rest = [*rest[:at], *parts, *rest[at + 1 :]]
    at = next(i for i, e in enumerate(rest) if e[0] == name)
    return rest.pop(at), rest


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """The map with every module whose entries all go to one device written as one entry.

    >>> clean_device_map({"a.0": "cpu", "a.1": "cpu", "b": "disk"})
    {'b': 'disk', 'a': 'cpu'}
    """
    prefix = f"{module_name}." if module_name else ""
    inside = [k for k in device_map if k.startswith(prefix)]
    values = [device_map[k] for k in inside]
    if len(values) > 1 and len(set(values)) == 1:
        for key in inside:
            del device_map[key]
        device_map[module_name] = values[0]
    depth = module_name.count(".") + 2 if module_name else 1
    children = {
        ".".join(k.split(".")[:depth])
        for k in device_map
        if k.startswith(prefix) and len(k) > len(module_name)
    }
    for child in children:
        clean_device_map(device_map, child)
    return device_map


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """A ``max_memory`` that spreads the model evenly over the accelerators (Accelerate's
    numbers: each but the last gets its share plus 1.25 × the larger of the largest unsplit
    block and the mean layer; ``low_zero`` keeps accelerator 0 as empty as the others allow).
    Without accelerators, ``max_memory`` as it is.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> get_balanced_memory(model, {0: 10**6, 1: 10**6, "cpu": 10**9})  # doctest: +SKIP
    {0: 180, 1: 1000000, 'cpu': 1000000000}
    """
    user_set = max_memory is not None
    memory: dict[int | str, Any] = get_max_memory(max_memory)
    accelerators = [d for d in memory if isinstance(d, int) and memory[d] > 0]
    if not accelerators:
        return memory
    if len(accelerators) == 1:
        low_zero = False
        if not user_set:  # keep a tenth for what runs there besides the weights
            memory[accelerators[0]] *= 0.9
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    share = sizes[""] // (len(accelerators) - 1 if low_zero else len(accelerators))
    no_split = _no_split(no_split_module_classes)
    block = 0.0
    if no_split:
        first: dict[str, float] = {}
        modules_by_name = dict(model.named_modules())
        for name in sizes:  # in the sizes' order, as Accelerate looks for the first of each
            kind = type(modules_by_name.get(name)).__name__
            if name and kind in no_split and kind not in first:
                first[kind] = sizes[name]
        block = max(first.values(), default=0)
    # The mean size of the modules just above the tensors (leaves of the sizes' name tree).
    leaves = _leaves(sizes)
    modules = {n: s for n, s in sizes.items() if n not in set(leaves)}
    layers = _leaves(modules)
    mean = int(sum(modules[n] for n in layers) / max(len(layers), 1))
    share += int(1.25 * max(block, mean))
    ordered = sorted(d for d in memory if isinstance(d, int) and memory[d] > 0)
    for device in ordered[:-1]:  # the last one keeps all it has, in case the margin is short
        memory[device] = min(memory[0] if low_zero and device == 0 else share, memory[device])
    if low_zero:
        rest = sum(memory[i] for i in range(1, len(accelerators)))
        memory[0] = min(max(0, sizes[""] - rest), memory[0])
    return memory


def _leaves(sizes: dict[str, float]) -> list[str]:
    parents = {n.rsplit(".", 1)[0] for n in sizes if n and "." in n}
    return [n for n in sizes if n and n not in parents]


def check_device_map(model: nn.Module, device_map: dict[str, Device]) -> None:
    """Refuse a device map that leaves a parameter or buffer of ``model`` without a device,
    naming them.

    >>> check_device_map(torch.nn.Linear(2, 2), {"": "cpu"})
    """
    if not isinstance(device_map, dict):  # "auto", "balanced", ...: a strategy, not a map
        raise ValueError(
            f"device_map={device_map!r} names a way to make a device map, not a map: pass a "
            "dict of module name to device, e.g. infer_auto_device_map(model, max_memory=...), "
            f"or load with load_checkpoint_and_dispatch(model, checkpoint, device_map={device_map!r})."
        )
    names = [n for n, _ in named_tensors(model, remove_duplicate=False)]
    missing = [n for n in names if _entry(n, device_map) is None]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(
            f"The device map gives no device to {shown}; add an entry for them (or their "
            "module), or make one with infer_auto_device_map(model, max_memory=...)."
        )


def _entry(name: str, device_map: dict[str, Any]) -> str | None:
    """The device map's entry covering ``name``: itself or its nearest enclosing module."""
    while True:
        if name in device_map:
            return name
        if not name:
            return None
        name = name.rsplit(".", 1)[0] if "." in name else ""
