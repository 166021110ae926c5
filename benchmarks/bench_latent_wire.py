"""Bytes on the wire per token for latent (MLA) layers against the expanded per-head K and V
(issue #27), on a model with DeepSeek-V3's real cache shapes.

DeepSeek-V3's cache is set by its attention's ranks and heads alone (``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64, 128 heads of ``qk_nope_head_dim`` 128 + ``v_head_dim`` 128), not by
its hidden size or experts: this builds a 2-layer random ``DeepseekV3Config`` with exactly
those (hidden 256, dense, vocab 512), prefills ``--tokens`` tokens on the torch engine in
bfloat16, and measures the pack's bytes (raw and zstd+bytegroup) and the per-head K and V
that the model's own ``kv_b_proj`` expands the same rows to (``engines/torch/latent.expand``).
Then ``muser model check``'s arithmetic for the real DeepSeek-V3 (61 layers) at 8k/32k/128k.
Bytes only (deterministic): no timing, so no repetitions.

    python benchmarks/bench_latent_wire.py --tokens 512
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

from _common import bench_args, run, stderr, write_receipt

V3_CACHE = {"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64, "q_lora_rank": 64}


def v3_shaped(directory: Path) -> Path:
    """The tiny deepseek_v3 folder (tokenizer and all) with DeepSeek-V3's cache shapes, 2 dense layers."""
    import torch
    import transformers

    from muser_cli.model.resolve import add_top_level_rope_theta
    from muser_cli.model.tiny import make_tiny

    make_tiny("deepseek_v3", directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(V3_CACHE, num_hidden_layers=2, first_k_dense_replace=2, hidden_size=256, intermediate_size=256,
                  max_position_embeddings=4096)
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures", "dtype")})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(str(directory))
    add_top_level_rope_theta(directory)
    return directory


def main() -> int:
    args = bench_args(tokens=512)
    from muser_cli.engines.registry import get_engine
    from muser_cli.engines.torch import latent
    from muser_cli.kvpack import read_pack_bytes, write_pack
    from muser_cli.model.check import check
    from muser_cli.model.resolve import resolve_model
    from muser_cli.produce.prefill import prefill
    from muser_cli.model.tiny import _CORPUS

    tmp = Path(tempfile.mkdtemp(prefix="latent-wire-"))
    try:
        info = resolve_model(v3_shaped(tmp / "v3-shaped"))
        from muser_cli.model.tokens import encode_prompt

        text = _CORPUS
        while len(encode_prompt(info, text)) < args.tokens:  # about --tokens tokens, whole corpus copies
            text += _CORPUS
        out = io.BytesIO()
        prefill(text, out, model=str(info.path), dtype="bfloat16", chunk_tokens=512, threads=2)
        raw = out.getvalue()
        pack = read_pack_bytes(raw)
        rows = pack.header.rows_end
        z = io.BytesIO()
        write_pack(z, pack.header, list(pack.layers), codec="zstd+bytegroup", level=1)
        eng = get_engine("torch", info, dtype="bfloat16", threads=2)
        k, v = latent.expand(eng, 0, pack.layers[0])
        layers = len(pack.header.layers)
        measured = {
            "tokens": rows + 1, "rows": rows, "layers": layers, "dtype": "bfloat16",
            "pack_bytes_raw": len(raw), "pack_bytes_zstd_bytegroup": len(z.getvalue()),
            "payload_bytes_per_token_per_layer": pack.stored_bytes / rows / layers,
            "wire_bytes_per_token_per_layer_raw": len(raw) / rows / layers,
            "wire_bytes_per_token_per_layer_zstd": len(z.getvalue()) / rows / layers,
            "expanded_bytes_per_token_per_layer": (k.numel() + v.numel()) * k.element_size() / rows,
            "expanded_shapes": [list(k.shape), list(v.shape)],
        }
        measured["expanded_over_latent_wire_raw"] = (measured["expanded_bytes_per_token_per_layer"]
                                                     / measured["wire_bytes_per_token_per_layer_raw"])
        stderr(json.dumps(measured))
        import transformers

        real = tmp / "DeepSeek-V3"
        transformers.DeepseekV3Config().save_pretrained(str(real))
        priced = []
        for tokens in (8192, 32768, 131072):
            r = check(str(real), tokens=tokens)
            priced.append({"tokens": tokens, "latent_payload_bytes": r["payload_bytes"],
                           "expanded_payload_bytes": r["expanded_payload_bytes"],
                           "ratio": r["classes"][0]["expanded_over_latent"]})
            stderr(json.dumps(priced[-1]))
        print(write_receipt("latent-wire", {"what": __doc__.splitlines()[0], "args": vars(args),
                                            "measured_v3_shaped": measured, "deepseek_v3_priced": priced}))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    run(main)
