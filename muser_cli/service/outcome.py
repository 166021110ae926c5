"""What an answered request says and teaches: its route and the split of its time to the first
token against the budget (:func:`budget`), what it measured into the cost model, its log line
and its metrics (:func:`observe`). Bookkeeping: nothing here fails an answer that was given."""

from __future__ import annotations

from typing import Any

from muser_cli.consumer.costs import CostModel, budget_split, overrun
from muser_cli.consumer.pull import learn_from
from muser_cli.consumer.route import route
from muser_cli.consumer.source import RowsFrom
from muser_cli.service.metrics import fallback_kind
from muser_cli.service.request import RunState


def budget(worker: Any, state: RunState, s: dict[str, Any]) -> None:
    """The answer's route and budget split (issue #39) into its summary ``s``; what it
    measured into the cost model. The budget: the request's deadline if it set one, else
    the chosen path's predicted TTFT with a quarter more (and 5 ms) of headroom."""
    out, live, plan, costs = state.out, state.live, state.route, worker.costs
    if plan is None and s.get("ttft_ms") is not None:
        plan = route(costs, tokens=len(state.ids), held=s.get("held_rows") or 0, producer=None)
    if plan is not None:
        s["route"] = plan.to_json(s.get("source"))
        if live is not None and live.promise is not None:
            s["route"]["promise"] = live.promise
    if out is None or s.get("ttft_ms") is None:
        return
    marks = live.marks if live is not None else {}
    arrived, ttft = state.job.arrived, s["ttft_ms"] / 1000
    since = (lambda k: marks[k] - arrived if k in marks else None)
    source = RowsFrom(s["source"])
    from_pack = source.shipped
    spot = out.spot_check or {}
    gate_ms = (spot.get("ms") or 0) if spot.get("ran") else 0
    if isinstance(spot.get("sampled"), dict):
        gate_ms += spot["sampled"].get("ms") or 0
    gate = gate_ms / 1000
    local_s = out.prefill_s if not from_pack or source == RowsFrom.PARTIAL_LOCAL else 0.0
    waited = 0.0  # a local prefill's waits for the others' turns: the consumer's queue, as predicted
    if live is None and not from_pack and state.engine_s is not None:
        waited = min(local_s, max(0.0, out.prefill_s - state.engine_s))
    split = budget_split(
        ttft_s=ttft, consumer_queue_s=state.t_lane - arrived + waited, remote=live is not None,
        lane_s=state.t_lane - arrived, serving_s=since("serving"),
        end_s=since("last_byte") if "last_byte" in marks else since("end"),
        rows_ready_s=None, local_prefill_s=local_s - waited,
        install_s=max(0.0, out.prefill_s - gate) if from_pack and source != RowsFrom.PARTIAL_LOCAL else 0.0,
        gate_s=gate, pack_bytes=int(s.get("bytes") or 0),
        link_Bps=measured_link(worker.costs, live.producer) if live is not None else None)
    budget_s = state.job.ask.prefill_deadline
    if budget_s is None and plan is not None:
        budget_s = plan.seconds * 1.25 + 0.005
    over = overrun(split, budget_s, plan.chosen_parts if plan is not None else {})
    s["budget"] = {"budget_ms": round(budget_s * 1000, 3) if budget_s is not None else None,
                   "split_ms": {k: round(v * 1000, 3) for k, v in split.items()}, "overrun": over}
    state.split, state.overrun = split, over
    engine_s = state.engine_s  # its own turns' time (the others' chunks and steps left out)
    learn_from(costs, out, marks=marks, accepted=live.accepted if live is not None else None,
               prefill_s=min(out.prefill_s, engine_s) if engine_s is not None else None,
               producer=live.producer if live is not None else None)
    costs.save()

def measured_link(costs: CostModel, producer: str) -> float | None:
    """The link rate from ``producer`` as pulls or a probe measured it (None: only the cold guess)."""
    rate, source = costs.link_for(producer)
    return None if source == "cold" else rate

def observe(worker: Any, state: RunState, s: dict[str, Any]) -> None:
    try:
        budget(worker, state, s)
    except Exception as exc:  # noqa: BLE001 - bookkeeping: never fails an answer that was given
        s["budget_error"] = f"{type(exc).__name__}: {exc}"
    m = worker.metrics
    gone = s.get("finish_reason") == "cancelled"  # its client went away while it ran
    if state.job.cut is None:  # one the server cut as it shut down: the service logs its line
        worker.log({"event": "request", "status": 499 if gone else 200,
                  **({"reason": "the client went away while its answer was made"} if gone else {}),
                  **{k: v for k, v in s.items() if k not in ("text", "choices")},
                  **({"user": state.job.ask.user} if state.job.ask.user is not None else {})})
    if s.get("store_problems") and not worker.store_warned:  # once: every answer's line says it too
        worker.store_warned = True
        worker.log({"event": "warning", "warning": f"the store could not keep an answer's rows "
                                                 f"({s['store_problems'][0]}); answering on, counted in "
                                                 "muser_store_errors_total"})
    if m is None:
        return
    source = s["source"]
    if s.get("ttft_ms") is not None:
        m.ttft.labels(source).observe(s["ttft_ms"] / 1000)
    for gap in state.gaps:
        m.token.labels(source).observe(gap)
    if s["bytes"]:
        m.shipped.labels(s.get("producer") or "").inc(s["bytes"])
    m.held.inc(s.get("held_rows") or 0)
    m.computed.inc(s.get("computed_rows") or 0)
    m.tokens.inc(s["completion_tokens"])
    if s.get("fallback_reason"):
        m.fallbacks.labels(fallback_kind(s["fallback_reason"])).inc()
    if state.refused is not None:
        m.gate.inc()
    if s.get("store_problems"):
        m.store_errors.inc()
    if state.split is not None:
        m.observe_budget(state.split, state.overrun)


__all__ = ["budget", "measured_link", "observe"]
