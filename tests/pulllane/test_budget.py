"""One latency budget across the two schedulers (issue #39), as a user runs it: real producer
processes on 127.0.0.1 (``prefill --serve``), a tiny model, mutual TLS.

    consumer$ MUSER_ROUTE=fastest muser decode --producer HOST:PORT --prompt doc.txt --json   # route, budget
    producer answers a request with a budget: Promise (start, compute, queue, rates), then Reject(late) at once if missed

What is checked: a short prompt stays local while a producer is up (it is not even asked); a
producer that cannot make the budget says "late" at once and the consumer prefills here at once
(not after its --timeout); the producer's order is earliest deadline first within per-consumer
rounds (in process: :class:`Admission`; over TLS: two queued requests of one consumer); its
promise counts the work before it.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import threading
import time

import pytest

from handoff_kit import (
    HANG_S, LANE_CHUNK as CHUNK, LANE_PROMPT as PROMPT, env_for, held_pull, home_env, muser_cmd,
    pull_lane, signed_request, wait_for,
)
from muser_cli.consumer.costs import CostCurve, CostModel, budget_split, overrun
from muser_cli.consumer.route import route
from muser_cli.handoff.pull.admission import Admission


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("budget"), tiny_llama.path, "--max-queue", "2", "--idle-timeout",
                   str(HANG_S), prompt=PROMPT) as lane:
        yield lane


def decode(lane, prompt_path, *extra: str, env_extra: dict | None = None,
           env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    base = env_for(lane["nodes"].consumer_home) if env is None else env
    r = subprocess.run(muser_cmd("decode", *lane["common"], "--chunk", str(CHUNK), "--prompt", str(prompt_path),
                                 "-n", "4", "--no-reuse", "--json", "--producer", lane["producer"].address, *extra),
                       env={**base, **(env_extra or {})}, capture_output=True, timeout=HANG_S)
    return r, time.monotonic() - t0


def seed_costs(lane, *, local_tps: float) -> None:
    """Write the consumer's cost file for the lane's model (float32, torch, one thread): its local
    prefill calibrated at ``local_tps`` tokens a second (two sizes, no fixed part)."""
    from muser_cli.consumer.costs import cost_file
    from muser_cli.model.resolve import resolve_model

    with home_env(lane["nodes"].consumer_home):  # the file itself: this process's cost models are not the CLI's
        info = resolve_model(lane["model"])
        key, path = cost_file(info.fingerprint, "torch", "float32", 1)
    seeded = CostModel(key, path)
    for n in (64, 128):
        seeded.local.observe(0, n, n / local_tps)
    seeded.save()


# ----------------------------------------------------------------------------- in process
def test_admission_rounds_and_deadlines():
    """One slot, held. A floods with three requests (relaxed deadlines), then B sends two, the
    second with the tightest deadline of all: within each round the earliest deadline goes
    first, and no consumer takes a second turn while another waits for its first of the round."""
    adm = Admission(1)
    assert adm.enter(False, who="holder")
    order: list[str] = []
    now = time.monotonic()
    plan = [("A", "a1", 100), ("A", "a2", 90), ("A", "a3", 80), ("B", "b1", 200), ("B", "b2", 5)]
    threads = []

    def go(who: str, name: str, due: float) -> None:
        assert adm.wait(False, lambda: False, poll=0.05, who=who, deadline=now + due)
        order.append(name)
        adm.leave(False)

    for who, name, due in plan:
        t = threading.Thread(target=go, args=(who, name, due))
        t.start()
        threads.append(t)
        assert wait_for(lambda: adm.waiting() == len(threads), HANG_S)
    adm.leave(False)  # the holder is done
    for t in threads:
        t.join(HANG_S)
    # round 1: B's b2 (due 5) before A's a3 (due 80); round 2: a2 (90) before b1 (200); then a1
    assert order == ["b2", "a3", "a2", "b1", "a1"], order


def test_admission_without_deadlines_stays_round_robin():
    adm = Admission(1)
    assert adm.enter(False, who="holder")
    order: list[str] = []
    threads = []
    for who, name in [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1"), ("B", "b2")]:
        t = threading.Thread(target=lambda w=who, n=name: (adm.wait(False, lambda: False, poll=0.05, who=w),
                                                           order.append(n), adm.leave(False)))
        t.start()
        threads.append(t)
        assert wait_for(lambda: adm.waiting() == len(threads), HANG_S)
    adm.leave(False)
    for t in threads:
        t.join(HANG_S)
    assert order == ["a1", "b1", "a2", "b2", "a3"], order


def test_expected_start_counts_the_work_before_it():
    adm = Admission(1)
    t0 = time.monotonic()  # A's 10 s count down from its entry: the bounds below allow for however long has run since
    assert adm.enter(False, who="A", cost_s=10.0)
    start, ahead = adm.expected_start("B", cost_s=1.0)
    assert ahead == 0 and 10.0 - (time.monotonic() - t0) <= start <= 10.0
    waiter = threading.Thread(target=lambda: (adm.wait(False, lambda: False, poll=0.05, who="A", cost_s=3.0,
                                                       deadline=time.monotonic() + 50), adm.leave(False)))
    waiter.start()
    assert wait_for(lambda: adm.waiting() == 1, HANG_S)
    later, ahead = adm.expected_start("B", cost_s=1.0, deadline=time.monotonic() + 100)
    assert ahead == 1 and 13.0 - (time.monotonic() - t0) <= later <= 13.0  # A's queued 3 s go first (earlier deadline)
    sooner, ahead = adm.expected_start("B", cost_s=1.0, deadline=time.monotonic() + 10)
    assert ahead == 0 and sooner <= 10.0  # a tighter deadline goes before it
    adm.leave(False)
    waiter.join(HANG_S)


def test_prediction_and_split_add_up():
    costs = CostModel()
    costs.local = CostCurve(cold_tps=1000.0)
    short = route(costs, tokens=8, held=0, producer="p:1")
    assert short.paths["local"] < short.paths["remote_whole"]
    split = budget_split(ttft_s=1.0, consumer_queue_s=0.1, remote=True, lane_s=0.1, serving_s=0.3, end_s=0.7,
                         rows_ready_s=None, install_s=0.05, gate_s=0.02, pack_bytes=10_000_000, link_Bps=1e8)
    assert math.isclose(sum(split.values()), 1.0, abs_tol=1e-5), split
    assert split["producer_queue"] == pytest.approx(0.2) and split["wire"] == pytest.approx(0.1)
    assert split["producer_compute"] == pytest.approx(0.3) and split["first_step"] == pytest.approx(0.23)
    # over a 0.6 s budget: the component furthest over what the prediction gave it is named
    assert overrun(split, 0.6, {"producer_queue": 0.19, "producer_compute": 0.05, "wire": 0.1}) == "producer_compute"
    assert overrun(split, 2.0, {}) is None


# ----------------------------------------------------------------------------- real processes
@pytest.mark.parametrize("mode", ["fastest", None])  # None: MUSER_ROUTE unset, the default
def test_a_short_prompt_stays_local_while_a_producer_is_up(lane, tmp_path, mode):
    short = tmp_path / "short.txt"
    short.write_text("Hello there.")
    before = len(lane["producer"].events("request")) + len(lane["producer"].events("promise"))
    env = env_for(lane["nodes"].consumer_home)
    env.pop("MUSER_ROUTE", None)
    r, _ = decode(lane, short, env_extra=None if mode is None else {"MUSER_ROUTE": mode}, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["source"] == "local", got
    route_ = got["route"]
    assert route_["choice"] == "local" and route_["mode"] == "fastest", route_
    assert {"local", "remote_whole"} <= set(route_["paths"]) and route_["paths"]["local"] < route_["paths"]["remote_whole"]
    assert "route: local predicted faster" in got["fallback_reason"], got
    time.sleep(0.3)
    assert len(lane["producer"].events("request")) + len(lane["producer"].events("promise")) == before  # never asked


def test_not_in_time_sends_the_consumer_to_local_prefill_at_once(lane):
    """The local path is known to be slow here (200 tokens/s, from the cost file), so the
    consumer asks, with the budget that beats it; the producer's turn is held by a request that
    has already run longer than that budget, so the producer says "late" at once -- the consumer
    prefills here without waiting out its 60 s --timeout."""
    seed_costs(lane, local_tps=200.0)
    prod = lane["producer"]
    ident, request = signed_request(lane)
    with held_pull(ident, prod.address, request) as answer:
        assert type(answer).__name__ == "Serving"
        time.sleep(1.0)  # it holds the turn past anything the budget allows
        before = len(prod.events("promise"))
        r, took = decode(lane, lane["prompt"], "--timeout", "60", env_extra={"MUSER_ROUTE": "fastest"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["source"] == "local" and got["fallback"], got
    assert "late" in got["fallback_reason"] and "not in time" in got["fallback_reason"], got
    assert got["route"]["budget_ms"] and got["route"]["budget_ms"] < 1000, got["route"]
    assert took < 30, took  # at once: not after the 60 s deadline
    heard = got["route"]["promise"]  # what the producer expects came before its refusal: the queue is learned
    assert heard["start_ms"] + heard["compute_ms"] > got["route"]["budget_ms"], (heard, got["route"])
    late = prod.wait_events(before + 1, "promise")[before:]
    assert [e["outcome"] for e in late] == ["late"], late
    assert late[0]["start_s"] > late[0]["budget_s"] - late[0]["compute_s"]
    assert any(e["outcome"] == "late" for e in prod.events("request"))


def test_a_broken_promise_is_raced_and_the_consumer_keeps_its_own_rows(lane):
    """Hedging: the local path is known to be very slow here (2 tokens/s), so the consumer asks
    with a generous budget, and the producer promises a start (the request holding its turn was
    expected to end soon). The turn stays held: once the promise, a quarter more and half a
    second have passed, the consumer computes the prompt here while the pull goes on; its own
    rows are ready first (the producer never started), so it keeps them and cancels the pull --
    long before its 120 s --timeout -- with the same tokens a local decode gives."""
    seed_costs(lane, local_tps=2.0)
    prod = lane["producer"]
    ident, request = signed_request(lane)
    with held_pull(ident, prod.address, request) as answer:
        assert type(answer).__name__ == "Serving"
        before = len(prod.events("promise"))
        r, took = decode(lane, lane["prompt"], "--timeout", "120", env_extra={"MUSER_ROUTE": "fastest"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    promised = prod.wait_events(before + 1, "promise")[before:]
    assert [e["outcome"] for e in promised] == ["promised"], promised
    assert got["source"] == "local" and got["fallback"], got
    assert "broke its promise" in got["fallback_reason"], got
    assert "computed here first" in got["fallback_reason"], got
    assert took < 100, took  # raced from the promise on, not waited out to the --timeout
    local, _ = decode(lane, lane["prompt"], env_extra={"MUSER_ROUTE": "producer"})  # the producer free again
    assert local.returncode == 0, local.stderr
    assert got["token_ids"] == json.loads(local.stdout)["token_ids"]


def test_a_raced_producer_whose_pack_comes_first_is_kept(lane):
    """Hedging, the other way round: the producer breaks its promise (its turn held), the consumer
    starts computing here, and then the producer is let go while the consumer's chunks are slow
    (its progress waits for the pull to end, then half a second a chunk). The producer's pack is
    whole first: the consumer drops what it computed and decodes from the pack (source
    ``handoff``), with the tokens of a local decode; the race started only after the promise
    broke (``hedged`` marked, after ``promise``)."""
    from dataclasses import replace

    from muser_cli.consumer.decode import decode as decode_here
    from muser_cli.consumer.pull import PipePull, ask_for

    prod = lane["producer"]
    ident, request = signed_request(lane)
    release, raced, holding = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with held_pull(ident, prod.address, request) as answer:
            if type(answer).__name__ == "Serving":
                holding.set()
            release.wait(HANG_S)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(HANG_S), "the producer's turn was not held"
    common = dict(model=lane["model"], prompt=PROMPT, chat=False, max_new_tokens=4, engine="torch", dtype="float32",
                  threads=1, chunk_tokens=CHUNK, reuse=False)
    with home_env(lane["nodes"].consumer_home):
        ask = ask_for(PROMPT, model=lane["model"], chat=False, chunk_tokens=CHUNK, dtype="float32", engine="torch")
        pulling = PipePull(prod.address, lambda: replace(ask, budget_ms=60_000), timeout=HANG_S, race=True)

        def slow(stage: str, done: int, total: int) -> None:
            raced.set()
            release.set()  # the producer's turn free: it computes our request now
            pulling.join(HANG_S)  # ... and its pull ends (the pack sent whole)
            time.sleep(0.5)

        try:
            out = decode_here(pulling.reader, progress=slow, hedge=pulling, **common)
        finally:
            pulling.reader.close()
            pulling.join(HANG_S)
            release.set()
        alone = decode_here(None, **common)
    holder.join(HANG_S)
    assert raced.is_set() and pulling.broken.is_set(), "the race never started"
    assert "broke its promise" in pulling.broken_why
    assert pulling.marks["promise"] <= pulling.marks["hedged"]
    assert pulling.error is None, pulling.error
    assert out.source == "handoff" and not out.fallback, (out.source, out.reason)
    assert out.token_ids == alone.token_ids


def test_a_producer_orders_queued_requests_by_deadline(lane):
    """Two requests of one consumer wait while the turn is held: the one sent second, with the
    tighter budget, is admitted first; each was promised a start at once."""
    from muser_cli.consumer.pull import ask_for, pull_prompt

    prod = lane["producer"]
    ident, request = signed_request(lane)
    with home_env(lane["nodes"].consumer_home):
        ask = ask_for(PROMPT, model=lane["model"], chat=False, chunk_tokens=CHUNK, dtype="float32", engine="torch")
    results: dict[str, object] = {}

    def ask_with(name: str, budget_ms: int) -> None:
        from dataclasses import replace

        with home_env(lane["nodes"].consumer_home):
            try:
                results[name] = pull_prompt(prod.address, replace(ask, budget_ms=budget_ms), out_stream=io.BytesIO(),
                                            timeout=HANG_S)
            except BaseException as exc:  # noqa: BLE001
                results[name] = exc

    before = len(prod.events("admitted"))
    promised = len(prod.events("promise"))
    with held_pull(ident, prod.address, request) as answer:
        assert type(answer).__name__ == "Serving"
        relaxed = threading.Thread(target=ask_with, args=("relaxed", 100_000))
        relaxed.start()
        assert len(prod.wait_events(promised + 1, "promise")) == promised + 1
        tight = threading.Thread(target=ask_with, args=("tight", 50_000))
        tight.start()
        got = prod.wait_events(promised + 2, "promise")[promised:]
        assert [e["outcome"] for e in got] == ["promised", "promised"], got
        assert got[1]["queued"] == 0  # the tighter one is promised the first start after the holder
    relaxed.join(HANG_S)
    tight.join(HANG_S)
    assert all(isinstance(v, dict) for v in results.values()), results
    admitted = prod.wait_events(before + 3, "admitted")[before + 1:]
    assert [e.get("budget_ms") for e in admitted] == [50_000, 100_000], admitted
