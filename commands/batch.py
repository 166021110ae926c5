"""muser batch: a JSONL of prompts on resident engines -> a JSONL of results."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer

from muser_cli.commands._common import complete_model, default_threads, emit_json, err, guarded, info, quiet
from muser_cli.errors import ExitStatus, MissingInput, UsageError
from muser_cli.fsio import is_special
from muser_cli.units import plural


def register(app: typer.Typer) -> None:
    @app.command("batch")
    def batch_cmd(
        jobs: str = typer.Argument(..., help="Jobs file (JSONL: id, prompt | prompt_file + question, max_tokens, ...), or - for stdin."),
        output: Optional[str] = typer.Option(None, "-o", "--output", help="Results file (JSONL, appended line by line, fsynced). Default: stdout, in input order."),
        model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="Model folder, .gguf file, or 'default'."),
        producer: List[str] = typer.Option([], "--producer", help="A resident producer HOST:PORT (`prefill --serve`); repeat for a pool."),
        producers_file: Optional[str] = typer.Option(None, "--producers-file", help="A file of producers, one HOST:PORT per line (# comments)."),
        resume: bool = typer.Option(False, "--resume", help="Continue a killed run: skip the ids the results file has done."),
        force: bool = typer.Option(False, "--force", help="Overwrite a results file that already holds results."),
        ray: Optional[str] = typer.Option(None, "--ray", help="Run the jobs as Ray tasks on the cluster at ADDRESS ('auto': the running one; 'local': start one here). Needs muser[ray]."),
        ray_workers: int = typer.Option(0, "--ray-workers", help="With --ray: consumer workers (0 = the cluster's CPUs / --threads)."),
        n: int = typer.Option(64, "-n", "--max-tokens", help="New tokens per job (a job's max_tokens wins)."),
        engine: str = typer.Option("torch", "--engine", help="torch | mlx"),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="KV dtype (default: the engine's)."),
        chat: bool = typer.Option(False, "--chat", help="Prompts use the chat template (a job's chat wins)."),
        chunk: Optional[int] = typer.Option(None, "--chunk", help="Chunk size of the canonical schedule (default 512)."),
        temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (a job's temperature wins)."),
        top_p: float = typer.Option(1.0, "--top-p"),
        seed: Optional[int] = typer.Option(None, "--seed"),
        threads: int = typer.Option(0, "--threads", help="Compute threads (0 = default)."),
        max_batch: int = typer.Option(4, "--max-batch", help="Jobs running at once, taking the engine's turns (their decode steps computed together); a job that shares a prefix with one that stores it starts when that one is done. 1: one after another, the next job's pull started while one decodes."),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds to wait for a producer's first frame before prefilling locally."),
        audit: Optional[int] = typer.Option(None, "--audit", help="Spot-check N positions of every pulled pack (default: 1, only for a foreign pack)."),
        no_audit: bool = typer.Option(False, "--no-audit", help="Skip the spot-check of foreign packs."),
        no_reuse: bool = typer.Option(False, "--no-reuse", help="Neither look in nor keep anything in the store (every job pays its whole prompt)."),
        as_json: bool = typer.Option(False, "--json", help="A summary object at the end (stdout with -o, else stderr)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Run nothing: list the jobs in run order, the prefixes they share and the producers (loads the tokenizer, not the model; contacts no producer)."),
    ) -> None:
        """Run many prompts with one model load: shared documents paid once, pulls overlapped with decoding, resumable."""
        from muser_cli.batch.jobs import Defaults, read_jobs  # lazy: kept out of `muser --help` (startup)
        from muser_cli.batch.results import Results  # lazy: kept out of `muser --help` (startup)
        from muser_cli.batch.runner import Batch, BatchConfig  # lazy: kept out of `muser --help` (startup)
        from muser_cli.consumer.pool import read_producers  # lazy: kept out of `muser --help` (startup)

        with guarded(as_json=as_json and output is not None):
            if n < 1:
                raise UsageError("-n must be at least 1")
            if not temperature >= 0 or not 0 < top_p <= 1:
                raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
            addresses = list(producer) + (read_producers(Path(producers_file)) if producers_file else [])
            if jobs == "-":
                lines = sys.stdin.buffer.read().splitlines()
                base = Path.cwd()
            else:
                path = Path(jobs)
                if not path.is_file():
                    raise MissingInput(f"no such jobs file: {jobs}")
                lines = path.read_bytes().splitlines()
                base = path.resolve().parent
            defaults = Defaults(max_tokens=n, temperature=temperature, top_p=top_p, seed=seed, chat=chat)
            items = read_jobs(lines, base_dir=base, defaults=defaults)
            config = BatchConfig(model=model, engine=engine, dtype=dtype, threads=threads or default_threads(),
                                 chunk_tokens=chunk, producers=tuple(addresses), timeout=timeout,
                                 audit=0 if no_audit else audit, reuse=not no_reuse, max_batch=max_batch)
            if dry_run:
                plan = Batch(config).dry_run(items)
                _show_plan(plan, as_json=as_json)
                if plan["bad"]:
                    raise typer.Exit(ExitStatus.ERROR)
                return
            results = Results(Path(output), resume=resume, force=force) if output else Results(
                stream=sys.stdout.buffer)
            stop = threading.Event()
            stopped_by: list[str] = []
            view = _Progress(len(items))

            def on_signal(signum, frame) -> None:  # the first: stop after the current job; a second aborts
                if stop.is_set():
                    raise KeyboardInterrupt
                stopped_by.append(signal.Signals(signum).name)
                stop.set()
                if signum == signal.SIGINT:
                    err("muser batch: stopping after the current job (Ctrl-C again to abort)")

            old = _handle(STOP_SIGNALS, on_signal)
            try:
                if ray is not None:
                    from muser_cli.batch.on_ray import run_on_ray  # lazy: kept out of `muser --help` (startup)

                    summary = run_on_ray(config, items, results, address=ray, workers=ray_workers,
                                         on_result=view.update, stop=stop)
                else:
                    summary = Batch(config, on_result=view.update, stop=stop).run(items, results)
            finally:
                view.close()
                _handle(old)
            summary.stopped_by = stopped_by[0] if stopped_by else None
            again = _resume_command(jobs, output)
            if summary.stopped_by in ("SIGTERM", "SIGHUP"):  # a service manager's stop: drained, one line, 0
                left = f"; continue with: {again}" if summary.left and again else ""
                err(f"muser batch: stopped by {summary.stopped_by}: {summary.done} done, {summary.failed} failed, "
                    f"{summary.skipped} skipped, {summary.left} left of {summary.jobs}{left}")
                _emit_summary(summary, as_json=as_json, output=output)
                return
            _report(summary, again)
            _warn_ended_at_once(view.at_once, chat=chat)
            _emit_summary(summary, as_json=as_json, output=output)
            if summary.interrupted:
                raise typer.Exit(ExitStatus.INTERRUPTED)
            if summary.failed:
                raise typer.Exit(ExitStatus.ERROR)


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _handle(signals, handler=None) -> dict:
    """Install ``handler`` for ``signals`` (or, given a dict of old handlers, put them back);
    returns the handlers replaced. Only the main thread may: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    if isinstance(signals, dict):
        return {sig: signal.signal(sig, old) for sig, old in signals.items()}
    return {sig: signal.signal(sig, handler) for sig in signals}


def _warn_ended_at_once(ids: list[str], *, chat: bool) -> None:
    """An answer that ends at its first token (end of sequence at once) is almost always a chat
    model given a raw prompt: say so, once, with the way out."""
    if not ids:
        return
    shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")

    way = "" if chat else "; a chat model's prompts need --chat (or \"chat\": true in the job)"
    err(f"muser batch: warning: {plural(len(ids), 'answer')} ended at the first token ({shown}){way}")


def _report(summary, again: str | None) -> None:
    """The human summary on stderr: the counts, the first failures, the producers that failed,
    and — when anything failed or is left — the command that continues."""
    line = f"muser batch: {summary.line()}"
    trouble = summary.failed or summary.interrupted
    (err if trouble else info)(line)
    for f in summary.failures[:5]:
        err(f"muser batch: {f['id']}: exit {f['exit']}: {f['message']}")
    bad = _failed_producers(summary.producers)
    if bad:
        err(f"muser batch: producers that failed: {bad}")
    if trouble:
        err(f"muser batch: to rerun what failed or is left: {again}" if again else
            "muser batch: to rerun only what failed or is left, write the results to a file (-o FILE) and add --resume")


def _failed_producers(states: list) -> str:
    out = []
    for s in states:
        if s.get("gone"):
            out.append(f"{s['address']} (dropped: {s['gone'][:120]})")
        elif s.get("failures"):
            out.append(f"{s['address']} (down: {s.get('last_error', '')[:120]})")
    return "; ".join(out)


def _resume_command(jobs: str, output: str | None) -> str | None:
    """This command line with ``--resume`` (and without ``--force``); None when the results do
    not go to a file that can be resumed."""
    import shlex


    if output is None or output == "-" or is_special(output):
        return None
    argv = sys.argv[1:]
    if "batch" not in argv:  # called in-process (tests): the essentials
        argv = ["batch", jobs, "-o", output]
    args = [a for a in argv if a != "--force"]
    return shlex.join(["muser", *args, *([] if "--resume" in args else ["--resume"])])


def _emit_summary(summary, *, as_json: bool, output: str | None) -> None:
    if not as_json:
        return
    if output is not None:
        emit_json(summary.to_json())
    else:
        import json

        err(json.dumps(summary.to_json(), sort_keys=True))


def _show_plan(plan: dict, *, as_json: bool) -> None:
    """``--dry-run``: the plan on stdout, as text or one JSON object."""
    if as_json:
        emit_json(plan)
        return
    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    lines = [f"{count(len(plan['jobs']), 'job')} to run (in this order), {count(len(plan['bad']), 'bad line')}; "
             f"chunk {plan['chunk']}; nothing was run"]
    width = max([len(j["id"]) for j in plan["jobs"]] + [2])
    for j in plan["jobs"]:
        doc = Path(j["document"]).name if j["document"] else "inline prompt"
        held = f", {j['shares_previous']} shared with the previous job" if j["shares_previous"] else ""
        lines.append(f"  {j['id']:<{width}}  line {j['line']:<4} {j['prompt_tokens']:>6} tokens  {doc}{held}")
    lines.append("shared prefixes (each paid once):" if plan["prefixes"] else "shared prefixes: none")
    for g in plan["prefixes"]:
        what = Path(g["document"]).name if g["document"] else "inline prompts with one first chunk"
        lines.append(f"  {what}: {g['shared_tokens']} tokens, {count(len(g['jobs']), 'job')} ({', '.join(g['jobs'][:8])}"
                     f"{', ...' if len(g['jobs']) > 8 else ''})")
    lines.append("producers (not contacted): " + ", ".join(plan["producers"]) if plan["producers"] else
                 "producers: none (every job is computed here)")
    for b in plan["bad"]:
        lines.append(f"bad: {b['id']} (line {b['line']}): exit {b['exit']}: {b['message']}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


class _Progress:
    """Jobs done/total, tokens/s, ETA and where the KV came from: rich, on a terminal only."""

    def __init__(self, total: int) -> None:
        self._bar = None
        self.at_once: list[str] = []  # jobs whose answer ended at its first token
        if quiet() or not sys.stderr.isatty() or total == 0:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             TextColumn("{task.fields[note]}"), console=Console(stderr=True), transient=False)
        self._task = self._bar.add_task("batch", total=total, note="")
        self._bar.start()

    def update(self, result: dict, summary) -> None:
        ids = result.get("token_ids")
        if not result.get("error") and isinstance(ids, list) and len(ids) <= 1:
            self.at_once.append(str(result.get("id")))
        if self._bar is None:
            return
        tok_s = summary.new_tokens / summary.wall_s if summary.wall_s > 0 else 0.0
        note = f"{tok_s:.1f} tok/s " + " ".join(f"{k}:{v}" for k, v in sorted(summary.sources.items()))
        if summary.failed:
            note += f" failed:{summary.failed}"
        self._bar.update(self._task, completed=summary.finished + summary.skipped, note=note)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
