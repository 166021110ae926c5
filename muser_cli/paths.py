"""Where muser keeps things. ``MUSER_HOME`` overrides every platformdirs location."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "muser"


def _home() -> Path | None:
    value = os.environ.get("MUSER_HOME")
    return Path(value).expanduser() if value else None


def _home_or_platform(sub: str, platform_dir: str) -> Path:
    """``$MUSER_HOME/<sub>`` when MUSER_HOME is set, else platformdirs' ``platform_dir`` for muser."""
    home = _home()
    if home is not None:
        return home / sub
    import platformdirs

    return Path(getattr(platformdirs, platform_dir)(APP_NAME, appauthor=False))


def data_dir() -> Path:
    return _home_or_platform("data", "user_data_dir")


def cache_dir() -> Path:
    return _home_or_platform("cache", "user_cache_dir")


def config_dir() -> Path:
    return _home_or_platform("config", "user_config_dir")


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
