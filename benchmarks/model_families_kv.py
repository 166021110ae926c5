"""KV bytes per token and kvpack payload at 8k / 32k / 128k tokens for each family's
default config (transformers' config class defaults, no weights), in bfloat16, against a
baseline with every layer full attention and one KV head per attention head (MHA): what
sliding rings, chunked layers and GQA save (a chunked layer's payload depends on where the
prompt ends in its chunk: at these depths, multiples of Llama 4's 8,192, its rows end one
short of a chunk boundary, 8,191 rows, the most it carries without the ring row reaching
back a chunk). Prints a Markdown table (docs/models.md). Reads config.json only.

    PYTHONPATH=. python benchmarks/model_families_kv.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from muser_cli.model.check import check
from muser_cli.model.config import text_config

CLASSES = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "cohere2": "Cohere2Config",
    "muse_glimmer": "MuseGlimmerConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config",
    "olmo2": "Olmo2Config", "smollm3": "SmolLM3Config", "granite": "GraniteConfig", "glm4": "Glm4Config",
    "exaone4": "Exaone4Config", "gpt_oss": "GptOssConfig", "llama4_text": "Llama4TextConfig",
}
DEPTHS = (8192, 32768, 131072)


def main() -> None:
    import json

    import transformers

    print("| model_type | layers (full / sliding, window) | KV B/token below any window | MHA all-full B/token | "
          + " | ".join(f"payload at {d // 1024}k" for d in DEPTHS) + " | MHA all-full at 128k |")
    print("|---|---|---|---|" + "---|" * len(DEPTHS) + "---|")
    for name, cls in CLASSES.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            getattr(transformers, cls)().save_pretrained(tmp)
            config = text_config(json.loads((Path(tmp) / "config.json").read_text()))
            reports = [check(tmp, tokens=d, dtype="bfloat16") for d in DEPTHS]
        r = reports[0]
        full = sum(c["layers"] for c in r["classes"] if c["kind"] == "full")
        windows = sorted({c["window"] for c in r["classes"] if c["window"]})
        windows += sorted({f"chunk {c['chunk']}" for c in r["classes"] if c.get("chunk")})
        heads = int(config["num_attention_heads"])
        head_dim = r["classes"][0]["head_dim"]
        mha = r["layers"] * heads * head_dim * 2 * 2
        plan = f"{r['layers']} ({full} / {r['layers'] - full}{', ' + '/'.join(map(str, windows)) if windows else ''})"
        cells = " | ".join(f"{x['payload_bytes'] / 2**30:.2f} GiB" for x in reports)
        print(f"| {name} | {plan} | {r['kv_bytes_per_token']:,} | {mha:,} | {cells} | "
              f"{mha * (DEPTHS[-1] - 1) / 2**30:.1f} GiB |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
