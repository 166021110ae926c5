"""The engine interface: one model runtime (torch, mlx, vllm) behind one contract.

Roles, declared in the type (never probed):
  * :class:`Producer`: :meth:`Producer.prefill` runs the canonical schedule over prompt[:-1]
    and returns the per-layer rows a kvpack carries (and, as abilities within the role,
    resumes a prefill from stored rows, streams its chunks, prefills several prompts at once);
  * :class:`Consumer`: installs rows and decodes, starting with the last prompt token (the
    consumer's first step, which yields the first logits), and recomputes rows for the gate.
    Its unit is a sequence handle (:class:`muser_cli.engines.sequence.Sequence`):
    :meth:`Consumer.open` installs rows and computes the first step, :meth:`Consumer.fork`
    makes more sequences from that same first step (a request's ``n`` choices), and
    :meth:`Consumer.run` steps one to its end; :meth:`Consumer.decode` is open, then run.

An engine is one or both (torch and mlx are both; vllm is a :class:`Producer` only). What
every engine has (its model, dtype, threads, the shared checks, ``close``, ``warm_up``,
``producer_info``) is on :class:`Engine`, their common base. Code that needs a role checks
it by type: :func:`muser_cli.engines.registry.consumer_class` before loading an engine.

Engines import kvpack types, never the other way round. Heavy frameworks are imported
inside the engine module only, and engine modules are imported lazily by :func:`muser_cli.engines.registry.get_engine`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import numpy as np

    from muser_cli.engines.sequence import Sequence as SequenceHandle

from muser_cli.errors import DataError, PromptTooLong, UsageError
from muser_cli.kvpack.layers import LOCAL_KINDS, LayerKV
from muser_cli.model.info import ModelInfo, ProgressFn
from muser_cli.schedule import DEFAULT_CHUNK_TOKENS

#: rows_of(layer, lo, hi) -> (keys, values): absolute rows [lo, hi) of one layer, as
#: (kv_heads, hi - lo, head_dim) arrays in the storage dtype, read from the live cache.
RowsOf = Callable[[int, int, int], "tuple[np.ndarray, np.ndarray]"]
#: on_chunk(rows_done, rows_of): called after each prefill chunk (and once after installed
#: rows, when continuing); every row below ``rows_done`` is final from then on.
ChunkFn = Callable[[int, RowsOf], None]

#: One picked token's log-probabilities: (its logprob, [(token id, logprob), ...] the most likely
#: ``Sampling.logprobs`` tokens, most likely first). Log-softmax of the model's raw logits.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class Sampling:
    """How each token is picked. The logits are shaped first, in this order, for engines with
    :attr:`Consumer.shapes_logits`: ``repetition_penalty`` (transformers' rule: the logit of each
    token already seen, in ``seen`` -- the prompt -- or generated, divided by it where positive,
    multiplied by it where negative), then ``frequency_penalty * count + presence_penalty *
    (count > 0)`` subtracted from each token's logit (count: how often it was *generated* so far
    in this sequence, the prompt not counted: OpenAI's definition), then ``logit_bias`` added;
    then the pick (temperature 0: the largest shaped logit), or temperature, then ``top_k`` (only
    the tokens whose logit is at least the k-th largest stay; 0: off), ``top_p`` (over what
    top-k left, renormalised) and ``min_p`` (a token whose probability is below ``min_p`` times
    the most likely one's goes; 0: off), transformers' order, then a sample of what stays.

    ``logprobs``: None records nothing; k (0..20) appends, for every token given out and before
    it is given out, a :data:`TokenLogprobs` with the k most likely tokens to ``record``: the
    log-softmax of the model's raw logits of that step (before penalties, bias, temperature and
    top-p: the model's own distribution, as vLLM's default ``raw_logprobs``).

    ``constraint``: a grammar the tokens keep to (:class:`muser_cli.engines.constraint.Constraint`,
    structured output): each sequence takes its own matcher from it, whose mask of the tokens that
    may come next is applied to the shaped logits before temperature and top-p (every other token
    at minus infinity; an end token only where the grammar accepts), the first pick included."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seen: tuple[int, ...] = field(default=(), compare=False, hash=False, repr=False)  # the prompt's ids
    logprobs: int | None = None
    record: list | None = field(default=None, compare=False, hash=False, repr=False)
    constraint: Any = field(default=None, compare=False, hash=False, repr=False)  # a Constraint, or None

    @property
    def shapes(self) -> bool:
        """Whether the logits are shaped before the pick (a penalty or a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.repeats)

    @property
    def repeats(self) -> bool:
        """Whether a repetition penalty is asked."""
        return self.repetition_penalty != 1.0

    @property
    def filters(self) -> bool:
        """Whether a sample is drawn from fewer than all tokens (top-k, top-p or min-p)."""
        return bool(self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclass
class DecodeResult:
    token_ids: list[int]
    ttft_s: float  # installing KV + the first step (the last prompt token) -> first new token
    decode_s: float  # time for the remaining tokens after the first
    stats: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """What every engine has, whatever its role: the model it loaded, its dtype and threads,
    how its packs lay out sliding rows, and the shared checks. Its roles are
    :class:`Producer` and :class:`Consumer`."""

    name: str = "?"

    def __init__(self, info: ModelInfo, *, dtype: str, threads: int) -> None:
        self.info = info
        self.dtype = dtype
        self.threads = threads

    #: Rows beyond ``window - 1`` that :meth:`Producer.prefill` gives each sliding layer (a
    #: pack's ``ring_extra``, docs/kvpack.md 1.3): with one, a consumer's spot-check recomputes
    #: the last position of every sliding layer exactly. :meth:`Consumer.open` takes rows with
    #: or without them (the oldest extra rows are dropped: decoding needs ``window - 1``).
    RING_EXTRA: int = 0
    #: The engine's own limit on a prompt's tokens below the model's context (vLLM's
    #: ``max_model_len``), or None: the model's context is the only limit.
    max_model_len: int | None = None
    #: True when the engine takes engine options (``--vllm-opt``: vLLM's engine arguments);
    #: the registry refuses options for the others.
    takes_options: bool = False
    #: True when the engine can give its sliding layers every row a prefill computed (the
    #: *sliding history*, docs/kvpack.md 1.3), so that another engine's numeric gate can
    #: recompute every layer at any position of the pack.
    writes_history: bool = False
    #: Set by a producer (``prefill --history``, on by default where the engine can): the
    #: packs it makes carry the sliding history. A consumer leaves it off.
    history: bool = False

    @property
    def has_local_layers(self) -> bool:
        """Whether the model has a sliding-window or chunked layer (one that carries its last rows)."""
        return any(s.kind in LOCAL_KINDS for s in self.info.layers)

    @property
    def ring_extra(self) -> int:
        """:attr:`RING_EXTRA` for a model with a sliding or chunked layer, else 0."""
        return self.RING_EXTRA if self.has_local_layers else 0

    @property
    def keeps_history(self) -> bool:
        """Whether this engine's packs carry the sliding history (:attr:`history` asked, the
        engine able, the model with a sliding layer)."""
        return self.history and self.writes_history and self.has_local_layers

    def pack_ring_extra(self, end: int, start: int = 0) -> int:
        """The ``ring_extra`` of a pack of rows [start, end) made by this engine: with the
        sliding history, ``end - start`` (every sliding layer then carries each row computed
        since ``start``, and the ``window - 1`` before it); else :attr:`ring_extra`."""
        if self.keeps_history:
            return max(self.ring_extra, end - start)
        return self.ring_extra

    def close(self) -> None:
        """Let go of what the engine holds beyond memory (vLLM's processes, spool folders, a
        consumer's stepper thread). Engines that hold nothing leave it a no-op."""

    def warm_up(self) -> None:
        """Run the model once on a throwaway cache, so the first real step pays no
        first-call costs (allocations, kernel selection). Called while a pack is still
        arriving; changes no state a decode depends on. Engines may leave it a no-op."""

    def producer_info(self) -> dict:
        """What this engine records in a kvpack's ``producer`` field (versions, backend)."""
        return {}

    # -------------------------------------------------------------- shared checks
    def _vocab_size(self) -> int:
        """The loaded model's vocabulary size (engines that check ids override it)."""
        raise NotImplementedError

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        vocab = self._vocab_size()
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise DataError(f"token id {bad[0]} is outside the model's vocabulary of {vocab}")
        return ids

    def _check_prompt(self, token_ids: Sequence[int], rows: int = 0) -> list[int]:
        """A prefill's ``token_ids`` checked, after ``rows`` installed positions: ids in the
        vocabulary, and the whole prompt (these and the last token, still to come) within the
        model's context."""
        ids = self._check_ids(token_ids)
        total = rows + len(ids)
        if total >= self.info.max_positions:
            raise PromptTooLong(
                f"prompt is {total + 1} tokens, longer than the model's context of {self.info.max_positions}"
            )
        return ids

    def _check_resume(self, rows: int, token_ids: Sequence[int], chunk_tokens: int,
                      anywhere: bool = False) -> list[int]:
        """:meth:`prefill_from`'s ``token_ids`` checked (:meth:`_check_prompt`) for a prefill that
        resumes at ``rows`` (> 0): only at a chunk boundary of ``chunk_tokens`` unless ``anywhere``."""
        if chunk_tokens < 1 or (rows % chunk_tokens and not anywhere):
            raise UsageError(f"a prefill resumes only at a chunk boundary: {rows} rows, chunk {chunk_tokens}")
        return self._check_prompt(token_ids, rows)

    def _check_decode_args(self, rows: int, next_tokens: Sequence[int], max_new_tokens: int) -> list[int]:
        nxt = self._check_ids(next_tokens)
        if not nxt:
            raise UsageError("decode needs at least one next token (the last prompt token)")
        if rows < 0 or max_new_tokens < 0:
            raise UsageError(f"rows ({rows}) and max_new_tokens ({max_new_tokens}) must not be negative")
        if rows + len(nxt) + max_new_tokens > self.info.max_positions:
            raise PromptTooLong(
                f"prompt is {rows + len(nxt)} tokens plus {max_new_tokens} new tokens, "
                f"longer than the model's context of {self.info.max_positions}",
                hint="ask for fewer new tokens or use a shorter prompt",
            )
        return nxt


class Producer(Engine):
    """The producer role: prompt tokens in, the rows a kvpack carries out."""

    @abc.abstractmethod
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: ProgressFn | None = None,
    ) -> list[LayerKV]:
        """Prefill ``token_ids`` (the caller passes prompt[:-1]) in fixed chunks.

        Returns one :class:`LayerKV` per layer: full layers carry every row,
        sliding layers their last ``window - 1`` rows, in the storage dtype.
        """

    # ---------------------------------------------------------- abilities within the role
    #: True when :meth:`prefill_from` can continue a prefill from installed rows
    #: (reuse and delta start from a stored prefix instead of position 0).
    resumes_prefill: bool = False
    #: True when :meth:`prefill` and :meth:`prefill_from` take ``on_chunk`` (a
    #: :data:`ChunkFn`), so a producer can write each chunk's frames as it finishes.
    streams_prefill: bool = False
    #: True when :meth:`prefill_many` computes several prompts together (vLLM): the resident
    #: producer then batches concurrent requests (:meth:`set_max_batch` sets how many).
    batches_prefill: bool = False

    def prefill_from(
        self,
        layers: Sequence[LayerKV],
        *,
        rows: int,
        token_ids: Sequence[int],
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: ProgressFn | None = None,
        anywhere: bool = False,
    ) -> list[LayerKV]:
        """Continue the canonical schedule from ``layers`` (the cache as of ``rows`` positions,
        a chunk boundary) over ``token_ids``; returns what :meth:`prefill` over all the tokens
        returns, byte for byte. ``anywhere``: ``rows`` may be any position (a server's turn
        memory, docs/serve.md): the chunks then start at ``rows``, a schedule break, and the
        result is a prefill on that schedule, not the canonical one. Only engines with
        :attr:`resumes_prefill` implement it."""
        raise UsageError(f"the {self.name} engine cannot continue a prefill from stored rows")

    def prefill_many(self, prompts: Sequence[Sequence[int]], *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     return_exceptions: bool = False) -> list:
        """Several prompts' rows computed together, one :meth:`prefill` result (or, with
        ``return_exceptions``, an exception) per prompt. Only engines with
        :attr:`batches_prefill` implement it."""
        raise UsageError(f"the {self.name} engine cannot prefill several prompts together")

    def set_max_batch(self, n: int) -> None:
        """How many prompts one :meth:`prefill_many` may run at once. Only engines with
        :attr:`batches_prefill` implement it."""
        raise UsageError(f"the {self.name} engine cannot prefill several prompts together")


class Consumer(Engine):
    """The consumer role: rows in, tokens out, through sequence handles
    (:class:`muser_cli.engines.sequence.Sequence`); and rows recomputed for the gate.

    * :meth:`open` installs rows and computes the first step (the fused gate, ``check_first``,
      judges its rows before anything is picked); the handle holds its first token, picked by
      its own :class:`Sampling`;
    * :meth:`fork` gives more handles from an opened one's first step, before it runs: each its
      own copy of the cache and its own picker (a request's ``n`` choices install the rows and
      compute the first step once);
    * :meth:`run` steps a handle to its end (its ``max_new_tokens``, an end token). Handles run
      on threads of their own step together in one batched call per step once
      :meth:`batch_decode` is on (:func:`muser_cli.engines.sequence.run_together`).

    :meth:`decode` is :meth:`open` then :meth:`run`: one path."""

    @abc.abstractmethod
    def open(
        self,
        layers: Sequence[LayerKV],
        *,
        rows: int,
        next_tokens: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_on_eos: bool = True,
        chunk_tokens: int | None = None,
        adopt: bool = False,
        check_first: Callable[[RowsOf], None] | None = None,
    ) -> SequenceHandle:
        """Install ``layers`` (covering positions [0, rows)) and compute the first step.

        ``next_tokens`` (usually the single last prompt token) are run first at
        positions ``rows, rows+1, ...``; their last logits give the first new token.
        ``chunk_tokens`` is the schedule the rows were computed on (the pack header's);
        an engine whose cache layout depends on it (MLX rotating caches) uses it.
        ``adopt``: the caller gives up the arrays' spare room (a layer's rows as a view
        of a larger array, :class:`muser_cli.kvpack.stream.StreamedPack`): an engine that
        can may use that memory as its cache, writing new rows after ``rows`` without a
        copy. The rows themselves are never written.
        ``check_first``: called once after the first forward, before its token is picked,
        with the live rows (a :data:`RowsOf` as of ``rows + len(next_tokens)`` positions);
        what it raises ends the open with no token emitted (the fused spot-check,
        :class:`muser_cli.gate.audit.SpotGate`). ``max_new_tokens`` 0: nothing is computed.
        """

    @abc.abstractmethod
    def fork(self, seq: SequenceHandle, samplings: Sequence[Sampling]) -> list[SequenceHandle]:
        """One more sequence per sampling from ``seq``'s first step (``seq`` opened, not run):
        each its own copy of the cache and its own picker, its first token picked from the same
        first logits. Each gives the tokens a separate :meth:`open` with that sampling would."""

    @abc.abstractmethod
    def run(self, seq: SequenceHandle, on_token: Callable[[int], None] | None = None) -> DecodeResult:
        """Step ``seq`` to its end, each token (its first included) to ``on_token`` as it comes.
        With :meth:`batch_decode` on, it joins the running batch. A handle runs once."""

    @abc.abstractmethod
    def recompute(self, layers: Sequence[LayerKV], *, rows: int, token_ids: Sequence[int]) -> list[LayerKV]:
        """Install ``layers`` (positions [0, rows)) and run ``token_ids`` in one step at
        positions ``rows..``: the rows every layer then holds (``verify --audit``, the gate)."""

    def decode(
        self,
        layers: Sequence[LayerKV],
        *,
        rows: int,
        next_tokens: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_on_eos: bool = True,
        on_token: Callable[[int], None] | None = None,
        chunk_tokens: int | None = None,
        adopt: bool = False,
        check_first: Callable[[RowsOf], None] | None = None,
    ) -> DecodeResult:
        """Install ``layers`` and decode: :meth:`open` (see there for the arguments), then
        :meth:`run` with ``on_token``."""
        seq = self.open(layers, rows=rows, next_tokens=next_tokens, max_new_tokens=max_new_tokens,
                        sampling=sampling, stop_on_eos=stop_on_eos, chunk_tokens=chunk_tokens, adopt=adopt,
                        check_first=check_first)
        return self.run(seq, on_token)

    # ---------------------------------------------------------- abilities within the role
    #: True when :meth:`recompute_at` recomputes many positions of a full-attention model in
    #: one forward (the audit and spot-check then need no step per position).
    recomputes_at: bool = False
    #: True when the engine can step many sequences together (:meth:`batch_decode`): a
    #: serving consumer's concurrent requests then decode in one batched call per step.
    batches_decode: bool = False
    #: True when the engine honours :class:`Sampling`'s penalties, ``logit_bias`` and
    #: ``logprobs`` (solo and batched); else only temperature, top-p and seed.
    shapes_logits: bool = False

    def recompute_at(self, layers: Sequence[LayerKV], *, rows: int, positions: Sequence[int],
                     token_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's K and V at ``positions`` recomputed in one forward from ``layers``'
        own rows before each position (full-attention models). Only engines with
        :attr:`recomputes_at` implement it."""
        raise UsageError(f"the {self.name} engine cannot recompute positions in one forward")

    def recomputes_at_hybrid(self, layers: Sequence[LayerKV], rows: int) -> bool:
        """Whether :meth:`recompute_at` takes this model's sliding-window or chunked layers too,
        for ``layers`` (those of a pack with the sliding history: every row from position 0).
        False unless an engine says otherwise (the gate then goes position by position)."""
        return False

    def batch_decode(self, turns: Any, *, on_step: Callable[[int], None] | None = None) -> None:
        """From now on, sequences run (:meth:`run`, :meth:`decode`) on several threads step
        together: each computes its first step itself (:meth:`open`), then joins one batch that
        a thread of the engine's steps, holding ``turns``
        (:class:`muser_cli.engines.stepper.EngineTurns`) for each step. Tokens then depend on
        which sequences share a step (batched kernels round differently from one-row ones):
        docs/serve.md. Only engines with :attr:`batches_decode` implement it."""
        raise UsageError(f"the {self.name} engine cannot decode several sequences together")
