"""Preemption at chunk boundaries (issue #39 item 2): a resident producer computing a long
prompt lets a short request with an earlier deadline go first, between two chunks; the long
stream pauses and its rows stay exact.

In process: the real :class:`Admission` (the server's), the real resident producer on tiny
models (torch and MLX, float32), two request threads as the server runs them -- one holding
the turn and computing, one waiting for it. The waiting request is queued before the long one
computes its first chunk, so the pause happens at its first boundary, with no race. The
packs are compared byte for byte with each prompt computed alone.
"""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

from muser_cli.handoff.pull.admission import PREEMPT_MAX_S, Admission
from muser_cli.handoff.wire.pull_protocol import PullRequest, new_request_id

CHUNK = 8
LONG = tuple(range(5, 70))  # 64 rows: eight chunks
SHORT = tuple(range(80, 90))


def pull_request(info, ids) -> PullRequest:
    return PullRequest(key_id="k1", request_id=new_request_id(), issued_at_ms=int(time.time() * 1000),
                       consumer="consumer", token_ids=tuple(ids), tokenizer_fingerprint=info.tokenizer_fingerprint,
                       model_fingerprint=info.fingerprint, chunk_tokens=CHUNK, dtype="float32")


def rows_of(buf: io.BytesIO):
    from muser_cli.kvpack import read_pack

    return read_pack(io.BytesIO(buf.getvalue())).layers


def same_rows(got, want) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.first_row == b.first_row, i
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.shape == y.shape and x.tobytes() == y.tobytes(), f"layer {i} differs"


def alone(prod, info, ids):
    buf = io.BytesIO()
    prod.run(pull_request(info, ids), buf)
    return rows_of(buf)


# ----------------------------------------------------------------------------- the rule
def queued(adm: Admission, n: int) -> None:
    end = time.monotonic() + 30
    while adm.waiting() != n and time.monotonic() < end:
        time.sleep(0.005)
    assert adm.waiting() == n


def test_who_may_pass_a_running_request():
    """Only a request with an earlier deadline and a known compute of at most PREEMPT_MAX_S
    passes; a paused request takes its turn back before later deadlines and after earlier
    ones, and a promise made meanwhile still counts its remaining work."""
    adm = Admission(1)
    now = time.monotonic()
    assert adm.enter(False, who="A", deadline=now + 100, cost_s=2.0)
    turn = adm.turn()
    assert turn is not None and turn.deadline == now + 100
    for due, cost, passes in [(200, 0.01, False), (10, None, False), (10, PREEMPT_MAX_S * 2, False),
                              (10, 0.01, True)]:
        stop = threading.Event()
        t = threading.Thread(target=adm.wait, args=(False, stop.is_set),
                             kwargs={"poll": 0.01, "who": "B", "deadline": now + due, "cost_s": cost})
        t.start()
        queued(adm, 1)
        assert adm.preempt_for(turn) is passes, (due, cost)
        stop.set()
        t.join(30)
        queued(adm, 0)
    assert adm.yield_turn(turn) is None  # nobody waits: it goes on

    order: list[str] = []
    gates = {who: threading.Event() for who in "SEL"}

    def waiter(who: str, due: float, cost: float | None) -> threading.Thread:
        def run() -> None:
            assert adm.wait(False, lambda: False, poll=0.01, who=who, deadline=now + due, cost_s=cost)
            order.append(who)
            gates[who].wait(30)
            adm.leave(False)

        t = threading.Thread(target=run)
        t.start()
        return t

    threads = [waiter("L", 200, 0.01), waiter("S", 5, 0.01)]
    queued(adm, 2)
    t_before = time.monotonic()
    before, _ = adm.expected_start("X", cost_s=0.0)
    paused = threading.Thread(target=lambda: order.append("A" if adm.yield_turn(turn) else "A?"))
    paused.start()
    end = time.monotonic() + 30
    while order != ["S"] and time.monotonic() < end:
        time.sleep(0.005)
    assert order == ["S"]  # the short one computes; A is paused, L waits
    during, _ = adm.expected_start("X", cost_s=0.0)
    # A's remaining ~2 s still counts (not counted, it would be about 0.02): paused, it is less
    # than ``before`` only by what A ran until it paused -- at most the time since, however long a
    # loaded machine made that -- and by the 0.02 s of S and L that ``before`` counted.
    assert during >= before - 0.05 - (time.monotonic() - t_before), (before, during)
    threads.append(waiter("E", 50, None))  # arrives while A is paused, with an earlier deadline than A's
    queued(adm, 2)
    gates["S"].set()
    while order != ["S", "E"] and time.monotonic() < end:
        time.sleep(0.005)
    assert order == ["S", "E"]  # an earlier deadline than the paused one's goes first
    gates["E"].set()
    paused.join(30)
    assert order == ["S", "E", "A"]  # then A takes its turn back, before the later deadline
    assert turn.paused == 1 and turn.paused_s > 0 and adm.turn() is turn  # running again, entered by this thread
    adm.leave(False)
    gates["L"].set()
    for t in threads:
        t.join(30)
    assert order == ["S", "E", "A", "L"]


# ----------------------------------------------------------------------------- exact rows
@pytest.fixture(params=["torch", "mlx"])
def engine(request):
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    return request.param


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_hybrid"])
def test_a_short_request_passes_a_long_one_and_both_packs_equal_their_prompts_alone(request, model, engine):
    from muser_cli.pulllane.producer import ResidentProducer

    info = request.getfixturevalue(model)
    prod = ResidentProducer(str(info.path), engine=engine, dtype="float32", history=False)
    assert prod.preempts
    want_long, want_short = alone(prod, info, LONG), alone(prod, info, SHORT)
    prod = ResidentProducer(str(info.path), engine=engine, dtype="float32", history=False)  # no memory of those

    adm = Admission(prod.max_concurrent)
    now = time.monotonic()
    assert adm.enter(False, who="long-consumer")  # no budget: no deadline
    turn = adm.turn()
    assert turn is not None
    events: list[str] = []
    short_buf = io.BytesIO()

    def short_request() -> None:  # the server's session thread for the short request
        assert adm.wait(False, lambda: False, poll=0.02, who="short-consumer", deadline=now + 60,
                        cost_s=prod.estimate(request_short))
        try:
            events.append("short computes")
            prod.run(request_short, short_buf)
            events.append("short done")
        finally:
            adm.leave(False)

    request_short = pull_request(info, SHORT)
    waiting = threading.Thread(target=short_request)
    waiting.start()
    end = time.monotonic() + 30
    while adm.waiting() != 1 and time.monotonic() < end:
        time.sleep(0.005)
    assert adm.waiting() == 1

    def between() -> None:
        if adm.yield_turn(turn) is not None:
            events.append("long resumed")

    long_buf = io.BytesIO()
    stats = prod.run(pull_request(info, LONG), long_buf, pause=between)
    events.append("long done")
    waiting.join(60)
    adm.leave(False)

    assert events == ["short computes", "short done", "long resumed", "long done"], events
    assert turn.paused == 1 and stats["paused_s"] > 0
    assert stats["prefill_s"] < stats["paused_s"] + 60  # the pause is not counted as compute
    same_rows(rows_of(long_buf), want_long)
    same_rows(rows_of(short_buf), want_short)
