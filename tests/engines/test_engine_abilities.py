"""Engine roles and abilities are declared in the type, never probed (#26 part 3, #37 item 2).

Each engine is a package of its own (``engines/torch``, ``engines/mlx``, ``engines/vllm``).
Whether it prefills or decodes at all is its role, a base class
(:class:`~muser_cli.engines.base.Producer`, :class:`~muser_cli.engines.base.Consumer`): torch
and mlx are both, vllm a producer only. What an engine can do beyond its roles' required
methods is a class attribute with a default on the role, and the optional methods have defaults
there that refuse by name. Nothing here loads a framework: the registry's classes import theirs
lazily (the vllm engine's module imports no vllm).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from muser_cli.engines.base import Consumer, DecodeResult, Producer
from muser_cli.engines.registry import ENGINE_NAMES, consumer_class, engine_class
from muser_cli.engines.sequence import Sequence
from muser_cli.errors import UsageError
from muser_cli.model.info import ModelInfo

ROOT = Path(__file__).resolve().parents[2]
ABILITIES = {"resumes_prefill", "streams_prefill", "recomputes_at", "batches_prefill", "takes_options"}


class Minimal(Producer, Consumer):
    """An engine of both roles with only their required methods."""

    name = "minimal"

    def prefill(self, token_ids, *, chunk_tokens=512, progress=None):
        return []

    def open(self, layers, *, rows, next_tokens, max_new_tokens, **kw):
        return Sequence(rows=rows, max_new_tokens=max_new_tokens, eos=(), start=0.0)

    def fork(self, seq, samplings):
        return [Sequence(rows=seq.rows, max_new_tokens=seq.max_new_tokens, eos=(), start=0.0) for _ in samplings]

    def run(self, seq, on_token=None):
        seq.take()
        return DecodeResult([], 0.0, 0.0)

    def recompute(self, layers, *, rows, token_ids):
        return []


def test_roles_are_types():
    roles = {name: {r for r, cls in (("producer", Producer), ("consumer", Consumer)) if issubclass(engine_class(name), cls)}
             for name in ENGINE_NAMES}
    assert roles == {"torch": {"producer", "consumer"}, "mlx": {"producer", "consumer"}, "vllm": {"producer"}}
    vllm = engine_class("vllm")
    assert not issubclass(vllm, Consumer) and "decode" not in vars(vllm)  # no decode stub: the role is absent
    for name in ("torch", "mlx"):
        assert consumer_class(name) is engine_class(name)
    with pytest.raises(UsageError, match="^the vllm engine is a producer only: it prefills and ships KV, it cannot "
                                         "recompute rows$") as refused:
        consumer_class("vllm", "recompute rows")
    assert "--engine torch" in (refused.value.hint or "")


def test_a_role_needs_its_methods():
    class Half(Consumer):
        name = "half"

        def recompute(self, layers, *, rows, token_ids):
            return []

    info = ModelInfo(path=Path("/nowhere"), name="m", fingerprint="x", tokenizer_fingerprint="y", architecture="a",
                     layers=(), max_positions=8)
    with pytest.raises(TypeError, match="open"):
        Half(info, dtype="float32", threads=1)  # type: ignore[abstract]
    eng = Minimal(info, dtype="float32", threads=1)
    assert isinstance(eng, Producer) and isinstance(eng, Consumer)
    assert eng.decode([], rows=0, next_tokens=[1], max_new_tokens=2).token_ids == []  # decode: open, then run
    seq = eng.open([], rows=0, next_tokens=[1], max_new_tokens=2)
    eng.run(seq)
    with pytest.raises(UsageError, match="runs once"):
        eng.run(seq)


def test_each_engine_lives_in_its_own_package():
    for name in ENGINE_NAMES:
        cls = engine_class(name)
        assert cls.__module__ == f"muser_cli.engines.{name}.engine"
        assert cls.name == name
        assert (ROOT / "muser_cli" / "engines" / name / "__init__.py").is_file()


def test_abilities_are_declared_per_engine():
    got = {name: {a for a in ABILITIES if getattr(engine_class(name), a, False)} for name in ENGINE_NAMES}  # a role it lacks: none of its abilities
    assert got == {"torch": {"resumes_prefill", "streams_prefill", "recomputes_at"},
                   "mlx": {"resumes_prefill", "streams_prefill"},
                   "vllm": {"batches_prefill", "takes_options"}}


def test_a_minimal_engine_gets_the_defaults_and_refuses_by_name():
    info = ModelInfo(path=Path("/nowhere"), name="m", fingerprint="x", tokenizer_fingerprint="y", architecture="a",
                     layers=(), max_positions=8)
    eng = Minimal(info, dtype="float32", threads=1)
    assert not any(getattr(eng, a) for a in ABILITIES) and not eng.batches_decode and not eng.shapes_logits
    assert eng.max_model_len is None and eng.ring_extra == 0 and eng.producer_info() == {}
    eng.close()
    eng.warm_up()
    calls = [lambda: eng.recompute_at([], rows=1, positions=[0], token_ids=[1]),
             lambda: eng.batch_decode(None),
             lambda: eng.prefill_many([[1, 2]]),
             lambda: eng.set_max_batch(2),
             lambda: eng.prefill_from([], rows=0, token_ids=[1])]
    for call in calls:
        with pytest.raises(UsageError, match="the minimal engine cannot"):
            call()


def test_the_library_does_not_probe_engines():
    """Outside the engine packages (which probe their frameworks' objects, not muser's engines)."""
    probe = re.compile(r"\b(hasattr|getattr)\(\s*(self\.)?(eng|engine|loaded)\b")
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in ("muser_cli", "commands") for p in sorted((ROOT / base).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line) and "engines" not in p.relative_to(ROOT).parts]
    assert hits == []


def test_engine_options_go_only_to_an_engine_that_takes_them():
    from muser_cli.engines.registry import get_engine

    info = ModelInfo(path=Path("/nowhere"), name="m", fingerprint="x", tokenizer_fingerprint="y", architecture="a",
                     layers=(), max_positions=8)
    for name in ("torch", "mlx"):
        with pytest.raises(UsageError, match=f"the {name} engine takes no engine options"):
            get_engine(name, info, dtype="float32", threads=1, options={"enforce_eager": True})


class Batching(Minimal):
    """A stand-in for vLLM's abilities: batches prefills, has its own prompt limit."""

    name = "batching"
    batches_prefill = True
    max_model_len = 20

    def set_max_batch(self, n: int) -> None:
        self.max_batch = n


def test_the_resident_producer_reads_the_declared_abilities(tiny_llama):
    from muser_cli.handoff.wire.pull_protocol import PullRequest
    from muser_cli.handoff.push.spool import Refusal
    from muser_cli.pulllane.producer import ResidentProducer

    def producer(eng):
        return ResidentProducer(str(tiny_llama.path), engine=eng.name, dtype="float32", loaded=eng, max_batch=4)

    plain = producer(Minimal(tiny_llama, dtype="float32", threads=1))
    batching = producer(Batching(tiny_llama, dtype="float32", threads=1))
    assert plain.max_concurrent == 1 and batching.max_concurrent == 4 and batching.engine.max_batch == 4

    def request(n: int) -> PullRequest:
        return PullRequest(key_id="k", request_id="r", issued_at_ms=0, consumer="c", token_ids=tuple(range(3, 3 + n)),
                           tokenizer_fingerprint=tiny_llama.tokenizer_fingerprint,
                           model_fingerprint=tiny_llama.fingerprint, chunk_tokens=16, dtype="float32")

    assert plain.check(request(30)).token_ids == tuple(range(3, 33))  # no limit of its own
    assert batching.check(request(20)).token_ids == tuple(range(3, 23))
    with pytest.raises(Refusal, match="exceed this producer's limit of 20") as refused:
        batching.check(request(21))
    assert refused.value.code == "too_large"
