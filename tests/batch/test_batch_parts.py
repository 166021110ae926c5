"""The batch's parts without processes: job lines, the results file, the producer pool, the
pull request's ``have`` and the resident producer's check of it."""

from __future__ import annotations

import json
import os

import pytest

from muser_cli.batch.jobs import BadJob, Defaults, Job, read_jobs
from muser_cli.consumer.pool import ProducerPool
from muser_cli.batch.results import Results
from muser_cli.errors import AuthError, DataError, MissingInput, ProtocolError, TempFailure, UsageError
from muser_cli.handoff.wire.pull_protocol import PullRequest, new_request_id, parse_request, sign_request
from handoff_kit import HANG_S


def jobs_of(tmp_path, *lines: str, defaults=Defaults()):
    return read_jobs([ln.encode() for ln in lines], base_dir=tmp_path, defaults=defaults)


# ----------------------------------------------------------------------------- job lines
def test_a_job_line_takes_the_batch_defaults_and_a_document_comes_first(tmp_path):
    (tmp_path / "doc.txt").write_text("The document.\n\n")
    [a, b] = jobs_of(tmp_path, '{"id": "a", "prompt": "hi there"}',
                     '{"id": "b", "prompt_file": "doc.txt", "question": "Why?", "max_tokens": 9, "seed": 3}',
                     defaults=Defaults(max_tokens=7, temperature=0.5))
    assert isinstance(a, Job) and a.text == "hi there" and a.max_tokens == 7 and a.temperature == 0.5
    assert a.document is None
    assert isinstance(b, Job) and b.text == "The document.\n\nWhy?" and b.max_tokens == 9 and b.seed == 3
    assert b.document == str((tmp_path / "doc.txt").resolve())
    assert a.digest != b.digest and a.digest.startswith("sha256:")


def test_the_digest_follows_the_document_bytes(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("one")
    line = '{"id": "a", "prompt_file": "doc.txt"}'
    [first] = jobs_of(tmp_path, line)
    doc.write_text("two")
    [second] = jobs_of(tmp_path, line)
    assert first.digest != second.digest  # a resumed batch notices a changed document


@pytest.mark.parametrize("line, status, words", [
    ('{"id": "a", "promt": "x"}', 65, "unknown field 'promt'"),
    ('{"id": "a"}', 65, "exactly one of"),
    ('{"id": "a", "prompt": "x", "prompt_file": "d"}', 65, "exactly one of"),
    ('{"id": "a", "prompt": ""}', 65, "non-empty"),
    ('{"id": "a", "prompt": "x", "max_tokens": 0}', 65, "max_tokens"),
    ('{"id": "a", "prompt": "x", "max_tokens": 2.5}', 65, "max_tokens"),
    ('{"id": "a", "prompt": "x", "top_p": 0}', 65, "top_p"),
    ('{"id": "a", "prompt": "x", "question": "q"}', 65, "question"),
    ('{"id": "a", "prompt": "x", "chat": "yes"}', 65, "chat"),
    ('{"id": "a", "prompt": "x", "seed": -1}', 65, "seed"),
    ('{"id": 7, "prompt": "x"}', 65, "'id'"),
    ('{"id": "a", "prompt_file": "missing.txt"}', 66, "missing.txt"),
    ('[1, 2]', 65, "not a JSON object"),
    ('{"id": "a", "prompt": "x", "prompt": "y"}', 65, ""),
    ('{"id": "a", "prompt": NaN}', 65, ""),
])
def test_a_bad_line_is_a_failed_job_with_its_exit_status(tmp_path, line, status, words):
    [bad] = jobs_of(tmp_path, line)
    assert isinstance(bad, BadJob) and bad.error.exit_status == status, bad
    assert words in str(bad.error) and "\n" not in str(bad.error)


def test_a_repeated_id_refuses_the_jobs_file_naming_its_lines_and_blank_lines_are_skipped(tmp_path):
    # Issue 30 item 6 changed this: a repeated id was a failed job on the later line; the whole
    # file is now refused (65) before anything runs, so one id never stands for two jobs.
    with pytest.raises(DataError, match="id 'a' is on lines 1, 3") as info:
        jobs_of(tmp_path, '{"id": "a", "prompt": "x"}', "", '{"id": "a", "prompt": "y"}')
    assert info.value.exit_status == 65 and "its own id" in info.value.hint
    got = jobs_of(tmp_path, '{"id": "a", "prompt": "x"}', "", '{"id": "b", "prompt": "y"}')
    assert [g.line for g in got] == [1, 3]


def test_a_bad_line_keeps_the_id_it_meant(tmp_path):
    [bad] = jobs_of(tmp_path, '{"id": "q7", "max_tokens": "many", "prompt": "x"}')
    assert bad.id == "q7"
    [bad] = jobs_of(tmp_path, "{{{")
    assert bad.id == "line-1"


# ----------------------------------------------------------------------------- results
def result(rid: str, *, model="m", job="j", error=None) -> dict:
    return {"id": rid, "model": model, "job": job, "error": error, "token_ids": [1]}


def test_results_are_durable_lines_rewritten_in_input_order_at_the_end(tmp_path):
    path = tmp_path / "res.jsonl"
    r = Results(path)
    r.open(["a", "b", "c"])
    r.write(result("c"))
    r.write(result("a"))
    assert [json.loads(x)["id"] for x in path.read_bytes().splitlines()] == ["c", "a"]  # as they finished
    r.write(result("b"))
    r.close(complete=True)
    assert [json.loads(x)["id"] for x in path.read_bytes().splitlines()] == ["a", "b", "c"]


def test_resume_cuts_a_torn_line_and_keeps_the_latest_per_id(tmp_path):
    path = tmp_path / "res.jsonl"
    path.write_bytes(b"\n".join(json.dumps(x).encode() for x in (
        result("a", error={"message": "x", "exit": 75}), result("a"), result("b"))) + b'\n{"id": "c", "te')
    r = Results(path, resume=True)
    done = r.done(model="m", jobs={"a": "j", "b": "j", "c": "j"})
    assert set(done) == {"a", "b"} and done["a"]["error"] is None
    assert path.read_bytes().endswith(b"\n")  # the torn line is gone
    with pytest.raises(DataError, match="another model"):
        Results(path, resume=True).done(model="other", jobs={})
    with pytest.raises(DataError, match="another job line"):
        Results(path, resume=True).done(model="m", jobs={"b": "changed"})


def test_results_file_guards(tmp_path):
    path = tmp_path / "res.jsonl"
    path.write_text(json.dumps(result("a")) + "\n")
    with pytest.raises(UsageError, match="already holds results") as info:
        Results(path)
    assert "--resume" in info.value.hint
    with pytest.raises(UsageError):
        Results(stream=open(os.devnull, "wb"), resume=True)
    with pytest.raises(MissingInput):
        Results(tmp_path / "no" / "res.jsonl")
    Results(path, force=True)  # allowed: starts over


def test_results_on_a_stream_come_out_in_input_order(tmp_path):
    out = tmp_path / "out"
    with open(out, "wb") as fh:
        r = Results(stream=fh)
        r.open(["a", "b", "c"])
        r.write(result("b"))
        assert out.read_bytes() == b""  # held until a's
        r.skip("a")
        r.write(result("c"))
        r.close(complete=True)
    assert [json.loads(x)["id"] for x in out.read_bytes().splitlines()] == ["b", "c"]


# ----------------------------------------------------------------------------- the pool
def test_the_pool_picks_the_least_busy_and_backs_off_a_failed_producer():
    now = [100.0]
    pool = ProducerPool(["127.0.0.1:1", "127.0.0.1:2"], backoff_s=2, clock=lambda: now[0])
    first = pool.pick()
    second = pool.pick()
    assert {first, second} == {"127.0.0.1:1", "127.0.0.1:2"}  # the idle one, not the busy one
    pool.done(first, TempFailure("connection refused"))
    pool.done(second)
    assert pool.pick() == second and pool.pick() == second  # first is backing off
    pool.done(second)
    pool.done(second)
    assert pool.pick(exclude=[second]) is None  # first still backing off
    now[0] += 2.1
    assert pool.pick(exclude=[second]) == first  # tried again after its back-off
    pool.done(first, AuthError("certificate refused"))
    now[0] += 1000
    assert pool.pick(exclude=[second]) is None  # refused us for good: dropped
    assert [s["gone"] for s in pool.to_json()] == ["certificate refused", None]


def test_the_pool_refuses_a_bad_or_repeated_address():
    with pytest.raises(UsageError):
        ProducerPool(["no-port"])
    with pytest.raises(UsageError, match="twice"):
        ProducerPool(["127.0.0.1:7070", "127.0.0.1:7070"])


# ----------------------------------------------------------------------------- have
def make_request(**over) -> PullRequest:
    fields = dict(key_id="k1", request_id=new_request_id(), issued_at_ms=1_700_000_000_000, consumer="consumer",
                  token_ids=tuple(range(1, 40)), tokenizer_fingerprint="sha256:" + "b" * 64,
                  model_fingerprint="sha256:" + "a" * 64, chunk_tokens=8, dtype="float32")
    fields.update(over)
    return PullRequest(**fields)


def test_a_request_with_have_round_trips_and_without_it_is_unchanged():
    plain = make_request()
    raw, _ = sign_request(plain, bytes(32))
    assert b"have" not in raw and parse_request(raw) == plain
    req = make_request(have_tokens=16, have_chain="c1:" + "f" * 64)
    raw, _ = sign_request(req, bytes(32))
    assert parse_request(raw) == req


@pytest.mark.parametrize("have", [
    {"held_tokens": 0, "chain": "x"}, {"held_tokens": 39, "chain": "x"}, {"held_tokens": 8},
    {"held_tokens": 8, "chain": "x", "more": 1}, {"held_tokens": "8", "chain": "x"}, [8, "x"],
    {"held_tokens": 8, "chain": "bad chain"},
])
def test_a_malformed_have_is_a_protocol_error(have):
    obj = make_request().to_json()
    obj["have"] = have
    from muser_cli.handoff.wire.header import canonical

    with pytest.raises(ProtocolError):
        parse_request(canonical(obj))


def test_the_resident_producer_refuses_a_have_chain_that_is_not_the_prompts(tiny_llama):
    from muser_cli.handoff.push.spool import Refusal
    from muser_cli.reuse.chain import Scope, chain_at
    from muser_cli.pulllane.producer import ResidentProducer

    prod = ResidentProducer(str(tiny_llama.path), dtype="float32")
    ids = tuple(range(5, 45))
    scope = Scope(tiny_llama.fingerprint, tiny_llama.tokenizer_fingerprint, "float32", 8)
    good = make_request(token_ids=ids, model_fingerprint=tiny_llama.fingerprint,
                        tokenizer_fingerprint=tiny_llama.tokenizer_fingerprint, have_tokens=16,
                        have_chain=chain_at(scope, list(ids), 16))
    prod.check(good)
    other = chain_at(scope, [9] + list(ids[1:]), 16)
    with pytest.raises(Refusal) as info:
        prod.check(make_request(token_ids=ids, model_fingerprint=tiny_llama.fingerprint,
                                tokenizer_fingerprint=tiny_llama.tokenizer_fingerprint, have_tokens=16,
                                have_chain=other))
    assert info.value.code == "data"


# ----------------------------------------------------------------------------- review fixes
def test_a_bad_line_never_takes_the_id_of_a_good_one(tmp_path):
    # Issue 30 item 6 changed this: a bad line repeating a good line's id refuses the file.
    with pytest.raises(DataError, match="id 'b' is on lines 2, 4"):
        jobs_of(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "y"}',
                '{"id": "c", "prompt": "z"}',
                '{"id": "b", "max_tokens": "many", "prompt": "w"}')
    got = jobs_of(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "b", "max_tokens": "many", "prompt": "w"}', "{{{")
    assert [g.id for g in got] == ["a", "b", "line-3"] and isinstance(got[1], BadJob)


def test_an_explicit_id_equal_to_a_default_id_refuses_the_file(tmp_path):
    """Item 6: line 1 named "line-2", line 2 had no id (default line-2): two jobs, one result line."""
    with pytest.raises(DataError, match=r"id 'line-2' is on lines 1, 2 \(it is line 2's default id\)"):
        jobs_of(tmp_path, '{"id": "line-2", "prompt": "x"}', '{"prompt": "y"}')
    with pytest.raises(DataError, match="id 'line-1' is on lines 1, 2"):  # a bad line's default id too
        jobs_of(tmp_path, "{{{", '{"id": "line-1", "prompt": "y"}')


def test_resume_checks_the_schedule_and_not_a_failed_lines_digest(tmp_path):
    path = tmp_path / "res.jsonl"
    ok = {**result("a"), "engine": "torch", "dtype": "float32", "chunk": 512}
    failed = {**result("b", error={"message": "x", "exit": 65}), "job": None}
    path.write_text(json.dumps(ok) + "\n" + json.dumps(failed) + "\n")
    same = {"engine": "torch", "dtype": "float32", "chunk": 512}
    done = Results(path, resume=True).done(model="m", jobs={"a": "j", "b": "other"}, schedule=same)
    assert set(done) == {"a", "b"} and done["b"]["error"] is not None  # b is rerun, not refused
    with pytest.raises(DataError, match="chunk 512"):
        Results(path, resume=True).done(model="m", jobs={"a": "j"}, schedule={**same, "chunk": 128})


def test_results_to_a_fifo_are_written_once_and_never_read_back(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    import threading

    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    r = Results(fifo)
    r.open(["a", "b"])
    r.write(result("b"))
    r.write(result("a"))
    r.close(complete=True)  # no rewrite: reading a pipe back would block forever
    reader.join(HANG_S)
    assert [json.loads(x)["id"] for x in got[0].splitlines()] == ["b", "a"]


def test_the_pool_keeps_a_producer_that_refused_one_request_and_drops_one_that_wrote_wrong_kv():
    from muser_cli.errors import SpotCheckFailed

    pool = ProducerPool(["127.0.0.1:1"])
    addr = pool.pick()
    pool.done(addr, DataError("prompt too long for this producer"))
    assert pool.pick() == addr  # not held against it
    pool.done(addr)
    pool.blame(addr, SpotCheckFailed("layer 3 differs"))
    assert pool.pick() is None and "refused" in pool.to_json()[0]["gone"]


# ----------------------------------------------------------------------------- issue 30
def _within(seconds: float, fn):
    """``fn()`` on a thread: its value, or a failure if it is still running after ``seconds``
    (a read that hangs must fail the test, not hang it)."""
    import threading

    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s"
    return box[0]


def test_a_prompt_file_that_is_a_fifo_or_a_device_fails_that_job_at_once(tmp_path):
    """Item 5: a FIFO no one writes hung the whole batch; now that job fails (66), the rest goes on."""
    os.mkfifo(tmp_path / "pipe")
    got = _within(30, lambda: jobs_of(tmp_path, '{"id": "p", "prompt_file": "pipe", "question": "?"}',
                                      '{"id": "z", "prompt_file": "/dev/zero"}', '{"id": "ok", "prompt": "x"}'))
    assert [type(g) for g in got] == [BadJob, BadJob, Job]
    assert got[0].error.exit_status == 66 and "named pipe (FIFO), not a regular file" in str(got[0].error)
    assert got[1].error.exit_status == 66 and "character device" in str(got[1].error)
    assert "\n" not in str(got[0].error) and str(got[0].error).startswith("job p: ")


def test_a_results_line_carries_its_own_digest_and_an_edited_or_old_line_is_redone(tmp_path):
    """Item 7: an edited line (text and token ids changed, job digest kept) was kept as done."""
    from muser_cli.batch.results import EDITED, NO_DIGEST, line_digest

    path = tmp_path / "res.jsonl"
    r = Results(path)
    r.open(["a", "b", "c", "d"])
    for rid in "abcd":
        r.write({**result(rid), "text": "caf\u00e9 \u2603", "temperature": 0.7})
    r.close(complete=True)
    lines = [json.loads(x) for x in path.read_bytes().splitlines()]
    assert all(x["line_digest"] == line_digest(x) for x in lines)
    lines[1].update(text="something else", token_ids=[9, 9])  # b: edited, its digests kept
    del lines[2]["line_digest"]  # c: as an older muser wrote it
    lines[3]["line_digest"] = lines[3]["line_digest"] + "0"
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    again = Results(path, resume=True)
    done = again.done(model="m", jobs={rid: "j" for rid in "abcd"})
    assert set(done) == set("abcd")
    assert again.redo == {"b": EDITED, "c": NO_DIGEST, "d": EDITED}
    lines[1]["model"] = "another"  # an edited line is redone, not taken as evidence of another model
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert "b" in Results(path, resume=True).done(model="m", jobs={})


def test_spools_of_gone_runs_are_removed_and_a_live_ones_is_kept(tmp_path, monkeypatch):
    """Item 8 (the rule; test_batch.py SIGKILLs a real run): a spool names its owner's pid and
    start time; gone (pid dead, or reused by a later process) -> removed."""
    import subprocess
    import sys
    import tempfile
    import time

    from muser_cli.batch.spool import make_spool, start_time, sweep_spools

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = make_spool()
    assert mine.parent == tmp_path and mine.name.startswith(f"muser-batch-{os.getpid()}.")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp_path / f"muser-batch-{child.pid}.{start_time(os.getpid()) or 0}-abc123"
    reused = tmp_path / f"muser-batch-{os.getpid()}.{(start_time(os.getpid()) or 0) + 1}-abc123"
    old, fresh, other = tmp_path / "muser-batch-a1b2c3d4", tmp_path / "muser-batch-z9y8x7w6", tmp_path / "muser-batch-notes"
    for d in (dead, reused, old, fresh, other):
        d.mkdir()
        (d / "job-1.kvpack").write_bytes(b"x")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    removed = sweep_spools()
    assert set(removed) == {dead, reused, old} if start_time(os.getpid()) else {dead, old}
    assert mine.is_dir() and fresh.is_dir() and other.is_dir()
