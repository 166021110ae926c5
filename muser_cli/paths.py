"""Where muser keeps things. ``MUSER_HOME`` overrides every platformdirs location."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "muser"


def _home() -> Path | None:
    value = os.environ.get("MUSER_HOME")
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    home = _home()
    if home is not None:
        return home / "data"
    import platformdirs

    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def cache_dir() -> Path:
    home = _home()
    if home is not None:
        return home / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def config_dir() -> Path:
    home = _home()
    if home is not None:
        return home / "config"
    import platformdirs

    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def models_dir() -> Path:
    """Converted models (the embedded GGUF as a folder). ``MUSER_MODELS`` overrides."""
    value = os.environ.get("MUSER_MODELS")
    if value:
        return Path(value).expanduser()
    return cache_dir() / "models"


def store_dir() -> Path:
    """The reuse store. ``MUSER_STORE`` overrides (each ``batch --ray`` worker keeps its own)."""
    value = os.environ.get("MUSER_STORE")
    if value:
        return Path(value).expanduser()
    return data_dir() / "store"


def keys_dir() -> Path:
    return config_dir() / "node"


def ensure_dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    return path
