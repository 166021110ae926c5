"""Bytes a prompt costs with recurrent-state layers against the same model all attention
(issue #27), from transformers' default ``Qwen3NextConfig()`` and ``GraniteMoeHybridConfig()``.

Config only (no weights): each default config is saved as a config.json, then a copy whose
every layer is a full-attention layer (``layer_types`` all ``full_attention``,
so the same KV heads and head dims as the hybrid's attention layers). ``muser model check``'s
own pricing (:func:`muser_cli.model.check.check`, as ``muser model check --tokens N --json``
prints it) gives the payload of each at 8k/32k/128k tokens: the hybrid's full layers' rows
plus one snapshot per state layer (float32, as both engines write it), against the rows of
every layer. Beside it, what a pack streamed on the default 512-token grid carries with a
snapshot every chunk (``state_every`` 1, every superseded snapshot counted) and every 16
chunks: the frame plan's decoded bytes (:meth:`PackHeader.total_raw_bytes`), before any codec.
Rows in ``--dtype`` (bfloat16: the real checkpoints' dtype). Bytes only (deterministic): no
timing, so no repetitions.

    python benchmarks/bench_state_bytes.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from _common import bench_args, run, stderr, write_receipt

FAMILIES = {"qwen3_next": "Qwen3NextConfig", "granitemoehybrid": "GraniteMoeHybridConfig"}
DEPTHS = (8192, 32768, 131072)


def streamed_bytes(config_file: Path, tokens: int, chunk: int, state_every: int, dtype: str) -> int:
    """Decoded bytes of a full pack of ``tokens`` on a ``chunk`` grid, by the kvpack frame plan."""
    from muser_cli.kvpack import PackHeader
    from muser_cli.model.config import STATE_DTYPE, cache_plan, read_json

    specs = cache_plan(read_json(config_file), state_dtype=STATE_DTYPE)
    every = state_every if any(s.kind == "state" for s in specs) else 1
    header = PackHeader(model_fingerprint="-", tokenizer_fingerprint="-", token_ids=tuple([0] * tokens),
                        layers=specs, dtype=dtype, chunk_tokens=chunk, state_every=every)
    return header.total_raw_bytes()


def main() -> int:
    args = bench_args(dtype="bfloat16", chunk=512, state_every=16)
    import transformers

    from muser_cli.model.check import check

    tmp = Path(tempfile.mkdtemp(prefix="state-bytes-"))
    try:
        out: dict = {}
        for family, class_name in FAMILIES.items():
            hybrid = tmp / family
            getattr(transformers, class_name)().save_pretrained(str(hybrid))
            data = json.loads((hybrid / "config.json").read_text())
            n = int(data["num_hidden_layers"])
            key = "layer_types"
            allattn = tmp / f"{family}-all-attention"
            allattn.mkdir()
            (allattn / "config.json").write_text(json.dumps({**data, key: ["full_attention"] * n}, indent=1))
            shape = check(str(hybrid))
            entry = {"config_class": class_name, "layers": n, "layer_types_counts":
                     {t: data[key].count(t) for t in sorted(set(data[key]))},
                     "config_dtype": data.get("dtype") or data.get("torch_dtype"),
                     "classes": [{k: c[k] for k in ("kind", "layers", "shape", "kv_heads", "head_dim",
                                                     "bytes_per_token_per_layer") if k in c}
                                 | ({"state_bytes_per_layer": c["state_bytes_per_layer"]} if c["kind"] == "state" else {})
                                 for c in shape["classes"]],
                     "all_attention_classes": [{k: c[k] for k in ("kind", "layers", "kv_heads", "head_dim",
                                                                  "bytes_per_token_per_layer")}
                                               for c in check(str(allattn))["classes"]],
                     "depths": []}
            for tokens in DEPTHS:
                h = check(str(hybrid), tokens=tokens, dtype=args.dtype)
                a = check(str(allattn), tokens=tokens, dtype=args.dtype)
                row = {"tokens": tokens, "hybrid_payload_bytes": h["payload_bytes"],
                       "hybrid_state_bytes": sum(c["payload_bytes"] for c in h["classes"] if c["kind"] == "state"),
                       "hybrid_row_bytes": sum(c["payload_bytes"] for c in h["classes"] if c["kind"] != "state"),
                       "all_attention_payload_bytes": a["payload_bytes"],
                       "all_attention_over_hybrid": round(a["payload_bytes"] / h["payload_bytes"], 2),
                       "streamed_every_chunk_bytes": streamed_bytes(hybrid / "config.json", tokens, args.chunk, 1, args.dtype),
                       f"streamed_state_every_{args.state_every}_bytes":
                           streamed_bytes(hybrid / "config.json", tokens, args.chunk, args.state_every, args.dtype),
                       "streamed_all_attention_bytes": streamed_bytes(allattn / "config.json", tokens, args.chunk, 1,
                                                                      args.dtype)}
                entry["depths"].append(row)
                stderr(json.dumps({"family": family, **row}))
            out[family] = entry
        print(write_receipt("state-bytes", {"what": __doc__.splitlines()[0], "args": vars(args),
                                            "transformers": transformers.__version__, "families": out}))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    run(main)
