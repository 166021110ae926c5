"""Shared pieces of the ``decode --serve`` tests (tests/service/): the importing module skipped
where Starlette or prometheus_client is missing, their prompt, and a resident engine worker
on a tiny model, run in this process. A module imports it before anything of the service.
It holds no tests itself."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go."


@contextlib.contextmanager
def engine_worker(info, *, max_queue: int) -> Iterator[Any]:
    """An :class:`EngineWorker` on ``info`` (float32, one thread, no reuse) with a queue of
    ``max_queue``, closed when the block ends."""
    from muser_cli.service.metrics import ConsumerMetrics
    from muser_cli.service.worker import Config, EngineWorker

    worker = EngineWorker(Config(model=str(info.path), dtype="float32", threads=1, max_queue=max_queue, reuse=False),
                          ConsumerMetrics())
    try:
        yield worker
    finally:
        worker.close()
