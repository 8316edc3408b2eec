"""The process environment as training code changes it: variables set for one block
(``patch_environment``) and the default launch config file (``write_basic_config``).

>>> with patch_environment(nbaccel_example="1"):
...     os.environ["NBACCEL_EXAMPLE"]
'1'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nbaccel.core.config import LaunchConfig, default_config_path


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (names upper-cased, values as strings) inside the block, then
    put back what was there before.

    >>> with patch_environment(nbaccel_example="1"):
    ...     os.environ["NBACCEL_EXAMPLE"]
    '1'
    >>> "NBACCEL_EXAMPLE" in os.environ
    False
    """
    before = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    os.environ.update({key.upper(): str(value) for key, value in kwargs.items()})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | bool:
    """Write nbaccel's default config file (shared by ``notebook_launcher``, the config panel and
    ``nbaccel launch``) with ``mixed_precision`` and every visible GPU as a process, unless the
    file already exists: then return False and leave it as it is.

    Example::

        write_basic_config(mixed_precision="bf16")   # ~/.config/nbaccel/default_config.yaml
    """
    path = Path(save_location) if save_location is not None else default_config_path()
    if path.exists():
        print(f"nbaccel: a config file already exists at {path}; it was left as it is.")
        return False
    return LaunchConfig(mixed_precision=mixed_precision).save(path)
