"""Handoff V3 streaming (docs/reliability.md H41-H43, B15, H50): real processes, real pipes, TLS on 127.0.0.1.

The producer is ``tests/stream_producer.py``: it writes a kvpack frame by frame, flushing
each, and can stop after k frames until a gate file appears -- so a test knows exactly
how many frames exist when it cuts, kills or checks something.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from muser_cli.errors import AuthError, DataError, TempFailure
from muser_cli.handoff import link as link_mod
from muser_cli.handoff.push import sender as sender_mod
from muser_cli.handoff.wire.header import HandoffTrailer
from muser_cli.handoff.wire.protocol import Role
from muser_cli.handoff.push.receiver import Destination, ReceiveConfig, Receiver
from muser_cli.handoff.push.sender import PackSource, prepare_handoff, transmit
from muser_cli.handoff.push.spool import remove_stale_parts

import stream_producer
from handoff_kit import (  # noqa: F401 - fixtures
    HANG_S, Relay, copy_home, env_for, muser_cmd, nodes, reaped, receivers, spawn_receiver, wait_for,
)

PRODUCER = str(Path(stream_producer.__file__).resolve())
SMALL = dict(tokens=200, layers=2)  # 13 chunks x 2 layers = 26 frames of 16 rows


@pytest.fixture
def consumer_home(nodes, tmp_path):
    return copy_home(nodes.consumer_home, tmp_path / "consumer")


def producer_cmd(*, tokens: int, layers: int, gate_after: int | None = None, gate: Path | None = None,
                 **kw) -> list[str]:
    cmd = [sys.executable, PRODUCER, "--tokens", str(tokens), "--layers", str(layers)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    if gate_after is not None:
        cmd += ["--gate-after", str(gate_after), "--gate", str(gate)]
    return cmd


class Collector:
    """Reads a process's stdout in a thread: everything it forwarded, as it arrives."""

    def __init__(self, stream, keep: bool = True) -> None:
        self.data = bytearray()
        self.size = 0
        self.sha = hashlib.sha256()
        self.keep = keep
        self._stream = stream
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self._stream.fileno()
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return
            self.size += len(chunk)
            self.sha.update(chunk)
            if self.keep:
                self.data += chunk

    def wait_size(self, n: int, timeout: float = HANG_S) -> bool:
        return wait_for(lambda: self.size >= n, timeout)

    def finish(self, timeout: float = HANG_S) -> bytes:
        self.thread.join(timeout)
        return bytes(self.data)


def stdout_receiver(home: Path, *args: str) -> tuple[subprocess.Popen, str, Collector]:
    proc, to = spawn_receiver(home, "--once", "--timeout", str(HANG_S), *args, stdout=subprocess.PIPE)
    return proc, to, Collector(proc.stdout)


def lane(producer: list[str], home: Path, to: str, *args: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """``producer | muser send - --to TO``."""
    prod = subprocess.Popen(producer, stdout=subprocess.PIPE, env=env_for(home))
    send = subprocess.Popen(muser_cmd("send", "-", "--to", to, *args), stdin=prod.stdout, env=env_for(home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    prod.stdout.close()
    return prod, send


def finish(proc: subprocess.Popen, timeout: float = HANG_S) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(HANG_S)
        raise


# ----------------------------------------------------------------------------- the lane streams
def test_streamed_lane_frames_flow_before_the_producer_ends(nodes, consumer_home, tmp_path):
    """prefill | send -> receive | ...: verified frames reach stdout while the producer is
    still computing; the whole stream equals the file-lane bytes."""
    data = stream_producer.pack_bytes(**SMALL)
    ends = stream_producer.frame_ends(data)
    gate = tmp_path / "gate"
    recv, to, out = stdout_receiver(consumer_home)
    prod, send = lane(producer_cmd(**SMALL, gate_after=6, gate=gate), nodes.producer_home, to, "--json")
    with reaped(prod, send, recv):
        # The producer has written the header and 6 of 26 frames and waits: those 6 are
        # forwarded, verified, and nothing else (not the end frame) can be.
        assert out.wait_size(ends[6]), f"only {out.size} bytes forwarded while the producer waits"
        time.sleep(0.2)
        assert out.size == ends[6] and bytes(out.data) == data[: ends[6]]
        assert send.poll() is None and recv.poll() is None
        gate.touch()
        assert finish(send) == 0, send.stderr.read()
        assert finish(recv) == 0
    assert out.finish() == data
    res = json.loads(send.stdout.read())
    assert res["ok"] and res["payload_bytes"] == len(data) and res["frames"] == len(ends) - 1
    assert 0 < res["first_byte_s"] <= res["last_byte_s"]
    assert res["last_byte_s"] - res["first_byte_s"] >= 0.2  # the wait at the gate is inside the stream
    assert res["input_wait_s"] >= 0.2 and res["first_byte_unix"] <= res["last_byte_unix"]
    assert b"accepted" in recv.stderr.read()


def test_receive_json_to_file_reports_first_and_last_byte(nodes, consumer_home, tmp_path):
    data = stream_producer.pack_bytes(**SMALL)
    dest = tmp_path / "got.kvpack"
    recv, to = spawn_receiver(consumer_home, "--once", "--timeout", str(HANG_S), "-o", str(dest), "--json",
                              stdout=subprocess.PIPE)
    prod, send = lane(producer_cmd(**SMALL, delay=0.01), nodes.producer_home, to)
    assert finish(send) == 0, send.stderr.read()
    assert finish(recv) == 0
    obj = json.loads(recv.stdout.read())
    assert dest.read_bytes() == data and obj["path"] == str(dest)
    assert 0 < obj["first_byte_s"] < obj["last_byte_s"]  # 26 frames 10 ms apart
    assert obj["frames"] == 26 and obj["payload_bytes"] == len(data)
    assert not list(tmp_path.glob(".*.part"))


# ----------------------------------------------------------------------------- H42 / B12
def corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_corrupt_frame_forwards_only_the_good_frames_exit_65(nodes, consumer_home, tmp_path):
    data = stream_producer.pack_bytes(**SMALL)
    ends = stream_producer.frame_ends(data)
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(corrupt(data, ends[5] + 64 + 10))  # a payload byte of frame 5
    recv, to, out = stdout_receiver(consumer_home)
    send = subprocess.run(muser_cmd("send", str(bad), "--to", to), env=env_for(nodes.producer_home),
                          capture_output=True, timeout=HANG_S)
    assert send.returncode == 65, send.stderr
    assert finish(recv) == 65
    assert out.finish() == data[: ends[5]]  # frames 0-4, verified; nothing of frame 5, no end frame
    assert b"no end frame was forwarded" in recv.stderr.read()


@pytest.mark.parametrize("what,status", [("mac", 77), ("root", 65), ("size", 65)])
def test_bad_trailer_at_the_very_end_no_end_frame(nodes, consumer_home, tmp_path, monkeypatch, what, status):
    """Every frame verified and forwarded; the trailer fails: no end frame, nothing decodable."""
    data = stream_producer.pack_bytes(**SMALL)
    src = tmp_path / "in.kvpack"
    src.write_bytes(data)
    real = sender_mod.sign_trailer

    def forged(trailer, secret, header_mac):
        if what == "mac":
            raw, mac = real(trailer, secret, header_mac)
            return raw, bytes([mac[0] ^ 1]) + mac[1:]
        if what == "root":
            return real(HandoffTrailer(trailer.handoff_id, trailer.payload_size, "00" * 32), secret, header_mac)
        return real(HandoffTrailer(trailer.handoff_id, trailer.payload_size - 1, trailer.root_digest), secret,
                    header_mac)

    monkeypatch.setattr(sender_mod, "sign_trailer", forged)
    recv, to, out = stdout_receiver(consumer_home)
    with pytest.raises(AuthError if status == 77 else DataError) as exc:
        transmit(prepare_handoff(src, nodes.producer), to=to, identity=nodes.producer)
    assert exc.value.exit_status == status
    assert finish(recv) == status
    assert out.finish() == data[:-128]  # everything but the end frame
    assert not (consumer_home / "data" / "ledger").exists() or all(
        len(p.read_text().splitlines()) == 1 for p in (consumer_home / "data" / "ledger").glob("*.ledger")
    )


# ----------------------------------------------------------------------------- H41: cut streams
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_cut_by_a_proxy_exit_75_no_end_frame(nodes, consumer_home, tmp_path, reset):
    data = stream_producer.pack_bytes(tokens=1200, layers=2)
    ends = stream_producer.frame_ends(data)
    src = tmp_path / "in.kvpack"
    src.write_bytes(data)
    recv, to, out = stdout_receiver(consumer_home)
    relay = Relay(int(to.rsplit(":", 1)[1]), cut_after=len(data) // 2, reset=reset, chunk=4096)
    try:
        with pytest.raises(TempFailure) as exc:
            transmit(prepare_handoff(src, nodes.producer), to=relay.to, identity=nodes.producer,
                     server_name="localhost", idle_s=3, chunk=8192)  # pipe-sized Data frames
        assert exc.value.exit_status == 75
        assert finish(recv) == 75, recv.stderr.read()
    finally:
        relay.close()
    got = out.finish()
    assert got == data[: len(got)] and len(got) in ends[:-1], "a prefix ending at a verified frame, no end frame"
    assert len(got) >= ends[1]  # frames did flow before the cut


@pytest.mark.parametrize("k", [0, 1, 25], ids=["k0", "k1", "n-1"])
def test_sender_sigkilled_after_k_frames_exit_75(nodes, consumer_home, tmp_path, k):
    data = stream_producer.pack_bytes(**SMALL)
    ends = stream_producer.frame_ends(data)
    recv, to, out = stdout_receiver(consumer_home)
    prod, send = lane(producer_cmd(**SMALL, gate_after=k, gate=tmp_path / "never"), nodes.producer_home, to)
    with reaped(prod, send, recv):
        assert out.wait_size(ends[k])
        send.send_signal(signal.SIGKILL)
        send.wait(HANG_S)
        assert finish(recv) == 75
    assert out.finish() == data[: ends[k]]  # header + k verified frames; no end frame
    assert b"no end frame was forwarded" in recv.stderr.read()


def test_producer_sigkilled_midstream(nodes, consumer_home, tmp_path):
    """``prefill`` dies: send sees its input end early (65) and tells the receiver (75)."""
    data = stream_producer.pack_bytes(**SMALL)
    ends = stream_producer.frame_ends(data)
    recv, to, out = stdout_receiver(consumer_home)
    prod, send = lane(producer_cmd(**SMALL, gate_after=9, gate=tmp_path / "never"), nodes.producer_home, to)
    with reaped(prod, send, recv):
        assert out.wait_size(ends[9])
        prod.send_signal(signal.SIGKILL)
        prod.wait(HANG_S)
        assert finish(send) == 65
        assert finish(recv) == 75
    assert out.finish() == data[: ends[9]]
    assert b"ended" in send.stderr.read()


# ----------------------------------------------------------------------------- H43
def test_v3_replay_refused_at_the_header_before_the_payload_exists(nodes, receivers, tmp_path, monkeypatch):
    run = receivers(nodes.consumer, tmp_path)
    data = stream_producer.pack_bytes(**SMALL)
    src = tmp_path / "in.kvpack"
    src.write_bytes(data)
    first = prepare_handoff(src, nodes.producer)
    assert transmit(first, to=run.to, identity=nodes.producer).ok
    sent: list[str] = []
    real_send = link_mod.Link.send

    def spy(self, ev, during="writing"):
        if self.conn.our_role is Role.SENDER:
            sent.append(type(ev).__name__)
        return real_send(self, ev, during)

    monkeypatch.setattr(link_mod.Link, "send", spy)
    # The same handoff id again, from a producer that has written only its kvpack header:
    # refused at the header, before one payload byte exists or is sent.
    prod = subprocess.Popen(producer_cmd(**SMALL, gate_after=0, gate=tmp_path / "never"), stdout=subprocess.PIPE)
    try:
        source = PackSource(prod.stdout)
        replay = prepare_handoff(source, nodes.producer, handoff_id=first.header.handoff_id)
        with pytest.raises(AuthError, match="replay") as exc:
            transmit(replay, to=run.to, identity=nodes.producer)
        # Refused without waiting on the payload (a state, not a stopwatch): the producer is
        # still held at its gate, its payload not written, when the refusal comes back.
        assert exc.value.exit_status == 77 and prod.poll() is None and not (tmp_path / "never").exists()
    finally:
        prod.kill()
        prod.wait(HANG_S)
    assert sent == ["Header"]
    assert len(run.kinds("streaming")) == 1  # Go went out once: for the first handoff only
    assert [p.name for p in run.published()] == [f"{first.header.handoff_id}.kvpack"]


# ----------------------------------------------------------------------------- H50: stale spool
def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_parts_removed_never_published(nodes, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    hid = "ab" * 16
    dead = out / f".{hid}.kvpack.{dead_pid()}-{'1' * 16}.part"
    live = out / f".{hid}.kvpack.1-{'2' * 16}.part"  # pid 1 runs: kept while young
    old_live = out / f".{'cd' * 16}.kvpack.1-{'3' * 16}.part"
    legacy_old = out / f".{hid}.kvpack.x1y2z3ab.part"  # V2 mkstemp name, no pid
    legacy_young = out / f".{'ef' * 16}.kvpack.q9w8e7rt.part"
    foreign = out / ".notes.txt.12-0000000000000000.part"  # not a handoff name: never touched
    for p in (dead, live, old_live, legacy_old, legacy_young, foreign):
        p.write_bytes(b"\x89KVPACK\n partial")
    hours_ago = time.time() - 7200
    for p in (old_live, legacy_old):
        os.utime(p, (hours_ago, hours_ago))
    r = Receiver(nodes.consumer, ReceiveConfig(port=0, session_s=600), ledger_dir=tmp_path / "ledger",
                 destination=Destination(directory=out))
    r.close()
    assert sorted(r.stale_removed) == sorted([dead, old_live, legacy_old])
    assert sorted(out.iterdir()) == sorted([live, legacy_young, foreign])
    assert not list(out.glob("*.kvpack"))  # removed, not published
    # A file destination owns only the parts of its own name.
    mine = tmp_path / f".x.kvpack.{dead_pid()}-{'4' * 16}.part"
    other = tmp_path / f".y.kvpack.{dead_pid()}-{'5' * 16}.part"
    mine.write_bytes(b"x")
    other.write_bytes(b"y")
    import re

    assert remove_stale_parts(tmp_path, re.compile(re.escape("x.kvpack")), max_age_s=3600) == [mine]
    assert other.exists()


def test_receiver_sigkilled_midstream_leaves_a_part_the_next_start_removes(nodes, consumer_home, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = stream_producer.pack_bytes(**SMALL)
    recv, to = spawn_receiver(consumer_home, "--once", "-o", str(out))
    prod, send = lane(producer_cmd(**SMALL, gate_after=8, gate=tmp_path / "never"), nodes.producer_home, to)
    with reaped(prod, send, recv):
        assert wait_for(lambda: any(p.stat().st_size > 0 for p in out.glob(".*.part")), HANG_S)
        parts = list(out.glob(".*.part"))
        assert len(parts) == 1 and f".{recv.pid}-" in parts[0].name
        recv.send_signal(signal.SIGKILL)
        recv.wait(HANG_S)
        assert finish(send) == 75
    assert parts[0].exists()  # SIGKILL: no cleanup ran
    again = subprocess.run(muser_cmd("receive", "--listen", "127.0.0.1:0", "--once", "--timeout", "0.5", "-o",
                                     str(out)), env=env_for(consumer_home), capture_output=True, timeout=HANG_S)
    assert again.returncode == 75  # nothing to receive; but the stale part is gone, not published
    assert b"removed 1 stale spool file" in again.stderr
    assert list(out.iterdir()) == []
    assert len(data) > 0


# ----------------------------------------------------------------------------- B15: bounded memory
class HashSink:
    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return len(b)

    def flush(self) -> None:
        pass


class HighWater:
    """A process's own peak RSS (VmHWM, KiB), sampled from /proc until it exits.

    Not ``wait4``'s ru_maxrss: Linux folds the parent's high-water mark into a child's at
    exec, so with a test process that holds models (GBs) every child would look that big."""

    def __init__(self, pid: int) -> None:
        self.kib = 0
        self._path = f"/proc/{pid}/status"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                with open(self._path) as f:
                    line = next((ln for ln in f if ln.startswith("VmHWM:")), None)
            except OSError:
                return
            if line is None:  # a zombie: its memory is gone, the last sample stands
                return
            self.kib = max(self.kib, int(line.split()[1]))
            time.sleep(0.005)

    def result(self) -> int:
        self._thread.join(HANG_S)
        return self.kib


def peak_rss_lane(nodes, home: Path, spec: dict) -> tuple[int, int, str, int]:
    """(send peak RSS, receive peak RSS, sha256 of what receive forwarded, bytes) in KiB."""
    recv, to = spawn_receiver(home, "--once", "--timeout", str(HANG_S), stdout=subprocess.PIPE)
    recv_hwm = HighWater(recv.pid)
    out = Collector(recv.stdout, keep=False)
    prod, send = lane(producer_cmd(**spec), nodes.producer_home, to)
    send_hwm = HighWater(send.pid)
    rss = {}
    for name, p, hwm in (("send", send, send_hwm), ("recv", recv, recv_hwm)):
        p.wait(HANG_S)
        assert p.returncode == 0, (name, p.stderr.read())
        rss[name] = hwm.result()
    prod.wait(HANG_S)
    out.finish()
    return rss["send"], rss["recv"], out.sha.hexdigest(), out.size


def test_peak_memory_independent_of_pack_size(nodes, consumer_home):
    """B15: a 200 MB stream through send and receive; peak RSS as for a 4 MB one (4 MiB frames)."""
    base = dict(tokens=8193, heads=8, head_dim=128, frame=1024)  # 4 MiB frames, 32 MiB per layer
    small = dict(base, tokens=1025, layers=1)
    big = dict(base, layers=6)
    s_send, s_recv, _, s_bytes = peak_rss_lane(nodes, consumer_home, small)
    b_send, b_recv, sha, b_bytes = peak_rss_lane(nodes, consumer_home, big)
    expect = HashSink()
    stream_producer.write(expect, stream_producer.make_header(big["tokens"], big["layers"], big["heads"],
                                                              big["head_dim"], big["frame"]))
    assert b_bytes == expect.size and sha == expect.sha.hexdigest()
    assert b_bytes > 190e6 and b_bytes > 40 * s_bytes
    print(f"\n[stream] peak RSS: send {s_send / 1024:.0f} -> {b_send / 1024:.0f} MiB, "
          f"receive {s_recv / 1024:.0f} -> {b_recv / 1024:.0f} MiB for {s_bytes / 1e6:.1f} -> {b_bytes / 1e6:.0f} MB")
    # The documented bound (docs/handoff.md 12): a few frames plus the queue, whatever the pack size.
    assert b_send - s_send < 40 * 1024 and b_recv - s_recv < 40 * 1024


def test_131k_token_stream_exact_and_bounded(nodes, consumer_home):
    """At the depth of the system we follow: 131,072 positions, 512 frames of 512 rows, exact bytes."""
    deep = dict(tokens=131_073, layers=2, heads=2, head_dim=16, frame=512)
    d_send, d_recv, sha, size = peak_rss_lane(nodes, consumer_home, deep)
    expect = HashSink()
    stream_producer.write(expect, stream_producer.make_header(deep["tokens"], deep["layers"], deep["heads"],
                                                              deep["head_dim"], deep["frame"]))
    assert size == expect.size and sha == expect.sha.hexdigest()
    print(f"\n[stream] 131k tokens ({size / 1e6:.0f} MB): peak RSS send {d_send / 1024:.0f} MiB, "
          f"receive {d_recv / 1024:.0f} MiB")
    assert d_send < 160 * 1024 and d_recv < 160 * 1024


# ----------------------------------------------------------------------------- the user's lane, tiny model
LANE_PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
               "After a long debate about costs, traffic and the river's spring floods, they chose "
               "the northern site, close to the old mill and the school.")


def test_prefill_send_receive_lane_tiny(nodes, consumer_home, tiny_llama, tmp_path):
    """``prefill | send`` -> ``receive``: a real model's streamed pack arrives as the file lane's bytes
    exactly (so any decode of it is the file lane's decode; decode's own streaming is tested with decode)."""
    model = str(tiny_llama.path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(LANE_PROMPT)
    common = ["-m", model, "--threads", "1"]
    pre = ["prefill", *common, "--chunk", "8", "--dtype", "float32", str(prompt)]
    pack = tmp_path / "file.kvpack"
    env = env_for(nodes.producer_home)
    assert subprocess.run(muser_cmd(*pre, "-o", str(pack)), env=env, capture_output=True, timeout=HANG_S).returncode == 0

    recv, to = spawn_receiver(consumer_home, "--once", "--timeout", str(HANG_S), stdout=subprocess.PIPE)
    tee = Collector(recv.stdout)  # what receive forwarded
    prod = subprocess.Popen(muser_cmd(*pre), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    send = subprocess.Popen(muser_cmd("send", "-", "--to", to, "--json"), stdin=prod.stdout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    prod.stdout.close()
    with reaped(prod, send, recv):
        assert finish(send) == 0, send.stderr.read()
        assert finish(recv) == 0
    streamed = tee.finish()
    assert streamed == pack.read_bytes()  # the streamed lane carries the file lane's bytes exactly
    res = json.loads(send.stdout.read())
    assert res["frames"] > 4 and res["first_byte_s"] < res["last_byte_s"]


def test_stream_tail_finds_the_root_only_at_a_real_end(tmp_path):
    """The sender's structural end check: any chunking gives the reader's root; any early end fails."""
    import io
    import random

    from muser_cli.errors import KVPackError
    from muser_cli.handoff.push.payload import StreamTail
    from muser_cli.kvpack import read_pack

    data = stream_producer.pack_bytes(**SMALL)
    root = read_pack(io.BytesIO(data)).root_digest.hex()
    source = PackSource(io.BytesIO(data))
    rng = random.Random(3)
    for _ in range(20):
        tail = StreamTail(source.start, source.head)
        pos = len(source.head)
        while pos < len(data):
            n = rng.choice([1, 7, 64, 127, 128, 129, 4096])
            tail.feed(memoryview(data)[pos : pos + n])
            pos += n
        assert tail.finish() == (len(data), root)
        assert tail.complete and tail.frames == source.start.frames
    ends = stream_producer.frame_ends(data)
    for cut in (len(source.head), ends[1], ends[-1], ends[-1] + 64, len(data) - 1):
        tail = StreamTail(source.start, source.head)
        tail.feed(data[len(source.head) : cut])
        assert not tail.complete
        with pytest.raises(KVPackError, match="end frame"):
            tail.finish()
    tail = StreamTail(source.start, source.head)
    with pytest.raises(KVPackError, match="after the kvpack's end frame"):
        tail.feed(data[len(source.head) :] + b"\0")
    tail = StreamTail(source.start, source.head)
    with pytest.raises(KVPackError, match="tag"):
        tail.feed(b"XXXX" + data[ends[0] + 4 :])


def test_slow_producer_pulses_through_idle_and_receive_timeout(nodes, receivers, tmp_path):
    """A producer silent for longer than the receiver's idle timeout (a long prefill chunk):
    Pulse keeps the link alive, and ``--timeout`` does not cut a handoff already streaming."""
    gate = tmp_path / "gate"
    prod = subprocess.Popen(producer_cmd(**SMALL, gate_after=3, gate=gate), stdout=subprocess.PIPE)
    # The producer process is writing before the receiver's 1 s connection deadline starts
    # (a Python start alone can take longer than that on a loaded machine).
    assert select.select([prod.stdout], [], [], HANG_S)[0], "the producer wrote nothing"
    run = receivers(nodes.consumer, tmp_path, once=True, idle_s=2.0, timeout=1.0)
    timer = threading.Timer(4.5, gate.touch)  # silent for over twice the idle timeout
    timer.start()
    try:
        source = PackSource(prod.stdout)
        res = transmit(prepare_handoff(source, nodes.producer), to=run.to, identity=nodes.producer)
    finally:
        timer.cancel()
        prod.kill()
        prod.wait(HANG_S)
    assert res.ok and res.input_wait_s > 2.0  # silent longer than the receiver's idle timeout
    run.wait_done()
    assert run.error is None and len(run.accepted) == 1
    assert run.published()[0].read_bytes() == stream_producer.pack_bytes(**SMALL)


def test_rate_caps_a_stream_after_a_producer_pause(nodes, receivers, tmp_path):
    """--rate is a cap on the stream, not an average: a pause of the producer earns no burst."""
    from muser_cli.handoff.push.clock import since_start

    run = receivers(nodes.consumer, tmp_path)
    data = stream_producer.pack_bytes(**SMALL)
    ends = stream_producer.frame_ends(data)
    gate = tmp_path / "gate"
    prod = subprocess.Popen(producer_cmd(**SMALL, gate_after=3, gate=gate), stdout=subprocess.PIPE)
    opened: list[float] = []
    timer = threading.Timer(1.0, lambda: (opened.append(since_start(time.monotonic())), gate.touch()))
    timer.start()
    rate = 100e3
    try:
        res = transmit(prepare_handoff(PackSource(prod.stdout), nodes.producer), to=run.to,
                       identity=nodes.producer, rate=rate)
    finally:
        timer.cancel()
        prod.kill()
        prod.wait(HANG_S)
    after_pause = len(data) - ends[3]
    # The bytes after the pause took at least their time at the rate (~0.5 s; a burst: a few ms),
    # counted from when the gate opened on the sender's clock: a loaded machine only adds to it.
    # (Not the seconds slept to pace them: a sender that wakes late sleeps less, and rightly.)
    assert res.ok and res.paced_s > 0 and len(opened) == 1, res
    assert res.last_byte_s - opened[0] >= 0.8 * after_pause / rate - 0.05, (res, opened)


def test_stuck_downstream_fails_the_handoff_within_the_idle_timeout(nodes, tmp_path):
    """``receive | X`` where X stops reading: the handoff is refused after idle_s, never hangs,
    and no end frame is written."""
    data = stream_producer.pack_bytes(tokens=1200, layers=2)  # ~330 KB: more than a pipe and the queue hold
    src = tmp_path / "in.kvpack"
    src.write_bytes(data)
    rfd, wfd = os.pipe()  # nobody reads rfd
    out = os.fdopen(wfd, "wb")
    r = Receiver(nodes.consumer, ReceiveConfig(port=0, once=True, idle_s=1.0, handshake_s=2.0),
                 ledger_dir=tmp_path / "ledger", out_stream=out)
    host, port = r.bind()
    errors: list[BaseException] = []

    def serve():
        try:
            r.serve()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(TempFailure):
            transmit(prepare_handoff(src, nodes.producer), to=f"{host}:{port}", identity=nodes.producer,
                     chunk=4096, idle_s=5)
        t.join(HANG_S)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], TempFailure), errors
        # Within the idle timeout: the receiver's own stall deadline (idle_s, 1 s) is what ended it.
        assert "has not drained for 1 s" in str(errors[0]), errors
    finally:
        r.close()
        os.close(rfd)  # the stuck write fails with EPIPE now
        try:
            out.close()
        except OSError:
            pass
