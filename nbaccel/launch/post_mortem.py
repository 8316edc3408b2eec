"""Post-mortem of a failed rank in the kernel: ``%debug`` and ``nbaccel.debug()``.

A failed rank sends, with its failure, a copy of its frames and their locals
(``core.snapshot``: tensors on the CPU, values too big or unpicklable described by type, shape
and repr). Here that copy is made into real frames again: each recorded frame is a small code
object compiled under the frame's own file name, function name and first line, run with the
recorded locals as its namespace, each calling the next (through ``exec``, so no frame of
nbaccel's sits between them) until the last raises the rank's exception at its line. The
traceback that results is what IPython's debugger (or pdb) walks: ``up``/``down`` go through
the user's frames only, ``l``/``ll`` list the cell's source as ``Cell In[n]``, ``p`` reads the
rank's locals, and globals are the notebook's.

Why a copy rather than the failed rank kept alive with its real frames: a launch ends when it
ends (every rank reaped and swept, nothing holding a GPU's memory), the copy outlives later
launches and costs nothing until it is used, and no rank process waits on a person who may
never come. What a copy cannot do: call methods on live state (a CUDA model, a process group)
or change the rank. ``%%ranks`` cells, whose ranks stay alive, debug their real frames.

``%debug`` is IPython's, wrapped (:func:`wrap_debug_magic`): after a launch failed it opens the
failing rank's frames; after any other error it is IPython's own.
"""

from __future__ import annotations

import builtins
import collections
import functools
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loaded with the first post-mortem: %debug is wrapped at `import nbaccel`
    import pdb

    from nbaccel.core import snapshot

KEPT = 8  # failed ranks whose frames are kept (the newest), for %debug after them
_RECORDS: collections.OrderedDict[int, tuple[BaseException, int, bytes, object]] = (
    collections.OrderedDict()
)
_NEXT, _RAISE = "__nbaccel_next__", "__nbaccel_exc__"
# Debuggers for errors whose ranks are still alive (a %%ranks cell's): each says whether it
# took the error (and debugged it). ``%ranks`` adds its own (``persistent.magics``).
LIVE: list[Callable[[BaseException | None], bool]] = []


def remember(error: BaseException, rank: int, frames: bytes | None, launch: object = None) -> None:
    """Keep ``rank``'s frames for a post-mortem of ``error`` (the newest :data:`KEPT`);
    ``launch``: what the failures of one launch share, so that any of them reaches the others'
    (``debug(rank=1)``)."""
    if frames is None:
        return
    _RECORDS[id(error)] = (error, rank, frames, launch if launch is not None else error)
    while len(_RECORDS) > KEPT:
        _RECORDS.popitem(last=False)


def find(
    error: BaseException | None, rank: int | None = None
) -> tuple[int, bytes, BaseException] | None:
    """The failed rank's number, recorded frames and exception behind ``error`` (or an error
    it was raised from), if its frames were kept; with ``rank``, that rank's of the same
    launch."""
    kept = _record(error, rank)
    return None if kept is None else (kept[1], kept[2], _raised(kept[0]))


def held_ranks(error: BaseException | None) -> list[int]:
    """The ranks of ``error``'s launch whose frames are kept (more than one where several
    ranks failed)."""
    kept = _record(error)
    if kept is None:
        return []
    return sorted({k[1] for k in _RECORDS.values() if k[3] is kept[3]})


def _record(
    error: BaseException | None, rank: int | None = None
) -> tuple[BaseException, int, bytes, object] | None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        kept = _RECORDS.get(id(error))
        if kept is not None and kept[0] is error:
            if rank is None or rank == kept[1]:
                return kept
            same = [k for k in _RECORDS.values() if k[3] is kept[3] and k[1] == rank]
            return same[0] if same else None
        error = error.__cause__ or error.__context__
    return None


def _raised(error: BaseException) -> BaseException:
    original = getattr(error, "original", None)
    return original if isinstance(original, BaseException) else RuntimeError(str(error))


def last_error() -> BaseException | None:
    """The error the notebook showed last (IPython keeps it in ``sys.last_value``)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def rebuild(records: list[snapshot.FrameRecord], exc: BaseException) -> TracebackType:
    """A traceback of real frames standing for ``records``: each with its file, line, function
    name and locals, the last raising ``exc``."""
    namespaces = [_locals(r) for r in records]
    codes = [_code(r, last=i == len(records) - 1) for i, r in enumerate(records)]
    for i in range(len(records) - 1):  # each frame calls the next, with no frame in between
        namespaces[i][_NEXT] = functools.partial(
            exec, codes[i + 1], _globals(records[i + 1]), namespaces[i + 1]
        )
    namespaces[-1][_RAISE] = exc.with_traceback(None)
    try:
        exec(codes[0], _globals(records[0]), namespaces[0])
    except BaseException as raised:  # noqa: BLE001 - it is exc, raised on purpose
        tb = raised.__traceback__
    finally:
        for namespace in namespaces:
            namespace.pop(_NEXT, None)
            namespace.pop(_RAISE, None)
    assert tb is not None and tb.tb_next is not None
    return tb.tb_next  # this function's own frame is not the rank's


def _code(record: snapshot.FrameRecord, last: bool) -> Any:
    first = min(record.first_line, record.line)
    body = f"raise {_RAISE}" if last else f"{_NEXT}()"
    code = compile("\n" * (record.line - first) + body, record.file, "exec")
    code = code.replace(co_name=record.function, co_firstlineno=first)
    if sys.version_info >= (3, 11):  # 3.10's code objects have no qualified name (TypeError)
        code = code.replace(co_qualname=record.function)
    return code


def _locals(record: snapshot.FrameRecord) -> dict[str, Any]:
    from nbaccel.core import pickling, snapshot

    values = {}
    for name, value in record.values.items():
        if isinstance(value, bytes):
            try:
                values[name] = pickling.loads(value)
            except Exception as exc:  # noqa: BLE001 - described, like a value the rank kept
                why = f"cannot be loaded in the kernel: {type(exc).__name__}: {exc}"
                values[name] = snapshot.Unsent("?", "", why, "")
        else:
            values[name] = value
    return values


def _globals(record: snapshot.FrameRecord) -> dict[str, Any]:
    """The module's globals where it is loaded here (the notebook's for a cell), else bare."""
    module = sys.modules.get(record.module)
    if module is not None:
        return vars(module)
    return {"__name__": record.module, "__builtins__": builtins}


def _debugger(rank: int) -> pdb.Pdb:
    """IPython's debugger in a kernel (colours, hidden frames), else pdb; either names the
    notebook's cells ``Cell In[n]`` as the traceback does."""
    import pdb

    from nbaccel.core.local_traceback import cell_label

    base: type[pdb.Pdb] = pdb.Pdb
    prompt = f"(Pdb rank {rank}) "
    try:
        from IPython import get_ipython

        if get_ipython() is not None:
            from IPython.core.debugger import Pdb as base  # noqa: N813

            prompt = f"ipdb rank {rank}> "
    except ImportError:
        pass

    class RankPostMortem(base):  # type: ignore[misc, valid-type]
        def format_stack_entry(self, frame_lineno: Any, *args: Any, **kwargs: Any) -> str:
            text = super().format_stack_entry(frame_lineno, *args, **kwargs)
            filename = frame_lineno[0].f_code.co_filename
            label = cell_label(filename)
            return text.replace(filename, label) if label else text

    debugger = RankPostMortem()
    debugger.prompt = prompt
    return debugger


def debug(error: BaseException | None = None, rank: int | None = None) -> None:
    """Open a debugger in the frames of the rank whose failure ``error`` is (by default the
    error the notebook showed last, as ``%debug`` does), with that rank's locals as they were
    when it failed: ``p``, ``pp``, ``l``, ``ll``, ``w``, ``u``, ``d``, ``q``. Where several
    ranks of the launch failed, ``rank`` chooses whose frames (by default the one the error
    names); the first line says which others are kept.

    Example::

        nbaccel.notebook_launcher(train, num_processes=2)   # RankFailedError: rank 1 ...
        nbaccel.debug()                                      # ipdb rank 1> p batch
        nbaccel.debug(rank=0)                                # where rank 0 failed too

    >>> debug(ValueError("not a launch"))
    Traceback (most recent call last):
    ...
    ValueError: nothing to debug: ValueError is not a rank's failure ...
    """
    error = error if error is not None else last_error()
    if rank is None and any(live(error) for live in LIVE):
        return
    found = find(error, rank)
    if found is None:
        what = type(error).__name__ if error is not None else "no error"
        held = held_ranks(error)
        if held:
            raise ValueError(
                f"nothing to debug for rank {rank}: the frames kept of this launch's failures "
                f"are rank {', '.join(map(str, held))}'s; try nbaccel.debug(rank={held[0]})"
            )
        raise ValueError(
            f"nothing to debug: {what} is not a rank's failure whose frames were kept (a launch "
            "that failed keeps its failing ranks' frames for its last "
            f"{KEPT} failed ranks; NBACCEL_POST_MORTEM=0 turns that off)"
        )
    from nbaccel.core import snapshot

    rank, frames, exc = found
    tb = rebuild(snapshot.load(frames), exc)
    others = [k for k in held_ranks(error) if k != rank]
    print(
        f"post-mortem of rank {rank}: its frames and locals as they were when it failed, copied "
        "to the kernel (tensors on the CPU; a value too big or that cannot be copied shows as "
        "<not sent ...>)"
    )
    if others:
        names = ", ".join(map(str, others))
        print(
            f"rank {names} failed too and {'their' if len(others) > 1 else 'its'} frames are "
            f"kept: nbaccel.debug(rank={others[0]}) opens them"
        )
    debugger = _debugger(rank)
    debugger.reset()
    debugger.interaction(None, tb)


def wrap_debug_magic(shell: Any) -> None:
    """Make IPython's ``%debug`` open the failed rank's frames after a launch failed (once)."""
    manager = shell.magics_manager
    # IPython 9 lists magics lazily: find() imports the real one (and its class's others), so
    # loading them later does not put IPython's back over this one.
    resolve = getattr(manager, "find", None)
    if resolve is not None:
        original, original_cell = resolve("line", "debug"), resolve("cell", "debug")
    else:
        original = manager.magics["line"].get("debug")
        original_cell = manager.magics["cell"].get("debug")
    if original is None or getattr(original, "_nbaccel_wraps", None) is not None:
        return
    original_cell = original_cell or original

    def debug_magic(line: str = "", cell: str | None = None, local_ns: Any = None) -> Any:
        error = last_error()
        if not line.strip() and cell is None and (find(error) or any(f(error) for f in LIVE)):
            return debug(error) if find(error) else None
        if cell is not None:
            return original_cell(line, cell, local_ns=local_ns)
        return original(line, local_ns=local_ns)

    debug_magic.__doc__ = original.__doc__
    debug_magic._nbaccel_wraps = original  # type: ignore[attr-defined]
    debug_magic.needs_local_scope = True  # type: ignore[attr-defined]
    debug_magic._ipython_magic_no_var_expand = True  # type: ignore[attr-defined]
    shell.register_magic_function(debug_magic, "line_cell", "debug")
