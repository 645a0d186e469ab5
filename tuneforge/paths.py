"""Where tuneforge keeps its own files (converted models, tokenized-data cache)."""

from __future__ import annotations

import os
from pathlib import Path


def tuneforge_home() -> Path:
    """$TUNEFORGE_HOME, else $XDG_CACHE_HOME/tuneforge, else ~/.cache/tuneforge."""
    if os.environ.get("TUNEFORGE_HOME"):
        return Path(os.environ["TUNEFORGE_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tuneforge"
