"""The project's cache folder (the ``auto`` backend choice, the flavor listing); imports no torch."""

import os
from pathlib import Path

CACHE_ENV = "TORCHTITAN_EXT_CACHE"


def cache_dir() -> Path:
    """``$TORCHTITAN_EXT_CACHE``, else ``~/.cache/torchtitan_ext``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "torchtitan_ext")
