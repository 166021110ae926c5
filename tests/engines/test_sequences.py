"""A consumer's sequence handles (#37 item 2): ``open`` installs rows and computes the first step
once, ``fork`` gives more sequences from it (each its own cache copy and sampling), ``run``
steps each to its end. On torch and MLX, on a plain and a sliding family: n choices from one open
compute one first forward and give the tokens n separate decodes give (greedy, and seeded);
``decode`` itself is open then run; a request's ``n`` choices (``consumer.decode``'s ``more``) go
through one open and one fork, choice i seeded seed + i as before."""

from __future__ import annotations

import pytest

from muser_cli.engines.base import Consumer, Sampling
from muser_cli.engines.sequence import run_together
from muser_cli.errors import UsageError

NEW = 10
SAMPLINGS = [Sampling(), Sampling(), Sampling(temperature=0.9, seed=7), Sampling(temperature=0.7, top_p=0.8, seed=8),
             Sampling(presence_penalty=1.0, logit_bias=((5, 3.0),))]


def _engine(name: str, info):
    if name == "mlx":
        from muser_cli.engines.mlx import blas as mlx_blas

        mlx_blas.ensure_fast_blas()
        pytest.importorskip("mlx.core", reason="mlx not installed")
        pytest.importorskip("mlx_lm", reason="mlx-lm not installed")
        from muser_cli.engines.mlx.engine import MLXEngine

        return MLXEngine(info, dtype="float32", threads=1)
    from muser_cli.engines.torch.engine import TorchEngine

    return TorchEngine(info, dtype="float32", threads=1)


class _Counted:
    """The engine's model, its calls counted (every forward: a first step or a decode step)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(params=["torch", "mlx"])
def engine_name(request):
    return request.param


@pytest.mark.parametrize("family", ["llama", "cohere2"])  # cohere2: sliding layers (window 8) past their window
def test_n_choices_from_one_open_are_n_separate_decodes(engine_name, family, tiny_family):
    eng = _engine(engine_name, tiny_family(family))
    assert isinstance(eng, Consumer)
    ids = list(range(3, 30))
    layers = eng.prefill(ids[:-1])
    solo = [eng.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW, sampling=s,
                       stop_on_eos=False).token_ids for s in SAMPLINGS]
    counted = _Counted(eng.model)
    eng.model = counted
    seq = eng.open(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW, sampling=SAMPLINGS[0],
                   stop_on_eos=False)
    forks = eng.fork(seq, SAMPLINGS[1:])
    assert counted.calls == 1  # one install, one first forward for all five
    got = run_together(eng, [seq, *forks], [None] * len(SAMPLINGS))
    assert [r.token_ids for r in got] == solo
    assert counted.calls == 1 + len(SAMPLINGS) * (NEW - 1)
    with pytest.raises(UsageError, match="forks before it runs"):
        eng.fork(seq, [Sampling()])


def test_decode_is_open_then_run(engine_name, tiny_llama):
    eng = _engine(engine_name, tiny_llama)
    ids = list(range(3, 20))
    layers = eng.prefill(ids[:-1])
    given: list[int] = []
    want = eng.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW, stop_on_eos=False,
                      on_token=given.append)
    seq = eng.open(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW, stop_on_eos=False)
    assert seq.picked and (seq.first == want.token_ids[0] or engine_name == "mlx")  # mlx reads it as it runs
    out = eng.run(seq)
    assert out.token_ids == want.token_ids == given and out.ttft_s > 0 and out.stats["stop_reason"] == "length"
    assert eng.run(eng.open(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=0)).token_ids == []
    with pytest.raises(UsageError, match="runs once"):
        eng.run(seq)


def test_a_requests_n_choices_open_once_and_fork(tiny_llama, monkeypatch):
    from muser_cli.consumer.decode import Extra, decode
    from muser_cli.engines.torch.engine import TorchEngine

    eng = TorchEngine(tiny_llama, dtype="float32", threads=1)
    calls = {"open": 0, "fork": 0}
    for name in calls:
        def counted(self, *args, _name=name, _real=getattr(TorchEngine, name), **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(TorchEngine, name, counted)
    kw = dict(model=str(tiny_llama.path), prompt="the sequences fork here", max_new_tokens=8, dtype="float32",
              resident=eng, reuse=False)
    seed = 1234
    extras = [Extra(Sampling(temperature=0.8, seed=seed + i)) for i in (1, 2)]
    first = decode(None, sampling=Sampling(temperature=0.8, seed=seed), more=extras, **kw)
    assert calls == {"open": 1, "fork": 1}
    for i, extra in enumerate(extras, 1):
        assert extra.error is None
        alone = decode(None, sampling=Sampling(temperature=0.8, seed=seed + i), **kw)
        assert extra.result.token_ids == alone.token_ids, i
    assert first.token_ids == decode(None, sampling=Sampling(temperature=0.8, seed=seed), **kw).token_ids
    greedy = [Extra(Sampling()) for _ in range(2)]
    one = decode(None, more=greedy, **kw)
    assert all(e.result.token_ids == one.token_ids for e in greedy)


def test_forks_step_together_in_the_running_batch(engine_name, tiny_llama):
    """With the batched decode on, forks run on threads of their own join one batch (the stepper:
    no batcher of their own); float32 on a tiny model: each gives its solo tokens."""
    from engine_kit import run_queued_together
    from muser_cli.consumer.turns import TurnEngine, Turns

    eng = _engine(engine_name, tiny_llama)
    ids = list(range(3, 24))
    layers = eng.prefill(ids[:-1])
    samplings = SAMPLINGS[1:4]
    solo = [eng.decode(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW, sampling=s,
                       stop_on_eos=False).token_ids for s in samplings]
    turns = Turns()
    eng.batch_decode(turns)
    te = TurnEngine(eng, turns)
    try:
        seq = te.open(layers, rows=len(ids) - 1, next_tokens=ids[-1:], max_new_tokens=NEW, sampling=samplings[0],
                      stop_on_eos=False)
        seqs = [seq, *te.fork(seq, samplings[1:])]
        out: list = [None] * len(seqs)

        def one(i: int) -> None:
            out[i] = te.run(seqs[i])

        run_queued_together(turns, len(seqs), one)
    finally:
        eng.close()
    assert [r.token_ids for r in out] == solo
    assert max(r.stats["batch_peak"] for r in out) > 1
