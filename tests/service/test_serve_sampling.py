"""``decode --serve`` honours logprobs / top_logprobs, ``n``, ``seed``, ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` (issue #38, item 3), and the extensions ``top_k``,
``min_p`` and ``repetition_penalty`` (issue #49, item 3): a real server on 127.0.0.1, the
real ``openai`` client, the torch and the MLX engine, a tiny model in float32.

The truth is computed here with transformers on the same model: each step's raw logits for the
prompt and the tokens before it; the logprobs the server gives are their log-softmax (within
1e-4), the greedy token the largest logit after OpenAI's penalties and bias."""

from __future__ import annotations

import math

import pytest

from serve_kit import DecodeServer  # first: the module skipped without Starlette or prometheus_client

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from muser_cli.model.tokens import decode_text, encode_prompt  # noqa: E402

PROMPT = "The committee met on a grey Tuesday to decide where the new bridge would go, and"
CHAT = [{"role": "user", "content": "Where should the new bridge go, and why?"}]
NEW = 8
ENGINES = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("mlx_lm"), reason="mlx-lm not installed"))]


@pytest.fixture(scope="module", params=ENGINES)
def server(request, tmp_path_factory, tiny_llama):
    srv = DecodeServer(tmp_path_factory.mktemp("home"), "-m", str(tiny_llama.path), "--dtype", "float32",
                       "--threads", "1", "--no-reuse", "--max-batch", "4", "--engine", request.param)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def truth(tiny_llama):
    """transformers' raw logits, float32: ids -> the next token's logits (vocab,)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama.path), dtype=torch.float32)
    model.eval()
    memo: dict[tuple, torch.Tensor] = {}

    def logits(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                memo[key] = model(torch.tensor([ids])).logits[0, -1].float()
        return memo[key]

    return logits


def reference(info, truth, ids: list[int], n: int, *, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """Greedy tokens by OpenAI's definition (penalties over the generated tokens, then the bias)."""
    tokens: list[int] = []
    counts: dict[int, int] = {}
    for _ in range(n):
        row = truth(ids + tokens).clone()
        for t, c in counts.items():
            row[t] -= frequency * c + presence
        for t, b in (bias or {}).items():
            row[int(t)] += b
        token = int(torch.argmax(row))
        tokens.append(token)
        counts[token] = counts.get(token, 0) + 1
        if token in info.eos_token_ids:
            break
    return tokens


def text_of(info, token: int) -> str:
    return decode_text(info, [token], skip_special_tokens=False)


def check_logprobs(info, truth, ids, tokens, got, *, top: int) -> None:
    """``got``: [(token text, logprob, [(text, logprob), ...] or the legacy {text: logprob})]
    against the truth (the legacy dict keeps one entry of tokens whose texts are the same)."""
    assert [g[0] for g in got] == [text_of(info, t) for t in tokens]
    for i, (token, (_, lp, tops)) in enumerate(zip(tokens, got)):
        row = torch.log_softmax(truth(ids + tokens[:i]), dim=-1)
        assert abs(lp - float(row[token])) < 1e-4, (i, lp, float(row[token]))
        want = [(text_of(info, int(t)), float(v)) for v, t in zip(*torch.topk(row, top))]
        if isinstance(tops, dict):
            tops, want = list(tops.items()), list(dict(want).items())
        assert [t for t, _ in tops] == [t for t, _ in want], i
        assert all(abs(v - w) < 1e-4 for (_, v), (_, w) in zip(tops, want)), i


# ----------------------------------------------------------------------------- logprobs
def test_chat_logprobs_are_the_models_log_softmax(server, tiny_llama, truth):
    ids = encode_prompt(tiny_llama, CHAT, chat=True)
    r = server.client().chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=0,
                                               logprobs=True, top_logprobs=5)
    assert r.usage.prompt_tokens == len(ids)
    tokens = reference(tiny_llama, truth, ids, NEW)
    content = r.choices[0].logprobs.content
    got = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content]
    check_logprobs(tiny_llama, truth, ids, tokens, got, top=5)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_completion_logprobs_legacy_shape_and_stream(server, tiny_llama, truth):
    ids = encode_prompt(tiny_llama, PROMPT, chat=False)
    client = server.client()
    # a frequency penalty shapes the pick, not the logprobs: those stay the model's own
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=3,
                                  frequency_penalty=1.5)
    tokens = reference(tiny_llama, truth, ids, NEW, frequency=1.5)
    lp = r.choices[0].logprobs
    got = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    check_logprobs(tiny_llama, truth, ids, tokens, got, top=3)
    texts = [text_of(tiny_llama, t) for t in tokens]
    assert lp.text_offset == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    # streamed: the chunks' logprobs, put together, are the whole answer's
    pieces, streamed = [], []
    for c in client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=3,
                                       frequency_penalty=1.5, stream=True):
        for ch in c.choices:
            pieces.append(ch.text)
            if ch.logprobs is not None:
                streamed += list(zip(ch.logprobs.tokens, ch.logprobs.token_logprobs))
    assert "".join(pieces) == r.choices[0].text
    assert streamed == list(zip(lp.tokens, lp.token_logprobs))


def test_streamed_chat_logprobs_equal_the_whole_answers(server):
    client = server.client()
    whole = client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=0,
                                           logprobs=True, top_logprobs=2)
    got = []
    for c in client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True):
        for ch in c.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                got += [(x.token, x.logprob, [t.token for t in x.top_logprobs]) for x in ch.logprobs.content]
    assert got == [(x.token, x.logprob, [t.token for t in x.top_logprobs]) for x in whole.choices[0].logprobs.content]


# ----------------------------------------------------------------------------- n and seed
def test_n_choices_are_seeded_and_reproducible(server):
    client = server.client()
    ask = {"model": "default", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0.7, "seed": 1234, "n": 3}
    a = client.completions.create(**ask)
    b = client.completions.create(**ask)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert NEW < a.usage.completion_tokens <= 3 * NEW
    # choice i is the one n: 1 gives with seed + i
    for i in range(3):
        one = client.completions.create(**{**ask, "n": 1, "seed": 1234 + i})
        assert one.choices[0].text == texts[i], i
    # streamed: every chunk names its choice; each choice's pieces make its text
    parts: dict[int, str] = {}
    ends: dict[int, str] = {}
    for c in client.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        for ch in c.choices:
            parts[ch.index] = parts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                ends[ch.index] = ch.finish_reason
        if c.usage is not None:
            assert c.usage.completion_tokens == a.usage.completion_tokens
    assert [parts[i] for i in range(3)] == texts and set(ends) == {0, 1, 2}


def test_chat_n_with_logprobs(server):
    r = server.client().chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=0.9,
                                               seed=7, n=2, logprobs=True, top_logprobs=1)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == len(c.message.content and c.logprobs.content)
        assert all(len(x.top_logprobs) == 1 and x.logprob <= 0 for x in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_same_seed_same_tokens(server):
    client = server.client()
    ask = {"model": "default", "prompt": PROMPT, "max_tokens": NEW, "temperature": 1.0}
    a = client.completions.create(**ask, seed=5).choices[0].text
    assert client.completions.create(**ask, seed=5).choices[0].text == a
    assert client.completions.create(**ask, seed=6).choices[0].text != a


# ----------------------------------------------------------------------------- penalties and bias
@pytest.mark.parametrize("kw", [{"presence_penalty": 1.5}, {"frequency_penalty": 2.0},
                                {"frequency_penalty": -1.0, "presence_penalty": 0.5}])
def test_penalties_follow_openais_definition(server, tiny_llama, truth, kw):
    ids = encode_prompt(tiny_llama, PROMPT, chat=False)
    client = server.client()
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=0, **kw)
    want = reference(tiny_llama, truth, ids, NEW, presence=kw.get("presence_penalty", 0.0),
                     frequency=kw.get("frequency_penalty", 0.0))
    assert r.choices[0].logprobs.tokens == [text_of(tiny_llama, t) for t in want]


def test_a_strong_frequency_penalty_stops_a_token_repeating(server, tiny_llama):
    """A bias makes token 123 the greedy pick at every step; a frequency penalty of 2 takes 2
    off it each time it was picked, so it stops coming once the bias is spent (3 times for +5)."""
    client = server.client()
    ask = {"model": "default", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0,
           "logit_bias": {"123": 5}}
    x = text_of(tiny_llama, 123)
    plain = client.completions.create(**ask).choices[0].logprobs.tokens
    assert plain.count(x) == len(plain) == 12
    penalised = client.completions.create(**ask, frequency_penalty=2.0).choices[0].logprobs.tokens
    assert 1 <= penalised.count(x) <= 4 and penalised[0] == x


def test_logit_bias_plus_100_makes_the_output(server, tiny_llama):
    client = server.client()
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=5, temperature=0.8, seed=1,
                                       logit_bias={"77": 100})
    assert r.choices[0].message.content == text_of(tiny_llama, 77) * 5
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt=PROMPT, max_tokens=2, logit_bias={"100000": 5})
    assert err.value.body["param"] == "logit_bias" and "100000" in err.value.body["message"]


# ----------------------------------------------------------------------------- top_k, min_p, repetition_penalty
def test_repetition_penalty_is_transformers(server, tiny_llama, truth):
    """``repetition_penalty`` (an extension, in the body) is transformers' rule: greedy picks the
    largest logit after RepetitionPenaltyLogitsProcessor over the prompt and the answer so far,
    on both routes; a penalty changes the plain answer."""
    from transformers import RepetitionPenaltyLogitsProcessor

    def want(ids: list[int], penalty: float) -> list[int]:
        tokens: list[int] = []
        for _ in range(NEW):
            row = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids + tokens]), truth(ids + tokens)[None])[0]
            tokens.append(int(torch.argmax(row)))
            if tokens[-1] in tiny_llama.eos_token_ids:
                break
        return tokens

    client = server.client()
    ids = encode_prompt(tiny_llama, PROMPT, chat=False)
    for penalty in (1.6, 0.8):
        r = client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=0,
                                      extra_body={"repetition_penalty": penalty})
        assert r.choices[0].logprobs.tokens == [text_of(tiny_llama, t) for t in want(ids, penalty)], penalty
    assert want(ids, 1.6) != reference(tiny_llama, truth, ids, NEW)
    ids = encode_prompt(tiny_llama, CHAT, chat=True)
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=0, logprobs=True,
                                       extra_body={"repetition_penalty": 1.6})
    assert [c.token for c in r.choices[0].logprobs.content] == [text_of(tiny_llama, t) for t in want(ids, 1.6)]


def _picks(server, seed: int, **body) -> list[tuple[float, list[float]]]:
    """A hot sampled chat answer's picks: (its logprob, the step's 5 largest logprobs)."""
    r = server.client().chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=2.0,
                                               seed=seed, logprobs=True, top_logprobs=5, extra_body=body)
    return [(c.logprob, [t.logprob for t in c.top_logprobs]) for c in r.choices[0].logprobs.content]


def test_top_k_and_min_p_keep_only_the_likely(server):
    """``top_k`` k: every pick is among the k most likely tokens of its step (the model's own
    logprobs say which); ``min_p`` m: every pick's probability at the request's temperature is at
    least m times the most likely one's; the same seeds without them pick outside (each had an
    effect); ``top_k`` 1 is the greedy answer."""
    client = server.client()
    greedy = client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=0)
    hot_k1 = client.chat.completions.create(model="default", messages=CHAT, max_tokens=NEW, temperature=2.0, seed=1,
                                            extra_body={"top_k": 1})
    assert hot_k1.choices[0].message.content == greedy.choices[0].message.content
    missed = {"top_k": 0, "min_p": 0}
    for seed in range(3):
        assert all(lp >= tops[2] - 1e-5 for lp, tops in _picks(server, seed, top_k=3)), seed
        assert all((lp - tops[0]) / 2.0 >= math.log(0.3) - 1e-5 for lp, tops in _picks(server, seed, min_p=0.3)), seed
        for lp, tops in _picks(server, seed):
            missed["top_k"] += lp < tops[2] - 1e-5
            missed["min_p"] += (lp - tops[0]) / 2.0 < math.log(0.3) - 1e-5
    assert all(missed.values()), missed
