"""Environment variables of rayinfer, each read here (and only here) through a typed getter.

Variables:
    RAYINFER_CACHE_DIR: root of rayinfer's caches (converted models live under ``<root>/models``);
        default ``platformdirs.user_cache_dir("rayinfer")``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root directory of rayinfer's on-disk caches (not created here)."""
    value = os.environ.get("RAYINFER_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rayinfer"))
