"""``muser batch --ray``: the same batch, its jobs run by consumer workers on a Ray cluster.

Each worker is a Ray actor: one process, one resident model and engine, its own reuse store
(``MUSER_STORE``). The driver (this process) plans as a local batch does — resume, bad
lines, groups of jobs sharing a document — and sends every job of a group to the same
worker, in order, so the document is paid once per group. Results come back job by job
and are written into the same results file as they arrive; ``--resume`` works the same.

What crosses to a worker is plain data (the job's fields, the batch's options); what comes
back is the result line (a JSON object). Ray carries them; muser never unpickles input.
Ray is imported only here, and only when ``--ray`` is given (``pip install 'muser[ray]'``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from muser_cli.batch.jobs import BadJob, Job
from muser_cli.batch.results import Results
from muser_cli.batch.runner import Batch, BatchConfig, Planned, ResultFn, Summary, Tally, failure
from muser_cli.errors import TempFailure, UsageError

IN_FLIGHT_PER_WORKER = 2  # the next job is queued at its worker while this one runs: no idle gap


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray", hint="pip install 'muser[ray]'") from None
    return ray


def _job_data(p: Planned) -> dict[str, Any]:
    return {"job": asdict(p.job), "store": p.store, "shares_next": p.shares_next}


class Worker:
    """The body of one Ray actor: a resident consumer (see module doc)."""

    def __init__(self, config: dict[str, Any], store_dir: str | None) -> None:
        if store_dir:
            os.environ["MUSER_STORE"] = store_dir
        self.batch = Batch(BatchConfig(**{**config, "producers": tuple(config["producers"])}))
        self.load_s = self.batch.load()

    def _planned(self, data: dict[str, Any] | None) -> Planned | None:
        if data is None:
            return None
        from muser_cli.tokens import encode_prompt

        job = Job(**data["job"])
        ids = encode_prompt(self.batch.info, job.text, chat=job.chat)
        return Planned(job, ids, None, store=bool(data["store"]), shares_next=int(data["shares_next"]))

    def run(self, data: dict[str, Any], nxt: dict[str, Any] | None) -> dict[str, Any]:
        p = self._planned(data)
        assert p is not None
        result = self.batch.run_one(p, self._planned(nxt))
        result["worker"] = os.getpid()
        return result

    def ready(self) -> float:
        return self.load_s

    def close(self) -> None:
        self.batch.close()


def _assign(order: Sequence[Planned], workers: int) -> list[list[Planned]]:
    """Groups to workers, whole: each group goes to the worker with the fewest prompt tokens so far."""
    groups: list[list[Planned]] = []
    for p in order:
        if groups and groups[-1][0].group == p.group:
            groups[-1].append(p)
        else:
            groups.append([p])
    lanes: list[list[Planned]] = [[] for _ in range(workers)]
    load = [0] * workers
    for g in sorted(groups, key=lambda g: -sum(len(p.ids) for p in g)):
        i = min(range(workers), key=lambda k: load[k])
        lanes[i].extend(g)
        load[i] += sum(len(p.ids) for p in g)
    return lanes


def run_on_ray(config: BatchConfig, items: Sequence[Job | BadJob], results: Results, *, address: str,
               workers: int = 0, on_result: ResultFn | None = None, stop: threading.Event | None = None,
               store_root: Path | None = None) -> Summary:
    """Run ``items`` on Ray (``address``: a cluster address, ``auto``, or ``local`` to start
    one here with ``workers`` CPUs)."""
    ray = _import_ray()
    stop = stop or threading.Event()
    if workers < 0:
        raise UsageError("--ray-workers must be >= 0")
    planner = Batch(config)
    tally = Tally(Summary(jobs=len(items)), results, on_result)
    order = planner.prepare(items, tally)
    started = False
    if not ray.is_initialized():
        try:
            if address == "local":
                ray.init(num_cpus=max(1, workers or os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:
            raise TempFailure(f"no Ray cluster at {address}: {exc}",
                              hint="start one (ray start --head), or use --ray local") from None
        started = True
    try:
        if workers == 0:
            cpus = int(ray.cluster_resources().get("CPU", 1))
            workers = max(1, cpus // max(1, config.threads))
        workers = max(1, min(workers, len(order))) if order else 0
        if workers:
            _dispatch(ray, config, order, workers, tally, stop, store_root, planner.model_fingerprint)
    finally:
        tally.finish([])
        if started:
            ray.shutdown()
    return tally.summary


def _dispatch(ray, config: BatchConfig, order: list[Planned], workers: int, tally: Tally, stop: threading.Event,
              store_root: Path | None, model: str) -> None:
    from muser_cli import paths

    # The workers see this process's MUSER_* settings (models folder, node keys), on any cluster.
    env = {k: v for k, v in os.environ.items() if k.startswith("MUSER_") and k != "MUSER_STORE"}
    remote = ray.remote(num_cpus=config.threads)(Worker).options(runtime_env={"env_vars": env})
    cfg = {**asdict(config), "producers": list(config.producers)}
    base = store_root or paths.store_dir()
    actors = [remote.remote(cfg, str(base.parent / f"{base.name}-ray-{i}")) for i in range(workers)]
    lanes = _assign(order, workers)
    nxt_of = {id(p): (lane[j + 1] if j + 1 < len(lane) else None) for lane in lanes for j, p in enumerate(lane)}
    pos = [0] * workers
    pending: dict[Any, tuple[int, Planned]] = {}

    def submit(w: int) -> None:
        while pos[w] < len(lanes[w]) and sum(1 for k, _ in pending.values() if k == w) < IN_FLIGHT_PER_WORKER:
            if stop.is_set():
                return
            p = lanes[w][pos[w]]
            pos[w] += 1
            n = nxt_of[id(p)]
            ref = actors[w].run.remote(_job_data(p), _job_data(n) if n is not None else None)
            pending[ref] = (w, p)

    for w in range(workers):
        submit(w)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        ref = done[0]
        w, p = pending.pop(ref)
        try:
            result = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a worker died: that job failed, the batch goes on
            result = failure(p.job, TempFailure(f"Ray worker failed: {type(exc).__name__}: {exc}"[:500]), model=model)
        tally.emit(result)
        if stop.is_set():
            tally.summary.interrupted = True
        else:
            submit(w)
    if any(pos[w] < len(lanes[w]) for w in range(workers)):
        tally.summary.interrupted = True
    for a in actors:
        ray.kill(a)
