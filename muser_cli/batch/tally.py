"""A batch run's counts: the :class:`Summary` its last line and ``--json`` give, the
:class:`Tally` that writes each job's result line as it comes and counts it, and the result
line of a job that failed (:func:`failure`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from muser_cli.batch.jobs import BadJob, Job
from muser_cli.batch.results import Results
from muser_cli.consumer.lane import one_line
from muser_cli.errors import ExitStatus, MuserError

ResultFn = Callable[[dict[str, Any], "Summary"], None]


@dataclass
class Summary:
    jobs: int = 0
    done: int = 0  # succeeded in this run
    skipped: int = 0  # done already (--resume)
    failed: int = 0
    sources: Counter = field(default_factory=Counter)
    new_tokens: int = 0
    prompt_tokens: int = 0
    shipped_bytes: int = 0
    wall_s: float = 0.0
    load_s: float = 0.0
    interrupted: bool = False
    stopped_by: str | None = None  # the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)
    producers: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # id, exit, message (first 20)
    redone: list[dict[str, str]] = field(default_factory=list)  # id, reason: a done line not kept (--resume)
    calibration: dict[str, Any] | None = None  # the local prefill measured at load (with producers)

    @property
    def finished(self) -> int:
        return self.done + self.failed

    @property
    def left(self) -> int:
        """Jobs this run did not get to (a stopped run): what ``--resume`` continues with."""
        return max(0, self.jobs - self.finished - self.skipped)

    def line(self) -> str:
        """The one-line summary the command prints at the end."""
        out = self.to_json()
        sources = ", ".join(f"{k} {v}" for k, v in sorted(self.sources.items()))  # none when nothing ran
        return (f"{self.done} done, {self.failed} failed, {self.skipped} skipped of {self.jobs} in {self.wall_s:.1f}s "
                f"({out['jobs_per_min']:.1f} jobs/min, {out['tokens_per_s']:.1f} tok/s)"
                + (f"; {sources}" if sources else "") + self._redone_note())

    def _redone_note(self) -> str:
        if not self.redone:
            return ""
        ids = ", ".join(r["id"] for r in self.redone[:5]) + (", ..." if len(self.redone) > 5 else "")
        return f"; {len(self.redone)} redone, their results line unverifiable or changed ({ids})"

    def to_json(self) -> dict[str, Any]:
        wall = self.wall_s
        return {"jobs": self.jobs, "done": self.done, "skipped": self.skipped, "failed": self.failed,
                "sources": dict(self.sources), "new_tokens": self.new_tokens, "prompt_tokens": self.prompt_tokens,
                "shipped_bytes": self.shipped_bytes, "wall_s": round(wall, 3), "load_s": round(self.load_s, 3),
                "tokens_per_s": round(self.new_tokens / wall, 3) if wall > 0 else 0.0,
                "jobs_per_min": round(60 * self.done / wall, 3) if wall > 0 else 0.0,
                "interrupted": self.interrupted, "producers": self.producers, "failures": self.failures,
                "redone": self.redone, "left": self.left, "stopped_by": self.stopped_by,
                "calibration": self.calibration,
                "ok": self.failed == 0 and not self.interrupted}


def failure(item: Job | BadJob, exc: BaseException, *, model: str) -> dict[str, Any]:
    """The result line of a job that failed: the exit status ``muser decode`` would have had."""
    if isinstance(exc, MuserError):
        err = {"message": one_line(str(exc)), "exit": exc.exit_status}
        if exc.hint:
            err["hint"] = one_line(exc.hint)
    else:  # a bug: the batch goes on, the line says what broke
        err = {"message": one_line(f"internal error: {type(exc).__name__}: {exc}"), "exit": ExitStatus.ERROR}
    return {"id": item.id, "line": item.line, "model": model,
            "job": item.digest if isinstance(item, Job) else None, "error": err, "text": None, "token_ids": None,
            "source": None, "producer": None}


class Tally:
    """Results written as they come, and the summary counted from them."""

    def __init__(self, summary: Summary, results: Results, on_result: ResultFn | None) -> None:
        self.summary = summary
        self.results = results
        self.on_result = on_result
        self.t0 = time.perf_counter()

    def emit(self, result: dict[str, Any]) -> None:
        s = self.summary
        self.results.write(result)
        if result.get("error") is None:
            s.done += 1
            s.sources[result["source"]] += 1
            s.new_tokens += len(result["token_ids"])
            s.prompt_tokens += result.get("prompt_tokens", 0)
            s.shipped_bytes += result.get("shipped_bytes", 0)
        else:
            s.failed += 1
            if len(s.failures) < 20:
                s.failures.append({"id": result["id"], **result["error"]})
        s.wall_s = time.perf_counter() - self.t0
        if self.on_result is not None:
            self.on_result(result, s)

    def finish(self, producers: list[dict[str, Any]], *, complete: bool) -> None:
        """``complete``: every job ran (the file is then rewritten in input order)."""
        self.summary.wall_s = time.perf_counter() - self.t0
        self.summary.producers = producers
        self.results.close(complete=complete and not self.summary.interrupted)


__all__ = ["ResultFn", "Summary", "Tally", "failure"]
