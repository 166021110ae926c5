"""Text prompts on the pull lane (issue 12): the producer tokenizes, the consumer stays authoritative.

    consumer$ muser receive --from HOST:PORT doc.txt --send-text [--chat]      # text, not token ids
    consumer$ muser decode --producer HOST:PORT --prompt doc.txt --send-text [--chat]

The consumer still tokenizes the prompt itself and refuses (65, before Go) a pack whose token
ids are not its own: a producer whose chat template renders differently cannot slip other
tokens in. Real processes, mutual TLS on 127.0.0.1, the tiny Llama.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from muser_cli.errors import AuthError
from muser_cli.handoff.wire.pull_protocol import PullRequest, new_request_id, parse_request, sign_request, verify_request_mac
from handoff_kit import HANG_S, env_for, lane_flags, muser_cmd, pull_lane, refused_as_malformed, serving

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "They chose the northern site, close to the old mill and the school.")
CHUNK = 8
SECRET = bytes(range(32))


# ----------------------------------------------------------------------------- the request bytes
def text_request(**over) -> PullRequest:
    return PullRequest(**{"key_id": "k1", "request_id": new_request_id(), "issued_at_ms": 1_700_000_000_000,
                          "consumer": "consumer", "token_ids": (), "tokenizer_fingerprint": "sha256:" + "b" * 64,
                          "model_fingerprint": "sha256:" + "a" * 64, "chunk_tokens": 8, "dtype": "float32",
                          "text": "Hello, world! Ünïcode too.", "chat": True, **over})


def test_a_text_request_round_trips_and_its_mac_covers_text_and_chat():
    req = text_request()
    raw, mac = sign_request(req, SECRET)
    obj = json.loads(raw)
    assert "token_ids" not in obj and obj["prompt"] == {"text": req.text, "chat": True}
    assert parse_request(raw) == req
    verify_request_mac(SECRET, raw, mac)
    for tampered in (raw.replace(b'"chat":true', b'"chat":false'), raw.replace(b"Hello", b"Jello")):
        assert tampered != raw
        with pytest.raises(AuthError):
            verify_request_mac(SECRET, tampered, mac)
    have = text_request(have_tokens=16, have_chain="sha256:" + "c" * 64)  # checked against the producer's count
    assert parse_request(sign_request(have, SECRET)[0]) == have


@pytest.mark.parametrize("change", [
    lambda o: o.update(token_ids=[1, 2, 3]),  # both forms at once
    lambda o: o.pop("prompt"),  # neither
    lambda o: o.update(prompt={"text": "x", "chat": 1}),
    lambda o: o.update(prompt={"text": "", "chat": False}),
    lambda o: o.update(prompt={"text": "x"}),
    lambda o: o.update(prompt={"text": "x", "chat": False, "template": "y"}),
    lambda o: o.update(prompt="just text"),
    lambda o: o.update(prompt={"text": ["x"], "chat": False}),
])
def test_malformed_text_requests_are_protocol_errors(change):
    refused_as_malformed(text_request().to_json(), change, parse_request)


# ----------------------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def lane(tmp_path_factory, tiny_llama):
    with pull_lane(tmp_path_factory.mktemp("pull-text"), tiny_llama.path, prompt=PROMPT) as lane:
        yield lane


def consumer_ids(lane, model: str, *, chat: bool) -> list[int]:
    from muser_cli.model.resolve import resolve_model
    from muser_cli.model.tokens import encode_prompt

    return encode_prompt(resolve_model(model), PROMPT, chat=chat)


def receive(lane, to: str, out, *extra: str, model: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(muser_cmd("receive", "--from", to, str(lane["prompt"]), "-m", model or lane["model"],
                                    "--chunk", str(CHUNK), "--dtype", "float32", "--no-reuse", "-o", str(out),
                                    *extra),
                          env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)


def test_receive_send_text_gets_a_pack_of_the_consumers_own_tokens(lane, tmp_path):
    from muser_cli.kvpack import read_pack

    p = lane["producer"]
    for chat in (False, True):
        before = len(p.events())
        out = tmp_path / f"text-{chat}.kvpack"
        r = receive(lane, p.address, out, "--send-text", *(["--chat"] if chat else []))
        assert r.returncode == 0, r.stderr
        with open(out, "rb") as f:
            pack = read_pack(f)
        ids = consumer_ids(lane, lane["model"], chat=chat)
        assert list(pack.header.token_ids) == ids
        served = p.wait_events(before + 1)[before:]
        assert [(e["outcome"], e["prompt"], e["tokens"]) for e in served] == [
            ("served", "chat" if chat else "text", len(ids))], served


def test_decode_producer_send_text_chat_decodes_the_local_tokens(lane):
    base = ["decode", *lane["common"], "--chunk", str(CHUNK), "--prompt", str(lane["prompt"]), "-n", "6", "--chat",
            "--no-reuse", "--json"]
    env = env_for(lane["nodes"].consumer_home)
    local = subprocess.run(muser_cmd(*base), env=env, input=b"", capture_output=True, timeout=HANG_S)
    assert local.returncode == 0, local.stderr
    pulled = subprocess.run(muser_cmd(*base, "--producer", lane["producer"].address, "--send-text"), env=env,
                            capture_output=True, timeout=HANG_S)
    assert pulled.returncode == 0, pulled.stderr
    got, want = json.loads(pulled.stdout), json.loads(local.stdout)
    assert got["source"] == "handoff" and not got["fallback"], got
    assert got["token_ids"] == want["token_ids"]
    bad = subprocess.run(muser_cmd("decode", "--prompt", str(lane["prompt"]), "--send-text"), env=env,
                         capture_output=True, timeout=HANG_S)
    assert bad.returncode == 2 and b"--producer" in bad.stderr


@pytest.fixture(scope="module")
def clock_model(lane, tmp_path_factory):
    """The tiny Llama with a chat template that renders the time of day (as Llama 3's renders
    the date): the same files, so the same fingerprints, on both sides, yet each tokenization
    of a chat prompt differs from the last."""
    folder = tmp_path_factory.mktemp("clock") / "tiny-llama-clock"
    shutil.copytree(lane["model"], folder)
    template = folder / "chat_template.jinja"
    template.write_text("{{ '<|im_start|>system\\nTime ' + strftime_now('%H:%M:%S.%f') + '<|im_end|>\\n' }}"
                        + template.read_text())
    return str(folder)


def test_a_producer_whose_template_renders_other_tokens_is_caught_by_the_consumer(lane, clock_model, tmp_path):
    first, second = (consumer_ids(lane, clock_model, chat=True) for _ in range(2))
    assert first != second  # the premise: two renderings of the template differ
    assert consumer_ids(lane, clock_model, chat=False) == consumer_ids(lane, lane["model"], chat=False)
    with serving(lane["nodes"].producer_home, *lane_flags(clock_model)) as producer:
        out = tmp_path / "text.kvpack"
        r = receive(lane, producer.address, out, "--send-text", "--chat", model=clock_model)
        assert r.returncode == 65, r.stderr
        err = r.stderr.decode().strip().splitlines()
        assert len(err) == 1 and "token ids" in err[0], err
        assert not out.exists() and not list(tmp_path.glob(".text.kvpack*"))  # nothing half-written
        events = producer.wait_events(1)
        assert [e["outcome"] for e in events] == ["failed"] and events[0]["prompt"] == "chat", events
        # Token ids (the default): the consumer's own rendering is what the producer computes.
        ids_out = tmp_path / "ids.kvpack"
        ok = receive(lane, producer.address, ids_out, "--chat", model=clock_model)
        assert ok.returncode == 0, ok.stderr
        assert [e["outcome"] for e in producer.wait_events(2)] == ["failed", "served"]
        # decode --producer --send-text falls back by itself and says why.
        dec = subprocess.run(muser_cmd("decode", "-m", clock_model, "--threads", "1", "--dtype", "float32",
                                       "--chunk", str(CHUNK), "--prompt", str(lane["prompt"]), "-n", "2", "--chat",
                                       "--no-reuse", "--json", "--producer", producer.address, "--send-text"),
                             env=env_for(lane["nodes"].consumer_home), capture_output=True, timeout=HANG_S)
        assert dec.returncode == 0, dec.stderr
        got = json.loads(dec.stdout)
        assert got["fallback"] and "token ids" in got["reason"], got


def test_a_producer_with_another_template_file_is_refused_before_any_work(lane, clock_model, tmp_path):
    """The tokenizer fingerprint covers the chat template files: a producer serving the clock
    template is refused by a consumer of the plain model naming both fingerprints (65 since issue 25:
    mismatched data, as on the push lane; decode --producer falls back)."""
    from muser_cli.model.resolve import resolve_model

    with serving(lane["nodes"].producer_home, *lane_flags(clock_model)) as producer:
        r = receive(lane, producer.address, tmp_path / "x.kvpack", "--send-text", "--chat")
        assert r.returncode == 65, r.stderr
        text = r.stderr.decode()
        assert resolve_model(clock_model).tokenizer_fingerprint in text
        assert resolve_model(lane["model"]).tokenizer_fingerprint in text
        assert [e["outcome"] for e in producer.wait_events(1)] == ["model"]
        assert producer.events("admitted") == []
