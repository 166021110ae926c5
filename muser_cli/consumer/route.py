"""The route (issues #39, #47): whether to ask a producer for a request's rows, and with what
budget, from the cost model's prediction of every path (:mod:`muser_cli.consumer.costs`); the
exploration that measures the path predicted slower now and then; what an answer says of it.

``MUSER_ROUTE=fastest`` (the default) asks a producer only when that is predicted faster, with
the budget that beats the local path; ``producer`` asks whenever a producer is given and the
rows are not all held. docs/pull-lane.md, "One latency budget".
"""

from __future__ import annotations

import math
import os
from typing import Any

from muser_cli.consumer.backlog import Backlog
from muser_cli.consumer.costs import COLD_CONNECT_S, CostModel

ROUTE_ENV = "MUSER_ROUTE"
ROUTES = ("producer", "fastest")
#: Exploration: the path predicted slower is taken once in this many requests where it is
#: within a factor of :data:`EXPLORE_FACTOR` of the faster (or within :data:`EXPLORE_UNMEASURED`
#: where it was never measured at that depth); ``MUSER_EXPLORE=0`` turns it off, ``=N`` sets N.
EXPLORE_EVERY = 8
EXPLORE_FACTOR = 1.25  # the budget's own headroom (a quarter): an exploration costs no more than a miss
EXPLORE_UNMEASURED = 4.0
EXPLORE_ENV = "MUSER_EXPLORE"
#: Prompts shorter than this many rows are never explored on (a short prompt stays local).
EXPLORE_MIN_ROWS = 256


def route_mode() -> str:
    """``MUSER_ROUTE``: ``fastest`` (the default: ask a producer only when the prediction says
    it is faster, with the budget to beat local) or ``producer`` (ask whenever one is given:
    the lane's mechanics, whatever the prediction). Anything else counts as the default."""
    value = os.environ.get(ROUTE_ENV, "").strip().lower()
    return value if value in ROUTES else "fastest"


def explore_every() -> int:
    """``MUSER_EXPLORE``: explore once in this many eligible requests (0: never); default
    :data:`EXPLORE_EVERY`."""
    value = os.environ.get(EXPLORE_ENV, "").strip()
    try:
        return max(0, int(value)) if value else EXPLORE_EVERY
    except ValueError:
        return EXPLORE_EVERY


def _explore(costs: CostModel, got: dict[str, Any], *, rows: int, producer: str, ask: bool, here: float,
             remote: float) -> str | None:
    """Which path to try instead of the predicted one (``"producer"`` or ``"local"``), or None:
    where the two are predicted within :data:`EXPLORE_FACTOR` of each other (within
    :data:`EXPLORE_UNMEASURED` where the slower was never measured at this depth: no pack that
    deep from that producer, no local prefill that deep), once in :func:`explore_every` such
    requests (the N-th, 2N-th, ... of them: a first request follows the prediction)."""
    every = explore_every()
    view = costs.producers.get(producer)
    if not every or rows < EXPLORE_MIN_ROWS or view is None or not got["known"] or not got["calibrated"]:
        return None
    if not math.isfinite(remote) or "local" not in got["paths"]:
        return None
    slower, faster = (here, remote) if ask else (remote, here)
    unmeasured = costs.local.measured_to() * 2 < rows if ask else view.pulled_to * 2 < rows
    if slower > faster * (EXPLORE_UNMEASURED if unmeasured else EXPLORE_FACTOR):
        return None
    with costs._lock:
        costs._explore_n += 1  # kept in the cost file: one-shot commands count across runs
        n = costs._explore_n
    if n % every:
        return None
    return "local" if ask else "producer"


def route(costs: CostModel, *, tokens: int, held: int, producer: str | None,
          deadline_s: float | None = None, backlog: Backlog | None = None, key: Any = None,
          chunk: int = 256) -> dict[str, Any]:
    """Whether to ask ``producer``, and with what budget: the prediction of every path
    (``paths``, ``parts``), the fastest predicted (``predicted``), the path this request goes for
    (``choice``), ``ask`` (bool), ``budget_ms`` (the producer must have sent the pack within it to
    beat the local path: the local prediction less what follows the pack here; None: no budget),
    ``explore`` (the path taken to measure it, against the prediction; None) and ``why`` (for a
    local choice: the reason the answer gives).

    A consumer whose local curve is not calibrated (nothing measured at two sizes: a one-shot
    command on a machine where no service ran) asks the producer without a budget: a guess of
    its own speed would be 10-140x off either way. With ``MUSER_ROUTE=producer`` the producer is
    asked whenever the rows are not all held, without a budget (unless ``deadline_s`` gives one).
    ``backlog``, ``key``, ``chunk``: the consumer's own queue (:meth:`CostModel.predict`). With a
    ``key``, an ask is put on that producer's queue (:meth:`CostModel.asking`) before the next
    route is decided (requests arriving together see each other's asks: ``asked_key``)."""
    with costs._routing:
        got = _route(costs, tokens=tokens, held=held, producer=producer, deadline_s=deadline_s, backlog=backlog,
                     key=key, chunk=chunk)
        if got["ask"] and key is not None and producer is not None:
            costs.asking(producer, key, float(got["parts"].get(got["choice"], {}).get("producer_compute") or 0.0))
            got["asked_key"] = key
    return got


def _route(costs: CostModel, *, tokens: int, held: int, producer: str | None, deadline_s: float | None,
           backlog: Backlog | None, key: Any, chunk: int) -> dict[str, Any]:
    got = costs.predict(tokens=tokens, held=held, producer=producer, backlog=backlog, key=key, chunk=chunk)
    mode = route_mode()
    paths_ = got["paths"]
    got.update(mode=mode, predicted=got["choice"], explore=None)
    here_name = "store" if "store" in paths_ else "local"
    here = paths_[here_name]
    remote_name = "remote_delta" if "remote_delta" in paths_ else "remote_whole"
    if producer is None or here_name == "store":
        got.update(ask=False, budget_ms=None, why="", choice=here_name)
        return got
    if mode == "producer":
        budget_ms = max(1, int(deadline_s * 1000)) if deadline_s is not None else None
        got.update(ask=True, budget_ms=budget_ms, why="", choice=remote_name)
        return got
    install, _, first = costs._tail(tokens - 1, gate=True, slow=1.0 / got["share"])
    connect = costs.connect_s if costs.connect_s is not None else COLD_CONNECT_S
    waits = [v.get("consumer_queue", 0.0) for k, v in got["parts"].items() if k.startswith("remote")]
    budget: float | None = here - install - first - connect - min(waits, default=0.0)  # what the producer must beat
    if deadline_s is not None:
        budget = min(budget, deadline_s)
    remote = min((v for k, v in paths_.items() if k.startswith("remote")), default=math.inf)
    view = costs.producers.get(producer)
    if view is not None and view.full(key):  # it would answer "busy": this consumer's asks fill its queue
        got.update(ask=False, budget_ms=None, choice=here_name,
                   why=f"route: {producer} holds as many of this consumer's requests as it takes ({view.limit})")
        return got
    if not got["calibrated"] and tokens - 1 >= EXPLORE_MIN_ROWS:  # our speed unknown: no budget from a guess
        ask, budget = True, deadline_s
    elif not got["known"]:  # a producer we know nothing of: ask, with the budget; "late" costs one round trip
        ask = budget > 0
    else:
        ask = remote < here and budget > 0
    explore = _explore(costs, got, rows=tokens - 1, producer=producer, ask=ask, here=here, remote=remote)
    if explore == "producer":  # measured, not raced against a budget it was predicted to miss
        ask, budget = True, deadline_s
    elif explore == "local":
        ask = False
    got["explore"] = explore
    got.update(ask=ask, budget_ms=max(1, int(budget * 1000)) if ask and budget is not None else None)
    if not ask:
        got["choice"] = here_name
        if explore == "local":
            got["why"] = (f"route: exploring the local path (predicted {here * 1000:.1f} ms against "
                          f"{remote * 1000:.1f} ms from {producer}; MUSER_EXPLORE)")
        else:
            got["why"] = (f"route: {here_name} predicted faster ({here * 1000:.1f} ms) than asking {producer} "
                          f"({'unknown' if not got['known'] else f'{remote * 1000:.1f} ms'}; MUSER_ROUTE=fastest)")
    else:
        got["why"] = ""
        got["choice"] = remote_name
    return got


#: A route's fields an answer shows (``muser decode --json``, a served answer's ``route``).
ROUTE_FIELDS = ("paths", "predicted", "choice", "explore", "mode", "known", "calibrated", "budget_ms", "parts", "link",
                "share", "held")


def taken_path(source: Any) -> str | None:
    """The path an answer took, in the route's names, from its ``source``: ``store`` (every row
    held), ``held`` (the turn memory), ``local`` (prefilled here, some rows held or not),
    ``remote_whole`` / ``remote_delta`` (a producer's pack; ``partial+local``: part of one)."""
    return {"handoff": "remote_whole", "delta": "remote_delta", "partial+local": "remote_whole", "store": "store",
            "held": "held", "local": "local", "store+local": "local"}.get(str(source))


def route_fields(plan: dict[str, Any], source: Any) -> dict[str, Any]:
    """What an answer says of its route: what was predicted (``paths``, ``parts``, ``predicted``),
    what was chosen (``choice``, ``explore``, ``budget_ms``) and what happened (``taken``, from the
    answer's ``source``: :func:`taken_path`)."""
    return {**{k: plan[k] for k in ROUTE_FIELDS if k in plan}, "taken": taken_path(source)}


__all__ = ["EXPLORE_EVERY", "EXPLORE_FACTOR", "EXPLORE_UNMEASURED", "ROUTE_ENV", "ROUTE_FIELDS", "explore_every",
           "route", "route_fields", "route_mode", "taken_path"]
