"""A loaded consumer engine made ready to be measured: a throwaway request so that nothing
measured afterwards holds the engine's first touch (:func:`warm_up`), and this machine's local
prefill measured at two sizes (:func:`calibrate`) so that the route predicts the local path from
its own measurements from the first request on (issue #47). ``decode --serve`` does both before
it listens; ``muser batch`` with producers before its first job."""

from __future__ import annotations

import time
from typing import Any

from muser_cli.consumer.costs import CostModel
from muser_cli.consumer.decode import decode
from muser_cli.costcurve import spread_ids
from muser_cli.engines.base import Engine
from muser_cli.model.info import ModelInfo

#: The warm-up's throwaway prompt.
WARM_PROMPT = "Warm up: the first request should cost what the second one does."
#: The calibration's prompt sizes: a short one, and one whole chunk or this many tokens,
#: whichever is more (up to the model's context).
CALIBRATE_SHORT = 32
CALIBRATE_LONG = 256


def warm_up(resident: Engine, *, model: str | None, engine: str, dtype: str, threads: int,
            chunk_tokens: int | None) -> float:
    """One throwaway request on a loaded engine: the lane's local path (tokenize, a prefill on
    the canonical schedule, install, the first decode steps). It leaves nothing behind: no
    store read or written, no producer asked, nothing learned. Seconds it took."""
    t0 = time.perf_counter()
    decode(None, model=model, prompt=WARM_PROMPT, chat=False, max_new_tokens=2, engine=engine, dtype=dtype,
           threads=threads, chunk_tokens=chunk_tokens, fallback_reason="warm-up", reuse=False, store=False,
           resident=resident)
    return time.perf_counter() - t0


def calibrate(costs: CostModel, resident: Engine, *, info: ModelInfo, model: str | None, engine: str, dtype: str,
              threads: int, chunk_tokens: int | None, chunk: int) -> dict[str, Any]:
    """The local prefill measured at two sizes: a short prompt and one whole chunk of ``chunk``
    (up to the model's context), each a fresh local decode of one token, into ``costs`` (a fit
    of fixed, per-token and depth costs), kept. Skipped when what this machine kept (the cost
    file) is calibrated already. ``{"calibrate_s", "calibration": [[tokens, seconds], ...]}``."""
    if costs.local.calibrated:
        return {"calibrate_s": 0.0, "calibration": [], "calibration_kept": True}
    t0, measured = time.perf_counter(), []
    top = info.max_positions - 1
    for n in sorted({min(n, top) for n in (CALIBRATE_SHORT, max(chunk + 1, CALIBRATE_LONG)) if min(n, top) >= 2}):
        ids = spread_ids(info.vocab_size or 2, n)
        out = decode(None, model=model, prompt="", chat=False, max_new_tokens=1, engine=engine, dtype=dtype,
                     threads=threads, chunk_tokens=chunk_tokens, fallback_reason="calibration", reuse=False,
                     store=False, resident=resident, prompt_ids=ids, info=info)
        measured.append([n, round(out.prefill_s, 6)])
        costs.observe(held=0, rows=n - 1, prefill_s=out.prefill_s, local=True)
    costs.save()
    return {"calibrate_s": round(time.perf_counter() - t0, 6), "calibration": measured}


__all__ = ["CALIBRATE_LONG", "CALIBRATE_SHORT", "WARM_PROMPT", "calibrate", "warm_up"]
