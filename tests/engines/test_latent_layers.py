"""Latent (MLA) layers end to end on DeepSeek-V3's tiny random model (issue #27).

kvpack 1.3 carries a ``latent`` layer as a one-head row layer: per position the latent after
``kv_a_layernorm`` (``kv_lora_rank`` values) and the shared RoPE key after the rotary
(``qk_rope_head_dim``). Checked against transformers' OWN modules and cache objects:

* the rows the torch producer extracts are what the model's own ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm`` and rotary make (forward hooks on transformers' modules, its own RoPE
  function), and what its own ``DynamicCache`` holds after its own forward;
* rows installed from a pack are the live cache's bytes, and expanded with the model's own
  ``kv_b_proj`` (``expand_kv``) they are the per-head K and V the producer's attention reads;
* torch -> torch through kvpack bytes decodes the tokens of the local fallback and of
  ``generate_reference`` (the producer's live cache), a pack's bytes a token are
  (rank + rope) x element a layer;
* the numeric gate compares latent rows and refuses a planted fault (a scaled row) with 65
  before the first token;
* the lanes: a streamed pack, a cut-off stream and a delta from the store give the fallback's tokens.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.engines.torch import latent
from muser_cli.errors import SpotCheckFailed
from muser_cli.kvpack import LayerKV, read_pack, read_pack_bytes, write_pack
from muser_cli.kvpack.parser import frame_ends
from muser_cli.produce.prefill import prefill
from muser_cli.model.tokens import encode_prompt
from handoff_kit import HANG_S

PROMPT = (
    "The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
    "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum."
)
NEW = 12
_ENGINES: dict = {}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("MUSER_THREADS", "1")  # bit-exactness: one engine, dtype and thread count


@pytest.fixture
def mla(tiny_family):
    return tiny_family("deepseek_v3")


def torch_engine(info):
    key = str(info.path)
    if key not in _ENGINES:
        _ENGINES[key] = get_engine("torch", info, dtype="float32", threads=1)
    return _ENGINES[key]


def _own_forward(eng, ids):
    """transformers' own forward over ``ids`` into its own cache, with hooks on its own MLA
    modules: per layer the latent after kv_a_layernorm, and the raw rope part of
    kv_a_proj_with_mqa; and the model's own (cos, sin)."""
    seen: dict = {"norm": {}, "proj": {}}
    hooks = []
    for i, attn in enumerate(latent.attentions(eng.model)):
        hooks.append(attn.kv_a_layernorm.register_forward_hook(lambda m, a, out, i=i: seen["norm"].__setitem__(i, out)))
        hooks.append(attn.kv_a_proj_with_mqa.register_forward_hook(
            lambda m, a, out, i=i: seen["proj"].__setitem__(i, out)))
    hooks.append(eng.model.model.rotary_emb.register_forward_hook(lambda m, a, out: seen.__setitem__("rope", out)))
    try:
        with torch.inference_mode():
            out = eng.model(input_ids=torch.tensor([ids]), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return (getattr(out, "cache", None) or out.past_key_values), seen


def test_layer_specs_describe_deepseek_v3_as_latent_layers(mla):
    cfg = json.loads((mla.path / "config.json").read_text())
    assert [s.kind for s in mla.layers] == ["latent"] * cfg["num_hidden_layers"]
    for s in mla.layers:
        assert (s.kv_heads, s.head_dim, s.v_head_dim) == (1, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
        assert s.rope.dims == cfg["qk_rope_head_dim"] and s.rope.style == "interleaved"


def test_extracted_latent_rows_are_the_models_own(mla):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    eng = torch_engine(mla)
    ids = encode_prompt(mla, PROMPT)[:-1]
    rows = len(ids)
    layers = eng.prefill(ids, chunk_tokens=rows)  # one forward, as the model's own below
    cache, seen = _own_forward(eng, ids)
    cos, sin = seen["rope"]
    rank, rope = mla.layers[0].head_dim, mla.layers[0].v_head_dim
    for i, kv in enumerate(layers):
        assert kv.first_row == 0 and kv.keys.shape == (1, rows, rank) and kv.values.shape == (1, rows, rope)
        # the latent: kv_a_layernorm's own output
        assert np.array_equal(kv.keys[0], seen["norm"][i][0].numpy()), i
        # the rope key: kv_a_proj_with_mqa's rope part through transformers' own RoPE, which
        # caches it [even dims, odd dims]; the pack carries the model's own (interleaved) order
        k_raw = seen["proj"][i][..., rank:].view(1, 1, rows, rope)
        _, k_rot = ds.apply_rotary_pos_emb_interleave(k_raw, k_raw, cos, sin)
        assert np.array_equal(kv.values[0][:, 0::2], k_rot[0, 0, :, : rope // 2].numpy()), i
        assert np.array_equal(kv.values[0][:, 1::2], k_rot[0, 0, :, rope // 2 :].numpy()), i
        # at position 0 RoPE is the identity: the pack's rope key is the projection's output as it is
        assert np.array_equal(kv.values[0, 0], k_raw[0, 0, 0].numpy())
        # and what transformers' own cache object holds (its rope keys in its own order)
        own = cache.layers[i]
        assert np.array_equal(kv.keys, own.keys[0].numpy())
        assert np.array_equal(kv.values, latent.rope_to_pack(own.values[0]).numpy())


def test_installed_rows_and_their_expansion_equal_the_live_cache(mla):
    eng = torch_engine(mla)
    ids = encode_prompt(mla, PROMPT)[:-1]
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(mla.path), chunk_tokens=16, dtype="float32", threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    assert pack.header.chunk_tokens == 16 and pack.header.rows_end == len(ids)
    with eng._session():
        live = eng._prefill_cache(ids, 16, None)  # the producer's live cache (its own chunk schedule)
        installed = eng._install(pack.layers, len(ids))
    for i, (a, b) in enumerate(zip(installed.layers, live.layers)):
        assert a.keys.shape == b.keys.shape == (1, 1, len(ids), mla.layers[i].head_dim)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), i
        # latent -> per-head K/V with the model's own kv_b_proj: what the attention reads
        k, v = latent.expand(eng, i, pack.layers[i])
        with torch.inference_mode():
            own_k, own_v = latent.attentions(eng.model)[i].expand_kv(b.keys, b.values)
        heads = eng.model.config.num_attention_heads
        assert k.shape == (heads, len(ids), eng.model.config.qk_head_dim) and v.shape[0] == heads
        assert torch.equal(k, own_k[0]) and torch.equal(v, own_v[0]), i
        # expanded chunk by chunk (the producer's schedule): the same rows, to float rounding
        kc, vc = latent.expand(eng, i, pack.layers[i], chunk_tokens=16)
        assert torch.allclose(kc, k, rtol=1e-5, atol=1e-6) and torch.allclose(vc, v, rtol=1e-5, atol=1e-6)


def test_installed_rows_are_transformers_own_cache_after_its_own_forward(mla):
    """One chunk (the shapes of the model's own forward): the cache a pack installs is, byte for
    byte, the DynamicCache transformers' own forward leaves (its rope keys in its own order)."""
    eng = torch_engine(mla)
    ids = encode_prompt(mla, PROMPT)[:-1]
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(mla.path), chunk_tokens=len(ids), dtype="float32", threads=1)
    pack = read_pack(io.BytesIO(out.getvalue()))
    own, _ = _own_forward(eng, ids)
    with eng._session():
        installed = eng._install(pack.layers, len(ids))
    for i, (a, b) in enumerate(zip(installed.layers, own.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), i


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_handoff_equals_the_fallback_and_the_live_cache(mla, dtype):
    eng = torch_engine(mla) if dtype == "float32" else get_engine("torch", mla, dtype=dtype, threads=1)
    ids = encode_prompt(mla, PROMPT)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(mla.path), chunk_tokens=16, dtype=dtype, threads=1)
    data = out.getvalue()
    handed = decode(io.BytesIO(data), model=str(mla.path), max_new_tokens=NEW, dtype=dtype, threads=1)
    local = decode(io.BytesIO(b""), model=str(mla.path), prompt=PROMPT, max_new_tokens=NEW, dtype=dtype, threads=1)
    live = eng.generate_reference(ids[:-1], ids[-1:], NEW, chunk_tokens=16)
    assert handed.fallback is False and local.fallback is True and handed.spot_check["ran"] is False
    assert handed.token_ids == local.token_ids == live.token_ids
    assert len(handed.token_ids) == NEW and len(set(handed.token_ids)) > 1
    # a latent layer ships (kv_lora_rank + qk_rope_head_dim) x element a token, nothing per head
    pack = read_pack_bytes(data)
    h = pack.header
    assert h.minor >= 3 and all(s.kind == "latent" for s in h.layers)
    rows = h.rows_end
    elem = 4 if dtype == "float32" else 2
    for kv, spec in zip(pack.layers, h.layers):
        assert kv.keys.nbytes + kv.values.nbytes == rows * (spec.head_dim + spec.v_head_dim) * elem
    assert h.codec["name"] == "none"
    assert pack.stored_bytes == rows * sum(s.head_dim + s.v_head_dim for s in h.layers) * elem


def test_cli_prefill_pipe_decode(mla, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    runner = CliRunner()
    made = runner.invoke(app, ["prefill", "-m", str(mla.path), "--chunk", "16", str(prompt)], catch_exceptions=False)
    assert made.exit_code == 0, made.stderr
    got = runner.invoke(app, ["decode", "-m", str(mla.path), "-n", str(NEW), "--json"], input=made.stdout_bytes,
                        catch_exceptions=False)
    assert got.exit_code == 0, got.output
    local = decode(io.BytesIO(b""), model=str(mla.path), prompt=PROMPT, max_new_tokens=NEW, threads=1)
    assert json.loads(got.stdout)["token_ids"] == local.token_ids


# ---------------------------------------------------------------------- the numeric gate

def _foreign(mla, *, plant=None) -> bytes:
    """A torch pack relabelled as made by another engine (so decode gates it), every digest
    right; ``plant(layers)`` edits its rows first."""
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(mla.path), chunk_tokens=8, dtype="float32", threads=1)
    p = read_pack(io.BytesIO(out.getvalue()))
    layers = [LayerKV(np.array(l.keys), np.array(l.values), l.first_row) for l in p.layers]
    if plant:
        plant(layers)
    again = io.BytesIO()
    write_pack(again, replace(p.header, producer={**p.header.producer, "engine": "vllm"}), layers)
    return again.getvalue()


def test_gate_recomputes_latent_rows_of_a_foreign_pack(mla):
    from muser_cli.gate.sampled import sample_check

    data = _foreign(mla)
    got = decode(io.BytesIO(data), model=str(mla.path), max_new_tokens=NEW, dtype="float32", threads=1)
    spot = got.spot_check
    assert spot["ran"] and spot["ok"] and spot["layers_checked"] == len(mla.layers) and not spot["layers_unchecked"]
    local = decode(io.BytesIO(b""), model=str(mla.path), prompt=PROMPT, max_new_tokens=NEW, dtype="float32", threads=1)
    assert got.token_ids == local.token_ids
    # the one-step recompute returns latent rows: (1, m, rank) and (1, m, rope), equal to the pack's
    pack = read_pack_bytes(data)
    eng = torch_engine(mla)
    check = sample_check(pack.header, list(pack.layers), eng, count=8, seed=5)
    assert check.ok and check.method == "one-step" and check.complete
    fresh = eng.recompute_at(list(pack.layers), rows=pack.header.rows_end, positions=[3, 20],
                             token_ids=[pack.header.token_ids[3], pack.header.token_ids[20]])
    for (k, v), kv in zip(fresh, pack.layers):
        assert k.shape == (1, 2, mla.layers[0].head_dim) and v.shape == (1, 2, mla.layers[0].v_head_dim)
        assert np.allclose(k, kv.keys[:, [3, 20]], rtol=1e-4, atol=1e-5)
        assert np.allclose(v, kv.values[:, [3, 20]], rtol=1e-4, atol=1e-5)


def test_verify_audit_recomputes_latent_rows(mla, tmp_path):
    pack = tmp_path / "p.kvpack"
    pack.write_bytes(_foreign(mla))
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    r = CliRunner().invoke(app, ["verify", "-m", str(mla.path), "--audit", "4", "--prompt", str(prompt), str(pack),
                                 "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["audit"]["ok"] is True and "positions sampled across the prompt" in checks["audit"]["detail"], checks


@pytest.mark.parametrize("part", ["latent", "rope"])
def test_gate_refuses_a_scaled_latent_row_before_the_first_token(mla, part, tmp_path):
    from muser_cli.gate.sampled import DEFAULT_SAMPLE_POSITIONS, sample_positions

    rows = len(encode_prompt(mla, PROMPT)) - 1
    seed = 7
    at = sample_positions(rows, DEFAULT_SAMPLE_POSITIONS, seed)[5]  # a position the gate samples with this seed

    def plant(where):
        def edit(layers):
            kv = layers[2]
            (kv.keys if part == "latent" else kv.values)[:, where] *= 1.5  # one row of layer 2
        return edit

    data = _foreign(mla, plant=plant(at))
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="before the first token") as err:
        decode(io.BytesIO(data), model=str(mla.path), max_new_tokens=NEW, dtype="float32", threads=1,
               audit_seed=seed, on_token=tokens.append)
    assert tokens == [] and "first layer 2" in str(err.value) and "(latent" in str(err.value)
    # the CLI: 65, the fault on the last row (which the gate always recomputes, --audit 1)
    pack = tmp_path / "bad.kvpack"
    pack.write_bytes(_foreign(mla, plant=plant(rows - 1)))
    cli = CliRunner().invoke(app, ["decode", "-m", str(mla.path), "-n", "4", str(pack)])
    assert cli.exit_code == 65 and "before the first token" in cli.output


def test_transformers_interop_round_trip(mla):
    """from_transformers(own cache) is the engine's pack; to_transformers(pack) is the own cache."""
    import muser_cli

    eng = torch_engine(mla)
    ids = encode_prompt(mla, PROMPT)
    cache, _ = _own_forward(eng, ids[:-1])
    data = muser_cli.from_transformers(cache, ids, eng.model, info=mla, chunk_tokens=len(ids) - 1)
    ours = eng.prefill(ids[:-1], chunk_tokens=len(ids) - 1)
    for a, b in zip(read_pack_bytes(data).layers, ours):
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)
    back = muser_cli.to_transformers(data, eng.model, info=mla)
    for a, b in zip(back.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# ---------------------------------------------------------------------- lanes

DOC = ("The producer computes the prompt once and ships its keys and values to the consumer. "
       "The consumer checks every frame, installs the rows and decodes the next token itself.")
MORE = (" A latent layer keeps one compressed row a position and one shared rope key; the heads come back "
        "from the up-projection. When the network fails, the consumer falls back to a local prefill.")


def _cli_ok(*args, input: bytes | None = None):
    r = CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def test_streamed_pack_equals_the_finished_one_and_decodes_like_the_fallback(mla, monkeypatch):
    """The V3 stream: frames leave while prefill runs (latent rows chunk by chunk), the bytes are
    the finished pack's, and decoding them gives the fallback's tokens."""
    from muser_cli.engines.torch.engine import TorchEngine

    kw = dict(model=str(mla.path), chunk_tokens=8, dtype="float32", threads=1)
    seen: list[tuple[int, int]] = []
    out = io.BytesIO()
    prefill(PROMPT, out, progress=lambda stage, done, total: seen.append((done, len(out.getbuffer()))), **kw)
    with monkeypatch.context() as m:
        m.setattr(TorchEngine, "streams_prefill", False)
        whole = io.BytesIO()
        prefill(PROMPT, whole, **kw)
    assert out.getvalue() == whole.getvalue()
    chunks = [(d, n) for d, n in seen if d > 0]
    assert chunks[1][1] > chunks[0][1] > 0 and chunks[-2][1] < len(out.getvalue())  # bytes left chunk by chunk
    got = decode(io.BytesIO(out.getvalue()), model=str(mla.path), max_new_tokens=NEW, dtype="float32", threads=1)
    local = decode(io.BytesIO(b""), model=str(mla.path), prompt=PROMPT, max_new_tokens=NEW, dtype="float32",
                   threads=1, chunk_tokens=8)
    assert got.source == "handoff" and got.token_ids == local.token_ids


def test_cut_stream_resumes_from_the_verified_chunks(mla):
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(mla.path), chunk_tokens=8, dtype="float32", threads=1)
    data = out.getvalue()
    head, ends = frame_ends(data)
    layers = len(mla.layers)
    chunks = len(ends) // layers
    local = decode(io.BytesIO(b""), model=str(mla.path), prompt=PROMPT, max_new_tokens=NEW, dtype="float32",
                   threads=1, chunk_tokens=8)
    rows = local.prompt_tokens - 1
    for k in (1, chunks // 2, chunks - 1):
        got = decode(io.BytesIO(data[: ends[k * layers - 1]]), model=str(mla.path), prompt=PROMPT,
                     max_new_tokens=NEW, dtype="float32", threads=1)
        assert got.token_ids == local.token_ids, k
        assert got.source == "partial+local" and got.handoff_rows == 8 * k and got.local_rows == rows - 8 * k


def test_delta_from_the_store_equals_the_full_pack_and_the_fallback(mla, tmp_path, monkeypatch):
    """reuse put -> reuse have -> prefill --have (a delta of the suffix's latent rows) -> decode:
    the same bytes as cutting the full pack, the same tokens as the full pack and a cold prefill."""
    monkeypatch.setenv("MUSER_THREADS", "1")
    m = mla.path
    doc, doc2 = tmp_path / "doc.txt", tmp_path / "doc2.txt"
    doc.write_text(DOC)
    doc2.write_text(DOC + MORE)
    pre, full, have, delta, cut = (tmp_path / n for n in ("doc.kvpack", "full.kvpack", "have.json", "delta.kvpack",
                                                          "cut.kvpack"))
    _cli_ok("prefill", "-m", m, "--chunk", "8", doc, "-o", pre)
    assert "stored" in _cli_ok("reuse", "put", pre).stderr
    _cli_ok("reuse", "have", "-m", m, doc2, "-o", have)
    manifest = json.loads(have.read_text())
    held = manifest["held_tokens"]
    assert held > 0 and held % 8 == 0 and not manifest["complete"]
    _cli_ok("prefill", "-m", m, doc2, "--have", have, "-o", delta)
    _cli_ok("prefill", "-m", m, "--chunk", "8", doc2, "-o", full)
    _cli_ok("pack", "--no-zstd", "--have", have, full, "-o", cut)
    assert cut.read_bytes() == delta.read_bytes()
    d = read_pack_bytes(delta.read_bytes())
    assert d.header.rows_start == held and all(kv.first_row == held for kv in d.layers)
    rank_rope = sum(s.head_dim + s.v_head_dim for s in d.header.layers)
    assert d.stored_bytes == (d.header.rows_end - held) * rank_rope * 4  # only the suffix's latent rows
    runs = {name: json.loads(_cli_ok("decode", "-m", m, *args, "-n", NEW, "--json", input=b"").stdout)
            for name, args in (("delta", [delta]), ("full", [full]),
                               ("cold", ["--chunk", "8", "--no-reuse", "--prompt", doc2]))}
    assert runs["delta"]["source"] == "delta" and runs["delta"]["reuse"]["held_tokens"] == held
    assert runs["delta"]["token_ids"] == runs["full"]["token_ids"] == runs["cold"]["token_ids"]
    # warm from the store: a partial hit resumes the prefill from the stored latent rows
    warm = json.loads(_cli_ok("decode", "-m", m, "--prompt", doc2, "-n", NEW, "--json", input=b"").stdout)
    assert warm["source"] in ("store+local", "store") and warm["token_ids"] == runs["cold"]["token_ids"]


def test_pull_lane_full_and_delta_give_the_fallbacks_tokens(mla, tmp_path):
    """``decode --producer``: the producer prefills latent rows and streams them; with the
    document stored on the consumer, ``receive --from`` gets a delta of only the follow-up's
    rows, which decode merges. Tokens = a cold local decode's, each time."""
    import subprocess

    from handoff_kit import env_for, lane_flags, make_nodes, muser_cmd, serving, without_store

    nodes = make_nodes(tmp_path / "nodes")
    doc, follow = tmp_path / "doc.txt", tmp_path / "follow.txt"
    doc.write_text(DOC)
    follow.write_text(DOC + MORE)
    common = lane_flags(mla.path)
    env = env_for(nodes.consumer_home)

    def run(*args, env=env):
        r = subprocess.run(muser_cmd(*args), env=env, input=b"", capture_output=True, timeout=HANG_S)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout) if "--json" in args else r

    with serving(nodes.producer_home, *common) as producer:
        for prompt in (doc, follow):
            local = run("decode", *common, "--chunk", "8", "--prompt", str(prompt), "-n", "8", "--no-reuse", "--json")
            pulled = run("decode", *common, "--chunk", "8", "--prompt", str(prompt), "-n", "8", "--no-reuse", "--json",
                         "--producer", producer.address)
            assert pulled["source"] == "handoff" and pulled["token_ids"] == local["token_ids"], pulled
        env2 = env_for(without_store(nodes.consumer_home, tmp_path / "consumer"))
        run("prefill", str(doc), *common, "--chunk", "8", "--store", "-o", str(tmp_path / "doc.kvpack"), env=env2)
        got = run("receive", "--from", producer.address, str(follow), "-m", str(mla.path), "--chunk", "8",
                  "-o", str(tmp_path / "delta.kvpack"), "--json", env=env2)
        head = read_pack_bytes((tmp_path / "delta.kvpack").read_bytes()).header
        assert got["held_tokens"] >= 8 and head.rows_start == got["held_tokens"]
        merged = run("decode", str(tmp_path / "delta.kvpack"), *common, "--chunk", "8", "--prompt", str(follow),
                     "-n", "8", "--json", env=env2)
        assert merged["source"] == "delta" and merged["token_ids"] == local["token_ids"], merged


@pytest.mark.mlx
def test_yarn_latent_pack_from_torch_passes_the_mlx_gate(tmp_path):
    """DeepSeek-V3's own RoPE scaling (YaRN with mscale and mscale_all_dim, as its hub config has
    it, scaled down to the tiny context): a torch pack passes MLX's numeric gate and MLX's first
    tokens equal its own local decode."""
    pytest.importorskip("mlx_lm")
    import transformers

    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import TINY_FAMILIES, _common, _write

    _, extra = TINY_FAMILIES["deepseek_v3"]
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
    config = transformers.DeepseekV3Config(**{**_common(), **extra, "rope_parameters": rope})
    info = resolve_model(_write(transformers.AutoModelForCausalLM.from_config, config, tmp_path / "yarn", 0))
    assert info.layers[0].rope.scaling["rope_type"] == "yarn"
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=16, threads=1)
    crossed = decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=8, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, engine="mlx", max_new_tokens=8, threads=1)
    spot = crossed.spot_check
    assert spot["ran"] and spot["ok"] and spot["layers_checked"] == len(info.layers)
    assert crossed.token_ids[:4] == local.token_ids[:4]
