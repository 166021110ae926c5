"""The lane is taken when it pays, from the first request (issue #47): cost curves fitted from
measurements at several sizes, calibrated before a service listens, kept across restarts (and
forgotten when the key changes), corrected by exploring the path predicted slower; a ``late``
never stops later asks; under a backlog of long prompts the work splits; a held preamble does
not keep a long prompt off the producer; the route's fields say what was predicted, chosen and
taken; a producer that declined a request is still up.

Real classes in process (the cost model, the route, the backlog, a worker's engine on the tiny
model), real processes for the lane (a resident producer on 127.0.0.1, mutual TLS, ``muser
decode``). No assertion on how long anything took, but the calibration's: within the range a
loaded machine keeps."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from handoff_kit import HANG_S, LANE_PROMPT as PROMPT, env_for, home_env, muser_cmd, pull_lane, wait_for
from muser_cli.consumer.costs import Backlog, CostCurve, CostModel, cost_file, costs_for
from muser_cli.consumer.route import EXPLORE_EVERY, route
from muser_cli.costcurve import RATE_POINTS, fit_curve, load_curve, save_curve

CHUNK = 64
TRUE = (0.05, 0.004, 2e-7)  # fixed s, s a token, s a token a position


def _secs(start: int, end: int, coef=TRUE) -> float:
    f, t, d = coef
    return f + t * (end - start) + d * (end * end - start * start) / 2


def _calibrated(costs: CostModel, tps: float) -> None:
    for n in (64, 512):
        costs.local.observe(0, n, n / tps)


def _producer(costs: CostModel, address: str, tps: float) -> None:
    view = costs.producer(address)
    view.rates = CostCurve()
    for n in (64, 512):
        view.rates.observe(0, n, 0.01 + n / tps)
    view.known = True
    costs.connect_s, costs.first_step_s, costs.install_spr = 0.02, 0.01, 1e-6


# ----------------------------------------------------------------------------- the curve
def test_the_fit_recovers_fixed_per_token_and_depth_costs_from_several_sizes():
    obs = [(0, n, _secs(0, n)) for n in (40, 512, 1024, 2048)] + [(512, 1024, _secs(512, 1024))]
    fixed, token_s, depth_s = fit_curve(obs)
    assert fixed == pytest.approx(TRUE[0], rel=1e-6) and token_s == pytest.approx(TRUE[1], rel=1e-6)
    assert depth_s == pytest.approx(TRUE[2], rel=1e-6)
    curve = CostCurve()
    for o in obs:
        curve.observe(*o)
    assert curve.calibrated and curve.seconds(0, 8000) == pytest.approx(_secs(0, 8000), rel=1e-4)
    # a 40-token warm-up alone (mostly fixed cost) once extrapolated 20-40x too slow; two sizes do not
    short = CostCurve()
    short.observe(0, 40, _secs(0, 40))
    assert not short.calibrated and short.seconds(0, 2000) > 1.2 * _secs(0, 2000)
    short.observe(0, 513, _secs(0, 513))
    assert short.calibrated and short.seconds(0, 2000) == pytest.approx(_secs(0, 2000), rel=0.25)
    # coefficients are never negative, whatever the noise
    noisy = fit_curve([(0, 64, 0.5), (0, 128, 0.2), (0, 1024, 1.0)])
    assert min(noisy) >= 0


def test_a_producers_rates_carry_its_whole_curve():
    curve = CostCurve()
    for n in (40, 513, 1500):
        curve.observe(0, n, _secs(0, n))
    rates = curve.to_rates(upto=32768)
    assert set(rates) == {str(b) for b in RATE_POINTS if b <= 32768}
    there = CostCurve()
    there.load_rates(rates)
    for start, end in ((0, 100), (0, 20000), (1000, 9000)):
        assert there.seconds(start, end) == pytest.approx(curve.seconds(start, end), rel=1e-3)


# ----------------------------------------------------------------------------- remembered
def test_what_is_learned_survives_a_restart_and_is_dropped_when_the_key_changes(tmp_path, monkeypatch):
    from muser_cli.consumer import costs as costs_mod

    with home_env(tmp_path / "home"):
        monkeypatch.setattr(costs_mod, "_MODELS", {})
        costs = costs_for("model-a", "torch", "float32", 1)
        _calibrated(costs, 300.0)
        _producer(costs, "p:1", 3000.0)
        costs.producer("p:1").trust = 2.0
        costs.save()
        before = costs.predict(tokens=2000, held=0, producer="p:1")
        monkeypatch.setattr(costs_mod, "_MODELS", {})  # a new process
        again = costs_for("model-a", "torch", "float32", 1)
        assert again is not costs and again.local.calibrated and again.producer("p:1").trust == 2.0
        after = again.predict(tokens=2000, held=0, producer="p:1")
        for path in before["paths"]:
            assert after["paths"][path] == pytest.approx(before["paths"][path], rel=1e-3), (before, after)
        # another thread count, another model: another key, nothing loaded
        assert not costs_for("model-a", "torch", "float32", 2).local.learned
        assert not costs_for("model-b", "torch", "float32", 1).local.learned
        # a file written under another key (another engine version or CPU) is not read
        key, path = cost_file("model-c", "torch", "float32", 1)
        body = json.loads(path.with_name(f"{cost_file('model-a', 'torch', 'float32', 1)[0]}.json").read_text())
        path.write_text(json.dumps(body))
        monkeypatch.setattr(costs_mod, "_MODELS", {})
        assert not costs_for("model-c", "torch", "float32", 1).local.learned
        # too old: forgotten
        _, path_a = cost_file("model-a", "torch", "float32", 1)
        body["saved_at"] = time.time() - 30 * 86400
        path_a.write_text(json.dumps(body))
        monkeypatch.setattr(costs_mod, "_MODELS", {})
        assert not costs_for("model-a", "torch", "float32", 1).local.learned
    curve = CostCurve()
    curve.observe(0, 64, 0.1)
    curve.observe(0, 512, 0.5)
    save_curve(curve, tmp_path / "p.json", "k1")
    kept = CostCurve()
    assert load_curve(kept, tmp_path / "p.json", "k1") is not None and kept.coef == curve.coef
    assert load_curve(CostCurve(), tmp_path / "p.json", "k2") is None


# ----------------------------------------------------------------------------- the route
def test_an_uncalibrated_consumer_asks_its_producer_without_a_guessed_budget(monkeypatch):
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    costs = CostModel()
    got = route(costs, tokens=1200, held=0, producer="p:1")
    assert got.ask and got.budget_ms is None and not got.calibrated, got
    assert got.choice == "remote_whole"
    short = route(costs, tokens=40, held=0, producer="p:1")  # a short prompt is no reason to ask
    assert not short.calibrated and short.paths["local"] < short.paths["remote_whole"]


def test_exploration_tries_the_path_predicted_slower_and_corrects_a_wrong_estimate(monkeypatch):
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    monkeypatch.delenv("MUSER_EXPLORE", raising=False)
    costs = CostModel()
    _calibrated(costs, 1000.0)
    _producer(costs, "p:1", 900.0)  # its own estimate: a little slower than here (it is 3x faster really)
    costs.local.observe(0, 4096, 4096 / 1000.0)  # the local path measured at depth
    plans = [route(costs, tokens=2000, held=0, producer="p:1") for _ in range(2 * EXPLORE_EVERY)]
    asked = [p for p in plans if p.ask]
    assert [p.explore for p in asked] == ["producer", "producer"], plans  # one in EXPLORE_EVERY
    assert [i for i, p in enumerate(plans) if p.ask] == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert all(p.predicted == "local" and p.choice == "remote_whole" for p in asked)
    assert all(p.budget_ms is None for p in asked)  # measured, not raced against a budget it was predicted to miss
    assert all(not p.ask and p.choice == "local" for p in plans if p.explore is None)
    # the explored pull measured the producer 3x faster than it estimated: its estimates are scaled
    for key in range(3):
        costs.asking("p:1", key, 2.5)
        costs.answered("p:1", key, promised_s=2.5, measured_s=2.5 / 3, rows=1999, outcome="served")
    monkeypatch.setenv("MUSER_EXPLORE", "0")  # off: the prediction alone
    fixed = route(costs, tokens=2000, held=0, producer="p:1")
    assert fixed.predicted == "remote_whole" and fixed.ask and fixed.budget_ms, fixed
    assert costs.producer("p:1").trust < 0.6
    costs2 = CostModel()
    _calibrated(costs2, 1000.0)
    _producer(costs2, "p:1", 900.0)
    assert not any(route(costs2, tokens=2000, held=0, producer="p:1").ask for _ in range(EXPLORE_EVERY))


def test_a_late_refusal_teaches_the_queue_and_later_requests_ask_again(monkeypatch):
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    monkeypatch.setenv("MUSER_EXPLORE", "0")
    costs = CostModel()
    _calibrated(costs, 200.0)
    _producer(costs, "p:1", 4000.0)
    assert route(costs, tokens=2000, held=0, producer="p:1").ask
    rates = costs.producer("p:1").rates.to_rates()
    costs.heard("p:1", {"start_ms": 60_000, "compute_ms": 500, "queued": 3, "rates": rates})  # then "late"
    costs.answered("p:1", "r1", outcome="late")
    busy = route(costs, tokens=2000, held=0, producer="p:1")
    assert not busy.ask and busy.parts["remote_whole"]["producer_queue"] > 50, busy
    costs.producer("p:1").said_at -= 61  # its queue drained since it said so
    assert route(costs, tokens=2000, held=0, producer="p:1").ask
    assert costs.producer("p:1").last == "late"


def test_under_a_backlog_of_long_prompts_the_work_splits(monkeypatch):
    """Eight long prompts arrive together on a consumer whose producer computes as fast as it
    does: some are asked of the producer, some stay here, so both machines compute."""
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    monkeypatch.setenv("MUSER_EXPLORE", "0")
    costs = CostModel()
    _calibrated(costs, 250.0)
    _producer(costs, "p:1", 250.0)
    backlog = Backlog()
    where = []
    for i in range(8):
        backlog.arrive(i, tokens=1200, chunk=512)
        plan = route(costs, tokens=1200, held=0, producer="p:1", backlog=backlog, key=i, chunk=512)
        where.append(plan.choice)
        if plan.ask:
            backlog.routed(i, start=0, end=1199, chunk=512, pulled=True)
            costs.asking("p:1", i, plan.parts["remote_whole"]["producer_compute"])
        else:
            backlog.routed(i, start=0, end=1199, chunk=512, pulled=False)
    assert where[0] == "local", where  # nothing ahead: no connection to pay
    assert 2 <= where.count("remote_whole") <= 6, where
    assert where.count("local") >= 2, where


def test_a_pull_asked_while_the_engine_is_busy_counts_that_wait_against_the_local_path(monkeypatch):
    """#48 item 2 (``muser batch``'s next job, asked for while the job before it decodes): a
    producer predicted a little slower than here is not asked for a request that could start
    now, and is asked when the engine is busy for longer than the difference; the budget grows
    by the wait, and the route says it."""
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    monkeypatch.setenv("MUSER_EXPLORE", "0")
    costs = CostModel()
    _calibrated(costs, 1000.0)
    _producer(costs, "p:1", 900.0)
    now = route(costs, tokens=2000, held=0, producer="p:1")
    assert not now.ask and now.choice == "local" and now.lead_s == 0, now
    gap = now.remote_s - now.seconds
    assert gap > 0
    later = route(costs, tokens=2000, held=0, producer="p:1", lead_s=2 * gap + 0.5)
    assert later.ask and later.choice == "remote_whole" and later.budget_ms is not None, later
    alone = costs.local.seconds(0, 1999)
    assert later.budget_ms / 1000 > alone, later  # the local path waits for the engine first
    assert later.to_json("handoff")["lead_ms"] == pytest.approx((2 * gap + 0.5) * 1000, rel=1e-3)
    assert later.paths == now.paths  # the predictions themselves: each path as if it began now


def test_a_short_prompt_stays_local_and_the_producer_route_asks_unless_all_is_held(monkeypatch):
    costs = CostModel()
    _calibrated(costs, 1000.0)
    _producer(costs, "p:1", 1000.0)
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    assert not route(costs, tokens=30, held=0, producer="p:1").ask
    monkeypatch.setenv("MUSER_ROUTE", "producer")
    got = route(costs, tokens=30, held=0, producer="p:1")
    assert got.ask and got.choice == "remote_whole", got
    assert route(costs, tokens=3000, held=2048, producer="p:1").choice == "remote_delta"
    held = route(costs, tokens=3000, held=2999, producer="p:1")
    assert not held.ask and held.choice == "store", held


# ----------------------------------------------------------------------------- real processes
def ask(worker, prompt: str) -> dict:
    """One completion through a service's engine worker (two tokens, greedy): its summary."""
    import threading

    from muser_cli.service.api import parse_ask
    from muser_cli.service.worker import Job

    done, got = threading.Event(), {}

    def emit(kind, payload):
        if kind in ("done", "error"):
            got[kind] = payload
            done.set()

    worker.submit(Job(parse_ask({"prompt": prompt, "max_tokens": 2, "temperature": 0}, "completion",
                                default_max_tokens=2), emit))
    assert done.wait(HANG_S) and "done" in got, got
    return got["done"]


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("learns"), tiny_llama.path, prompt=PROMPT) as lane:
        yield lane


def test_the_producer_calibrates_before_listening_and_keeps_its_curve(lane):
    warmed = lane["producer"].events("warmed")
    assert warmed, "no warmed event"
    cal = warmed[0]["calibration"]
    assert len({n for n, _ in cal}) >= 2 and max(n for n, _ in cal) >= min(513, 255), cal  # a whole chunk, or the context
    assert len(warmed[0]["rates"]) >= 3
    files = list((lane["nodes"].producer_home).rglob("producer-*.json"))
    assert len(files) == 1, files
    kept = json.loads(files[0].read_text())
    assert kept["curve"]["fit"] and len(kept["curve"]["obs"]) >= 2


def test_a_calibrated_consumer_predicts_its_local_path_within_a_loaded_machines_range(lane):
    """A serving consumer's calibration (two sizes) predicts a longer prompt's local prefill on the
    tiny model; the best of three runs of each, within 3x (the benchmark's aim is 2x: a test
    leaves room for a loaded machine)."""
    from muser_cli.model.resolve import resolve_model
    from muser_cli.service.metrics import ConsumerMetrics
    from muser_cli.service.worker import Config, EngineWorker
    from muser_cli.consumer.decode import decode
    from muser_cli.pulllane.producer import warm_ids

    with home_env(lane["nodes"].consumer_home):
        worker = EngineWorker(Config(model=lane["model"], dtype="float32", threads=1, reuse=False, max_batch=1,
                                     chunk_tokens=CHUNK, turn_memory_mb=0), ConsumerMetrics())
        try:
            worker.costs = CostModel()
            warmed = worker.warm_up()
            assert worker.costs.local.calibrated and len(warmed["calibration"]) == 2, warmed
            info = resolve_model(lane["model"])
            n = info.max_positions - 1
            best = min(decode(None, model=lane["model"], prompt="", max_new_tokens=1, engine="torch", dtype="float32",
                              threads=1, chunk_tokens=CHUNK, reuse=False, store=False, resident=worker.engine.inner,
                              prompt_ids=warm_ids(info.vocab_size, n), info=info).prefill_s for _ in range(3))
            predicted = worker.costs.local.seconds(0, n - 1)
            assert best / 3 <= predicted <= best * 3, (predicted, best, worker.costs.local.obs)
        finally:
            worker.close()


def test_taken_is_the_source_and_a_declined_request_keeps_the_producer_up(lane, monkeypatch):
    """A served answer's route says what was predicted, chosen and taken (``taken`` the path of its
    source); a producer that declined one request (``late``: its turn held by a request that ran
    past the budget) stays up on /metrics and in the pool /health shows."""
    from handoff_kit import held_pull, signed_request
    from muser_cli.service.metrics import ConsumerMetrics
    from muser_cli.service.worker import Config, EngineWorker

    address = lane["producer"].address
    monkeypatch.setenv("MUSER_EXPLORE", "0")

    with home_env(lane["nodes"].consumer_home):
        metrics = ConsumerMetrics()
        worker = EngineWorker(Config(model=lane["model"], dtype="float32", threads=1, reuse=False, max_batch=1,
                                     producers=(address,), chunk_tokens=CHUNK, turn_memory_mb=0,
                                     prefill_deadline=HANG_S), metrics)
        try:
            worker.costs = CostModel()
            monkeypatch.setenv("MUSER_ROUTE", "producer")
            s = ask(worker, PROMPT)
            assert s["source"] == "handoff" and s["route"]["taken"] == "remote_whole", s["route"]
            assert s["route"]["choice"] == "remote_whole" and "predicted" in s["route"]
            assert metrics.producer_up.labels(address)._value.get() == 1
            # the default route, this machine known to be slow (200 tokens/s): asked with the budget to beat
            # it, while the producer's turn is held past anything that budget allows: it says "late"
            monkeypatch.delenv("MUSER_ROUTE")
            worker.costs = CostModel()
            _calibrated(worker.costs, 200.0)
            ident, request = signed_request(lane)
            with held_pull(ident, address, request) as answer:
                assert type(answer).__name__ == "Serving"
                time.sleep(1.0)
                s = ask(worker, PROMPT + " Once more.")
            assert s["source"] == "local" and s["route"]["taken"] == "local", s
            assert "late" in (s.get("fallback_reason") or ""), s
            assert metrics.producer_up.labels(address)._value.get() == 1
            state = worker.pool.to_json()[0]
            assert state["up"] and state["declined"] == 1 and "late" in state["last_declined"], state
            assert state["last_error"] == "", state
            assert worker.costs.producer(address).last == "late"
        finally:
            worker.close()


def test_a_short_held_preamble_does_not_keep_a_prompt_off_the_producer(lane, monkeypatch):
    """The turn memory holds a few tokens of a new prompt (a conversation's preamble):
    ``MUSER_ROUTE=producer`` still asks the producer, since the rows are not all held; the same
    prompt again, wholly held, is not asked."""
    from muser_cli.service.metrics import ConsumerMetrics
    from muser_cli.service.worker import Config, EngineWorker

    address = lane["producer"].address
    monkeypatch.setenv("MUSER_ROUTE", "producer")

    with home_env(lane["nodes"].consumer_home):
        worker = EngineWorker(Config(model=lane["model"], dtype="float32", threads=1, reuse=False, max_batch=1,
                                     producers=(address,), chunk_tokens=CHUNK, turn_memory_mb=64,
                                     prefill_deadline=HANG_S), ConsumerMetrics())
        try:
            worker.costs = CostModel()
            first = ask(worker, PROMPT)
            assert first["source"] == "handoff", first
            from muser_cli.model.tokens import encode_prompt

            other = PROMPT[:30] + (" Entirely other words follow here, about rivers, mountains and the long roads "
                                   "between the small towns of the valley, one after another.")
            ids = encode_prompt(worker.info, other)
            held = worker.memory.find(ids)  # (waits for the first answer's rows to be kept)
            assert held is not None and 0 < held.rows < len(ids) // 3, (held and held.rows, len(ids))  # a preamble
            second = ask(worker, other)
            assert second["source"] == "handoff" and second["route"]["taken"] == "remote_whole", second
            again = ask(worker, PROMPT)  # every row held (the first answer's turn): not asked
            assert again["source"] in ("held", "store"), again
        finally:
            worker.close()


def test_a_busy_producer_teaches_how_many_asks_it_takes(monkeypatch):
    """A ``busy`` (its queue for this consumer full) is learned: while that many of this consumer's
    asks are in flight there, the route keeps new requests here instead of asking to be refused;
    as they are answered, it asks again. The pool keeps the producer up."""
    from muser_cli.consumer.pool import ProducerPool
    from muser_cli.handoff.wire.refusal import ProducerBusy

    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    monkeypatch.setenv("MUSER_EXPLORE", "0")
    costs = CostModel()
    _calibrated(costs, 200.0)
    _producer(costs, "p:1", 4000.0)
    for key in ("a", "b", "c"):
        assert route(costs, tokens=2000, held=0, producer="p:1", key=key).ask
    assert route(costs, tokens=2000, held=0, producer="p:1", key="d").ask
    costs.answered("p:1", "d", outcome="busy")  # it took the three, not the fourth
    full = route(costs, tokens=2000, held=0, producer="p:1", key="e")
    assert not full.ask and "holds as many" in full.why and costs.producer("p:1").limit == 3, full
    costs.answered("p:1", "a", outcome="served", rows=1999)
    assert route(costs, tokens=2000, held=0, producer="p:1", key="e").ask
    pool = ProducerPool(["127.0.0.1:7070"])
    addr = pool.pick()
    pool.done(addr, ProducerBusy("producer 127.0.0.1:7070 refused: busy: producer busy"))
    state = pool.to_json()[0]
    assert state["up"] and state["declined"] == 1 and state["failures"] == 0, state
