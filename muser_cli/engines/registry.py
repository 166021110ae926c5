"""The engine registry: a closed table of engine names, each imported only when asked for.

Heavy frameworks (torch, mlx, vllm) load with their engine module, so ``muser --help``
and the kvpack/handoff layers never pay for them.
"""

from __future__ import annotations

import importlib

from muser_cli.engines.base import Consumer, Engine
from muser_cli.errors import UsageError
from muser_cli.model.info import ModelInfo

# name -> (module, class); a closed set written here, never read from input.
_ENGINES: dict[str, tuple[str, str]] = {
    "torch": ("muser_cli.engines.torch.engine", "TorchEngine"),
    "mlx": ("muser_cli.engines.mlx.engine", "MLXEngine"),
    "vllm": ("muser_cli.engines.vllm.engine", "VLLMEngine"),
}
ENGINE_NAMES = tuple(_ENGINES)


def engine_class(name: str) -> type[Engine]:
    """The class of the named engine (imports its module, and so its framework)."""
    try:
        module, cls = _ENGINES[name]
    except KeyError:
        raise UsageError(f"unknown engine {name!r}", hint="choose one of: " + ", ".join(ENGINE_NAMES)) from None
    return getattr(importlib.import_module(module), cls)


def consumer_class(name: str, doing: str = "decode") -> type[Consumer]:
    """The class of the named engine, which must have the consumer role (a
    :class:`~muser_cli.engines.base.Consumer`): else a one-line :class:`UsageError` naming the
    engine, what it can do and what was asked (``doing``), before any model is loaded."""
    cls = engine_class(name)
    if not issubclass(cls, Consumer):
        raise UsageError(f"the {name} engine is a producer only: it prefills and ships KV, it cannot {doing}",
                         hint="use --engine torch or --engine mlx")
    return cls


def get_consumer(name: str, info: ModelInfo, *, dtype: str, threads: int, doing: str = "decode") -> Consumer:
    """:func:`get_engine` for an engine that must have the consumer role (:func:`consumer_class`)."""
    consumer_class(name, doing)
    engine = get_engine(name, info, dtype=dtype, threads=threads)
    assert isinstance(engine, Consumer)
    return engine


def get_engine(name: str, info: ModelInfo, *, dtype: str, threads: int, options: dict | None = None) -> Engine:
    """Import the named engine lazily and load ``info`` into it.

    ``options``: vLLM's engine arguments; the other engines take none and refuse them."""
    cls = engine_class(name)
    if options:
        if not cls.takes_options:
            raise UsageError(f"the {name} engine takes no engine options", hint="engine options are for --engine vllm")
        return cls(info, dtype=dtype, threads=threads, vllm_options=options)  # type: ignore[call-arg]
    return cls(info, dtype=dtype, threads=threads)
