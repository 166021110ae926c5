"""The live lane as a user runs it (docs/reliability.md H41): real processes, real pipes,
mutual TLS on 127.0.0.1.

    consumer$ muser receive --listen 127.0.0.1:0 --once | muser decode --prompt doc.txt -n 8
    producer$ muser prefill doc.txt | muser send --to HOST:PORT

A whole stream decodes to the local fallback's tokens; a stream cut after k chunks (the
producer's input ends early, or the sender is SIGKILLed) keeps the verified chunks and
prefills the rest, still the same tokens; without --prompt a cut stream is refused (65)
with nothing on stdout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from handoff_kit import HANG_S, copy_home, env_for, muser_cmd, nodes, spawn_receiver  # noqa: F401 - fixtures

PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
          "After a long debate about costs, traffic and the river's spring floods, they chose "
          "the northern site, close to the old mill and the school.")
CHUNK = 8


@pytest.fixture
def lane(nodes, tiny_llama, tmp_path):
    prompt = tmp_path / "doc.txt"
    prompt.write_text(PROMPT)
    model = str(tiny_llama.path)
    common = ["-m", model, "--threads", "1", "--dtype", "float32"]
    consumer = copy_home(nodes.consumer_home, tmp_path / "consumer")
    pack = tmp_path / "file.kvpack"
    r = subprocess.run(muser_cmd("prefill", *common, "--chunk", str(CHUNK), str(prompt), "-o", str(pack)),
                       env=env_for(nodes.producer_home), capture_output=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    local = subprocess.run(muser_cmd("decode", *common, "--chunk", str(CHUNK), "--prompt", str(prompt), "-n", "8",
                                     "--json"), env=env_for(consumer), input=b"", capture_output=True, timeout=HANG_S)
    assert local.returncode == 0, local.stderr
    return {"prompt": prompt, "common": common, "consumer": consumer, "producer": nodes.producer_home,
            "pack": pack, "local": json.loads(local.stdout)}


def consumer(lane, *, with_prompt: bool = True):
    recv, to = spawn_receiver(lane["consumer"], "--once", "--timeout", str(HANG_S), stdout=subprocess.PIPE)
    args = ["decode", *lane["common"], "-n", "8", "--json"] + (["--prompt", str(lane["prompt"])] if with_prompt else [])
    dec = subprocess.Popen(muser_cmd(*args), env=env_for(lane["consumer"]), stdin=recv.stdout,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    recv.stdout.close()
    return recv, dec, to


def finish(*procs, timeout: float = HANG_S):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        finally:
            if p.poll() is None:
                p.kill()
    return outs


def test_streamed_lane_decodes_the_fallbacks_tokens(lane):
    recv, dec, to = consumer(lane)
    env = env_for(lane["producer"])
    pre = subprocess.Popen(muser_cmd("prefill", *lane["common"], "--chunk", str(CHUNK), str(lane["prompt"])),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    send = subprocess.Popen(muser_cmd("send", "-", "--to", to), env=env, stdin=pre.stdout,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pre.stdout.close()
    finish(pre, send)
    (out, err), _ = finish(dec, recv)
    assert dec.returncode == 0 and recv.returncode == 0, err
    got = json.loads(out)
    assert got["source"] == "handoff" and not got["fallback"]
    assert got["token_ids"] == lane["local"]["token_ids"]
    assert got["tail_s"] is not None and got["first_byte_s"] <= got["last_frame_s"] <= got["first_token_s"]


def _frames_in(pack_bytes: bytes) -> list[int]:
    from muser_cli.kvpack import FrameEvent, PackReader

    reader, pos, ends = PackReader(), 0, []
    while pos < len(pack_bytes):
        n = max(1, reader.want())
        if any(isinstance(ev, FrameEvent) for ev in reader.feed(pack_bytes[pos : pos + n])):
            ends.append(pos + n)
        pos += n
    return ends


@pytest.mark.parametrize("chunks", [0, 1, "n-1"])
def test_cut_stream_keeps_the_verified_chunks(lane, tiny_llama, chunks):
    """The producer's input ends after k whole chunks: the sender never sends a trailer,
    receive forwards no end frame, decode keeps k chunks and prefills the rest."""
    data = lane["pack"].read_bytes()
    ends = _frames_in(data)
    layers = len(tiny_llama.layers)
    n = len(ends) // layers
    k = n - 1 if chunks == "n-1" else chunks
    cut = data[: ends[k * layers - 1]] if k else data[: ends[0] - 1]
    recv, dec, to = consumer(lane)
    send = subprocess.run(muser_cmd("send", "-", "--to", to), env=env_for(lane["producer"]), input=cut,
                          capture_output=True, timeout=HANG_S)
    assert send.returncode != 0  # a pack that never ended is no handoff
    (out, err), _ = finish(dec, recv)
    assert recv.returncode in (65, 75, 76), recv.returncode
    assert dec.returncode == 0, err
    got = json.loads(out)
    assert got["token_ids"] == lane["local"]["token_ids"]
    assert got["fallback"] and got["handoff_rows"] == CHUNK * k
    assert got["source"] == ("partial+local" if k else "local")


def test_sender_killed_mid_stream(lane):
    """SIGKILL of the sender while paced: whatever verified is kept, the tokens are the same."""
    recv, dec, to = consumer(lane)
    size = lane["pack"].stat().st_size
    send = subprocess.Popen(muser_cmd("send", str(lane["pack"]), "--to", to, "--rate", str(max(1, size // 4))),
                            env=env_for(lane["producer"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)  # about half the payload has gone
    send.send_signal(signal.SIGKILL)
    send.wait()
    (out, err), _ = finish(dec, recv)
    assert dec.returncode == 0, err
    got = json.loads(out)
    assert got["fallback"] and got["token_ids"] == lane["local"]["token_ids"]
    assert got["source"] in ("partial+local", "local")
    if got["source"] == "partial+local":
        assert 0 < got["handoff_rows"] and got["local_rows"] > 0


def test_cut_stream_without_a_prompt_is_refused(lane):
    data = lane["pack"].read_bytes()
    ends = _frames_in(data)
    recv, dec, to = consumer(lane, with_prompt=False)
    subprocess.run(muser_cmd("send", "-", "--to", to), env=env_for(lane["producer"]), input=data[: ends[3]],
                   capture_output=True, timeout=HANG_S)
    (out, err), _ = finish(dec, recv)
    assert dec.returncode == 65
    report = json.loads(out)  # --json: the one object is the error; no text, no tokens
    assert report["ok"] is False and "truncated" in report["error"] and "token_ids" not in report
