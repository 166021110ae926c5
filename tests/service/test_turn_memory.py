"""Turn memory (issue #38 item 4; docs/serve.md "Turn memory"): ``decode --serve`` keeps each
answered conversation's rows, its prompt and the answer it generated, and the next turn computes
only its new tokens, from any token. Real processes on 127.0.0.1, the real ``openai`` client,
tiny models of three families (full attention, sliding windows, recurrent state) on torch and MLX.

The reference each held turn is compared with is the documented one, computed here through the
engine API, independently of the server's code: prefill the first prompt, ``prefill_from`` its
answer, cut the rows at the common prefix with the next prompt (any token for full layers; for
sliding and state layers only at a point held: a turn's end or its prompt's end),
``prefill_from`` the new tokens, decode, at temperature 0.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from handoff_kit import LANE_PROMPT, pull_lane  # noqa: E402
from serve_kit import DecodeServer  # noqa: E402

CHUNK = 8  # small, so that the schedule (and its breaks) matters in a prompt of ~60 tokens
N = 6
FIRST = "The committee met on a grey Tuesday to decide where the new bridge would go."
LATER = ["And the school?", "Paris is the capital of France; Berlin of Germany."]
ANYWHERE = ("full", "latent")


def _common(n: int, a, b) -> int:
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def lcp(a, b) -> int:
    return _common(min(len(a), len(b)), a, b)


class Reference:
    """The documented turn-memory rule, computed through the engine API alone."""

    def __init__(self, info, engine: str) -> None:
        from muser_cli.engines.registry import get_engine

        self.info = info
        self.eng = get_engine(engine, info, dtype="float32", threads=1)
        self.kinds = [s.kind for s in info.layers]
        self.anywhere = all(k in ANYWHERE for k in self.kinds)
        self.entries: list[tuple[list[int], list, dict[int, list]]] = []  # tokens, rows of all, {point: layers}

    def best(self, ids: list[int]) -> tuple[int, int, int | None]:
        """(held rows, the reach a full-attention model would have had, the entry's index)."""
        best, reach_best, which = 0, 0, None
        for i, (tokens, _, points) in enumerate(self.entries):
            reach = min(lcp(tokens, ids), len(ids) - 1)
            reach_best = max(reach_best, reach)
            h = reach if self.anywhere else max([p for p in (*points, len(tokens)) if p <= reach], default=0)
            if h > best:
                best, which = h, i
        return best, reach_best, which

    def cut(self, which: int, h: int) -> list:
        from muser_cli.kvpack import LayerKV

        tokens, layers, points = self.entries[which]
        if h == len(tokens):
            return layers
        return [LayerKV(kv.keys[:, :h], kv.values[:, :h], first_row=0) if kind in ANYWHERE else points[h][i]
                for i, (kind, kv) in enumerate(zip(self.kinds, layers))]

    def turn(self, ids: list[int], n: int = N) -> tuple[list[int], int, int]:
        """The answer's tokens, the rows held and the full-attention reach for prompt ``ids``."""
        eng, rows = self.eng, len(ids) - 1
        h, reach, which = self.best(ids)
        if which is None:
            layers = eng.prefill(ids[:-1], chunk_tokens=CHUNK)
        else:
            layers = self.cut(which, h)
            if h < rows:
                layers = eng.prefill_from(layers, rows=h, token_ids=ids[h:-1], chunk_tokens=CHUNK, anywhere=True)
        answer = list(eng.decode(layers, rows=rows, next_tokens=[ids[-1]], max_new_tokens=n,
                                 chunk_tokens=CHUNK).token_ids)
        tokens = ids + answer
        whole = eng.prefill_from(layers, rows=rows, token_ids=tokens[rows:], chunk_tokens=CHUNK, anywhere=True)
        self.entries.append((tokens, whole, {rows: layers}))
        return answer, h, reach


def serve(home, info, engine: str, *args: str) -> DecodeServer:
    return DecodeServer(home, "-m", str(info.path), "--threads", "1", "--dtype", "float32", "--chunk", str(CHUNK),
                        "--engine", engine, *args)


def chat(client, messages, n: int = N):
    raw = client.chat.completions.with_raw_response.create(model="default", messages=messages, max_tokens=n,
                                                           temperature=0)
    body = raw.parse()
    return body, body.model_extra["muser"], raw.headers


def three_turns(server, info, ref: Reference | None):
    """A 3-turn chat through ``server``; with ``ref``, each turn checked against the reference.
    Returns each turn's (held rows, full-attention reach, muser field)."""
    from muser_cli.model.tokens import decode_text, encode_prompt

    client = server.client()
    messages = [{"role": "user", "content": FIRST}]
    seen = []
    for nxt in [*LATER, None]:
        body, muser, headers = chat(client, messages)
        ids = encode_prompt(info, messages, chat=True)
        assert body.usage.prompt_tokens == len(ids)
        text = body.choices[0].message.content
        if ref is not None:
            answer, h, reach = ref.turn(ids)
            assert text == decode_text(info, answer), (len(seen), muser)
            assert muser["held_rows"] == h and muser["computed_rows"] == len(ids) - 1 - h, (h, muser)
            assert muser["source"] == ("held" if h else "local") and headers["x-muser-source"] == muser["source"]
            assert muser["bytes"] == 0 and body.usage.prompt_tokens_details.cached_tokens == h
            seen.append((h, reach, muser))
        else:
            seen.append((muser["held_rows"], None, muser))
        if nxt is not None:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": nxt}]
    return seen, messages


ENGINES = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]


def _need(engine: str) -> None:
    if engine == "mlx":
        pytest.importorskip("mlx_lm")


def stopped(server, engine: str = "torch") -> None:
    """SIGTERM drains and exits 0, on MLX too (a process that loaded MLX skips the interpreter's
    teardown, which could abort it: commands/__init__.py)."""
    rc = server.stop()
    assert rc == 0, "".join(server.lines[-20:])


@pytest.mark.parametrize("engine", ENGINES)
def test_three_turns_compute_only_their_new_tokens(tmp_path, tiny_llama, engine):
    """Full attention: turns 2 and 3 hold the common prefix with the previous turn's prompt and
    answer, compute only the rest, and their tokens are the reference's."""
    _need(engine)
    server = serve(tmp_path / "home", tiny_llama, engine)
    try:
        seen, _ = three_turns(server, tiny_llama, Reference(tiny_llama, engine))
        assert seen[0][0] == 0 and seen[0][2]["source"] == "local"
        for h, reach, muser in seen[1:]:  # cut at any token: all the common prefix is held
            assert h == reach and h > 0 and muser["computed_rows"] < h, muser
        kept = server.wait_events(3, "turn_memory")
        assert len(kept) == 3 and all(k["kept"] for k in kept)
    finally:
        stopped(server, engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", ["cohere2", "qwen3_next"])
def test_sliding_and_state_families_are_cut_only_where_exact(tmp_path, tiny_family, family, engine):
    """Sliding windows (cohere2) and recurrent state (qwen3_next) are cut only at a point held (a
    turn's end, its prompt's end): where the common prefix reaches past it, the cut falls back
    to it; the tokens are still the reference's."""
    _need(engine)
    info = tiny_family(family)
    assert any(s.kind in ("sliding", "state") for s in info.layers)
    server = serve(tmp_path / "home", info, engine)
    try:
        ref = Reference(info, engine)
        seen, _ = three_turns(server, info, ref)
        held = [h for h, _, _ in seen[1:]]
        assert all(h > 0 for h in held)  # the previous prompt's end at least
        assert any(reach > h for h, reach, _ in seen[1:]), seen  # a full-attention model would have held more
        for (tokens, _, points), h in zip(ref.entries, held):  # each cut is a point its entry held
            assert h in (*points, len(tokens))
    finally:
        stopped(server, engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_off_gives_a_cold_decode(tmp_path, tiny_llama, engine):
    """``--turn-memory 0``: every turn's rows on the canonical schedule, its text a cold ``decode``'s."""
    _need(engine)
    from muser_cli.consumer.decode import decode

    server = serve(tmp_path / "home", tiny_llama, engine, "--turn-memory", "0", "--no-reuse")
    try:
        seen, messages = three_turns(server, tiny_llama, None)
        assert [m["source"] for _, _, m in seen] == ["local"] * 3 and [h for h, _, _ in seen] == [0, 0, 0]
        assert server.events("turn_memory") == []
        client = server.client()
        for k in (1, 3, 5):  # each turn's conversation again, against a cold decode of it
            body, muser, _ = chat(client, messages[:k])
            want = decode(None, model=str(tiny_llama.path), prompt=messages[:k], chat=True, max_new_tokens=N,
                          engine=engine, dtype="float32", threads=1, reuse=False, chunk_tokens=CHUNK).text
            assert body.choices[0].message.content == want and muser["source"] == "local"
    finally:
        stopped(server, engine)


def _entry_bytes(info, tokens: int) -> int:
    per = sum(2 * s.kv_heads * s.head_dim * 4 for s in info.layers)  # float32 K and V (head_dim == v_head_dim)
    return per * tokens


def test_the_byte_bound_evicts_the_least_recently_used(tmp_path, tiny_llama):
    """With room for one conversation, the second evicts the first: the first, asked again,
    holds only what the second's entry shares with it; the second, asked again, is all held."""
    from muser_cli.model.tokens import encode_prompt

    a = [{"role": "user", "content": "Quick brown foxes jump over lazy dogs while seven wizards box."}]
    b = [{"role": "user", "content": "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 appear in logs."}]
    ids_a, ids_b = encode_prompt(tiny_llama, a, chat=True), encode_prompt(tiny_llama, b, chat=True)
    budget = _entry_bytes(tiny_llama, max(len(ids_a), len(ids_b)) + N) * 1.5
    ref = Reference(tiny_llama, "torch")
    server = serve(tmp_path / "home", tiny_llama, "torch", "--turn-memory", f"{budget / 1e6:.6f}")
    try:
        client = server.client()
        assert chat(client, a)[1]["held_rows"] == 0
        ans_a, _, _ = ref.turn(ids_a)
        _, muser_b, _ = chat(client, b)
        assert muser_b["held_rows"] == min(lcp(ids_a + ans_a, ids_b), len(ids_b) - 1)  # the template's opening
        ans_b, _, _ = ref.turn(ids_b)
        kept = server.wait_events(2, "turn_memory")
        assert kept[-1]["entries"] == 1 and kept[-1]["evicted"] == 1 and kept[-1]["bytes"] <= budget
        _, again_b, _ = chat(client, b)
        assert again_b["source"] == "held" and again_b["held_rows"] == len(ids_b) - 1 and again_b["computed_rows"] == 0
        _, again_a, _ = chat(client, a)
        assert again_a["held_rows"] == min(lcp(ids_b + ans_b, ids_a), len(ids_a) - 1) < len(ids_a) - 1
    finally:
        stopped(server)


def test_a_prompt_held_is_never_pulled_again(tmp_path, tiny_llama):
    """With a producer: the first request is shipped (a handoff); the same prompt again, and the
    chat's next turn, are answered from the turn memory: no producer asked, 0 bytes."""
    with pull_lane(tmp_path, tiny_llama.path, check_exit=False) as lane:
        server = DecodeServer(lane["nodes"].consumer_home, *lane["common"], "--producer", lane["producer"].address,
                              "--chunk", str(CHUNK))
        try:
            client = server.client()
            raw = client.completions.with_raw_response.create(model="default", prompt=LANE_PROMPT, max_tokens=N,
                                                              temperature=0)
            first = raw.parse()
            assert raw.headers["x-muser-source"] == "handoff" and int(raw.headers["x-muser-bytes"]) > 0
            served = len(lane["producer"].wait_events(1))
            server.wait_events(1, "turn_memory")
            raw = client.completions.with_raw_response.create(model="default", prompt=LANE_PROMPT, max_tokens=N,
                                                              temperature=0)
            again = raw.parse()
            muser = again.model_extra["muser"]
            assert raw.headers["x-muser-source"] == "held" and raw.headers["x-muser-bytes"] == "0", muser
            assert muser["bytes"] == 0 and muser["producer"] is None and muser["computed_rows"] == 0
            assert muser["held_rows"] == again.usage.prompt_tokens - 1
            assert again.choices[0].text == first.choices[0].text  # the same rows: the shipped ones, held
            # the next turn: all but its new tail held, computed here (predicted faster than any pull)
            raw = client.completions.with_raw_response.create(
                model="default", prompt=LANE_PROMPT + first.choices[0].text + " And the school?", max_tokens=N,
                temperature=0)
            nxt = raw.parse().model_extra["muser"]
            assert nxt["source"] == "held" and nxt["bytes"] == 0 and nxt["held_rows"] > 0, nxt
            assert len(lane["producer"].events()) == served  # the producer was not asked again
        finally:
            stopped(server)
