"""The one consumer lane (issue #37 item 1): ``muser decode``, ``decode --serve`` and ``muser
batch`` answer a request through :func:`muser_cli.consumer.lane.answer`, and the sequence it
holds — decode from the producer's pack; a pack a gate refuses blamed on its producer and the
request computed here; the pull joined and the pool told — is written nowhere else."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

from muser_cli.consumer.lane import Source, answer
from muser_cli.consumer.pool import ProducerPool
from muser_cli.errors import DataError, SpotCheckFailed

ROOT = Path(__file__).resolve().parents[2]
CALLERS = ("commands/decode.py", "muser_cli/service/worker.py", "muser_cli/batch/runner.py")


def _calls_answer(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) == "answer"
               for n in ast.walk(tree))


@pytest.mark.parametrize("caller", CALLERS)
def test_every_way_of_answering_calls_the_one_lane(caller):
    assert _calls_answer(ROOT / caller), f"{caller} does not answer through muser_cli.consumer.lane.answer"


def test_no_other_module_catches_a_refused_pack_around_decode():
    """The fallback sequence (a DataError from decode -> blame -> decode again locally) is the
    lane's alone: no other module wraps a call of ``decode``/``run`` in ``except DataError``."""
    found = []
    for path in [*(ROOT / "muser_cli").rglob("*.py"), *(ROOT / "commands").glob("*.py")]:
        if path.name == "lane.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Try):
                continue
            catches = any(h.type is not None and "DataError" in ast.unparse(h.type) for h in node.handlers)
            calls = {c.func.id for s in node.body for c in ast.walk(s)
                     if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            if catches and calls & {"decode", "run"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _state(pool: ProducerPool, addr: str):
    return next(s for s in pool.states if s.address == addr)


class _Pull:
    """What the lane needs of a pull on a thread: join, is_alive, error."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.joined = error, False

    def join(self, timeout=None) -> None:
        self.joined = True

    def is_alive(self) -> bool:
        return False


def test_a_refused_pack_is_blamed_on_its_producer_and_the_request_computed_here():
    pool = ProducerPool(["127.0.0.1:7001", "127.0.0.1:7002"])
    addr = pool.pick()
    runs = []

    def run(src, why):
        runs.append((src is not None, why))
        if src is not None:
            raise SpotCheckFailed("layer 3 off by 0.4")
        return "local answer"

    pull = _Pull()
    got = answer(Source(io.BytesIO(b"pack"), addr, f"nothing from {addr}", live=pull), run, pool=pool)
    assert got.out == "local answer" and isinstance(got.refused, SpotCheckFailed) and not got.from_producer
    assert runs == [(True, f"nothing from {addr}"), (False, f"the pack from {addr} was refused: layer 3 off by 0.4")]
    assert pull.joined
    state = _state(pool, addr)
    assert state.busy == 0 and "its pack was refused" in (state.gone or "")
    assert pool.pick() != addr  # dropped: the other producer is asked next


def test_a_refusal_that_may_not_be_replaced_is_the_answer_and_the_pool_still_hears_of_it():
    pool = ProducerPool(["127.0.0.1:7001"])
    addr = pool.pick()

    def run(src, why):
        raise DataError("another prompt's pack")

    with pytest.raises(DataError):
        answer(Source(io.BytesIO(b"pack"), addr, "", live=_Pull()), run, pool=pool, recompute=lambda exc: False)
    assert _state(pool, addr).busy == 0


def test_a_good_pack_counts_for_its_producer_and_a_failed_pull_against_it():
    pool = ProducerPool(["127.0.0.1:7001"])
    addr = pool.pick()
    got = answer(Source(io.BytesIO(b"pack"), addr, "", live=_Pull()), lambda src, why: "from the pack", pool=pool)
    assert got.out == "from the pack" and got.from_producer and got.pull_error is None
    assert _state(pool, addr).served == 1
    addr = pool.pick()
    lost = ConnectionResetError("the producer went away")
    got = answer(Source(io.BytesIO(b""), addr, "nothing", live=_Pull(lost)), lambda src, why: "computed", pool=pool)
    assert got.pull_error is lost
    assert _state(pool, addr).last_error == "the producer went away"
