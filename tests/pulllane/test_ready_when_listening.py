"""Issue 39 item 5: a resident producer is ready when it says so (real processes on 127.0.0.1).

* ``prefill --serve`` warms its engine before its "listening" line: the first request's
  prefill costs what a second one of the same size does (the producer's own figures);
* a consumer joined (`muser node join`) on a running producer is served without a restart;
* before it joined, its 77 says what is wrong, and where to fix it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from handoff_kit import HANG_S, Producer, env_for, keys_dir_of, make_nodes, muser_cmd
from muser_cli.handoff.trust import node

CHUNK = 8
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def flags(model) -> list[str]:
    return ["-m", str(model), "--threads", "1", "--dtype", "float32"]


def receive(home: Path, address: str, prompt: Path, model, out: Path) -> subprocess.CompletedProcess:
    """``muser receive --from`` under ``home`` (no store: a full pack), the pack written to ``out``."""
    return subprocess.run(muser_cmd("receive", "--from", address, str(prompt), *flags(model)[:2], "--chunk", str(CHUNK),
                                    "--dtype", "float32", "--no-reuse", "-o", str(out)),
                          env=env_for(home), capture_output=True, timeout=HANG_S)


def prompt_of(seed: int, n: int) -> str:
    """``n`` words after "The": the same words for every seed, in another order (so the same
    number of tokens, but other tokens from the second word on: no rows shared)."""
    import random

    words = [WORDS[k % len(WORDS)] for k in range(n)]
    random.Random(seed).shuffle(words)
    return "The " + " ".join(words)


def test_the_first_request_to_a_fresh_producer_pays_no_first_touch_cost(tmp_path, tiny_llama):
    nodes = make_nodes(tmp_path)
    producer = Producer(nodes.producer_home, *flags(tiny_llama.path))
    try:
        json_lines = [json.loads(line) for line in producer.lines if line.startswith("{")]
        warmed = [e for e in json_lines if e.get("event") == "warmed"]
        assert warmed and warmed[0]["warm_s"] > 0 and warmed[0]["prefill_s"], producer.lines  # before "listening"
        served = []
        for i, seed in enumerate((1, 2)):  # two prompts of one size, different tokens (no reuse between them)
            doc = tmp_path / f"doc{i}.txt"
            doc.write_text(prompt_of(seed, 40))
            r = receive(nodes.consumer_home, producer.address, doc, tiny_llama.path, tmp_path / f"doc{i}.kvpack")
            assert r.returncode == 0, r.stderr
            served.append(producer.wait_events(i + 1)[i])
    finally:
        assert producer.stop() == 0, "".join(producer.lines)
    first, second = served
    assert [e["outcome"] for e in served] == ["served", "served"], served
    assert first["reused_rows"] == 0 and second["reused_rows"] == 0, served
    assert first["tokens"] == second["tokens"], served
    # The producer's own CPU time making the rows (its thread's: what the work cost, not how
    # long another process held the core), and its wall time, as it reports both.
    assert first["prefill_cpu_s"] <= 2 * second["prefill_cpu_s"], served


def _consumer(root: Path, name: str, producer: str = "gx10") -> tuple[Path, Path]:
    """A consumer home ``root/name`` (its own CA) and the bundle it made for ``producer``."""
    home = root / name
    node.init_node(keys_dir_of(home), name=name)
    bundle = root / f"{name}.bundle"
    node.export_producer(keys_dir_of(home), producer=producer, deliver=bundle.write_bytes)
    return home, bundle


def test_a_consumer_joined_on_a_running_producer_is_served_and_its_77_said_why(tmp_path, tiny_llama):
    nodes = make_nodes(tmp_path)  # the producer joined "consumer" first
    late_home, late_bundle = _consumer(tmp_path, "late")
    doc = tmp_path / "doc.txt"
    doc.write_text(prompt_of(5, 20))
    producer = Producer(nodes.producer_home, *flags(tiny_llama.path))
    try:
        # Not joined yet: 77, naming this consumer as the one the producer does not know, and the join.
        r = receive(late_home, producer.address, doc, tiny_llama.path, tmp_path / "before.kvpack")
        err = r.stderr.decode()
        assert r.returncode == 77, err
        assert "does not know consumer 'late'" in err and "muser node join" in err, err
        assert "no restart" in err, err
        assert not (tmp_path / "before.kvpack").exists() or not (tmp_path / "before.kvpack").stat().st_size
        assert producer.events("request") == []  # refused in TLS: no request read

        joined = subprocess.run(muser_cmd("node", "join", str(late_bundle)), env=env_for(nodes.producer_home),
                                capture_output=True, timeout=HANG_S)
        assert joined.returncode == 0, joined.stderr

        # The same producer, still running: the late consumer is served ...
        r = receive(late_home, producer.address, doc, tiny_llama.path, tmp_path / "late.kvpack")
        assert r.returncode == 0, r.stderr
        # ... and the first one still is.
        r = receive(nodes.consumer_home, producer.address, doc, tiny_llama.path, tmp_path / "first.kvpack")
        assert r.returncode == 0, r.stderr
        events = producer.wait_events(2)
    finally:
        assert producer.stop() == 0, "".join(producer.lines)
    assert [(e["outcome"], e["consumer"]) for e in events] == [("served", "late"), ("served", "consumer")], events


def test_a_key_the_producer_never_joined_is_refused_77_naming_the_join(tmp_path, tiny_llama):
    """The producer knows this consumer, but not the key it signs with now (a newer bundle made
    here, never joined there): 77, with the join to run on the producer."""
    nodes = make_nodes(tmp_path)
    node.export_producer(keys_dir_of(nodes.consumer_home), producer="gx10")  # a newer key, not joined
    doc = tmp_path / "doc.txt"
    doc.write_text(prompt_of(6, 12))
    producer = Producer(nodes.producer_home, *flags(tiny_llama.path))
    try:
        r = receive(nodes.consumer_home, producer.address, doc, tiny_llama.path, tmp_path / "out.kvpack")
        refused = producer.wait_events(1)
    finally:
        assert producer.stop() == 0, "".join(producer.lines)
    err = r.stderr.decode()
    assert r.returncode == 77, err
    assert "unknown key id" in err and "node join --force" in err, err
    assert [e["outcome"] for e in refused] == ["auth"] and "not joined here" in refused[0]["reason"], refused
