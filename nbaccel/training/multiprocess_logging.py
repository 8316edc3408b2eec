"""``get_logger``: a logger for training code that runs on every rank, as Accelerate's is; and
``tqdm``, a progress bar shown by the local main process only.

By default a record is emitted by the main process only, so N ranks do not print each message N
times; ``main_process_only=False`` emits it on every rank, and ``in_order=True`` on every rank
one after the other (rank 0 first; each rank waits for the previous). Lines reach the notebook
labelled by rank like any rank output. The level comes from ``log_level``, else
``$NBACCEL_LOG_LEVEL`` (or Accelerate's ``$ACCELERATE_LOG_LEVEL``).

>>> get_logger("example").logger is logging.getLogger("example")
True
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch.distributed as dist

from nbaccel.training.distributed import env_int

__all__ = ["MultiProcessAdapter", "get_logger"]


def _process_index() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_int("RANK", 0)


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger adapter whose calls take ``main_process_only`` (default True) and ``in_order``.

    Example::

        logger = get_logger(__name__)
        logger.info("epoch %d done", epoch)                        # once, from rank 0
        logger.info("my shard: %d", n, main_process_only=False)    # every rank
    """

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)  # the caller's line, not this adapter's
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if not main_process_only or _process_index() == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        if not (dist.is_available() and dist.is_initialized()):
            self.logger.log(level, msg, *args, **kwargs)
            return
        for turn in range(dist.get_world_size()):
            if turn == dist.get_rank():
                self.logger.log(level, msg, *args, **kwargs)
                for handler in logging.getLogger().handlers + self.logger.handlers:
                    handler.flush()  # out before the next rank's turn
            dist.barrier()

    @functools.lru_cache(None)  # noqa: B019 - the cache lives as long as the logger, on purpose
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning`` that emits a given message once per process."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger ``name`` wrapped for multi-process use; ``log_level`` (e.g. ``"INFO"``) also
    becomes the root logger's level, as in Accelerate.

    Example::

        from nbaccel.logging import get_logger
        logger = get_logger(__name__, log_level="INFO")
    """
    if log_level is None:
        log_level = os.environ.get("NBACCEL_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown by the local main process only (with ``main_process_only``);
    in a rank it is reported to the launch's dashboard like any tqdm bar.

    Example::

        for batch in tqdm(loader, desc="train"):   # one bar per machine, not per rank
            ...
    """
    if args and isinstance(args[0], bool):
        raise ValueError(
            "tqdm's first argument is the iterable; to show the bar on every rank pass "
            "main_process_only=False (Accelerate's older tqdm(True, ...) form is not supported)."
        )
    from tqdm.auto import tqdm as bar

    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or env_int("LOCAL_RANK", 0) != 0
    return bar(*args, **kwargs)
