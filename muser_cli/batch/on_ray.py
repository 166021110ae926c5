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

import contextlib
import os
import threading
from dataclasses import asdict
from typing import Any, Sequence

from muser_cli import paths
from muser_cli.batch.jobs import BadJob, Job
from muser_cli.batch.plan import Planned, mark_sharing
from muser_cli.batch.results import Results
from muser_cli.batch.runner import Batch, BatchConfig
from muser_cli.batch.tally import ResultFn, Summary, Tally, failure
from muser_cli.consumer.lane import one_line
from muser_cli.errors import TempFailure, UsageError
from muser_cli.model.tokens import encode_prompt

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

    def __init__(self, config: dict[str, Any], name: str) -> None:
        base = paths.store_dir()  # this node's, beside its own store
        os.environ["MUSER_STORE"] = str(base.parent / f"{base.name}-{name}")
        self.batch = Batch(BatchConfig(**{**config, "producers": tuple(config["producers"])}))
        self.load_s = self.batch.load()

    def _planned(self, data: dict[str, Any] | None) -> Planned | None:
        if data is None:
            return None

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
               workers: int = 0, on_result: ResultFn | None = None, stop: threading.Event | None = None) -> Summary:
    """Run ``items`` on Ray (``address``: a cluster address, ``auto``, or ``local`` to start
    one here with ``workers`` CPUs)."""
    ray = _import_ray()
    stop = stop or threading.Event()
    if workers < 0:
        raise UsageError("--ray-workers must be >= 0")
    threads = max(1, config.threads)
    started = False
    if not ray.is_initialized():  # before anything is written: a missing cluster leaves the results as they were
        try:
            if address == "local":
                ray.init(num_cpus=max(1, workers or os.cpu_count() or 1) * threads, include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:
            raise TempFailure(one_line(f"no Ray cluster at {address}: {exc}"),
                              hint="start one (ray start --head), or use --ray local") from None
        started = True
    try:
        planner = Batch(config)
        tally = Tally(Summary(jobs=len(items)), results, on_result)
        ran_all = False
        try:
            order = planner.prepare(items, tally)
            fits = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
            workers = min(workers or fits, fits)  # more actors than the cluster can place would wait forever
            groups = len({p.group for p in order})
            workers = max(1, min(workers, groups)) if order else 0
            if workers:
                ran_all = _dispatch(ray, config, order, workers, tally, stop, planner.model_fingerprint, planner.chunk)
            else:
                ran_all = True
        finally:
            tally.finish([], complete=ran_all)
    finally:
        if started:
            ray.shutdown()
    return tally.summary


def _dispatch(ray, config: BatchConfig, order: list[Planned], workers: int, tally: Tally, stop: threading.Event,
              model: str, chunk: int) -> bool:
    """Run the lanes; True when every job ran."""
    # The workers see this process's MUSER_* settings (models folder, node keys), on any cluster.
    env = {k: v for k, v in os.environ.items() if k.startswith("MUSER_") and k != "MUSER_STORE"}
    remote = ray.remote(num_cpus=max(1, config.threads))(Worker).options(runtime_env={"env_vars": env})
    cfg = {**asdict(config), "producers": list(config.producers)}
    actors = [remote.remote(cfg, f"ray-{i}") for i in range(workers)]
    try:
        return _lanes(ray, actors, order, tally, stop, model, chunk, config.reuse)
    finally:
        _close_workers(ray, actors)


def _close_workers(ray, actors: list) -> None:
    """Let each worker remove its temp folders and prefetches, then end it. Best effort, in a
    ``finally``: the batch's outcome (every result line written, or the error in flight) is
    decided already, and a worker that died (its node gone, killed) can neither close nor be
    killed; Ray raises its own kinds for that (RayActorError, GetTimeoutError, ...)."""
    with contextlib.suppress(Exception):  # a dead or hung worker: its temp folder goes with its node
        ray.get([a.close.remote() for a in actors], timeout=60)
    for a in actors:
        with contextlib.suppress(Exception):  # already dead: nothing left to end
            ray.kill(a)


def _lanes(ray, actors: list, order: list[Planned], tally: Tally, stop: threading.Event, model: str, chunk: int,
           reuse: bool) -> bool:
    workers = len(actors)
    try:  # a worker that cannot load the model says why once, instead of failing every job silently
        ray.get([a.ready.remote() for a in actors], timeout=600)
    except Exception as exc:  # noqa: BLE001
        raise TempFailure(one_line(f"a Ray worker did not start: {type(exc).__name__}: {exc}")) from None
    lanes = _assign(order, workers)
    for lane in lanes:
        mark_sharing(lane, chunk, reuse)  # what each worker shares with its own next job
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
            result = failure(p.job, TempFailure(f"Ray worker failed: {type(exc).__name__}: {exc}"), model=model)
        tally.emit(result)
        if stop.is_set():
            tally.summary.interrupted = True
        else:
            submit(w)
    if any(pos[w] < len(lanes[w]) for w in range(workers)):
        tally.summary.interrupted = True
        return False
    return True
