"""The numeric gate across the whole prompt (issue 30, items 1-2; issue 29, item 3).

A pack declared as made by another engine, every digest right, whose rows in one layer are
wrong at more than a quarter of the positions -- anywhere in the prompt -- is never decoded
from: refused (65) without a prompt, set aside for local rows with one (``--strict``:
refused). Whatever path its rows take: a whole pack, a cut stream, the store.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from muser_cli.gate.sampled import DEFAULT_SAMPLE_POSITIONS, sample_check
from muser_cli.consumer.decode import decode
from muser_cli.engines.registry import get_engine
from muser_cli.errors import GateIncomplete, IdentityMismatch, SpotCheckFailed
from muser_cli.kvpack import LayerKV, read_pack, write_pack
from muser_cli.produce.prefill import prefill
from handoff_kit import HANG_S

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. After a long debate "
          "about costs, traffic and the river's spring floods, they chose the northern site, close to the old "
          "mill, where the banks are high and the water runs slow. Engineers were asked to report within a "
          "month on the foundations, the approach roads and the cost of keeping the ferry running meanwhile.")
OTHER = ("A small bakery on the corner of the square sells bread before dawn. Its owner, who learned the trade "
         "from her grandfather, bakes rye and wheat loaves in a wood oven and closes when the last one is sold; "
         "people queue in the rain for them, and tourists photograph the queue more often than the bread itself.")
TRIALS = 200


def _pack(model, prompt: str = PROMPT, *, engine_name: str = "vllm", dtype: str = "float32") -> bytes:
    out = io.BytesIO()
    prefill(prompt, out, model=str(model.path), chunk_tokens=8, dtype=dtype)
    return _relabel(out.getvalue(), engine_name)


def _relabel(data: bytes, engine_name: str, corrupt=None) -> bytes:
    """``data`` written again as made by ``engine_name``, every digest right; ``corrupt(layers)``
    applied to copies of its rows first."""
    p = read_pack(io.BytesIO(data))
    layers = [LayerKV(l.keys.copy(), l.values.copy(), l.first_row) for l in p.layers]
    if corrupt is not None:
        corrupt(layers)
    again = io.BytesIO()
    write_pack(again, replace(p.header, producer={**p.header.producer, "engine": engine_name}), layers)
    return again.getvalue()


def _fault(layers, layer: int, positions, kind: str) -> None:
    if kind == "negate-k":
        layers[layer].keys[:, positions] *= -1
    else:
        layers[layer].values[:, positions] *= 1.5


def _decode(model, data: bytes | None, prompt: str | None = None, **kw):
    return decode(io.BytesIO(data) if data is not None else None, model=str(model.path), prompt=prompt,
                  max_new_tokens=6, **kw)


# ------------------------------------------------------------------ the catch rate
def test_planted_faults_anywhere_are_caught_and_honest_rows_pass(tiny_llama, capsys):
    """>= 200 trials on one prefill, forged in memory: one random layer's K negated or V scaled
    by 1.5 at a random quarter-and-one of the positions (the last excluded: the fused check
    sees that one). Every trial caught; an honest foreign pack passes for every seed."""
    pack = read_pack(io.BytesIO(_pack(tiny_llama)))
    h = pack.header
    rows = h.rows_end
    eng = get_engine("torch", tiny_llama, dtype="float32", threads=1)
    rng = random.Random(30)
    caught, shares = 0, []
    for trial in range(TRIALS):
        layer, kind = rng.randrange(len(h.layers)), rng.choice(["negate-k", "scale-v"])
        bad = rng.sample(range(rows - 1), rows // 4 + 1)
        layers = [LayerKV(l.keys.copy(), l.values.copy(), l.first_row) if i == layer else l
                  for i, l in enumerate(pack.layers)]
        _fault(layers, layer, bad, kind)
        shares.append(len(bad) / rows)
        try:
            sample_check(h, layers, eng, seed=trial)
        except SpotCheckFailed:
            caught += 1
    honest = [sample_check(h, list(pack.layers), eng, seed=s) for s in range(50)]
    with capsys.disabled():
        print(f"\ngate catch rate: {caught}/{TRIALS} (faults at {min(shares):.3f} of {rows} rows, one layer of "
              f"{len(h.layers)}, {DEFAULT_SAMPLE_POSITIONS} positions sampled); honest passes 50/50, worst rel "
              f"{max(c.worst['rel_max'] for c in honest):.2g}")
    assert caught == TRIALS
    assert all(c.ok and len(c.positions) == min(rows, DEFAULT_SAMPLE_POSITIONS) for c in honest)


def test_the_sampled_positions_span_the_prompt_and_are_reported(tiny_llama):
    data = _pack(tiny_llama)
    rows = read_pack(io.BytesIO(data)).header.rows_end
    a = _decode(tiny_llama, data, audit_seed=7).spot_check["sampled"]
    b = _decode(tiny_llama, data, audit_seed=7).spot_check["sampled"]
    c = _decode(tiny_llama, data).spot_check["sampled"]
    assert a["ok"] and a["seed"] == 7 and a["positions"] == b["positions"] and len(a["positions"]) == 32
    assert min(a["positions"]) < rows // 4 and max(a["positions"]) > 3 * rows // 4
    assert a["layers"] == list(range(len(tiny_llama.layers))) and a["method"] == "one-step"
    assert a["worst_rel"] <= a["tolerance"] and a["worst_position"] in a["positions"]
    assert c["seed"] != 7  # unpredictable by default


# ------------------------------------------------------------------ the packs
@pytest.mark.parametrize("kind", ["negate-k", "scale-v"])
def test_last_layer_wrong_except_the_last_position_is_never_decoded(tiny_llama, kind):
    """Issue 30's reproduction: it passed the last-position check and decoded wrong text."""
    honest = _pack(tiny_llama)
    last = len(tiny_llama.layers) - 1
    rows = read_pack(io.BytesIO(honest)).header.rows_end
    bad = _relabel(honest, "mlx", corrupt=lambda layers: _fault(layers, last, list(range(rows - 1)), kind))
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="sampled across the prompt"):
        _decode(tiny_llama, bad, on_token=tokens.append)
    assert tokens == []
    local = _decode(tiny_llama, None, PROMPT)
    out = _decode(tiny_llama, bad, PROMPT)
    assert out.source == "local" and out.token_ids == local.token_ids
    assert out.set_aside.startswith("pack set aside: pack refused by the spot-check")
    assert out.to_json()["fallback_reason"] == out.set_aside
    with pytest.raises(SpotCheckFailed):
        _decode(tiny_llama, bad, PROMPT, strict=True)


def _hybrid_pack(model, *, history: bool | None = None, corrupt=None) -> bytes:
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(model.path), chunk_tokens=8, dtype="float32", history=history)
    return _relabel(out.getvalue(), "mlx", corrupt=corrupt)


def _above_first_sliding(model) -> int:
    """The first full-attention layer above a sliding one: the layer the gate could not
    recompute before the window without the sliding history."""
    kinds = [s.kind for s in model.layers]
    return next(i for i in range(kinds.index("sliding") + 1, len(kinds)) if kinds[i] == "full")


def test_a_hybrid_pack_carries_its_sliding_history_and_every_layer_is_checked_everywhere(tiny_hybrid):
    """The torch producer writes every row of its sliding layers (docs/kvpack.md 1.3): the gate
    recomputes every layer at every sampled position, across the whole prompt."""
    data = _hybrid_pack(tiny_hybrid)
    h = read_pack(io.BytesIO(data)).header
    window = min(s.window for s in tiny_hybrid.layers if s.kind == "sliding")
    assert h.rows_end > 3 * window and h.ring_extra == h.rows_end  # past the window; every row carried
    out = _decode(tiny_hybrid, data, audit_seed=3)
    s = out.spot_check["sampled"]
    assert s["ok"] and s["complete"] and s["layers_unchecked"] == [] and s["layers_partial"] == []
    assert s["layers"] == list(range(len(tiny_hybrid.layers))) and min(s["positions"]) < window
    assert out.source == "handoff" and out.token_ids == _decode(tiny_hybrid, None, PROMPT).token_ids


def test_a_hybrid_pack_wrong_before_the_window_is_caught(tiny_hybrid):
    """The fault the gate could not see before (it passed, and decoded wrong text): a full layer
    above a sliding one, wrong at more than a quarter of the positions, all before the window."""
    h = read_pack(io.BytesIO(_hybrid_pack(tiny_hybrid))).header
    window = min(s.window for s in tiny_hybrid.layers if s.kind == "sliding")
    layer = _above_first_sliding(tiny_hybrid)
    early = list(range(0, h.rows_end - window))
    assert len(early) > h.rows_end // 4
    rng = random.Random(30)
    caught = 0
    for trial in range(40):
        bad = rng.sample(early, h.rows_end // 4 + 1)
        data = _hybrid_pack(tiny_hybrid, corrupt=lambda layers: _fault(layers, layer, bad, "negate-k"))
        try:
            sample_check(h, list(read_pack(io.BytesIO(data)).layers), get_engine("torch", tiny_hybrid,
                         dtype="float32", threads=1), seed=trial)
        except SpotCheckFailed as exc:
            assert not isinstance(exc, GateIncomplete)
            caught += 1
    assert caught == 40
    data = _hybrid_pack(tiny_hybrid, corrupt=lambda layers: _fault(layers, layer, early, "scale-v"))
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="sampled across the prompt"):
        _decode(tiny_hybrid, data, on_token=tokens.append)
    assert tokens == []
    out = _decode(tiny_hybrid, data, PROMPT)
    assert out.source == "local" and out.set_aside.startswith("pack set aside: pack refused by the spot-check")


def test_a_foreign_hybrid_pack_without_its_history_is_never_decoded_unchecked(tiny_hybrid):
    """A pack whose sliding layers carry only their window (``--no-history``, or an engine that
    cannot write more): the layers above the first sliding one cannot be recomputed before the
    window, so the gate refuses it (65) -- set aside for local rows with a prompt -- instead of
    decoding from rows nobody checked; ``--audit 0`` is the user's explicit way past it."""
    honest = _hybrid_pack(tiny_hybrid, history=False)
    h = read_pack(io.BytesIO(honest)).header
    assert h.ring_extra == 1
    tokens: list[int] = []
    with pytest.raises(GateIncomplete, match="cannot be checked in full") as err:
        _decode(tiny_hybrid, honest, on_token=tokens.append)
    assert tokens == [] and "--history" in err.value.hint
    local = _decode(tiny_hybrid, None, PROMPT)
    out = _decode(tiny_hybrid, honest, PROMPT)
    assert out.source == "local" and out.token_ids == local.token_ids and "checked in full" in out.set_aside
    with pytest.raises(GateIncomplete):
        _decode(tiny_hybrid, honest, PROMPT, strict=True)
    skipped = _decode(tiny_hybrid, honest, audit=0)
    assert skipped.source == "handoff" and skipped.spot_check["skipped"] and skipped.token_ids == local.token_ids
    # before: a fault above the first sliding layer before the window passed and decoded wrong text
    layer = _above_first_sliding(tiny_hybrid)
    window = min(s.window for s in tiny_hybrid.layers if s.kind == "sliding")
    bad = _relabel(honest, "mlx", corrupt=lambda layers: _fault(layers, layer, list(range(h.rows_end - window)),
                                                                 "negate-k"))
    with pytest.raises(SpotCheckFailed):
        _decode(tiny_hybrid, bad)


def test_the_cli_prefills_with_the_history_by_default_and_without_it_when_told(tiny_hybrid, tmp_path):
    (tmp_path / "p.txt").write_text(PROMPT)
    for flag, ring in ((None, "rows"), ("--no-history", 1)):
        args = ["prefill", "p.txt", "-m", str(tiny_hybrid.path), "--chunk", "8", "--dtype", "float32", "-o", "x.kvpack"]
        r = _muser(*(args + ([flag] if flag else [])), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        h = read_pack(open(tmp_path / "x.kvpack", "rb")).header
        assert h.ring_extra == (h.rows_end if ring == "rows" else ring)
    pytest.importorskip("mlx.core", reason="mlx not installed")
    r = _muser("prefill", "p.txt", "-m", str(tiny_hybrid.path), "--engine", "mlx", "--chunk", "8", "-o", "y.kvpack",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # MLX collects each chunk's sliding rows before its ring drops them
    h = read_pack(open(tmp_path / "y.kvpack", "rb")).header
    assert h.ring_extra == h.rows_end and h.producer["engine"] == "mlx"


# ------------------------------------------------------------------ every path rows enter by
def _whole_frames(data: bytes) -> bytes:
    """The pack without its end frame: every data frame verified, the stream cut."""
    from muser_cli.kvpack.format import FRAME_HEADER, pad_len
    from tests.kvpack_factory import frame_offsets

    last = frame_offsets(data)[-1]
    stored = FRAME_HEADER.unpack_from(data, last)[-1]
    return data[: last + FRAME_HEADER.size + stored + pad_len(stored) + 64]


def test_a_cut_foreign_stream_is_gated_before_its_chunks_are_kept(tiny_llama):
    honest = _pack(tiny_llama)
    rows = read_pack(io.BytesIO(honest)).header.rows_end
    local = _decode(tiny_llama, None, PROMPT)
    kept = _decode(tiny_llama, _whole_frames(honest), PROMPT, audit_seed=1)
    assert kept.source == "partial+local" and kept.handoff_rows > 0
    assert kept.spot_check["ran"] and kept.spot_check["sampled"]["ok"]  # before: spot_check null
    assert kept.token_ids == local.token_ids
    bad = _relabel(honest, "vllm", corrupt=lambda layers: _fault(layers, 2, list(range(0, rows, 3)), "scale-v"))
    out = _decode(tiny_llama, _whole_frames(bad), PROMPT, audit_seed=1)
    assert out.source == "local" and out.handoff_rows == 0 and "kept rows set aside" in out.reason
    assert out.token_ids == local.token_ids
    with pytest.raises(SpotCheckFailed):
        _decode(tiny_llama, _whole_frames(bad), PROMPT, strict=True)


def _count_checks(monkeypatch) -> list:
    """Every run of the sampled gate, wherever it is called from, appends to the list returned."""
    from muser_cli.consumer import checks
    from muser_cli.gate import sampled as gate

    runs: list = []
    real = gate.sample_check

    def counted(*a, **k):
        runs.append(1)
        return real(*a, **k)
    monkeypatch.setattr(gate, "sample_check", counted)
    monkeypatch.setattr(checks, "sample_check", counted)  # where decode's checks call it (consumer/checks.py)
    return runs


def test_a_foreign_store_entry_is_checked_on_first_use_and_never_serves_wrong_rows(tiny_llama, monkeypatch):
    """``reuse put`` of a foreign pack, then ``decode --prompt``: the entry is checked before its
    rows serve (recorded: not checked again); a wrong one is removed and the rows made here."""
    from muser_cli.reuse import Store

    honest = _pack(tiny_llama)
    rows = read_pack(io.BytesIO(honest)).header.rows_end
    local = _decode(tiny_llama, None, PROMPT, reuse=False)
    runs = _count_checks(monkeypatch)

    bad = _relabel(honest, "vllm", corrupt=lambda layers: _fault(layers, 3, list(range(1, rows, 2)), "negate-k"))
    st = Store()
    entry = st.put(io.BytesIO(bad)).entry.id
    out = _decode(tiny_llama, None, PROMPT)
    assert out.source == "local" and out.token_ids == local.token_ids and len(runs) == 1
    assert any("refused by the numeric gate" in p for p in out.store_problems)
    assert not Store().pack_path(entry).exists()

    entry = Store().put(io.BytesIO(honest)).entry.id
    first = _decode(tiny_llama, None, PROMPT)
    assert first.source == "store" and first.token_ids == local.token_ids and len(runs) == 2
    assert Store().check_of(entry, engine="torch", dtype="float32")["ok"]
    again = _decode(tiny_llama, None, PROMPT)
    assert again.source == "store" and len(runs) == 2  # checked once, recorded with the entry


def test_decode_store_records_the_gate_a_foreign_pack_passed(tiny_llama, monkeypatch):
    from muser_cli.reuse import Store

    runs = _count_checks(monkeypatch)
    out = _decode(tiny_llama, _pack(tiny_llama), PROMPT, store=True)
    assert out.stored and Store().check_of(out.stored, engine="torch", dtype="float32")["ok"]
    assert _decode(tiny_llama, None, PROMPT).source == "store" and len(runs) == 1


# ------------------------------------------------------------------ issue 29 item 3: one rule
def test_a_pack_of_another_prompt_is_set_aside_with_a_prompt_and_refused_when_strict(tiny_llama):
    other = _pack(tiny_llama, OTHER, engine_name="torch")
    local = _decode(tiny_llama, None, PROMPT)
    out = _decode(tiny_llama, other, PROMPT)
    assert out.source == "local" and out.fallback and out.token_ids == local.token_ids
    assert "set aside" in out.set_aside and "prompt" in out.set_aside
    with pytest.raises(IdentityMismatch):
        _decode(tiny_llama, other, PROMPT, strict=True)


def test_a_damaged_pack_is_set_aside_with_a_prompt(tiny_llama):
    from muser_cli.errors import KVPackError

    data = bytearray(_pack(tiny_llama, engine_name="torch"))
    data[len(data) // 2] ^= 0xFF
    out = _decode(tiny_llama, bytes(data), PROMPT)
    assert out.source == "local" and "set aside" in out.set_aside
    with pytest.raises(KVPackError):
        _decode(tiny_llama, bytes(data), PROMPT, strict=True)
    with pytest.raises(KVPackError):
        _decode(tiny_llama, bytes(data))


def _muser(*args, cwd):
    return subprocess.run([sys.executable, "-m", "muser_cli.commands", *args], capture_output=True, cwd=cwd,
                          env=dict(os.environ), timeout=HANG_S)


def test_cli_warns_in_one_line_and_strict_exits_65(tiny_llama, tmp_path):
    (tmp_path / "a.txt").write_text(PROMPT)
    (tmp_path / "b.kvpack").write_bytes(_pack(tiny_llama, OTHER, engine_name="torch"))
    r = _muser("decode", "b.kvpack", "--prompt", "a.txt", "-m", str(tiny_llama.path), "-n", "4", "--json",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["source"] == "local" and "prompt" in out["fallback_reason"]
    warn = [line for line in r.stderr.decode().splitlines() if "warning" in line]
    assert len(warn) == 1 and "set aside" in warn[0] and "--strict" in warn[0]
    r = _muser("decode", "b.kvpack", "--prompt", "a.txt", "-m", str(tiny_llama.path), "-n", "4", "--strict",
               cwd=tmp_path)
    assert r.returncode == 65 and len(r.stderr.decode().strip().splitlines()) <= 2
    r = _muser("decode", "b.kvpack", "-m", str(tiny_llama.path), "-n", "4", cwd=tmp_path)
    assert r.returncode == 0  # no prompt: nothing to compare with, the pack's own prompt decodes


def test_verify_audit_samples_the_whole_prompt_too(tiny_llama):
    """``verify --audit 1`` recomputed only the last position: the issue's pack passed it."""
    from muser_cli.gate.verify import verify

    honest = _pack(tiny_llama)
    rows = read_pack(io.BytesIO(honest)).header.rows_end
    last = len(tiny_llama.layers) - 1
    bad = _relabel(honest, "vllm", corrupt=lambda layers: _fault(layers, last, list(range(rows - 1)), "negate-k"))
    good = verify(io.BytesIO(honest), model=str(tiny_llama.path), audit=1)
    assert good.ok and good.summary["audit"]["sampled"]["ok"]
    rep = verify(io.BytesIO(bad), model=str(tiny_llama.path), audit=1)
    assert not rep.ok and "sampled across the prompt" in [c for c in rep.checks if c.name == "audit"][0].detail


def test_a_resident_producer_never_serves_a_foreign_entry_the_gate_refuses(tiny_llama):
    """``prefill --serve --store``: rows put from another engine's pack would otherwise leave
    as the producer's own (its header names its engine, so no consumer would check them)."""
    from muser_cli.reuse import Store
    from muser_cli.pulllane.producer import ResidentProducer
    from tests.pulllane.test_pull_store import DOC, reference, request, same_rows, serve_one

    want = reference(tiny_llama, DOC)[1]
    layers = [LayerKV(l.keys.copy(), l.values.copy(), l.first_row) for l in want.layers]
    _fault(layers, 1, list(range(0, want.header.rows_end, 2)), "negate-k")
    bad = io.BytesIO()
    write_pack(bad, replace(want.header, producer={**want.header.producer, "engine": "vllm"}), layers)
    entry = Store().put(io.BytesIO(bad.getvalue())).entry.id
    prod = ResidentProducer(str(tiny_llama.path), dtype="float32", store=True)
    prod.keep_last = False
    stats, pack = serve_one(prod, request(tiny_llama, DOC))
    assert stats["reused_from"] != "store" and stats["reused_rows"] == 0, stats
    same_rows(pack, want)
    assert entry not in [e.id for e in Store().entries()]


def test_a_delta_put_on_a_foreign_base_is_stored_as_foreign(tiny_llama):
    """``reuse put`` of this engine's delta over another engine's stored base: the merged
    entry holds the other engine's rows too, so it must not pass for this engine's own."""
    from muser_cli.gate.audit import spot_check_reason
    from muser_cli.reuse import Store, api

    Store().put(io.BytesIO(_pack(tiny_llama)))  # the base, made by "vllm"
    longer = PROMPT + " The ferry would run until the first lorry crossed."
    manifest = api.have(longer, model=str(tiny_llama.path), chunk_tokens=8)
    assert manifest.held_tokens > 0
    delta = io.BytesIO()
    prefill(longer, delta, model=str(tiny_llama.path), chunk_tokens=8, dtype="float32", have=manifest)
    assert read_pack(io.BytesIO(delta.getvalue())).header.rows_start > 0
    merged = Store().put(io.BytesIO(delta.getvalue())).entry.id
    header = Store().header_of(merged)
    assert header.producer["engine"] == "torch+vllm"
    assert spot_check_reason(header, engine="torch", dtype="float32") is not None


def test_a_foreign_hybrid_delta_is_checked_in_full_over_its_own_rows(tiny_hybrid):
    """Multi-turn across engines on a sliding-window model: the consumer (MLX) holds the first
    turn's rows, made here; the producer (torch) sends a delta with its sliding history (the
    window before the consumer's prefix and every row after). The gate samples the delta's own
    positions and compares every layer at each; a fault there is refused before any token."""
    pytest.importorskip("mlx.core", reason="mlx not installed")
    pytest.importorskip("mlx_lm", reason="mlx-lm not installed")
    from muser_cli.reuse import api

    first = PROMPT[: len(PROMPT) // 2]
    assert _decode(tiny_hybrid, None, first, engine="mlx", store=True, chunk_tokens=8).stored
    manifest = api.have(PROMPT, model=str(tiny_hybrid.path), chunk_tokens=8, dtype="float32")
    assert manifest.held_tokens > 16  # past the window of 8
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(tiny_hybrid.path), have=manifest)
    delta = read_pack(io.BytesIO(out.getvalue()))
    h = delta.header
    assert h.rows_start > 0 and h.ring_extra == h.rows_end - h.rows_start and h.producer["engine"] == "torch"
    window = min(s.window for s in tiny_hybrid.layers if s.kind == "sliding")
    assert all(l.first_row == (h.rows_start - (window - 1) if s.kind == "sliding" else h.rows_start)
               for l, s in zip(delta.layers, tiny_hybrid.layers))
    got = _decode(tiny_hybrid, out.getvalue(), engine="mlx", audit_seed=5)
    s = got.spot_check["sampled"]
    assert got.source == "delta" and s["ok"] and s["complete"] and min(s["positions"]) >= h.rows_start
    assert got.token_ids == _decode(tiny_hybrid, None, PROMPT, engine="mlx", reuse=False).token_ids

    layer = _above_first_sliding(tiny_hybrid)
    mine = list(range(h.rows_start, h.rows_end - 1))
    bad = _relabel(out.getvalue(), "torch",
                   corrupt=lambda layers: _fault(layers, layer, [p - layers[layer].first_row for p in mine], "scale-v"))
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="sampled across the prompt"):
        _decode(tiny_hybrid, bad, engine="mlx", on_token=tokens.append)
    assert tokens == []


@pytest.mark.parametrize("family", ["tiny_hybrid", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "exaone4",
                                    "muse_glimmer"])
def test_a_hybrid_pack_with_its_history_is_checked_in_one_step_as_position_by_position(family, request):
    """With every layer's rows from position 0, the gate's positions go through one masked
    forward (each layer type its own mask: the window, the chunk) instead of one step each;
    the rows it recomputes are those of the step-by-step recomputation."""
    from muser_cli.gate.audit import prefix_rows

    info = request.getfixturevalue("tiny_hybrid") if family == "tiny_hybrid" else request.getfixturevalue(
        "tiny_family")(family)
    out = io.BytesIO()
    prefill(PROMPT, out, model=str(info.path), chunk_tokens=8, dtype="float32")
    pack = read_pack(io.BytesIO(out.getvalue()))
    h, layers = pack.header, list(pack.layers)
    eng = get_engine("torch", info, dtype="float32", threads=1)
    assert eng.recomputes_at_hybrid(layers, h.rows_end)
    positions = [0, 3, h.rows_end // 3, h.rows_end // 2, h.rows_end - 2, h.rows_end - 1]
    ids = list(h.token_ids)
    one = eng.recompute_at(layers, rows=h.rows_end, positions=positions, token_ids=[ids[p] for p in positions])
    for j, p in enumerate(positions):
        prefix, _ = prefix_rows(h.layers, layers, p)
        step = eng.recompute(prefix, rows=p, token_ids=[ids[p]])
        for i, l in enumerate(step):
            for a, b in ((one[i][0][:, j], l.keys[:, p - l.first_row]), (one[i][1][:, j], l.values[:, p - l.first_row])):
                assert np.allclose(a, b, rtol=1e-4, atol=1e-5), (family, i, p, float(np.abs(a - b).max()))
    checked = sample_check(h, layers, eng, seed=1, reason="test")
    assert checked.method == "one-step" and checked.complete and checked.ok
    no_history = io.BytesIO()
    prefill(PROMPT, no_history, model=str(info.path), chunk_tokens=8, dtype="float32", history=False)
    short = read_pack(io.BytesIO(no_history.getvalue()))
    assert not eng.recomputes_at_hybrid(list(short.layers), short.header.rows_end)
