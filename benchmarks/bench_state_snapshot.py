"""The cost of a state snapshot per chunk in the V3 stream (issue #27): bytes and time against
the chunk's compute, on the torch engine, with Qwen3-Next's real state shapes.

The model: the tiny qwen3_next folder (its tokenizer, vocab 512) with transformers'
``Qwen3NextConfig()`` defaults for everything the cache holds -- gated DeltaNet layers of 16
key heads and 32 value heads of 128 x 128, conv kernel 4 (a snapshot: conv (8192, 3) and
recurrent (32, 128, 128), float32, 2,195,456 B) and gated full attention of 16 heads, 2 KV
heads x 256 -- in the real 3:1 pattern over ``--layers`` layers (default 4: 3 state, 1 full),
hidden ``--hidden`` (default 512), a dense MLP of ``2 x hidden`` on every layer (no experts),
random weights (seed 0), saved with ``save_pretrained``. ``--tokens`` tokens (rows: one fewer)
are prefilled in chunks of ``--chunk`` on one thread (torch and the pack writer), streaming
the pack's frames to a sink that counts and drops them, as ``prefill`` streams them
(``FrameEmitter`` on the engine's ``on_chunk``, ``PackWriter``), in two modes:

* ``every``: as shipped -- the engine records every state layer's snapshot at each chunk's
  end (``engines/torch/state.record``) and the pack carries one per chunk (``state_every`` 1);
* ``end``: the header's ``state_every`` is 65,536 (a snapshot at the end only) and this
  script turns ``state.record`` into a no-op (the engine has no switch for it; the last
  snapshot is then read from the live cache, as ``state.rows_of`` does at the end).

Per chunk it times the model's forward (``TorchEngine._forward``), the snapshot recording
and the frame emitting (extraction + encoding + hashing + the sink), and reports each mode's
totals. Modes alternate (every, end, every, ...) after one warm-up each; ``--reps`` each.

    python benchmarks/bench_state_snapshot.py --reps 5
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import bench_args, run, stderr, summarize, write_receipt

STATE_SHAPES = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_attention_heads": 16,
                "num_key_value_heads": 2, "head_dim": 256}  # as Qwen3NextConfig() has them (checked below)


class CountingSink:
    """A binary stream that counts what it is given and keeps none of it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.n += size
        return size

    def flush(self) -> None:
        pass


def real_shaped(directory: Path, layers: int, hidden: int) -> Path:
    import torch
    import transformers

    from muser_cli.model.resolve import add_top_level_rope_theta
    from muser_cli.model.tiny import make_tiny

    default = transformers.Qwen3NextConfig()
    assert all(getattr(default, k) == v for k, v in STATE_SHAPES.items()), "Qwen3NextConfig's defaults changed"
    make_tiny("qwen3_next", directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(STATE_SHAPES, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                  mlp_only_layers=list(range(layers)), max_position_embeddings=8192,
                  layer_types=[default.layer_types[i % 4] for i in range(layers)])
    cfg = transformers.Qwen3NextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "dtype")})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(str(directory))
    add_top_level_rope_theta(directory)
    return directory


def one_run(eng, info, ids: list[int], chunk: int, mode: str) -> dict:
    from muser_cli.engines.torch import state
    from muser_cli.kvpack import PackWriter
    from muser_cli.kvpack.format import MAX_STATE_EVERY
    from muser_cli.produce.pipeline import FrameEmitter, pack_header

    header = pack_header(info, ids, dtype=eng.dtype, chunk_tokens=chunk, engine="torch", threads=1, eng=eng)
    if mode == "end":
        header = replace(header, state_every=MAX_STATE_EVERY)
    sink = CountingSink()
    writer = PackWriter(sink, header)
    emitter = FrameEmitter(writer, sink)
    forward, record, emit = [], [], []
    state_bytes = row_bytes = 0
    real_forward, real_record, real_write = eng._forward, state.record, writer.write_frame

    def timed_forward(*a, **kw):
        t = time.perf_counter()
        out = real_forward(*a, **kw)
        forward.append(time.perf_counter() - t)
        return out

    def timed_record(*a, **kw):
        t = time.perf_counter()
        if mode == "every":
            real_record(*a, **kw)
        record.append(time.perf_counter() - t)

    def counted_write(layer, start, keys, values):
        nonlocal state_bytes, row_bytes
        before = sink.n
        real_write(layer, start, keys, values)
        if info.layers[layer].kind == "state":
            state_bytes += sink.n - before
        else:
            row_bytes += sink.n - before

    def timed_emit(done, rows_of):
        t = time.perf_counter()
        emitter(done, rows_of)
        emit.append(time.perf_counter() - t)

    eng._forward, state.record, writer.write_frame = timed_forward, timed_record, counted_write
    try:
        t0 = time.perf_counter()
        eng.prefill(ids[:-1], chunk_tokens=chunk, on_chunk=timed_emit)
        t_emit_end = time.perf_counter()
        writer.finish()
        total = time.perf_counter() - t0
        finish = time.perf_counter() - t_emit_end
    finally:
        del eng._forward
        state.record = real_record
    return {"mode": mode, "total_s": total, "forward_s": forward, "record_s": record, "emit_s": emit,
            "finish_s": finish, "bytes": sink.n, "state_frame_bytes": state_bytes, "row_frame_bytes": row_bytes}


def main() -> int:
    args = bench_args(tokens=2049, chunk=256, reps=5, layers=4, hidden=512, dtype="float32")
    os.environ["MUSER_KVPACK_THREADS"] = "1"  # the writer hashes inline, on this one thread
    from muser_cli.engines.registry import get_engine
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tokens import encode_prompt
    from muser_cli.model.tiny import _CORPUS

    tmp = Path(tempfile.mkdtemp(prefix="state-snap-"))
    try:
        info = resolve_model(real_shaped(tmp / "qwen3-next-shaped", args.layers, args.hidden))
        text = _CORPUS
        while len(ids := encode_prompt(info, text)) < args.tokens:
            text += _CORPUS
        ids = ids[: args.tokens]
        eng = get_engine("torch", info, dtype=args.dtype, threads=1)
        specs = [s.to_json() for s in info.layers]
        stderr(json.dumps({"layers": [s["kind"] for s in specs], "rows": len(ids) - 1}))
        runs: dict[str, list[dict]] = {"every": [], "end": []}
        for rep in range(args.reps + 1):
            for mode in ("every", "end"):
                r = one_run(eng, info, ids, args.chunk, mode)
                stderr(json.dumps({"rep": rep, "mode": mode, "total_s": round(r["total_s"], 4),
                                   "forward_s": round(sum(r["forward_s"]), 4), "record_s": round(sum(r["record_s"]), 4),
                                   "emit_s": round(sum(r["emit_s"]), 4), "bytes": r["bytes"]}))
                if rep:  # rep 0: the warm-up
                    runs[mode].append(r)
        summary = {}
        for mode, rs in runs.items():
            per_chunk_forward = [f for r in rs for f in r["forward_s"]]
            summary[mode] = {
                "total_s": summarize([r["total_s"] for r in rs]),
                "forward_s": summarize([sum(r["forward_s"]) for r in rs]),
                "record_s": summarize([sum(r["record_s"]) for r in rs]),
                "emit_s": summarize([sum(r["emit_s"]) for r in rs]),
                "finish_s": summarize([r["finish_s"] for r in rs]),
                "per_chunk_forward_s": summarize(per_chunk_forward),
                "per_chunk_record_s": summarize([f for r in rs for f in r["record_s"]]),
                "per_chunk_emit_s": summarize([f for r in rs for f in r["emit_s"]]),
                "bytes": rs[0]["bytes"], "state_frame_bytes": rs[0]["state_frame_bytes"],
                "row_frame_bytes": rs[0]["row_frame_bytes"], "chunks": len(rs[0]["forward_s"]),
            }
        every, end = runs["every"], runs["end"]
        extra = [(a["total_s"] - b["total_s"]) / sum(b["forward_s"]) for a, b in zip(every, end)]
        direct = [(sum(r["record_s"]) + sum(r["emit_s"]) - sum(e["emit_s"])) / sum(r["forward_s"])
                  for r, e in zip(every, end)]
        summary["every_minus_end_over_forward"] = summarize(extra)
        summary["record_plus_extra_emit_over_forward"] = summarize(direct)
        summary["median_shares"] = {
            "record_over_forward": statistics.median(sum(r["record_s"]) / sum(r["forward_s"]) for r in every),
            "emit_every_over_forward": statistics.median(sum(r["emit_s"]) / sum(r["forward_s"]) for r in every),
            "emit_end_over_forward": statistics.median(sum(r["emit_s"]) / sum(r["forward_s"]) for r in end),
        }
        stderr(json.dumps(summary, default=str)[:4000])
        print(write_receipt("state-snapshot", {
            "what": __doc__.splitlines()[0], "args": vars(args), "layers": specs,
            "config": {k: v for k, v in json.loads((info.path / "config.json").read_text()).items()
                       if k in (*STATE_SHAPES, "num_hidden_layers", "hidden_size", "intermediate_size", "layer_types",
                                "mlp_only_layers", "vocab_size")},
            "summary": summary, "runs": runs}))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    run(main)
