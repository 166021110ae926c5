"""A fast BLAS for MLX on Linux CPUs, and a record of which BLAS MLX actually uses.

The ``mlx[cpu]`` wheel links a bundled reference BLAS (~3 GFLOP/s fp32 matmul here).
MLX calls ``cblas_sgemm`` through the dynamic linker's global scope first, so a BLAS
that is already global when ``libmlx.so`` is loaded wins over the bundled one. Two ways
to get there, both supported:

  * in-process: :func:`ensure_fast_blas`, called before the first ``import mlx.core``,
    loads MKL's single dynamic library (PyPI ``mkl``: ``<prefix>/lib/libmkl_rt.so.*``)
    with ``RTLD_GLOBAL``. Too late once ``mlx.core`` is imported: then MLX keeps the
    reference BLAS, and :func:`ensure_fast_blas` says so instead of pretending.
  * before the process starts: :func:`preload_env` returns an environment with
    ``LD_PRELOAD`` set, for a subprocess (a benchmark, a test, a shell wrapper).

``MUSER_MLX_BLAS`` chooses: ``auto`` (default: MKL if found, else a system OpenBLAS,
else the bundled one), ``mkl``, ``openblas``, ``reference`` (load nothing), or a path
to a shared library exporting ``cblas_sgemm``. An explicit choice that cannot be
honoured raises :class:`~muser_cli.errors.ConfigError`.

Pure Python: importing this module imports no ML framework.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from muser_cli.errors import ConfigError

ENV_VAR = "MUSER_MLX_BLAS"
CHOICES = ("auto", "mkl", "openblas", "reference")
MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
OPENBLAS_NAMES = ("libopenblas.so.0", "libopenblas.so")
OPENBLAS_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_PROBE_SYMBOL = "cblas_sgemm"


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's matmuls go to in this process."""

    name: str  # "mkl" | "openblas" | "reference" | "accelerate" | "other"
    path: str | None  # the library file providing cblas_sgemm, when known
    how: str  # how it got there (one short phrase)
    threads: int | None = None  # BLAS threads, when the library reports them

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def fast(self) -> bool:
        return self.name not in ("reference",)


_ACTIVE: BlasInfo | None = None
_LOADED: ctypes.CDLL | None = None


# --------------------------------------------------------------------------- finding


def _lib_dirs() -> list[Path]:
    """Where pip puts a wheel's ``data/lib`` files: this environment's prefix, then the others."""
    dirs = []
    for prefix in (sys.prefix, sys.base_prefix, os.path.expanduser("~/.local")):
        d = Path(prefix) / "lib"
        if d not in dirs:
            dirs.append(d)
    for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if entry and Path(entry) not in dirs:
            dirs.append(Path(entry))
    return dirs


def find_library(kind: str) -> Path | None:
    """The shared library file of ``kind`` ("mkl" or "openblas"), or ``None``."""
    if kind == "mkl":
        names, extra = MKL_NAMES, ()
    elif kind == "openblas":
        names, extra = OPENBLAS_NAMES, OPENBLAS_DIRS
    else:
        raise ConfigError(f"unknown BLAS kind {kind!r}", hint="choose one of: mkl, openblas")
    for directory in [*_lib_dirs(), *map(Path, extra)]:
        for name in names:
            candidate = directory / name
            if candidate.is_file():
                return candidate
    if kind == "openblas":
        found = ctypes.util.find_library("openblas")
        if found:
            return Path(found)
    return None


def _choice(env: dict[str, str] | None = None) -> str:
    value = (os.environ if env is None else env).get(ENV_VAR, "auto").strip() or "auto"
    if value in CHOICES or "/" in value:
        return value
    raise ConfigError(f"{ENV_VAR}={value!r} is not a BLAS choice", hint="use auto, mkl, openblas, reference or a path to a .so")


def choose_library(env: dict[str, str] | None = None) -> Path | None:
    """The library :data:`ENV_VAR` (in ``env``, default ``os.environ``) asks for
    (``None``: the bundled reference BLAS)."""
    choice = _choice(env)
    if choice == "reference" or sys.platform != "linux":
        return None
    if "/" in choice:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ConfigError(f"{ENV_VAR} names {path}, which is not a file")
        return path
    if choice == "auto":
        return find_library("mkl") or find_library("openblas")
    path = find_library(choice)
    if path is None:
        hint = "pip install mkl (the mlx extra)" if choice == "mkl" else "apt-get install libopenblas0-pthread"
        raise ConfigError(f"{ENV_VAR}={choice} but no {choice} library was found", hint=hint)
    return path


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) with the chosen BLAS first in ``LD_PRELOAD``."""
    out = dict(os.environ if env is None else env)
    try:
        path = choose_library(out)
    except ConfigError:
        return out
    if path is not None:
        current = [p for p in out.get("LD_PRELOAD", "").split() if p and p != str(path)]
        out["LD_PRELOAD"] = " ".join([str(path), *current])
    return out


# --------------------------------------------------------------------------- loading


def _kind_of(path: str | None) -> str:
    name = Path(path).name if path else ""
    if "mkl" in name:
        return "mkl"
    if "openblas" in name:
        return "openblas"
    return "other"


def global_provider() -> str | None:
    """The file of the library that provides ``cblas_sgemm`` in the global scope, if any."""
    try:
        default = ctypes.CDLL(None)
        function = getattr(default, _PROBE_SYMBOL)
    except (OSError, AttributeError):
        return None

    class _DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    info = _DlInfo()
    try:
        dladdr = default.dladdr
    except AttributeError:
        return "?"
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    address = ctypes.cast(function, ctypes.c_void_p).value
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return "?"
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def _threads(path: str | None) -> int | None:
    if _kind_of(path) != "mkl" or not path:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.MKL_Get_Max_Threads.restype = ctypes.c_int
        return int(lib.MKL_Get_Max_Threads())
    except (OSError, AttributeError):
        return None


def set_threads(n: int) -> int | None:
    """Set MKL's thread count (no-op for other BLAS); returns the count now in force."""
    info = active_blas()
    if info.name != "mkl" or not info.path:
        return info.threads
    try:
        lib = ctypes.CDLL(info.path)
        if n and n > 0:
            lib.MKL_Set_Num_Threads(ctypes.c_int(int(n)))
    except (OSError, AttributeError):
        return info.threads
    return _threads(info.path)


def ensure_fast_blas() -> BlasInfo:
    """Make the chosen BLAS global before MLX loads, once per process; report the outcome."""
    global _ACTIVE, _LOADED
    if _ACTIVE is not None:
        return _ACTIVE
    if sys.platform == "darwin":
        _ACTIVE = BlasInfo("accelerate", None, "macOS Accelerate, linked by MLX")
        return _ACTIVE
    mlx_loaded = "mlx.core" in sys.modules
    provider = global_provider()
    preloaded = [p for p in os.environ.get("LD_PRELOAD", "").split() if p]
    if provider is not None:
        if any(os.path.realpath(p) == provider for p in preloaded):
            how = "LD_PRELOAD"
        elif mlx_loaded:
            how = "global, but mlx was imported first: its binding is not verified"
        else:
            how = "already global before mlx was imported"
        _ACTIVE = BlasInfo(_kind_of(provider), provider, how, _threads(provider))
        return _ACTIVE
    path = choose_library()
    if path is None:
        _ACTIVE = BlasInfo("reference", None, "the BLAS bundled with mlx" + (f" ({ENV_VAR}=reference)" if _choice() == "reference" else ", no fast BLAS found"))
        return _ACTIVE
    if mlx_loaded:
        _ACTIVE = BlasInfo("reference", None, f"mlx was imported before {path.name} could be loaded")
        return _ACTIVE
    try:
        _LOADED = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if _choice() == "auto":
            _ACTIVE = BlasInfo("reference", None, f"loading {path} failed: {exc}")
            return _ACTIVE
        raise ConfigError(f"cannot load {path}: {exc}") from exc
    provider = global_provider()
    if provider is None:
        _ACTIVE = BlasInfo("reference", None, f"{path.name} exports no {_PROBE_SYMBOL}")
    else:
        _ACTIVE = BlasInfo(_kind_of(provider), provider, "loaded before mlx (RTLD_GLOBAL)", _threads(provider))
    return _ACTIVE


def active_blas() -> BlasInfo:
    """What :func:`ensure_fast_blas` arranged (calling it if nobody has yet)."""
    return _ACTIVE if _ACTIVE is not None else ensure_fast_blas()
