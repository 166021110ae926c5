"""Shared pieces of the ``decode --serve`` tests (tests/service/): the importing module skipped
where Starlette or prometheus_client is missing, their prompt, and a resident engine worker
on a tiny model, run in this process. A module imports it before anything of the service.
It holds no tests itself."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from handoff_kit import HANG_S, ServiceProcess, muser_cmd  # noqa: E402

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go."


@contextlib.contextmanager
def engine_worker(info, *, max_queue: int, max_batch: int = 1) -> Iterator[Any]:
    """An :class:`EngineWorker` on ``info`` (float32, one thread, no reuse) with a queue of
    ``max_queue`` and ``max_batch`` requests running at once (1: one at a time, the order the
    queue tests check), closed when the block ends."""
    from muser_cli.service.metrics import ConsumerMetrics
    from muser_cli.service.worker import Config, EngineWorker

    worker = EngineWorker(Config(model=str(info.path), dtype="float32", threads=1, max_queue=max_queue, reuse=False,
                                 max_batch=max_batch),
                          ConsumerMetrics())
    try:
        yield worker
    finally:
        worker.close()


_LISTEN = re.compile(r"listening on http://(\S+)/v1")


class DecodeServer(ServiceProcess):
    """``muser decode --serve 127.0.0.1:0 ARGS`` under ``home``, its stderr lines collected on a
    thread: the real ``openai`` client on it, its log records, its metrics."""

    what = "decode --serve"

    def __init__(self, home: Path, *args: str) -> None:
        super().__init__(home, muser_cmd("decode", "--serve", "127.0.0.1:0", *args), _LISTEN)
        self.base = f"http://{self.address}/v1"

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=HANG_S)

    def records(self, event: str = "request") -> list[dict]:
        return self.events(event)

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples on /metrics (``name`` with its labels, as exposed)."""
        import httpx

        text = httpx.get(f"http://{self.address}/metrics", timeout=HANG_S).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} (\S+)$", text, re.M))
