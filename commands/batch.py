"""muser batch: a JSONL of prompts on resident engines -> a JSONL of results."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer

from muser_cli.commands._common import default_threads, emit_json, err, guarded, info, quiet


def register(app: typer.Typer) -> None:
    @app.command("batch")
    def batch_cmd(
        jobs: str = typer.Argument(..., help="Jobs file (JSONL: id, prompt | prompt_file + question, max_tokens, ...), or - for stdin."),
        output: Optional[str] = typer.Option(None, "-o", "--output", help="Results file (JSONL, appended line by line, fsynced). Default: stdout, in input order."),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="Model folder, .gguf file, or 'default'."),
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
        timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds to wait for a producer's first frame before prefilling locally."),
        audit: Optional[int] = typer.Option(None, "--audit", help="Spot-check N positions of every pulled pack (default: 1, only for a foreign pack)."),
        no_audit: bool = typer.Option(False, "--no-audit", help="Skip the spot-check of foreign packs."),
        no_reuse: bool = typer.Option(False, "--no-reuse", help="Neither look in nor keep anything in the store (every job pays its whole prompt)."),
        as_json: bool = typer.Option(False, "--json", help="A summary object at the end (stdout with -o, else stderr)."),
    ) -> None:
        """Run many prompts with one model load: shared documents paid once, pulls overlapped with decoding, resumable."""
        from muser_cli.batch.jobs import Defaults, read_jobs
        from muser_cli.batch.pool import read_producers
        from muser_cli.batch.results import Results
        from muser_cli.batch.runner import Batch, BatchConfig
        from muser_cli.errors import MissingInput, UsageError

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
            results = Results(Path(output), resume=resume, force=force) if output else Results(
                stream=sys.stdout.buffer)
            config = BatchConfig(model=model, engine=engine, dtype=dtype, threads=threads or default_threads(),
                                 chunk_tokens=chunk, producers=tuple(addresses), timeout=timeout,
                                 audit=0 if no_audit else audit, reuse=not no_reuse)
            stop = threading.Event()
            view = _Progress(len(items))

            def on_sigint(signum, frame) -> None:  # first Ctrl-C: stop after the current job
                if stop.is_set():
                    raise KeyboardInterrupt
                stop.set()
                err("muser batch: stopping after the current job (Ctrl-C again to abort)")

            old = signal.signal(signal.SIGINT, on_sigint) if threading.current_thread() is threading.main_thread() else None
            try:
                if ray is not None:
                    from muser_cli.batch.on_ray import run_on_ray

                    summary = run_on_ray(config, items, results, address=ray, workers=ray_workers,
                                         on_result=view.update, stop=stop)
                else:
                    summary = Batch(config, on_result=view.update, stop=stop).run(items, results)
            finally:
                view.close()
                if old is not None:
                    signal.signal(signal.SIGINT, old)
            out = summary.to_json()
            line = f"muser batch: {summary.line()}"
            if summary.failed or summary.interrupted:
                err(line)
                for f in summary.failures[:5]:
                    err(f"muser batch: {f['id']}: exit {f['exit']}: {f['message']}")
            else:
                info(line)
            if as_json:
                if output is not None:
                    emit_json(out)
                else:
                    import json

                    err(json.dumps(out, sort_keys=True))
            if summary.interrupted:
                raise typer.Exit(130)
            if summary.failed:
                raise typer.Exit(1)


class _Progress:
    """Jobs done/total, tokens/s, ETA and where the KV came from: rich, on a terminal only."""

    def __init__(self, total: int) -> None:
        self._bar = None
        if quiet() or not sys.stderr.isatty() or total == 0:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             TextColumn("{task.fields[note]}"), console=Console(stderr=True), transient=False)
        self._task = self._bar.add_task("batch", total=total, note="")
        self._bar.start()

    def update(self, result: dict, summary) -> None:
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
