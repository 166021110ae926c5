"""Grammar libraries for structured output (docs/serve.md, "Structured output"): per-token
mask cost for a small JSON schema with the embedded SmolLM2 tokenizer (49,152 tokens), at 1
and 8 concurrent sequences, compile time, and which JSON Schema keywords each compiles.

Each candidate is imported if it is importable (install them into a scratch folder and put it
on PYTHONPATH: they are not muser's dependencies, except the one chosen):

    pip install --target /tmp/g/ll llguidance==1.9.1
    pip install --target /tmp/g/oc outlines-core==0.2.14
    pip install --target /tmp/g/xg --no-deps xgrammar==0.2.8 apache-tvm-ffi
    PYTHONPATH=/tmp/g/ll:/tmp/g/oc:/tmp/g/xg .venv/bin/python benchmarks/bench_grammar.py

A sequence's steps: the mask before each token of a valid instance (tokenized by the model's
own tokenizer), then the token consumed. Timed: mask + consume, per token, median of reps;
8 sequences: the 8 masks of one step (one after another, and with llguidance's parallel
executor), per step. Writes benchmarks/results/grammar-<UTC>.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bench_args, machine, write_receipt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
INSTANCE = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "kind": "cat"}'

#: one schema per keyword (or group), compiled by each library: which compile.
COVERAGE = {
    "type/properties/required": SCHEMA,
    "enum": {"enum": ["a", "b", 3]},
    "const": {"const": "x"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                       "$ref": "#/$defs/n"},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,5}$"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "format: email": {"type": "string", "format": "email"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": 1, "maximum": 9},
    "exclusiveMinimum (number)": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 3},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "additionalProperties: schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "minProperties": {"type": "object", "minProperties": 1},
    "type list + null": {"type": ["string", "null"]},
    "not": {"not": {"type": "string"}},
    "if/then": {"if": {"type": "string"}, "then": {"minLength": 1}},
}


def _vocab_path() -> Path:
    from muser_cli.model.resolve import resolve_model

    return Path(resolve_model("default").path) / "tokenizer.json"


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


# ------------------------------------------------------------------------- llguidance
def bench_llguidance(tok_json: str, ids: list[int], vocab: int, eos: int, reps: int) -> dict:
    import llguidance
    import llguidance.numpy as lln
    import numpy as np

    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - t0
    executor = llguidance.LLExecutor()

    def run(n: int, parallel: bool) -> list[float]:
        matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(n)]
        mask = lln.allocate_token_bitmask(n, vocab)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            if parallel:
                lln.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
            else:
                for i, m in enumerate(matchers):
                    lln.fill_next_token_bitmask(m, mask, i)
            for m in matchers:
                assert (mask[0, t // 32] >> (t % 32)) & 1, "the instance's token is masked out"
                m.consume_token(t)
            out.append(time.perf_counter() - t0)
        assert all(m.is_accepting() for m in matchers)
        return out

    def cov(schema: dict) -> str:
        try:
            m = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema))
        except Exception as exc:  # noqa: BLE001 - the library's own refusal, recorded
            return f"error: {str(exc)[:120]}"
        return "ok" if not m.is_error() else f"error: {m.get_error()[:120]}"

    return _result(run, reps, tok_s, compile_s, {k: cov(v) for k, v in COVERAGE.items()},
                   parallel=True, version=llguidance.__version__, np=np)


# ------------------------------------------------------------------------- xgrammar
def bench_xgrammar(tok_json: str, ids: list[int], vocab: int, eos: int, reps: int) -> dict:
    from importlib.metadata import version

    import torch
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(_vocab_path()))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    compile_s = time.perf_counter() - t0

    def run(n: int, parallel: bool) -> list[float]:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(n)]
        mask = xgr.allocate_token_bitmask(n, vocab)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
            for m in matchers:
                assert m.accept_token(t), "the instance's token is refused"
            out.append(time.perf_counter() - t0)
        return out

    def cov(schema: dict) -> str:
        try:
            compiler.compile_json_schema(json.dumps(schema))
        except Exception as exc:  # noqa: BLE001
            return f"error: {str(exc)[:120]}"
        return "ok"

    del torch
    return _result(run, reps, tok_s, compile_s, {k: cov(v) for k, v in COVERAGE.items()},
                   parallel=False, version=version("xgrammar"), np=None)


# ------------------------------------------------------------------------- outlines-core
def _byte_vocab(tok_json: str) -> dict[bytes, list[int]]:
    """The tokenizer's tokens as the bytes they stand for (byte-level BPE: GPT-2's byte map)."""
    table = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = table[:], 0
    for b in range(256):
        if b not in table:
            table.append(b)
            chars.append(256 + n)
            n += 1
    decode = {chr(c): b for b, c in zip(table, chars)}
    spec = json.loads(tok_json)
    out: dict[bytes, list[int]] = {}
    special = {t["id"] for t in spec.get("added_tokens", [])}
    for text, i in spec["model"]["vocab"].items():
        if i in special:
            continue
        out.setdefault(bytes(decode[c] for c in text), []).append(i)
    return out


def bench_outlines(tok_json: str, ids: list[int], vocab: int, eos: int, reps: int) -> dict:
    from importlib.metadata import version

    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocabulary = oc.Vocabulary(eos, _byte_vocab(tok_json))
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    compile_s = time.perf_counter() - t0
    import torch

    def run(n: int, parallel: bool) -> list[float]:
        guides = [oc.Guide(index) for _ in range(n)]
        mask = torch.zeros((n, (vocab + 31) // 32), dtype=torch.int32)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            for i, g in enumerate(guides):
                row = mask[i]
                g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
            for g in guides:
                g.advance(t, return_tokens=False)
            out.append(time.perf_counter() - t0)
        return out

    def cov(schema: dict) -> str:
        try:
            oc.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException
            return f"error: {str(exc)[:120]}"
        return "ok"

    return _result(run, reps, tok_s, compile_s, {k: cov(v) for k, v in COVERAGE.items()},
                   parallel=False, version=version("outlines-core"), np=None)


def _result(run, reps: int, tok_s: float, compile_s: float, coverage: dict, *, parallel: bool,
            version: str, np) -> dict:
    run(1, False)  # warm-up
    one = [s for _ in range(reps) for s in run(1, False)]
    eight = [s for _ in range(reps) for s in run(8, False)]
    out = {
        "version": version,
        "tokenizer_setup_s": round(tok_s, 3),
        "compile_s": round(compile_s, 4),
        "per_token_us_1seq": _median_us(one),
        "per_step_us_8seq": _median_us(eight),
        "p90_per_token_us_1seq": round(sorted(one)[int(0.9 * len(one))] * 1e6, 1),
        "coverage": coverage,
        "keywords_ok": sum(v == "ok" for v in coverage.values()),
    }
    if parallel:
        out["per_step_us_8seq_parallel"] = _median_us([s for _ in range(reps) for s in run(8, True)])
    return out


def main() -> None:
    args = bench_args(reps=5)
    from tokenizers import Tokenizer

    path = _vocab_path()
    tok_json = path.read_text()
    tok = Tokenizer.from_str(tok_json)
    vocab = 49152
    eos = 2
    ids = tok.encode(INSTANCE, add_special_tokens=False).ids
    results: dict = {}
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines)):
        try:
            results[name] = fn(tok_json, ids, vocab, eos, args.reps)
        except ImportError as exc:
            results[name] = {"skipped": f"not importable: {exc}"}
        print(name, json.dumps(results[name], indent=1), flush=True)
    payload = {"schema": SCHEMA, "instance": INSTANCE, "instance_tokens": len(ids), "vocab": vocab,
               "reps": args.reps, "results": results, "machine": machine()}
    print(write_receipt("grammar", payload))


if __name__ == "__main__":
    main()
