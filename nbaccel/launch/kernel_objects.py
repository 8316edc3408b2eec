"""Which of the kernel's own lists, dicts and sets a launched function changes in place.

Every rank is a process of its own, also with ``num_processes=1`` (so the kernel never touches
CUDA), where Accelerate's ``notebook_launcher`` calls the function in the kernel. A notebook
written for Accelerate that collects results with ``results.append(...)`` then finds its list
empty: ``launch.plan`` names such containers before the launch, in one line.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable
from typing import Any

# Methods that change a list, dict or set in place.
_CHANGERS = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
    | {"update", "setdefault", "popitem", "add", "discard"}
    | {"__setitem__", "__delitem__", "__iadd__"}
)
_CONTAINERS = (list, dict, set)
_LOADS = {"LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME"}
_ATTRS = {"LOAD_METHOD", "LOAD_ATTR"}


def kernel_containers_changed(function: Callable[..., Any]) -> list[str]:
    """The names of the notebook's lists, dicts and sets (globals or closed-over) that
    ``function`` (or a function defined inside it) changes in place, in order, once each.

    >>> results = []
    >>> def train():
    ...     results.append(1.0)
    >>> kernel_containers_changed(train)
    ['results']
    >>> kernel_containers_changed(lambda: sorted(results))
    []
    """
    while isinstance(function, functools.partial):  # as the plan names it: the wrapped function
        function = function.func
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    closure = dict(
        zip(code.co_freevars, (c.cell_contents for c in function.__closure__ or ()), strict=False)
    )
    found: list[str] = []
    for inner in _codes(code):
        for name in _changed_names(inner):
            value = closure.get(name, function.__globals__.get(name))
            if isinstance(value, _CONTAINERS) and name not in found:
                found.append(name)
    return found


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and every code object nested in it (inner functions, comprehensions)."""
    out = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += _codes(const)
    return out


def _changed_names(code: types.CodeType) -> list[str]:
    """Names loaded and then changed in place: ``name.append(...)``, ``name[k] = v``,
    ``del name[k]``."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    names = []
    for n, instruction in enumerate(ins):
        if instruction.opname not in _LOADS:
            continue
        after = ins[n + 1 : n + 3]
        if (
            after
            and after[0].opname in _ATTRS
            and after[0].argval in _CHANGERS
            or len(after) == 2
            and after[1].opname in ("STORE_SUBSCR", "DELETE_SUBSCR")
        ):
            names.append(str(instruction.argval))
    return names
