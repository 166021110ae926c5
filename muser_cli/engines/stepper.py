"""Many sequences decoded together: one batched step at a time, on a thread of its own.

A serving consumer runs each request on a thread of its own (``muser_cli.consumer.turns``);
with an engine that can step several sequences in one call, each request's thread computes
its first step itself (the rows installed, the numeric gate fused into that step), then hands
its cache to the :class:`Stepper` and waits for its tokens, away from the engine
(:meth:`Member.tokens`). The stepper's thread takes the engine's turn, brings in the sequences
that joined, drops those that left, computes one step for all of them, gives the turn back
and hands each sequence its token. It asks for the turn ahead of those waiting, so between two
steps exactly one other holder runs at most — one prefill chunk, or one sequence's first step:
a long local prefill slows the running streams by one chunk per token, never freezes them,
and the prompt work of several waiting requests goes in turn.

What a step is belongs to the engine: a :class:`Batch` (MLX: mlx-lm's own generation batch
over its batch caches). This module holds no arrays and imports no ML framework.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Protocol


class EngineTurns(Protocol):
    """The engine's turn, as :class:`muser_cli.consumer.turns.Turns` gives it."""

    def acquire(self, *, first: bool = False) -> None: ...  # first: ahead of those waiting

    def release(self) -> None: ...

    def away(self) -> ContextManager[None]: ...


@dataclass(eq=False)
class Member:
    """One sequence in the batch: what the engine needs to step it (``entry``, the engine's own),
    and its tokens as the steps give them."""

    entry: Any
    _out: queue.Queue = field(default_factory=queue.Queue)
    left: bool = False
    peak: int = 0  # the most sequences it shared a step with (itself included)

    def tokens(self) -> Iterator[tuple[int, str | None]]:
        """(token, finish) as the steps give them; finish is None until the last one ("length"
        or "stop"). A step that failed raises its exception here."""
        while True:
            item = self._out.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[1] is not None:
                return


class Batch(Protocol):
    """An engine's running batch (see :class:`Stepper`)."""

    def add(self, members: list[Member]) -> None:
        """Bring these sequences in (their first step already computed by their own threads)."""

    def drop(self, members: list[Member]) -> None:
        """Take these sequences out (finished, cancelled, failed)."""

    def step(self) -> list[tuple[Member, int, str | None]]:
        """One step for every sequence: each one's token and finish (None, "length", "stop");
        a finished sequence is out of the batch afterwards."""

    def __len__(self) -> int: ...


class Stepper:
    """The thread that steps an engine's running sequences together (see the module's doc).

    ``turns``: the engine's turn (every step is computed holding it); ``on_step(n)``: called
    with the batch size of every step (the metrics' histogram)."""

    def __init__(self, batch: Batch, turns: EngineTurns, *, on_step: Callable[[int], None] | None = None,
                 name: str = "muser-stepper") -> None:
        self._batch = batch
        self._turns = turns
        self._on_step = on_step
        self._cv = threading.Condition()
        self._joining: list[Member] = []
        self._leaving: list[Member] = []
        self._running: set[Member] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def join(self, entry: Any) -> Member:
        member = Member(entry)
        with self._cv:
            if self._closed:
                raise RuntimeError("the stepper is closed")
            self._joining.append(member)
            self._cv.notify_all()
        return member

    def follow(self, entry: Any, first: int, on_token: Callable[[int], None] | None) -> tuple[list[int], str, int]:
        """The rest of a sequence whose first step its own thread computed (``first``, not an
        end token, not yet given out): it joins the batch; its tokens, ``first`` included, go
        to ``on_token`` as they come, on this thread, which meanwhile holds no turn of the
        engine. Returns (tokens, stop: "eos" or "length", the most sequences it shared a step
        with). Whatever ``on_token`` raises takes it out of the batch and goes up."""
        tokens, stop = [first], "length"
        member = self.join(entry)
        try:
            with self._turns.away():
                if on_token is not None:
                    on_token(first)
                for token, finish in member.tokens():
                    tokens.append(token)
                    if on_token is not None:
                        on_token(token)
                    if finish == "stop":
                        stop = "eos"
        finally:
            self.leave(member)
        return tokens, stop, member.peak

    def leave(self, member: Member) -> None:
        """The sequence is done with (its thread returns): out of the batch before the next step."""
        with self._cv:
            if member.left:
                return
            member.left = True
            if member in self._joining:
                self._joining.remove(member)
            elif member in self._running:
                self._leaving.append(member)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._joining and not self._running:
                    self._cv.wait()
                if self._closed:
                    failed = list(self._running) + self._joining
                    break
                joining, self._joining = self._joining, []
                leaving, self._leaving = self._leaving, []
                self._running.update(joining)
                self._running.difference_update(leaving)
            given = self._one_step(joining, leaving)
            with self._cv:
                for member, token, finish in given:
                    if finish is not None:
                        self._running.discard(member)
                        member.left = True
                    member._out.put((token, finish))
        for member in failed:
            member._out.put(RuntimeError("the engine was closed while the sequence was decoding"))

    def _one_step(self, joining: list[Member], leaving: list[Member]) -> list[tuple[Member, int, str | None]]:
        self._turns.acquire(first=True)  # between two steps, one other holder at most (a prefill chunk)
        try:
            if leaving:
                self._batch.drop(leaving)
            if joining:
                self._batch.add(joining)
            size = len(self._batch)
            if not size:
                return []
            with self._cv:
                for member in self._running:
                    member.peak = max(member.peak, size)
            if self._on_step is not None:
                self._on_step(size)
            return self._batch.step()
        except BaseException as exc:  # noqa: BLE001 - every sequence of a failed step gets the failure
            with self._cv:
                hit = list(self._running)
                self._running.clear()
            for member in hit:
                member.left = True
                member._out.put(exc)
            try:
                self._batch.drop(hit)
            except BaseException:  # noqa: BLE001 - the batch is reset below either way
                pass
            return []
        finally:
            self._turns.release()


__all__ = ["Batch", "EngineTurns", "Member", "Stepper"]
