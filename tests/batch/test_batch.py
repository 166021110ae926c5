"""``muser batch`` (issue 15) as a user runs it: real processes, a real resident producer over
mutual TLS on 127.0.0.1, real files with fsync, SIGKILL, and a local Ray instance.

Every result is compared with what ``muser decode`` gives for that job alone (the library
call the command makes, on a fresh store, no reuse): same tokens, whatever path the job's
KV took (local, the store, a handoff, a delta, a fallback).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from handoff_kit import HANG_S, Producer, env_for, lane_flags, muser_cmd, pull_lane

CHUNK = 32
DOC = " ".join(f"Line {i}: the committee chose the northern site near the old mill and the school." for i in range(14))
QUESTIONS = ["Where is the mill?", "Who chose the site?", "Why the north?", "When did they meet?",
             "What is near the school?", "How long was the debate?"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from muser_cli.model.tiny import make_tiny_long_llama

    return str(make_tiny_long_llama(tmp_path_factory.mktemp("batch-models") / "tiny-long"))


def write_jobs(folder: Path, questions=QUESTIONS, *, extra: list[str] = (), n: int = 5) -> Path:
    (folder / "doc.txt").write_text(DOC)
    lines = [json.dumps({"id": f"q{i}", "prompt_file": "doc.txt", "question": q, "max_tokens": n})
             for i, q in enumerate(questions)]
    lines[1:1] = list(extra)  # between the first two questions of the document
    path = folder / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def reference(model: str, text: str, n: int, home: Path) -> list[int]:
    """``muser decode --prompt`` for one job, no store: the tokens every path must give."""
    from muser_cli.consumer.decode import decode

    old = os.environ.get("MUSER_HOME")
    os.environ["MUSER_HOME"] = str(home)
    try:
        out = decode(None, model=model, prompt=text, max_new_tokens=n, dtype="float32", threads=1,
                     chunk_tokens=CHUNK, reuse=False)
    finally:
        if old is None:
            del os.environ["MUSER_HOME"]
        else:
            os.environ["MUSER_HOME"] = old
    return out.token_ids


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory) -> dict[str, list[int]]:
    home = tmp_path_factory.mktemp("ref-home")
    out = {f"q{i}": reference(model, f"{DOC}\n\n{q}", 5, home) for i, q in enumerate(QUESTIONS)}
    out["solo"] = reference(model, "Hello there, how are you today?", 4, home)
    return out


def batch(home: Path, *args: str, timeout: float = HANG_S, input: bytes | None = None,
          route: str | None = None) -> subprocess.CompletedProcess:
    """``route``: ``MUSER_ROUTE`` (``producer``: the lane's mechanics, whatever the cost model
    predicts of a tiny model; None: the default route)."""
    env = env_for(home)
    env.pop("MUSER_ROUTE", None)
    if route is not None:
        env["MUSER_ROUTE"] = route
    return subprocess.run(muser_cmd("batch", *args), env=env, capture_output=True, timeout=timeout, input=input)


def lines_of(data: bytes) -> list[dict]:
    return [json.loads(raw) for raw in data.splitlines() if raw.strip()]


def common(model: str) -> list[str]:
    return ["-m", model, "--chunk", str(CHUNK), "--threads", "1", "--dtype", "float32"]


# ----------------------------------------------------------------------------- local
def test_local_batch_equals_decode_per_job_in_input_order(model, expected, tmp_path):
    solo = json.dumps({"id": "solo", "prompt": "Hello there, how are you today?", "max_tokens": 4})
    bad = '{"id": "typo", "promt": "x"}'
    jobs = write_jobs(tmp_path, QUESTIONS[:3], extra=[solo, bad, "not json"])
    r = batch(tmp_path / "home", str(jobs), *common(model))
    assert r.returncode == 1, r.stderr  # two bad lines: exit 1, a summary on stderr
    got = lines_of(r.stdout)
    assert [g["id"] for g in got] == ["q0", "solo", "typo", "line-4", "q1", "q2"]  # input order
    by = {g["id"]: g for g in got}
    for rid in ("q0", "q1", "q2", "solo"):
        assert by[rid]["error"] is None and by[rid]["token_ids"] == expected[rid], by[rid]
    # The document is paid once: q0 computed it, q1 and q2 only their own suffix.
    assert by["q0"]["source"] == "local" and by["q0"]["stored"]
    for rid in ("q1", "q2"):
        assert by[rid]["source"] == "store+local" and by[rid]["reuse"]["held_tokens"] >= CHUNK, by[rid]
        assert by[rid]["reuse"]["computed_tokens"] < by[rid]["prompt_tokens"] - CHUNK
    assert by["typo"]["error"]["exit"] == 65 and "promt" in by["typo"]["error"]["message"]
    assert by["line-4"]["error"]["exit"] == 65 and by["line-4"]["token_ids"] is None
    assert "2 failed" in r.stderr.decode() and "typo: exit 65" in r.stderr.decode()


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_questions_about_one_document_decode_together(model, tmp_path, engine):
    """--max-batch 4 (the default): the first question computes the document and stores it,
    the other four start together once it is done, compute only their own tail, and decode
    in one batch; their tokens equal the one-after-another run's."""
    if engine == "mlx":
        pytest.importorskip("mlx_lm")
    jobs = write_jobs(tmp_path, QUESTIONS[:5], n=24)
    flags = [*common(model), "--engine", engine]
    one_by_one = batch(tmp_path / "home1", str(jobs), *flags, "--max-batch", "1")
    together = batch(tmp_path / "home4", str(jobs), *flags)
    assert one_by_one.returncode == 0 and together.returncode == 0, together.stderr
    alone, got = lines_of(one_by_one.stdout), lines_of(together.stdout)
    assert [g["id"] for g in got] == [f"q{i}" for i in range(5)]  # input order
    assert [g["token_ids"] for g in got] == [a["token_ids"] for a in alone]
    assert not any(a["batched"] for a in alone)
    assert got[0]["source"] == "local" and got[0]["stored"] and not got[0]["batched"]
    for g in got[1:]:
        assert g["source"] == "store+local" and g["reuse"]["held_tokens"] >= CHUNK, g
    # they shared steps (one may end alone: an end token, or the last to join after the others ended)
    assert sum(g["batched"] for g in got[1:]) >= 2, [g["batched"] for g in got]


def test_jobs_from_stdin_and_a_missing_document_is_that_jobs_exit_66(model, expected, tmp_path):
    lines = [json.dumps({"id": "solo", "prompt": "Hello there, how are you today?", "max_tokens": 4}),
             json.dumps({"id": "gone", "prompt_file": str(tmp_path / "nope.txt"), "question": "?"})]
    r = batch(tmp_path / "home", "-", *common(model), "--json", input=("\n".join(lines) + "\n").encode())
    got = lines_of(r.stdout)
    assert r.returncode == 1, (got, r.stderr)
    assert got[0]["token_ids"] == expected["solo"], (got[0], r.stderr)
    assert got[1]["error"]["exit"] == 66 and "nope.txt" in got[1]["error"]["message"]
    summary = json.loads(r.stderr.decode().strip().splitlines()[-1])  # --json with results on stdout: stderr
    assert summary["done"] == 1 and summary["failed"] == 1 and not summary["ok"]


def stop_at_lines(proc, res, lines: int) -> None:
    """SIGSTOP the batch ``proc`` the moment its results file ``res`` holds ``lines`` whole
    lines: a tiny model finishes the other jobs in milliseconds, so a signal sent a little
    later could land after the last one (SIGINT and SIGTERM stay pending until SIGCONT)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end and proc.poll() is None:
        if res.exists() and res.read_bytes().count(b"\n") >= lines:
            proc.send_signal(signal.SIGSTOP)
            break
        time.sleep(0.002)
    assert proc.poll() is None, proc.stderr.read()


# ----------------------------------------------------------------------------- resume
def start_stopped(model, tmp_path, lines: int, max_batch: int = 1):
    """A batch of the six questions started in the background and stopped (SIGSTOP) once
    ``lines`` results are in: (the process, its jobs file, results file and home). One job at
    a time by default: then no job after the one running can have begun when the signal lands
    (with several at once, jobs that finished but were not yet written let the next ones start,
    so every job may be running or done by the time one line is in the file)."""
    jobs = write_jobs(tmp_path)
    res = tmp_path / "res.jsonl"
    home = tmp_path / "home"
    proc = subprocess.Popen(muser_cmd("batch", str(jobs), *common(model), "-o", str(res),
                                      "--max-batch", str(max_batch)),
                            env=env_for(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stop_at_lines(proc, res, lines)
    return proc, jobs, res, home


def test_resume_after_sigkill_loses_no_job_and_does_none_twice(model, expected, tmp_path):
    proc, jobs, res, home = start_stopped(model, tmp_path, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = lines_of(res.read_bytes())
    assert 2 <= len(before) < len(QUESTIONS)
    with open(res, "ab") as fh:  # as if killed in the middle of writing a line
        fh.write(b'{"id": "q5", "text": "half a li')
    r = batch(home, str(jobs), *common(model), "-o", str(res), "--resume", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["skipped"] == len(before) and summary["done"] == len(QUESTIONS) - len(before)
    final = lines_of(res.read_bytes())
    assert [g["id"] for g in final] == [f"q{i}" for i in range(len(QUESTIONS))]  # once each, input order
    for g in final:
        assert g["error"] is None and g["token_ids"] == expected[g["id"]], g


def test_ctrl_c_stops_after_the_current_job_and_resume_finishes(model, expected, tmp_path):
    proc, jobs, res, home = start_stopped(model, tmp_path, 1)
    proc.send_signal(signal.SIGINT)  # pending while stopped; handled the moment the run continues
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, err
    assert b"stopping after the current job" in err
    partial = lines_of(res.read_bytes())
    assert 1 <= len(partial) < len(QUESTIONS) and all(g["error"] is None for g in partial)
    assert res.read_bytes().endswith(b"\n")  # whole lines only
    r = batch(home, str(jobs), *common(model), "-o", str(res), "--resume")
    assert r.returncode == 0, r.stderr
    final = lines_of(res.read_bytes())
    assert [g["id"] for g in final] == [f"q{i}" for i in range(len(QUESTIONS))]
    assert all(g["token_ids"] == expected[g["id"]] for g in final)


def test_ctrl_c_with_jobs_at_once_ends_the_running_jobs_and_resume_finishes(model, expected, tmp_path):
    """--max-batch 4: Ctrl-C lets the jobs already running end (their lines written whole, none
    failed), starts no other, exits 130; --resume does what is left, each job once."""
    proc, jobs, res, home = start_stopped(model, tmp_path, 1, max_batch=4)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, err
    assert b"stopping after the current job" in err
    partial = lines_of(res.read_bytes())
    assert partial and all(g["error"] is None and g["token_ids"] == expected[g["id"]] for g in partial)
    assert res.read_bytes().endswith(b"\n")
    r = batch(home, str(jobs), *common(model), "-o", str(res), "--resume", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["skipped"] == len(partial) and summary["done"] == len(QUESTIONS) - len(partial)
    final = lines_of(res.read_bytes())
    assert [g["id"] for g in final] == [f"q{i}" for i in range(len(QUESTIONS))]
    assert all(g["token_ids"] == expected[g["id"]] for g in final)


def test_resume_refuses_another_model_or_jobs_file_and_a_fresh_run_keeps_old_results(model, tmp_path,
                                                                                        tmp_path_factory):
    from muser_cli.model.tiny import make_tiny_llama

    jobs = write_jobs(tmp_path, QUESTIONS[:2])
    res = tmp_path / "res.jsonl"
    home = tmp_path / "home"
    r = batch(home, str(jobs), *common(model), "-o", str(res))
    assert r.returncode == 0, r.stderr
    kept = res.read_bytes()
    other = str(make_tiny_llama(tmp_path_factory.mktemp("other") / "tiny"))
    r = batch(home, str(jobs), *common(other), "-o", str(res), "--resume")
    assert r.returncode == 65 and b"another model" in r.stderr, r.stderr
    write_jobs(tmp_path, ["Where is the mill?", "A different question?"])
    r = batch(home, str(jobs), *common(model), "-o", str(res), "--resume")
    assert r.returncode == 65 and b"another job line" in r.stderr, r.stderr
    r = batch(home, str(jobs), *common(model), "-o", str(res))
    assert r.returncode == 2 and b"--resume" in r.stderr, r.stderr
    assert res.read_bytes() == kept


# ----------------------------------------------------------------------------- the pull lane
@pytest.fixture(scope="module")
def lane(tmp_path_factory, model):
    with pull_lane(tmp_path_factory.mktemp("batch-pull"), model, check_exit=False) as lane:
        yield lane


def test_pull_lane_batch_ships_the_document_once_then_deltas(model, expected, lane, tmp_path):
    jobs = write_jobs(tmp_path, QUESTIONS[:4])
    p = lane["producer"]
    before = len(p.events())
    r = batch(lane["nodes"].consumer_home, str(jobs), *common(model), "--producer", p.address, "-o",
              str(tmp_path / "res.jsonl"), "--json", route="producer")
    assert r.returncode == 0, r.stderr
    got = lines_of((tmp_path / "res.jsonl").read_bytes())
    for g in got:
        assert g["token_ids"] == expected[g["id"]] and g["producer"] == p.address, g
    assert got[0]["source"] == "handoff"
    assert [g["source"] for g in got[1:]] == ["delta"] * 3, [g["source"] for g in got]
    full = got[0]["shipped_bytes"]
    assert all(0 < g["shipped_bytes"] < full / 2 for g in got[1:]), [g["shipped_bytes"] for g in got]
    served = p.wait_events(before + 4)[before:]
    assert [e["outcome"] for e in served] == ["served"] * 4
    assert served[0]["held_rows"] == 0 and all(e["held_rows"] >= CHUNK for e in served[1:]), served
    # The producer kept the last prompt's rows: the next question continued from them.
    assert all(e["reused_rows"] >= CHUNK for e in served[1:]), served
    summary = json.loads(r.stdout)
    assert summary["sources"] == {"handoff": 1, "delta": 3} and summary["shipped_bytes"] == sum(
        g["shipped_bytes"] for g in got)


def _dead_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def test_a_dead_producer_in_the_pool_is_skipped(model, expected, lane, tmp_path):
    jobs = write_jobs(tmp_path, QUESTIONS[:3])
    dead = _dead_address()
    r = batch(lane["nodes"].consumer_home, str(jobs), *common(model), "--producer", dead, "--producer",
              lane["producer"].address, "-o", str(tmp_path / "res.jsonl"), "--json", "--no-reuse", route="producer")
    assert r.returncode == 0, r.stderr
    got = lines_of((tmp_path / "res.jsonl").read_bytes())
    assert all(g["token_ids"] == expected[g["id"]] for g in got)
    assert sum(g["producer"] == lane["producer"].address for g in got) >= 2  # the live one did the work
    summary = json.loads(r.stdout)
    state = {s["address"]: s for s in summary["producers"]}
    assert state[dead]["failures"] >= 1 and state[dead]["served"] == 0


def test_batch_asks_its_producer_as_the_route_says(model, expected, lane, tmp_path):
    """#48 item 2: ``muser batch`` routes as the served consumer and ``decode --producer`` do. With
    producers it warms its engine up and measures its own prefill at two sizes first (once: the
    cost file keeps it, and says so); a short prompt then stays here (no connection is worth a
    few rows: the line says the route kept it), a longer one goes where the route predicts it is
    answered sooner (the line says which and why); ``MUSER_ROUTE=producer`` asks for both. The
    tokens are the same either way."""
    import shutil

    p = lane["producer"]
    solo = json.dumps({"id": "solo", "prompt": "Hello there, how are you today?", "max_tokens": 4})
    jobs = tmp_path / "jobs.jsonl"
    write_jobs(tmp_path, QUESTIONS[:1])
    jobs.write_text(solo + "\n" + jobs.read_text())
    runs, summaries = {}, {}
    for mode in (None, "producer"):
        home = tmp_path / f"consumer-{mode}"
        shutil.copytree(lane["nodes"].consumer_home, home)  # enrolled with the lane's producer
        for kept in ("costs", "store"):  # what earlier tests measured and stored: not this one's
            shutil.rmtree(home / "data" / kept, ignore_errors=True)
        res = tmp_path / f"res-{mode}.jsonl"
        r = batch(home, str(jobs), *common(model), "--producer", p.address, "-o", str(res), "--json", "--no-reuse",
                  route=mode)
        assert r.returncode == 0, r.stderr
        runs[mode] = {g["id"]: g for g in lines_of(res.read_bytes())}
        summaries[mode] = json.loads(r.stdout)
        assert {i: g["token_ids"] for i, g in runs[mode].items()} == {"solo": expected["solo"], "q0": expected["q0"]}
        [kept] = list((home / "data" / "costs").glob("*.json"))
        sizes = {end - start for start, end, _ in json.loads(kept.read_text())["local"]["obs"]}
        assert max(sizes) >= 2 * min(sizes), sizes  # calibrated: two sizes at least twice apart
    calibrated = summaries[None]["calibration"]
    assert [n for n, _ in calibrated["calibration"]] == [32, 256] and calibrated["calibrate_s"] > 0, calibrated
    default, asked = runs[None], runs["producer"]
    assert default["solo"]["producer"] is None and default["solo"]["source"] == "local", default["solo"]
    assert "route: local predicted faster" in default["solo"]["fallback_reason"], default["solo"]
    q0 = default["q0"]
    assert (q0["producer"] == p.address and q0["source"] == "handoff") or (
        q0["producer"] is None and "route: local predicted faster" in q0["fallback_reason"]), q0
    assert all(g["producer"] == p.address and g["source"] == "handoff" for g in asked.values()), asked


def test_producer_killed_mid_batch_every_job_still_completes(model, expected, lane, tmp_path):
    prod = Producer(lane["nodes"].producer_home, *lane_flags(model))
    jobs = write_jobs(tmp_path)
    res = tmp_path / "res.jsonl"
    try:
        proc = subprocess.Popen(muser_cmd("batch", str(jobs), *common(model), "--producer", prod.address, "-o",
                                          str(res), "--timeout", "20"),
                                env={**env_for(lane["nodes"].consumer_home), "MUSER_ROUTE": "producer"},
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        stop_at_lines(proc, res, 1)  # the other jobs must meet a dead producer
        prod.proc.kill()
        prod.proc.wait()
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err
    finally:
        prod.proc.kill()
        prod.proc.wait()
    got = lines_of(res.read_bytes())
    assert [g["id"] for g in got] == [f"q{i}" for i in range(len(QUESTIONS))]
    for g in got:
        assert g["error"] is None and g["token_ids"] == expected[g["id"]], g
    assert got[0]["source"] in ("handoff", "delta")  # the store may hold the document from an earlier test
    assert any(g["producer"] is None for g in got[1:]), [g["source"] for g in got]  # after the kill: local


# ----------------------------------------------------------------------------- Ray
def test_ray_batch_equals_the_local_batch(model, expected, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'muser[ray]')")
    solo = json.dumps({"id": "solo", "prompt": "Hello there, how are you today?", "max_tokens": 4})
    jobs = write_jobs(tmp_path, QUESTIONS[:3], extra=[solo])
    res = tmp_path / "res.jsonl"
    r = batch(tmp_path / "home", str(jobs), *common(model), "--ray", "local", "--ray-workers", "2", "-o", str(res),
              "--json", timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    got = lines_of(res.read_bytes())
    assert [g["id"] for g in got] == ["q0", "solo", "q1", "q2"]
    for g in got:
        assert g["error"] is None and g["token_ids"] == expected[g["id"]], g
    doc_workers = {g["worker"] for g in got if g["id"].startswith("q")}
    assert len(doc_workers) == 1  # one document, one worker: its prefix paid once
    assert [g["source"] for g in got if g["id"] != "solo"] == ["local", "store+local", "store+local"]


def test_decode_producer_asks_only_for_what_the_store_lacks(model, expected, lane, tmp_path):
    """``decode --producer`` (not only batch) sends its have: a stored document -> a delta."""
    home = tmp_path / "consumer"
    import shutil

    shutil.copytree(lane["nodes"].consumer_home, home)
    shutil.rmtree(home / "data" / "store", ignore_errors=True)  # what earlier tests stored: not this one's
    p = lane["producer"]
    runs = []
    for i, q in enumerate(QUESTIONS[:2]):
        prompt = tmp_path / f"p{i}.txt"
        prompt.write_text(f"{DOC}\n\n{q}")
        r = subprocess.run(muser_cmd("decode", *common(model), "--prompt", str(prompt), "-n", "5", "--json",
                                     "--producer", p.address, "--store"),
                           env={**env_for(home), "MUSER_ROUTE": "producer"}, capture_output=True, timeout=HANG_S)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout))
    assert runs[0]["source"] == "handoff" and runs[1]["source"] == "delta", [x["source"] for x in runs]
    assert runs[1]["reuse"]["held_tokens"] >= CHUNK
    assert [x["token_ids"] for x in runs] == [expected["q0"], expected["q1"]]


def test_an_mlx_consumer_batch_equals_mlx_decode_per_job(model, tmp_path):
    pytest.importorskip("mlx.core", reason="MLX is not installed on this machine")
    from muser_cli.consumer.decode import decode

    jobs = write_jobs(tmp_path, QUESTIONS[:2])
    r = batch(tmp_path / "home", str(jobs), *common(model), "--engine", "mlx")
    assert r.returncode == 0, r.stderr
    got = lines_of(r.stdout)
    assert [g["source"] for g in got] == ["local", "store+local"] and {g["engine"] for g in got} == {"mlx"}
    for g, q in zip(got, QUESTIONS):
        want = decode(None, model=model, prompt=f"{DOC}\n\n{q}", max_new_tokens=5, engine="mlx", dtype="float32",
                      threads=1, chunk_tokens=CHUNK, reuse=False)
        assert g["token_ids"] == want.token_ids, g


# ----------------------------------------------------------------------------- issues 29 and 30
def spools(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("muser-batch-*"))


def test_a_fifo_prompt_file_fails_that_job_and_the_summary_names_producers_and_ends_with_resume(
        model, expected, tmp_path):
    """#30 item 5: a job whose prompt_file is a FIFO no one writes hung the whole batch; it now
    fails alone (66). #29 item 9: the human summary names the producers that failed and ends
    with the command that continues."""
    pipe_job = json.dumps({"id": "pipe", "prompt_file": "pipe", "question": "?"})
    jobs = write_jobs(tmp_path, QUESTIONS[:2], extra=[pipe_job])
    os.mkfifo(tmp_path / "pipe")
    res = tmp_path / "res.jsonl"
    dead = _dead_address()
    r = batch(tmp_path / "home", str(jobs), *common(model), "--producer", dead, "-o", str(res), "--timeout", "5",
              timeout=HANG_S, route="producer")  # asked whatever the route predicts: the summary names it
    assert r.returncode == 1, r.stderr
    by = {g["id"]: g for g in lines_of(res.read_bytes())}
    assert by["pipe"]["error"]["exit"] == 66 and "named pipe (FIFO)" in by["pipe"]["error"]["message"]
    assert by["q0"]["token_ids"] == expected["q0"] and by["q1"]["token_ids"] == expected["q1"]
    err = r.stderr.decode().strip().splitlines()
    assert any(ln.startswith(f"muser batch: producers that failed: {dead} (") for ln in err), err
    assert err[-1].startswith("muser batch: to rerun what failed or is left: muser batch "), err
    assert str(jobs) in err[-1] and err[-1].endswith("--resume") and str(res) in err[-1]


def test_an_edited_results_line_is_redone_on_resume_and_the_summary_says_so(model, expected, tmp_path):
    """#30 item 7: a done line whose text and token ids were edited (job digest kept) was kept."""
    jobs = write_jobs(tmp_path, QUESTIONS[:3])
    res = tmp_path / "res.jsonl"
    home = tmp_path / "home"
    r = batch(home, str(jobs), *common(model), "-o", str(res))
    assert r.returncode == 0, r.stderr
    lines = lines_of(res.read_bytes())
    lines[1].update(text="edited", token_ids=[1, 2, 3])
    res.write_text("".join(json.dumps(g) + "\n" for g in lines))
    r = batch(home, str(jobs), *common(model), "-o", str(res), "--resume", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["skipped"] == 2 and summary["done"] == 1
    assert [x["id"] for x in summary["redone"]] == ["q1"] and "changed" in summary["redone"][0]["reason"]
    assert b"1 redone" in r.stderr
    final = lines_of(res.read_bytes())
    assert [g["token_ids"] for g in final] == [expected[f"q{i}"] for i in range(3)]


def test_a_sigkilled_batchs_spool_is_removed_by_resume(model, expected, tmp_path):
    """#30 item 8: SIGKILL (for real) left muser-batch-* in the temp folder for ever."""
    jobs = write_jobs(tmp_path)
    res = tmp_path / "res.jsonl"
    home = tmp_path / "home"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**env_for(home), "TMPDIR": str(tmp)}
    proc = subprocess.Popen(muser_cmd("batch", str(jobs), *common(model), "-o", str(res)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    end = time.monotonic() + HANG_S
    while time.monotonic() < end and proc.poll() is None and not (res.exists() and res.read_bytes().strip()):
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read()
    left = spools(tmp)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(left) == 1 and spools(tmp) == left  # what the killed run could not remove
    r = subprocess.run(muser_cmd("batch", str(jobs), *common(model), "-o", str(res), "--resume"), env=env,
                       capture_output=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert spools(tmp) == []
    assert [g["token_ids"] for g in lines_of(res.read_bytes())] == [expected[f"q{i}"] for i in range(len(QUESTIONS))]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_drains_prints_one_line_and_exits_0(model, expected, tmp_path, sig):
    """#29 item 4: a service manager's stop finishes the job in flight, says what is done and
    left in one line, exits 0; --resume continues."""
    jobs = write_jobs(tmp_path)
    res = tmp_path / "res.jsonl"
    home = tmp_path / "home"
    proc = subprocess.Popen(muser_cmd("batch", str(jobs), *common(model), "-o", str(res)), env=env_for(home),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    end = time.monotonic() + HANG_S
    while time.monotonic() < end and proc.poll() is None and not (res.exists() and res.read_bytes().strip()):
        time.sleep(0.02)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err
    lines = [ln for ln in err.decode().splitlines() if ln.startswith("muser")]  # not a library's FutureWarning (#29 item 6)
    assert len(lines) == 1 and lines[0].startswith(f"muser batch: stopped by {sig}: "), lines
    partial = lines_of(res.read_bytes())
    assert f"{len(partial)} done, 0 failed, 0 skipped, {len(QUESTIONS) - len(partial)} left of {len(QUESTIONS)}" \
        in lines[0]
    assert len(partial) < len(QUESTIONS) and lines[0].endswith("--resume"), lines
    r = batch(home, str(jobs), *common(model), "-o", str(res), "--resume")
    assert r.returncode == 0, r.stderr
    assert [g["token_ids"] for g in lines_of(res.read_bytes())] == [expected[f"q{i}"] for i in range(len(QUESTIONS))]


def test_dry_run_lists_jobs_shared_prefixes_and_producers_and_runs_nothing(model, tmp_path):
    """#29 item 9: ``--dry-run`` shows the plan; no results file, nothing stored, no producer asked."""
    solo = json.dumps({"id": "solo", "prompt": "Hello there, how are you today?", "max_tokens": 4})
    jobs = write_jobs(tmp_path, QUESTIONS[:3], extra=[solo])
    res = tmp_path / "res.jsonl"
    home = tmp_path / "home"
    dead = _dead_address()
    r = batch(home, str(jobs), *common(model), "--producer", dead, "-o", str(res), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [j["id"] for j in plan["jobs"]] == ["q0", "q1", "q2", "solo"]  # the document's jobs together
    [shared] = plan["prefixes"]
    assert shared["jobs"] == ["q0", "q1", "q2"] and shared["shared_tokens"] >= CHUNK
    assert shared["shared_tokens"] % CHUNK == 0 and shared["document"] == str((tmp_path / "doc.txt").resolve())
    assert plan["producers"] == [dead] and plan["bad"] == []
    assert not res.exists() and not (home / "data" / "store").exists()
    r = batch(home, str(jobs), *common(model), "--dry-run")
    text = r.stdout.decode()
    assert r.returncode == 0 and "shared prefixes (each paid once):" in text and "doc.txt" in text, text
    assert "producers: none" in text and "4 jobs to run" in text


def test_resume_with_every_job_done_ends_its_summary_cleanly(model, tmp_path):
    """Issue #49: a --resume that finds every job done skips them all; its summary line ends
    with its rates, not with a dangling '; ' where the sources of the jobs run would be."""
    home = tmp_path / "home"
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "solo", "prompt": "Hello there, how are you today?", "max_tokens": 2}) + "\n")
    res = tmp_path / "results.jsonl"
    first = batch(home, str(jobs), *common(model), "-o", str(res))
    assert first.returncode == 0, first.stderr
    ran = [ln for ln in first.stderr.decode().splitlines() if ln.startswith("muser batch: 1 done")]
    assert len(ran) == 1 and ran[0].endswith("local 1"), first.stderr  # a job ran: its source closes the line
    again = batch(home, str(jobs), *common(model), "-o", str(res), "--resume")
    assert again.returncode == 0, again.stderr
    [line] = [ln for ln in again.stderr.decode().splitlines() if ln.startswith("muser batch: 0 done")]
    assert "1 skipped of 1" in line and line.endswith("tok/s)"), line
