"""The route (issues #39, #47): whether to ask a producer for a request's rows, and with what
budget, from the cost model's prediction of every path (:mod:`muser_cli.consumer.costs`); the
exploration that measures the path predicted slower now and then; what an answer says of it.

``MUSER_ROUTE=fastest`` (the default) asks a producer only when that is predicted faster, with
the budget that beats the local path; ``producer`` asks whenever a producer is given and the
rows are not all held. docs/pull-lane.md, "One latency budget".
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

from muser_cli.consumer.backlog import Backlog
from muser_cli.consumer.costs import COLD_CONNECT_S, CostModel
from muser_cli.consumer.source import RowsFrom

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


@dataclass
class Route:
    """A request's route, decided before it runs: what every path was predicted to take
    (:meth:`CostModel.predict`), which this request goes for, and whether a producer is asked.

    Paths: ``store`` (every row held here), ``held`` (a served conversation's turn memory, the
    rest prefilled here), ``local`` (prefilled here, after what the store holds), ``remote_whole``
    / ``remote_delta`` (a producer's pack of every row, or of those after the stored prefix)."""

    paths: dict[str, float]  # every path's predicted time to the first token, seconds
    parts: dict[str, dict[str, float]]  # ... and its components (queue, compute, wire, install, ...)
    choice: str  # the path this request goes for
    predicted: str  # the path predicted fastest
    known: bool = False  # the producer's rates came from its own promise, not guessed from ours
    calibrated: bool = False  # this machine's local curve was measured at two sizes at least
    link: str | None = None  # where the link rate came from: pulls, probe, cold
    share: float = 1.0  # the share of its cores the engine gets now
    mode: str = "fastest"  # MUSER_ROUTE
    ask: bool = False  # a producer is asked
    budget_ms: int | None = None  # ... and must have sent the pack within it (None: no budget)
    explore: str | None = None  # the path taken against the prediction, to measure it
    why: str = ""  # a local choice's reason, as the answer gives it
    held: int | None = None  # rows the turn memory held (a served conversation's next turn)
    remote_ms: float | None = None  # a turn memory's choice: the producer's best prediction
    lead_s: float = 0.0  # the engine is busy this long before the request could start here anyway
    asked_key: Any = field(default=None, repr=False)  # the key the ask was put on the producer's queue with

    @classmethod
    def of(cls, prediction: dict[str, Any], **decided: Any) -> "Route":
        """A route from :meth:`CostModel.predict`'s prediction, as predicted (the fastest path
        chosen, nobody asked) unless ``decided`` says otherwise."""
        got = {k: prediction[k] for k in ("paths", "parts", "known", "calibrated", "link", "share") if k in prediction}
        got.setdefault("parts", {})
        return cls(**{**got, "choice": prediction["choice"], "predicted": prediction["choice"], **decided})

    @property
    def seconds(self) -> float:
        """The chosen path's predicted time to the first token (0 when it has none)."""
        return self.paths.get(self.choice, 0.0)

    @property
    def chosen_parts(self) -> dict[str, float]:
        return self.parts.get(self.choice, {})

    @property
    def remote_s(self) -> float:
        """The fastest producer path's prediction (infinite: no producer path)."""
        return min((v for k, v in self.paths.items() if k.startswith("remote")), default=math.inf)

    def to_json(self, source: Any = None) -> dict[str, Any]:
        """What an answer says of its route (``muser decode --json``, a served answer's ``route``):
        what was predicted (``paths``, ``parts``, ``predicted``), what was chosen (``choice``,
        ``explore``, ``budget_ms``) and what happened (``taken``, from the answer's ``source``)."""
        out: dict[str, Any] = {"paths": self.paths, "predicted": self.predicted, "choice": self.choice,
                               "explore": self.explore, "mode": self.mode, "known": self.known,
                               "calibrated": self.calibrated, "budget_ms": self.budget_ms, "parts": self.parts,
                               "link": self.link, "share": self.share}
        if self.held is not None:
            out["held"] = self.held
        if self.remote_ms is not None:
            out["remote_ms"] = self.remote_ms
        if self.lead_s:
            out["lead_ms"] = round(self.lead_s * 1000, 3)
        return {**out, "taken": taken_path(source)}


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
          chunk: int = 256, lead_s: float = 0.0) -> Route:
    """Whether to ask ``producer``, and with what budget (:class:`Route`): the prediction of
    every path, the fastest predicted, the path this request goes for, whether the producer is
    asked and the budget it must beat (the local prediction less what follows the pack here;
    None: no budget), the path taken to measure it against the prediction, and for a local
    choice the reason the answer gives.

    A consumer whose local curve is not calibrated (nothing measured at two sizes: a one-shot
    command on a machine where no service ran) asks the producer without a budget: a guess of
    its own speed would be 10-140x off either way. With ``MUSER_ROUTE=producer`` the producer is
    asked whenever the rows are not all held, without a budget (unless ``deadline_s`` gives one).
    ``backlog``, ``key``, ``chunk``: the consumer's own queue (:meth:`CostModel.predict`). With a
    ``key``, an ask is put on that producer's queue (:meth:`CostModel.asking`) before the next
    route is decided (requests arriving together see each other's asks: ``asked_key``).
    ``lead_s``: the engine is busy this long before the request could start here anyway (a
    batch's next job, asked for while the job before it decodes): the local path starts after
    it, a producer's pack may arrive within it (then only installing it and the first step are
    left), and the budget grows by it."""
    with costs._routing:
        got = _route(costs, tokens=tokens, held=held, producer=producer, deadline_s=deadline_s, backlog=backlog,
                     key=key, chunk=chunk, lead_s=max(0.0, lead_s))
        if got.ask and key is not None and producer is not None:
            costs.asking(producer, key, float(got.chosen_parts.get("producer_compute") or 0.0))
            got.asked_key = key
    return got


def _route(costs: CostModel, *, tokens: int, held: int, producer: str | None, deadline_s: float | None,
           backlog: Backlog | None, key: Any, chunk: int, lead_s: float = 0.0) -> Route:
    got = costs.predict(tokens=tokens, held=held, producer=producer, backlog=backlog, key=key, chunk=chunk)
    mode = route_mode()
    made = functools.partial(Route.of, got, mode=mode, lead_s=lead_s)  # this request's route, as decided below
    paths_ = got["paths"]
    here_name = "store" if "store" in paths_ else "local"
    here = paths_[here_name] + lead_s
    remote_name = "remote_delta" if "remote_delta" in paths_ else "remote_whole"
    if producer is None or here_name == "store":
        return made(choice=here_name)
    if mode == "producer":
        budget_ms = max(1, int(deadline_s * 1000)) if deadline_s is not None else None
        return made(ask=True, budget_ms=budget_ms, choice=remote_name)
    install, gate, first = costs._tail(tokens - 1, gate=True, slow=1.0 / got["share"])
    connect = costs.connect_s if costs.connect_s is not None else COLD_CONNECT_S
    waits = [v.get("consumer_queue", 0.0) for k, v in got["parts"].items() if k.startswith("remote")]
    budget: float | None = here - install - first - connect - min(waits, default=0.0)  # what the producer must beat
    if deadline_s is not None:
        budget = min(budget, deadline_s)
    remote = min((v for k, v in paths_.items() if k.startswith("remote")), default=math.inf)
    remote = max(remote, lead_s + install + gate + first)  # a pack in by then waits for the engine
    view = costs.producers.get(producer)
    if view is not None and view.full(key):  # it would answer "busy": this consumer's asks fill its queue
        return made(choice=here_name,
                    why=f"route: {producer} holds as many of this consumer's requests as it takes ({view.limit})")
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
    if ask:
        return made(explore=explore, ask=True, choice=remote_name,
                    budget_ms=max(1, int(budget * 1000)) if budget is not None else None)
    if explore == "local":
        why = (f"route: exploring the local path (predicted {here * 1000:.1f} ms against "
               f"{remote * 1000:.1f} ms from {producer}; MUSER_EXPLORE)")
    else:
        why = (f"route: {here_name} predicted faster ({here * 1000:.1f} ms) than asking {producer} "
               f"({'unknown' if not got['known'] else f'{remote * 1000:.1f} ms'}; MUSER_ROUTE=fastest)")
    return made(explore=explore, choice=here_name, why=why)


def with_memory(costs: CostModel, plan: Route, *, tokens: int, held: int, producer: str | None,
                backlog: Backlog | None = None, key: Any = None, chunk: int = 256) -> Route | None:
    """A served conversation's next turn whose first ``held`` rows the turn memory holds: the
    route of computing the rest here (``choice`` ``held``'s prediction, nobody asked) when that
    is predicted no slower than ``plan``'s producer paths, or every row is held, or no producer
    is up; else None (``plan`` stands). With ``MUSER_ROUTE=producer`` a prompt mostly new (a
    held preamble) is still asked of the producer; a turn whose rows are at least half held is
    not (docs/serve.md)."""
    rows = tokens - 1
    here = costs.predict(tokens=tokens, held=held, producer=None, backlog=backlog, key=key, chunk=chunk)
    mine, remote = here["paths"][here["choice"]], plan.remote_s
    wins = mine <= remote and (plan.mode != "producer" or held * 2 >= rows)
    if held < rows and not wins and producer is not None:
        return None
    return Route.of(here, mode=plan.mode, held=held,
                    remote_ms=round(remote * 1000, 3) if math.isfinite(remote) else None)


def taken_path(source: Any) -> str | None:
    """The path an answer took, in the route's names, from its ``source`` (:attr:`RowsFrom.path`;
    None: no rows, or a source it does not know)."""
    try:
        return RowsFrom(str(source)).path
    except ValueError:
        return None


__all__ = ["EXPLORE_EVERY", "EXPLORE_FACTOR", "EXPLORE_UNMEASURED", "ROUTE_ENV", "Route", "explore_every", "route",
           "route_mode", "taken_path", "with_memory"]
