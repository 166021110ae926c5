"""One latency budget across the two schedulers (issues #39, #47): what each way of answering a
request is expected to cost, learned from what this machine measured, and the choice between them.

Prefill cost is a fitted curve (:class:`muser_cli.costcurve.CostCurve`: a fixed part per request,
a part per token, a part growing with depth), one per side: the producer keeps its own compute's
(its ``Promise`` carries it as rates at a few prompt sizes, which fit the same curve again here);
the consumer its local prefills'. A serving consumer and a resident producer calibrate theirs
before they listen (two prompt sizes, one a whole chunk).

:class:`CostModel`: the consumer's live estimates for one model, engine, dtype and thread count
-- its local prefill curve, install (seconds per row), gate, first decode step, connection
set-up, the link rate (bytes per second of the packs it received) and each producer's curve,
last promise, trust and the asks in flight there -- kept in memory for the process and in ``<data dir>/costs/<key>.json`` between
runs (a cache: a file that cannot be read or written is ignored; the key names the model,
engine and its version, dtype, threads and this machine's CPU; a file older than
:data:`MAX_AGE_S` is forgotten). :meth:`CostModel.predict`
gives the TTFT of every path -- ``store`` (every row held), ``local``, ``remote_whole``,
``remote_delta`` -- and the fastest; :func:`muser_cli.consumer.route.route` whether to ask a producer at all (with
``MUSER_ROUTE=fastest``, the default; ``producer`` asks whenever a producer is given and the
rows are not all held) and the budget to ask with. A path never taken is never measured: the
route explores (:mod:`muser_cli.consumer.route`) -- it takes the path predicted slower once in N times when
the two are within a factor of each other or the slower one was never measured at
that depth, and says so (``route.explore``). :func:`budget_split` divides one answer's TTFT into its components.

:class:`~muser_cli.consumer.backlog.Backlog`: what is ahead of a new request on a serving consumer's engine (the requests
queued and running: each one's prompt work still to do here, whether its rows come from a
producer, whether it decodes), so that :meth:`CostModel.predict` adds the consumer's own queue
(``consumer_queue``) to every path: a local prefill takes its turns among the others' chunks and
the batched decode steps; a pulled pack waits off the engine, then for one turn round to install.
``muser decode`` (one request a process) has no backlog: its queue is zero.

The share of its cores the consumer's engine gets (:class:`muser_cli.consumer.cpushare.CpuShare`):
the consumer's engine work (its prefill rate, install, gate, steps) is learned as measured times
the share (the rate with the cores its own) and predicted divided by the share now;
``route.share`` in each answer.

The link rate from a producer: learned from the pulls from it; before any, the rate ``muser
probe-link`` measured to that address (:mod:`muser_cli.consumer.links`); then any producer's
pulls; before that, :data:`COLD_LINK_BPS`.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from muser_cli import paths
from muser_cli.consumer.backlog import Backlog, Work
from muser_cli.costcurve import COLD_TPS, MAX_AGE_S, CostCurve, cost_key
from muser_cli.consumer.cpushare import CpuShare
from muser_cli.consumer.links import probed_link
from muser_cli.strict import loads

#: Cold starts, before anything was measured here (deliberately modest: the first measurements
#: replace them): the per-row install, the first step, a TLS connection, the link.
COLD_INSTALL_S_PER_ROW = 2e-6
COLD_FIRST_STEP_S = 0.01
COLD_CONNECT_S = 0.05
COLD_LINK_BPS = 100e6
ALPHA = 0.3  # weight of a new measurement in an average
#: A producer's measured compute over its own estimate is kept within these bounds.
TRUST_RANGE = (0.25, 20.0)

#: The components of one answer's TTFT, in the order they happen (:func:`budget_split`).
COMPONENTS = ("consumer_queue", "producer_queue", "producer_compute", "wire", "local_prefill", "install", "gate",
              "first_step")


def _avg(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


@dataclass
class ProducerView:
    """What this consumer knows of one producer: its prefill cost curve (its promises carry it),
    when it last promised to start and when that was said, the work this consumer has asked of it
    and not yet received (``asked``: seconds expected, by request), how its compute measured
    against its own estimates (``trust``: measured over promised, an average), the deepest pack
    received from it (``pulled_to``) and what it said last (``last``: promised, late)."""

    rates: CostCurve = field(default_factory=lambda: CostCurve())
    start_s: float = 0.0
    said_at: float = 0.0  # time.time() of the promise
    known: bool = False
    link_Bps: float | None = None  # the link from it, learned from its packs
    asked: dict[Any, float] = field(default_factory=dict)
    trust: float = 1.0
    pulled_to: int = 0
    last: str = ""
    limit: int | None = None  # asks it takes from this consumer at once (learned from a "busy")

    def full(self, key: Any = None) -> bool:
        """This consumer has as many asks in flight there as it takes (a ``busy`` said so)."""
        return self.limit is not None and sum(1 for k in list(self.asked) if k is not key) >= self.limit

    def queue_s(self, now: float, key: Any = None) -> float:
        """What is ahead of a new request there: what is left of its last promised start (its
        queue drains as time passes), or the work this consumer asked of it since, if more."""
        promised = max(0.0, self.start_s - (now - self.said_at))
        mine = sum(v for k, v in list(self.asked.items()) if k is not key)
        return max(promised, mine)

    def compute_s(self, start: int, end: int, shape: CostCurve | None = None) -> float:
        """Its compute for rows ``[start, end)``: its curve, times how its estimates measured."""
        return self.rates.seconds(start, end, shape=shape) * self.trust


class CostModel:
    """The consumer's estimates for one model/engine/dtype/threads (module doc)."""

    def __init__(self, key: str = "", path=None, threads: int = 1) -> None:
        self.key = key
        self.path = path
        self.share = CpuShare(threads)  # not kept: it is this moment's machine
        self.local = CostCurve()
        self.saved_at: float | None = None  # when the file it was loaded from was written
        self._explore_n = 0  # requests where exploring was worth it (every EXPLORE_EVERY-th explores)
        self._routing = threading.Lock()  # one route decided at a time: its ask is in the next one's view
        self.install_spr: float | None = None  # seconds per row installed
        self.gate_s: float | None = None
        self.first_step_s: float | None = None
        self.connect_s: float | None = None
        self.link_Bps: float | None = None  # learned from pulls (before any: the probes', :func:`probed_link`)
        self.step_s: float | None = None  # one batched decode step (the turns' measured steps)
        self.row_bytes: float | None = None  # pack bytes per row, as received
        self.producers: dict[str, ProducerView] = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------- learning
    def producer(self, address: str) -> ProducerView:
        with self._lock:
            return self.producers.setdefault(address, ProducerView())

    def heard(self, address: str, promise: dict[str, Any]) -> None:
        """A producer's ``Promise`` (the pull client's ``promise`` event), kept or refused ``late``
        after it: its curve and its queue, for every later prediction (a ``late`` never stops
        this consumer asking: the next prediction weighs what it said)."""
        view = self.producer(address)
        view.rates.load_rates(promise.get("rates") or {})
        view.start_s = max(0.0, float(promise.get("start_ms") or 0) / 1000)
        view.said_at = time.time()
        view.known = view.rates.learned

    def asking(self, address: str, key: Any, compute_s: float) -> None:
        """This consumer asks ``address`` for work expected to take ``compute_s`` there (its
        queue in the next predictions, until :meth:`answered`)."""
        view = self.producer(address)
        with self._lock:
            view.asked[key] = max(0.0, compute_s)

    def answered(self, address: str, key: Any, *, promised_s: float | None = None, measured_s: float | None = None,
                 rows: int = 0, outcome: str = "") -> None:
        """The request ``key`` asked of ``address`` ended (``outcome``: served, late, failed):
        its work is off that queue; a pack received says how the producer's estimate measured
        (``measured_s`` from its Serving to the pack's last byte over ``promised_s``)."""
        view = self.producer(address)
        with self._lock:
            view.asked.pop(key, None)
            if outcome:
                view.last = outcome
            if outcome == "busy":  # its queue for us was full with the asks still in flight
                view.limit = max(1, len(view.asked))
            elif outcome == "served" and view.limit is not None and len(view.asked) >= view.limit:
                view.limit = len(view.asked) + 1  # it took more than we thought
            if rows > 0 and outcome == "served":
                view.pulled_to = max(view.pulled_to, rows)
            if promised_s and measured_s and promised_s > 0.05 and measured_s > 0:
                lo, hi = TRUST_RANGE
                view.trust = min(hi, max(lo, _avg(view.trust, measured_s / promised_s)))

    def observe(self, *, held: int, rows: int, prefill_s: float | None = None, local: bool,
                install_s: float | None = None, gate_s: float | None = None, first_step_s: float | None = None,
                connect_s: float | None = None, pack_bytes: int = 0, wire_s: float | None = None,
                shipped_rows: int = 0, producer: str | None = None) -> None:
        """One answer's measurements: ``local``: rows ``[held, rows)`` prefilled here in ``prefill_s``.
        The engine's times are kept as with the cores its own (times the share now, :class:`CpuShare`)."""
        own = self.share.now()
        prefill_s, install_s, gate_s, first_step_s = (
            None if v is None else v * own for v in (prefill_s, install_s, gate_s, first_step_s))
        if local and prefill_s is not None and rows > held:
            self.local.observe(held, rows, prefill_s)
        with self._lock:
            if install_s is not None and rows > 0:
                self.install_spr = _avg(self.install_spr, max(0.0, install_s) / rows)
            if gate_s is not None:
                self.gate_s = _avg(self.gate_s, max(0.0, gate_s))
            if first_step_s is not None and first_step_s >= 0:
                self.first_step_s = _avg(self.first_step_s, first_step_s)
            if connect_s is not None and connect_s >= 0:
                self.connect_s = _avg(self.connect_s, connect_s)
            if pack_bytes > 0 and shipped_rows > 0:
                self.row_bytes = _avg(self.row_bytes, pack_bytes / shipped_rows)
            if pack_bytes > 0 and wire_s is not None and wire_s > 0:
                self.link_Bps = _avg(self.link_Bps, pack_bytes / wire_s)  # any producer's
                if producer is not None:
                    view = self.producers.setdefault(producer, ProducerView())
                    view.link_Bps = _avg(view.link_Bps, pack_bytes / wire_s)

    def observe_step(self, seconds: float) -> None:
        """One batched decode step's time (the engine's turn held for it)."""
        if seconds > 0 and math.isfinite(seconds):
            seconds *= self.share.now()
            with self._lock:
                self.step_s = _avg(self.step_s, seconds)

    # -------------------------------------------------------------- predicting
    def link_for(self, producer: str | None) -> tuple[float, str]:
        """The link rate (bytes per second) from ``producer`` and where it came from: ``pulls``
        (learned from this machine's pulls from it), ``probe`` (``muser probe-link`` to that
        address), ``pulls_any`` (learned from pulls from other producers) or ``cold``
        (:data:`COLD_LINK_BPS`)."""
        view = self.producers.get(producer) if producer is not None else None
        if view is not None and view.link_Bps is not None:
            return view.link_Bps, "pulls"
        probed = probed_link(producer) if producer is not None else None
        if probed is not None:
            return probed, "probe"
        if self.link_Bps is not None:
            return self.link_Bps, "pulls_any"
        return COLD_LINK_BPS, "cold"

    def _chunk_s(self, w: Work) -> tuple[int, float]:
        """(chunks left, seconds per chunk) of ``w``'s prompt work here."""
        n = math.ceil(w.todo / w.chunk) if w.todo > 0 else 0
        return n, (self.local.seconds(w.done, w.end) / n if n else 0.0)

    def _step_round_s(self, ahead: list[Work], batched: bool) -> float:
        """The decode steps between two prefill chunks: one batched step while any sequence
        decodes (else one step per decoding sequence)."""
        decoding = sum(1 for w in ahead if w.decoding)
        if not decoding:
            return 0.0
        one = self.first_step_s if self.first_step_s is not None else COLD_FIRST_STEP_S
        if batched:
            return self.step_s if self.step_s is not None else one
        return decoding * one

    def consumer_queue(self, ahead: list[Work], *, start: int, end: int, chunk: int, batched: bool = True,
                       ready_s: float | None = None) -> float:
        """The seconds this request waits on the engine behind ``ahead`` (module doc).

        ``ready_s`` None: its rows ``[start, end)`` are prefilled here in chunks of ``chunk``; the
        engine's turns go round first come first served, one chunk (or one step) a turn, so each
        request ahead with ``k`` chunks left takes ``min(k, ours)`` of its chunks before ours are
        done, and every turn round also holds the decode steps. Else its rows come in ``ready_s``
        from now (a pull, off the engine): it then waits one round -- a chunk of each request
        still prefilling then, the decode steps -- and the install of pulled rows that came first."""
        if not ahead:
            return 0.0
        step = self._step_round_s(ahead, batched)
        spr = self.install_spr if self.install_spr is not None else COLD_INSTALL_S_PER_ROW
        first = self.first_step_s if self.first_step_s is not None else COLD_FIRST_STEP_S
        chunks = [self._chunk_s(w) for w in ahead]
        if ready_s is None:
            ours = math.ceil(max(0, end - start) / max(1, chunk)) if end > start else 1
            wait = sum(min(n, ours) * s for n, s in chunks)
            wait += sum(w.rows * spr + first for w in ahead if w.pulled)  # their installs and first steps
            turns = ours + sum(min(n, ours) for n, _ in chunks)
            return wait + turns * step
        wait = step
        for n, s in chunks:
            if not n:
                continue
            finish = sum(min(m, n) * t for m, t in chunks) + n * step  # when it is done, without us
            if finish > ready_s:
                wait += s
        return wait + sum(w.rows * spr for w in ahead if w.pulled)

    def _tail(self, rows: int, *, gate: bool, slow: float = 1.0) -> tuple[float, float, float]:
        """(install, gate, first step) of ``rows`` here, each times ``slow`` (one over the share)."""
        install = rows * (self.install_spr if self.install_spr is not None else COLD_INSTALL_S_PER_ROW)
        first = self.first_step_s if self.first_step_s is not None else COLD_FIRST_STEP_S
        return install * slow, ((self.gate_s or 0.0) if gate else 0.0) * slow, first * slow

    def predict(self, *, tokens: int, held: int, producer: str | None, row_bytes: float | None = None,
                now: float | None = None, backlog: Backlog | None = None, key: Any = None,
                chunk: int = 256) -> dict[str, Any]:
        """The TTFT (seconds) of every path for a prompt of ``tokens`` whose first ``held`` rows this
        machine's store holds, and the fastest: ``{"paths": {...}, "choice": NAME, "known": bool,
        "parts": {path: {component: seconds}}, "link": "pulls" | "probe" | "cold"}`` (``known``:
        the producer's rates came from its own promise, not guessed from ours). ``backlog``: what
        is ahead on this engine (a serving consumer's, less ``key``'s own request; prefilled in
        chunks of ``chunk``): each path's ``consumer_queue`` (zero without one)."""
        rows = tokens - 1
        now = time.time() if now is None else now
        share = self.share.now()
        slow = 1.0 / share  # the consumer's engine work, at the share of its cores it gets now
        install, gate, first = self._tail(rows, gate=False, slow=slow)
        ahead = backlog.ahead(key) if backlog is not None else []
        batched = backlog.batched if backlog is not None else True
        view = self.producers.get(producer) if producer is not None else None
        known = view is not None and view.known and view.rates.learned
        theirs = view.rates if known else None  # the same model's curve, measured there
        parts: dict[str, dict[str, float]] = {}
        if held >= rows:
            parts["store"] = {"consumer_queue": slow * self.consumer_queue(ahead, start=rows, end=rows, chunk=chunk,
                                                                           batched=batched, ready_s=0.0),
                              "install": install, "first_step": first}
        else:
            parts["local"] = {"consumer_queue": slow * self.consumer_queue(ahead, start=held, end=rows, chunk=chunk,
                                                                           batched=batched),
                              "local_prefill": slow * self.local.seconds(held, rows, shape=theirs), "first_step": first}
        link, link_from = self.link_for(producer)
        if producer is not None:
            queue = (view.queue_s(now, key) if view is not None else 0.0) + (
                self.connect_s if self.connect_s is not None else COLD_CONNECT_S)
            per_row = self.row_bytes or row_bytes or 0.0
            _, rgate, _ = self._tail(rows, gate=True, slow=slow)
            for name, start in (("remote_whole", 0), ("remote_delta", held)):
                if name == "remote_delta" and not 0 < held < rows:
                    continue
                # unknown: as fast as we are
                compute = view.compute_s(start, rows, shape=self.local) if known else self.local.seconds(start, rows)
                wire = max(0.0, per_row * (rows - start) / link - compute)
                ours = slow * self.consumer_queue(ahead, start=rows, end=rows, chunk=chunk, batched=batched,
                                                  ready_s=(queue + compute + wire) * share)  # the pull waits off the engine
                parts[name] = {"consumer_queue": ours, "producer_queue": queue, "producer_compute": compute,
                               "wire": wire, "install": install, "gate": rgate, "first_step": first}
        paths_ = {k: sum(v.values()) for k, v in parts.items()}
        choice = min(paths_, key=lambda k: paths_[k])
        return {"paths": {k: round(v, 6) for k, v in paths_.items()}, "choice": choice, "known": known,
                "calibrated": self.local.calibrated,
                "parts": {k: {c: round(x, 6) for c, x in v.items()} for k, v in parts.items()},
                "link": link_from if producer is not None else None, "share": round(share, 3)}

    # -------------------------------------------------------------- keeping
    def to_json(self) -> dict[str, Any]:
        return {"v": 2, "key": self.key, "saved_at": round(time.time(), 3), "local": self.local.to_json(),
                "explore_n": self._explore_n,
                "install_s_per_row": self.install_spr, "gate_s": self.gate_s, "first_step_s": self.first_step_s,
                "connect_s": self.connect_s, "link_Bps": self.link_Bps, "row_bytes": self.row_bytes,
                "step_s": self.step_s,
                "producers": {a: {"rates": v.rates.to_rates(), "link_Bps": v.link_Bps, "trust": round(v.trust, 4),
                                  "pulled_to": v.pulled_to}
                              for a, v in self.producers.items() if v.known or v.link_Bps is not None}}

    def load_json(self, obj: dict[str, Any]) -> None:
        """What :meth:`to_json` wrote, unless it is of another version or key, or older than
        :data:`MAX_AGE_S` (then nothing is loaded: a cold start, calibrated again)."""
        if not isinstance(obj, dict) or obj.get("v") != 2:
            return
        if self.key and obj.get("key") != self.key:
            return
        saved = obj.get("saved_at")
        if not isinstance(saved, (int, float)) or isinstance(saved, bool) or not -60 <= time.time() - saved <= MAX_AGE_S:
            return
        self.saved_at = float(saved)
        self.local.load_json(obj.get("local"))
        if type(obj.get("explore_n")) is int and obj["explore_n"] >= 0:
            self._explore_n = obj["explore_n"]
        for name in ("install_spr", "gate_s", "first_step_s", "connect_s", "link_Bps", "row_bytes", "step_s"):
            key = "install_s_per_row" if name == "install_spr" else name
            v = obj.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v):
                setattr(self, name, float(v))
        for addr, p in (obj.get("producers") or {}).items():
            if isinstance(p, dict):
                view = self.producer(str(addr))
                view.rates.load_rates(p.get("rates") or {})
                view.known = view.rates.learned
                link = p.get("link_Bps")
                if isinstance(link, (int, float)) and not isinstance(link, bool) and link > 0 and math.isfinite(link):
                    view.link_Bps = float(link)
                trust = p.get("trust")
                if isinstance(trust, (int, float)) and not isinstance(trust, bool) and \
                        TRUST_RANGE[0] <= trust <= TRUST_RANGE[1]:
                    view.trust = float(trust)
                pulled = p.get("pulled_to")
                if type(pulled) is int and pulled >= 0:
                    view.pulled_to = pulled

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.part")
            part.write_bytes(json.dumps(self.to_json(), sort_keys=True).encode())
            os.replace(part, self.path)  # whole or not at all (last writer wins: it is a cache)
        except OSError:  # a cache: not keeping it costs only a cold start next time
            pass


_MODELS: dict[tuple[str, str], CostModel] = {}
_MODELS_LOCK = threading.Lock()


def cost_file(model_fingerprint: str, engine: str, dtype: str, threads: int, *, side: str = "consumer") -> tuple[str, Path]:
    """The key and the file (under this home's data directory) of the cost model for this model,
    engine, dtype and thread count on this machine (:func:`machine_key`); ``side``: the consumer's
    costs or a producer's own curve (``producer``)."""
    key = cost_key(model_fingerprint, engine, dtype, threads)
    name = f"{key}.json" if side == "consumer" else f"{side}-{key}.json"
    return key, paths.data_dir() / "costs" / name


def costs_for(model_fingerprint: str, engine: str, dtype: str, threads: int) -> CostModel:
    """The process's one :class:`CostModel` for this model, engine, dtype and thread count (and
    data directory), loaded from its file the first time."""
    key, path = cost_file(model_fingerprint, engine, dtype, threads)
    with _MODELS_LOCK:
        model = _MODELS.get((key, str(path)))
        if model is None:
            model = _MODELS[(key, str(path))] = CostModel(key, path, threads)
            try:
                model.load_json(loads(path.read_bytes(), str(path), limit=1 << 20))
            except Exception:  # noqa: BLE001 - a cache: missing or damaged, start cold
                pass
        return model


def budget_split(*, ttft_s: float, consumer_queue_s: float, remote: bool, lane_s: float,
                 serving_s: float | None, end_s: float | None, rows_ready_s: float | None,
                 local_prefill_s: float = 0.0, install_s: float = 0.0, gate_s: float = 0.0,
                 pack_bytes: int = 0, link_Bps: float | None = None) -> dict[str, float]:
    """One answer's TTFT divided into :data:`COMPONENTS` (seconds, summing to ``ttft_s``).

    Times are seconds since the request arrived: ``lane_s`` the lane began (the consumer's
    queue before it), ``serving_s`` the producer admitted it (Serving), ``end_s`` its pack's
    last byte was in, ``rows_ready_s`` the rows were installed (None: unknown). The producer's
    part between Serving and the pack's end is wire (the bytes at the link rate, at most all of
    it) and compute (the rest); after the rows are in, install, the gate, then the first step
    (the rest up to the first token). Each interval is clipped into the one before, so the
    components never go negative and always add up."""
    out = dict.fromkeys(COMPONENTS, 0.0)
    t = min(max(0.0, consumer_queue_s), ttft_s)
    out["consumer_queue"] = t
    if remote and serving_s is not None:
        s = min(max(t, serving_s), ttft_s)
        out["producer_queue"] = s - t
        e = min(max(s, end_s if end_s is not None else s), ttft_s)
        span = e - s
        wire = min(span, pack_bytes / link_Bps) if link_Bps and pack_bytes else 0.0
        out["wire"], out["producer_compute"] = wire, span - wire
        t = e
    elif remote:  # asked, but never admitted: the wait for the producer was its queue
        e = min(max(t, end_s if end_s is not None else t), ttft_s)
        out["producer_queue"] = e - t
        t = e
    if local_prefill_s > 0:
        lp = min(local_prefill_s, ttft_s - t)
        out["local_prefill"] = lp
        t += lp
    inst = min(max(0.0, install_s), ttft_s - t)
    out["install"] = inst
    t += inst
    g = min(max(0.0, gate_s), ttft_s - t)
    out["gate"] = g
    t += g
    out["first_step"] = max(0.0, ttft_s - t)
    return {k: round(v, 6) for k, v in out.items()}


def overrun(split: dict[str, float], budget_s: float | None, expected: dict[str, float]) -> str | None:
    """The component that overran an answer over its budget: the one furthest over what it was
    expected to take (``expected``: seconds by component; absent: 0); None when within budget."""
    total = sum(split.values())
    if budget_s is None or total <= budget_s:
        return None
    return max(split, key=lambda k: split[k] - expected.get(k, 0.0))


__all__ = ["COLD_TPS", "COMPONENTS", "Backlog", "CostCurve", "CostModel", "ProducerView", "Work", "budget_split",
           "cost_file", "costs_for", "overrun"]
