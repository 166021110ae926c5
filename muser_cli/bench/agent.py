"""The agent-refresh workload's parts (benchmarks/bench_agent_refresh.py): a growing
conversation through the OpenAI client, the endpoint a starting ``decode --serve`` prints,
and the same conversations against ``mlx_lm.server``. Nothing here prints or exits."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from muser_cli.bench.common import Pinning
from muser_cli.engines.mlx.blas import preload_env
from muser_cli.errors import TempFailure

_URL = re.compile(r"listening on http://(\S+)/v1")


def wait_url(proc: subprocess.Popen, what: str, timeout: float = 600) -> str:
    """The endpoint a starting ``decode --serve`` prints; its stderr is read on a thread from
    then on (a line reader, so two lines arriving together are both seen)."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def read() -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in proc.stderr:
                lines.put(raw.decode(errors="replace"))
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        m = _URL.search(line)
        if m:
            return f"http://{m.group(1)}/v1"
        if not line:
            break
    proc.kill()
    raise TempFailure(f"{what} did not start")


def conversation(client: Any, model: str, slices: list[str], max_tokens: int) -> list[dict]:
    """One agent session: each turn adds the last answer and the next slice; per-turn TTFT."""
    turns: list[dict] = []
    out = []
    for i, piece in enumerate(slices):
        turns.append({"role": "user", "content": piece if i else f"Read this and keep it in mind.\n\n{piece}"})
        t0 = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(model=model, messages=turns, max_tokens=max_tokens,
                                                               temperature=0, stream=True)
        ttft, text, muser = None, [], None
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            extra = getattr(chunk, "model_extra", None) or {}
            if isinstance(extra.get("muser"), dict):  # muser's own field, on the last chunk
                muser = extra["muser"]
        turns.append({"role": "assistant", "content": "".join(text)})
        got = {"turn": i + 1, "ttft_s": ttft, "source": raw.headers.get("x-muser-source"),
               "bytes": int(raw.headers.get("x-muser-bytes") or 0)}
        if muser is not None:
            got.update({k: muser.get(k) for k in ("prompt_tokens", "held_rows", "computed_rows", "cached_tokens")
                        if k in muser})
        out.append(got)
    return out


def agents_at_once(client: Any, model: str, slices: Callable[[int], list[str]], *, reps: int, agents: int,
                   max_tokens: int) -> list[list[dict]]:
    """``agents`` conversations at once against one server, ``reps`` times: each agent its own
    document (``slices(k)`` for a ``k`` no other agent or rep uses), all started together and
    each going turn after turn as fast as the server answers it. One list of turns per agent
    and rep (``agents * reps`` of them), each turn as :func:`conversation` gives it. A failed
    conversation raises here, after the others ended."""
    from concurrent.futures import ThreadPoolExecutor

    out: list[list[dict]] = []
    with ThreadPoolExecutor(max_workers=agents) as pool:
        for r in range(reps):
            futures = [pool.submit(conversation, client, model, slices(100 + r * agents + a), max_tokens)
                       for a in range(agents)]
            out.extend(f.result() for f in futures)
    return out


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait for ``mlx_lm.server``'s ``/health`` (its ``/v1/models`` scans the Hugging Face hub
    cache and answers an empty body when there is none, as on a fresh machine)."""
    import urllib.error
    import urllib.request

    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > end or proc.poll() is not None:
            raise TempFailure("mlx_lm.server did not start")
        time.sleep(1)


def mlx_lm_conversations(model_path: str, pins: Pinning, slices: Callable[[int], list[str]], *, reps: int,
                         max_tokens: int, agents: int = 1) -> dict[str, list[list[dict]]]:
    """The same conversations against ``mlx_lm.server`` on the consumer's core, with the BLAS
    muser's MLX engine uses (MKL preloaded, one thread: the ``mlx[cpu]`` wheel's bundled
    reference BLAS would make mlx-lm ~30x slower than it is with a real one): ``{"one": one
    agent's reps}``, and with ``agents`` > 1 also ``{"many": }`` :func:`agents_at_once`'s, the
    server batching that many (``--decode-concurrency``/``--prompt-concurrency``)."""
    import openai


    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    concurrency = ["--decode-concurrency", str(agents), "--prompt-concurrency", str(agents)] if agents > 1 else []
    proc = subprocess.Popen(pins.command("consumer", [sys.executable, "-m", "mlx_lm.server", "--model", model_path,
                                                      "--host", "127.0.0.1", "--port", str(port), *concurrency]),
                            env=preload_env(dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")),
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        _wait_health(f"http://127.0.0.1:{port}/health", proc)
        conversation(client, model_path, slices(-1)[:2], max_tokens)
        got = {"one": [conversation(client, model_path, slices(r), max_tokens) for r in range(reps)]}
        if agents > 1:
            got["many"] = agents_at_once(client, model_path, slices, reps=reps, agents=agents, max_tokens=max_tokens)
        return got
    finally:
        proc.terminate()
        proc.wait(60)
