"""The consumer's own queue and the probed link in the prediction (issue #39): a serving consumer
knows what is ahead of a new request on its engine (:class:`Backlog`: the requests queued and
running, their prompt work left here, whether they decode) and adds it to every path
(``consumer_queue``), so under load a long prompt goes to the producer when the producer is
predicted faster, and stays here when the consumer is idle. ``muser probe-link`` keeps the rate it
measured to a producer; the cost model predicts the wire with it until pulls have measured the link.

Real parts: a resident producer process on 127.0.0.1 (mutual TLS), the service's engine worker
in this process on the tiny model (its engine's turn held by the test to keep it busy), the
real ``muser probe-link``."""

from __future__ import annotations

import json
import math
import subprocess
import threading

import pytest

from serve_kit import engine_worker  # noqa: F401  first: the module skipped without the serve extra
from handoff_kit import HANG_S, LANE_PROMPT as PROMPT, env_for, home_env, muser_cmd, pull_lane, wait_for
from muser_cli.consumer.costs import COLD_LINK_BPS, Backlog, CostCurve, CostModel, budget_split
from muser_cli.consumer.route import route
from muser_cli.consumer.cpushare import SHARE_STALE_S, CpuShare
from muser_cli.consumer.links import LINKS_FILE, note_link, probed_link
from muser_cli.consumer.turns import Turns

LONG = PROMPT + " " + PROMPT[:200]  # about 175 tokens of the tiny model (its context: 256): three chunks of 64
CHUNK = 64


@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("queue"), tiny_llama.path, prompt=PROMPT) as lane:
        yield lane


def _even(costs: CostModel, producer: str, tps: float = 1000.0) -> None:
    """The producer known to compute as fast as this machine (its promise's rates), so only the
    queues and the fixed costs tell the paths apart."""
    costs.local = CostCurve(cold_tps=tps)
    costs.local.observe(0, 128, 128 / tps)  # two sizes: calibrated, no fixed part
    costs.local.observe(0, 512, 512 / tps)
    view = costs.producer(producer)
    view.rates = CostCurve(cold_tps=tps)
    view.rates.observe(0, 128, 128 / tps)
    view.known = True
    costs.connect_s, costs.first_step_s, costs.install_spr = 0.02, 0.01, 1e-6


# ----------------------------------------------------------------------------- in process
def test_a_loaded_engine_predicts_a_longer_local_path(monkeypatch):
    monkeypatch.delenv("MUSER_ROUTE", raising=False)  # the default: fastest
    costs = CostModel()
    _even(costs, "p:1")
    backlog = Backlog()
    idle = costs.predict(tokens=1000, held=0, producer="p:1", backlog=backlog, key="me", chunk=256)
    assert idle["parts"]["local"]["consumer_queue"] == 0 and idle["choice"] == "local", idle
    for i in range(3):  # three long local prefills ahead, one stream decoding
        backlog.arrive(i, tokens=2000, chunk=256)
        backlog.routed(i, start=0, end=1999, chunk=256, pulled=False)
    backlog.arrive("d", tokens=20, chunk=256)
    backlog.decoding("d")
    costs.observe_step(0.02)
    busy = costs.predict(tokens=1000, held=0, producer="p:1", backlog=backlog, key="me", chunk=256)
    queue = busy["parts"]["local"]["consumer_queue"]
    # each of the three (8 chunks left) takes as many of its chunks as ours (4) before ours are done;
    # every turn, one batched decode step
    theirs = costs.local.seconds(0, 1999) / 8
    assert queue == pytest.approx(3 * 4 * theirs + (4 + 12) * 0.02, rel=0.01), busy["parts"]
    assert busy["paths"]["local"] > idle["paths"]["local"] + 3
    assert 0 < busy["parts"]["remote_whole"]["consumer_queue"] < queue  # the pull waits off the engine
    assert busy["choice"] == "remote_whole", busy
    got = route(costs, tokens=1000, held=0, producer="p:1", backlog=backlog, key="me", chunk=256)
    assert got.ask and got.budget_ms > 0, got
    backlog.progress(0, 1999)  # one of them done with its prompt: less ahead
    assert costs.predict(tokens=1000, held=0, producer="p:1", backlog=backlog, key="me",
                         chunk=256)["parts"]["local"]["consumer_queue"] < queue
    backlog.arrive("r", tokens=2000, chunk=256)  # routed to the producer: its install only, off the engine until then
    backlog.routed("r", start=0, end=1999, chunk=256, pulled=True)
    assert [w.todo for w in backlog.ahead("me") if w.pulled] == [0]
    backlog.progress("r", 256)  # ... then computing here after all (its producer broke its promise: a race)
    raced = [w for w in backlog.ahead("me") if not w.pulled and w.end == 1999 and w.done == 256]
    assert len(raced) == 1 and raced[0].todo == 1999 - 256, backlog.ahead("me")
    for key in (0, 1, 2, "d", "r"):
        backlog.finish(key)
    assert len(backlog) == 0
    # muser decode: no backlog, no queue
    assert costs.predict(tokens=1000, held=0, producer=None)["parts"]["local"]["consumer_queue"] == 0


def test_the_share_of_the_cores_slows_the_engine_work_and_not_the_producers(monkeypatch):
    """Another process on the same cores (two services pinned to one core, a laptop's other
    work) slows the consumer's engine: its predicted engine work (local prefill, the queue
    ahead, install, first step) is divided by the share it gets; the producer's parts are not.
    What it learns meanwhile is kept as with the cores its own."""
    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    costs = CostModel()  # its share from its turns only (no look at the machine: its load is not this test's)
    _even(costs, "p:1")
    whole = costs.predict(tokens=1000, held=0, producer="p:1")
    assert whole["share"] == 1.0 and whole["choice"] == "local", whole
    for _ in range(40):  # whole seconds on the engine, its thread waiting for the core as long as it ran: half
        costs.share.sample(1.0, 0.5, 0.5)
    half = costs.predict(tokens=1000, held=0, producer="p:1")
    assert half["share"] == pytest.approx(0.5)
    for part in ("local_prefill", "first_step"):
        assert half["parts"]["local"][part] == pytest.approx(2 * whole["parts"]["local"][part]), half["parts"]
    for part in ("install", "first_step"):
        assert half["parts"]["remote_whole"][part] == pytest.approx(2 * whole["parts"]["remote_whole"][part])
    for part in ("producer_queue", "producer_compute", "wire"):
        assert half["parts"]["remote_whole"][part] == pytest.approx(whole["parts"]["remote_whole"][part])
    assert half["choice"] == "remote_whole", half  # the producer is now the faster path
    got = route(costs, tokens=1000, held=0, producer="p:1")
    assert got.ask and got.share == pytest.approx(0.5), got
    before = costs.local.seconds(0, 999)
    costs.observe(held=0, rows=999, prefill_s=2 * before, local=True)  # measured at half the core: as fast as before
    assert costs.local.seconds(0, 999) == pytest.approx(before)
    costs.share.at -= 3 * SHARE_STALE_S  # the engine idle for long: the other work may be over
    assert costs.share.now() == 1.0
    assert CpuShare().now() == 1.0  # never sampled (``muser decode``: one request, alone)


def test_a_turn_that_computes_at_half_the_core_measures_half(tmp_path):
    """The share measured from real turns (:class:`Turns` ``on_hold``: the holding thread's run and
    runnable-wait time): a holder that blocks (an engine computing elsewhere, a sleep) says nothing
    of the cores (the share stays 1, whatever the engine); one that computes on a core another
    process also spins on gets about half (a child process pinned to the same core, both pinned by
    this test's subprocess); and, the engine idle, a look at the machine (``/proc/stat``, a serving
    consumer's) says the same. Linux (``/proc/thread-self/schedstat``): elsewhere the share is 1."""
    import os
    import sys

    from muser_cli.consumer.turns import thread_sched

    share = CpuShare()
    turns = Turns(on_hold=share.sample)
    for _ in range(3):
        turns.acquire()
        threading.Event().wait(0.1)
        turns.release()
    # Not exactly 1: a thread woken from its sleep may wait a few milliseconds for a core on a
    # loaded machine, and that wait is (rightly) contention. A holder counted as computing for its
    # whole hold (wall time, not run and runnable wait) would give about 0.7 here.
    assert share.now() > 0.9, share.value
    if not hasattr(os, "sched_setaffinity") or thread_sched() is None:
        pytest.skip("no CPU affinity or scheduler statistics on this platform: the shared-core half is Linux-only")
    script = tmp_path / "share.py"
    script.write_text("""
import os, subprocess, sys, time
from muser_cli.consumer.cpushare import CpuShare
from muser_cli.consumer.turns import Turns
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
spin = "import os\\nos.sched_setaffinity(0, {%d})\\nprint(flush=True)\\nwhile True: pass" % core
hog = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
try:
    hog.stdout.readline()  # it spins (a loaded machine may take long to start it)
    time.sleep(0.2)
    share = CpuShare()
    turns = Turns(on_hold=share.sample)
    for _ in range(30):
        turns.acquire()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
            pass
        turns.release()
    idle = CpuShare(look=True)
    idle.now()  # the first look
    time.sleep(0.6)  # the engine idle, the other process spinning on its core
    from muser_cli.consumer.cpushare import cores_busy_s
    print(share.now(), idle.now(), int(bool(cores_busy_s({core}))))
finally:
    hog.kill()
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    turns_share, idle_share, can_look = (float(x) for x in r.stdout.split())
    assert turns_share < 0.8, r.stdout  # about half: the other process took the rest
    if can_look:  # (a virtualized /proc/stat that counts no busy time cannot be looked at)
        assert idle_share < 0.8, r.stdout  # idle, the machine's look: one core kept busy by another leaves half


def test_the_link_rate_is_kept_per_producer(tmp_path):
    """A pull's measured link rate is that producer's: another producer is predicted with its
    own probe first, and with the rate of any producer's pulls only without one."""
    with home_env(tmp_path / "home"):
        costs = CostModel()
        costs.observe(held=0, rows=100, local=False, pack_bytes=10_000_000, wire_s=1.0, shipped_rows=100,
                      producer="a:1")
        assert costs.link_for("a:1") == (pytest.approx(10e6), "pulls")
        assert costs.link_for("b:2") == (pytest.approx(10e6), "pulls_any")
        assert note_link("b:2", down_Bps=3e6)
        assert costs.link_for("b:2") == (3e6, "probe")
        again = CostModel()
        again.load_json(json.loads(json.dumps(costs.to_json())))
        assert again.link_for("a:1") == (pytest.approx(10e6), "pulls")
        assert again.producers["a:1"].known is False  # a link alone says nothing of its compute


def test_the_split_still_adds_up_with_a_queue():
    split = budget_split(ttft_s=2.0, consumer_queue_s=0.7, remote=False, lane_s=0.7, serving_s=None, end_s=None,
                         rows_ready_s=None, local_prefill_s=1.0)
    assert math.isclose(sum(split.values()), 2.0, abs_tol=1e-5), split
    assert split["consumer_queue"] == pytest.approx(0.7) and split["local_prefill"] == pytest.approx(1.0)


def test_a_damaged_links_file_is_ignored(tmp_path):
    with home_env(tmp_path / "home"):
        from muser_cli import paths

        assert probed_link("127.0.0.1:9") is None
        paths.data_dir().mkdir(parents=True, exist_ok=True)
        (paths.data_dir() / LINKS_FILE).write_text("{not json")
        assert probed_link("127.0.0.1:9") is None
        assert CostModel().link_for("127.0.0.1:9") == (COLD_LINK_BPS, "cold")
        assert note_link("127.0.0.1:9", down_Bps=5e6)  # a damaged file is replaced
        assert probed_link("127.0.0.1:9") == 5e6
        assert json.loads((paths.data_dir() / LINKS_FILE).read_text())["v"] == 1


# ----------------------------------------------------------------------------- real processes
def _ask(worker, prompt: str):
    from muser_cli.service.api import parse_ask
    from muser_cli.service.worker import Job

    done = threading.Event()
    got: dict = {}

    def emit(kind, payload):
        if kind in ("done", "error"):
            got[kind] = payload
            done.set()

    job = Job(parse_ask({"prompt": prompt, "max_tokens": 3, "temperature": 0}, "completion", default_max_tokens=3),
              emit)
    worker.submit(job)
    return job, done, got


@pytest.fixture
def served(lane, monkeypatch):
    """The service's engine worker in this process, on the lane's consumer home, asking the
    lane's producer (MUSER_ROUTE unset: the default, fastest); its cost model fresh (not the
    process's shared one) with both machines known to compute alike."""
    from muser_cli.service.metrics import ConsumerMetrics
    from muser_cli.service.worker import Config, EngineWorker

    monkeypatch.delenv("MUSER_ROUTE", raising=False)
    address = lane["producer"].address
    with home_env(lane["nodes"].consumer_home):
        worker = EngineWorker(Config(model=lane["model"], dtype="float32", threads=1, reuse=False, max_batch=4,
                                     producers=(address,), chunk_tokens=CHUNK, turn_memory_mb=0,
                                     prefill_deadline=HANG_S), ConsumerMetrics())
        worker.costs = CostModel()  # not saved: the shared file and the process's model untouched
        worker.turns.on_hold = None  # the test's own holds are not compute, nor the machine's load its subject
        _even(worker.costs, address, tps=200.0)
        try:
            yield worker, address
        finally:
            worker.close()


def test_a_long_prompt_stays_here_when_idle_and_goes_to_the_producer_when_busy(served):
    worker, address = served
    _, done, idle = _ask(worker, LONG)  # idle: here is no slower, and it saves the connection
    assert done.wait(HANG_S) and "done" in idle, idle
    s = idle["done"]
    assert s["source"] == "local" and s["route"]["choice"] == "local", s
    assert s["route"]["parts"]["local"]["consumer_queue"] == 0, s["route"]
    _even(worker.costs, address, tps=200.0)  # what the idle answer taught it, forgotten
    worker.turns.acquire()  # the engine busy: the prompt ahead waits for its turns with all its chunks
    try:
        first, done_first, ahead = _ask(worker, LONG + " The first part.")  # nothing ahead of it yet: local
        assert wait_for(lambda: first.state is not None and first.state.route is not None, HANG_S)
        assert wait_for(lambda: sum(w.todo for w in worker.backlog.ahead()) >= 150, HANG_S), worker.backlog.ahead()
        _, done, busy = _ask(worker, LONG + " The last part.")
        assert wait_for(lambda: any(w.pulled for w in worker.backlog.ahead()), HANG_S)  # routed: asked the producer
    finally:
        worker.turns.release()
    assert done_first.wait(HANG_S) and "done" in ahead, ahead
    assert done.wait(HANG_S) and "done" in busy, busy
    assert ahead["done"]["source"] == "local" and ahead["done"]["route"]["choice"] == "local", ahead["done"]
    s = busy["done"]
    parts = s["route"]["parts"]
    assert s["route"]["choice"] == "remote_whole" and s["source"] == "handoff", s
    assert parts["local"]["consumer_queue"] > 0.5, parts  # the one ahead: 3 chunks of 64 at 200 tokens/s
    assert parts["remote_whole"]["consumer_queue"] < parts["local"]["consumer_queue"], parts
    assert s["route"]["paths"]["local"] > idle["done"]["route"]["paths"]["local"], (s["route"], idle["done"]["route"])
    split = s["budget"]["split_ms"]
    assert sum(split.values()) == pytest.approx(s["ttft_ms"], abs=0.05), split
    assert len(worker.backlog) == 0
    assert worker.costs.step_s is None or worker.costs.step_s > 0


def test_the_probed_link_rate_is_used_before_any_pull(lane, tmp_path):
    """``muser probe-link`` to the producer keeps its measured rate; a cost model that has not
    pulled yet predicts the wire with it (``link``: probe), and with its pulls' rate once it has."""
    address = lane["producer"].address
    env = env_for(lane["nodes"].consumer_home)
    r = subprocess.run(muser_cmd("probe-link", address, "--seconds", "0.3", "--json"), env=env, capture_output=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    down = json.loads(r.stdout)["down_Bps"]
    with home_env(lane["nodes"].consumer_home):
        assert probed_link(address) == pytest.approx(down)
        costs = CostModel()
        costs.row_bytes = 1000.0
        got = costs.predict(tokens=4001, held=0, producer=address)
        assert got["link"] == "probe", got
        assert costs.link_for(address) == (pytest.approx(down), "probe")
        assert costs.predict(tokens=10, held=0, producer="127.0.0.1:1")["link"] == "cold"  # never probed
        costs.observe(held=0, rows=100, local=False, pack_bytes=10_000, wire_s=0.5, shipped_rows=100,
                      producer=address)
        assert costs.link_for(address) == (pytest.approx(20_000.0), "pulls")
