"""Shared pieces of the handoff tests: nodes, packs, a receiver thread, a fault-injecting relay.

Everything listens and connects on 127.0.0.1 or ::1 only. Imported by the other
``test_handoff_*`` modules; it holds no tests itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvpack_factory import make_pack
from muser_cli.handoff.trust import node
from muser_cli.handoff.trust.node import Identity, load_identity
from muser_cli.bench.loopback import wait_listening
from muser_cli.handoff.push.receiver import Destination, ReceiveConfig, Receiver

LOOPBACK = "127.0.0.1"

# The ceiling for a wait that only catches a hang: every wait for a process, a line or a state
# uses it, never a budget a loaded machine can exceed (a test waits on the event it needs; one
# that fails for being slow is a flaky test, not a finding). MUSER_TEST_HANG_S lowers it locally.
HANG_S = float(os.environ.get("MUSER_TEST_HANG_S", "900"))


@contextlib.contextmanager
def home_env(home: Path) -> Iterator[None]:
    """MUSER_HOME=home in this process while the block runs; as it was, after."""
    old = os.environ.get("MUSER_HOME")
    os.environ["MUSER_HOME"] = str(home)
    try:
        yield
    finally:
        if old is None:
            del os.environ["MUSER_HOME"]
        else:
            os.environ["MUSER_HOME"] = old


def keys_dir_of(home: Path) -> Path:
    """``muser_cli.paths.keys_dir()`` for MUSER_HOME=home."""
    with home_env(home):
        from muser_cli import paths

        return paths.keys_dir()


@dataclass
class Nodes:
    """A consumer (CA owner) and a producer that joined it, each under its own MUSER_HOME."""

    consumer_home: Path
    producer_home: Path
    consumer: Identity
    producer: Identity
    producer_key_id: str


def make_nodes(root: Path, *, producer: str = "gx10") -> Nodes:
    ch, ph = root / "consumer", root / "producer"
    node.init_node(keys_dir_of(ch), name="consumer")
    bundle, summary = node.export_producer(keys_dir_of(ch), producer=producer)
    node.join_node(keys_dir_of(ph), bundle)
    return Nodes(ch, ph, load_identity(keys_dir_of(ch)), load_identity(keys_dir_of(ph)), summary["key_id"])


def first_pull_answer(ident: Identity, address: str, frame) -> object:
    """Open a pull-lane connection to the producer at ``address`` as ``ident``, send ``frame``
    (a signed Request or Probe) and return the producer's first answer event (Serving, Reject, …)."""
    with held_pull(ident, address, frame) as answer:
        return answer


@contextlib.contextmanager
def held_pull(ident: Identity, address: str, frame) -> Iterator[object]:
    """:func:`first_pull_answer`, with the connection held open until the block ends: a
    consumer admitted (``Serving``) that never says it is ready holds the producer's turn,
    for as long as the test needs, with no race against the producer's compute."""
    from muser_cli.handoff.link import client_context
    from muser_cli.handoff.wire.pull_protocol import ALPN_PULL, PullConnection, Side

    host, port = address.rsplit(":", 1)
    ctx = client_context(ident)
    ctx.set_alpn_protocols([ALPN_PULL])
    with socket.create_connection((host, int(port)), timeout=HANG_S) as s, ctx.wrap_socket(s, server_hostname=host) as tls:
        pc = PullConnection(Side.CONSUMER)
        tls.sendall(pc.send(frame))
        while True:
            pc.receive_data(tls.recv(65536))
            ev = pc.next_event()
            if ev is not None and type(ev).__name__ != "_NeedData":
                break
        yield ev


def refused_as_malformed(obj: dict[str, Any], change, parse) -> None:
    """A frame's JSON ``obj`` after ``change(obj)``, canonical again: ``parse`` refuses it as a
    protocol error."""
    from muser_cli.errors import ProtocolError
    from muser_cli.handoff.wire.header import canonical

    change(obj)
    with pytest.raises(ProtocolError):
        parse(canonical(obj))


def copy_home(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.fixture(scope="session")
def nodes(tmp_path_factory) -> Nodes:
    """Shared, never mutated: tests that revoke or tear build their own with make_nodes."""
    return make_nodes(tmp_path_factory.mktemp("nodes"))


@pytest.fixture
def homes(tmp_path, nodes) -> tuple[Path, Path]:
    """A consumer and a producer that joined it (copies of ``nodes``': each test may change them).
    A module that imports it imports ``nodes`` too."""
    return copy_home(nodes.consumer_home, tmp_path / "c"), copy_home(nodes.producer_home, tmp_path / "p")


@pytest.fixture(scope="session")
def pack_bytes() -> bytes:
    return make_pack(120)[0]


@pytest.fixture
def pack_file(tmp_path, pack_bytes) -> Path:
    p = tmp_path / "in.kvpack"
    p.write_bytes(pack_bytes)
    return p


# ----------------------------------------------------------------------------- receiver thread
@dataclass
class RunningReceiver:
    receiver: Receiver
    to: str
    out_dir: Path
    ledger_dir: Path
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    accepted: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in list(self.events) if k == kind]

    def published(self) -> list[Path]:
        return sorted(p for p in self.out_dir.iterdir()) if self.out_dir.exists() else []

    def wait_done(self, timeout: float = HANG_S) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "receiver did not stop"

    def stop(self) -> None:
        self.receiver.stop()
        if self.thread is not None:
            self.thread.join(HANG_S)
        self.receiver.close()


def start_receiver(identity: Identity, root: Path, *, host: str = LOOPBACK, **cfg: Any) -> RunningReceiver:
    defaults = dict(once=False, idle_s=3.0, handshake_s=2.0, queue_s=5.0, probe_max_s=2.0)
    defaults.update(cfg)
    out_dir, ledger_dir = root / "out", root / "ledger"
    events: list = []
    receiver = Receiver(
        identity, ReceiveConfig(host=host, port=0, **defaults), ledger_dir=ledger_dir,
        destination=Destination(directory=out_dir), on_event=lambda k, f: events.append((k, f)),
    )
    h, port = receiver.bind()
    to = f"[{h}]:{port}" if ":" in h else f"{h}:{port}"
    run = RunningReceiver(receiver, to, out_dir, ledger_dir, events)

    def serve() -> None:
        try:
            receiver.serve(on_accept=run.accepted.append)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            run.error = exc

    run.thread = threading.Thread(target=serve, daemon=True)
    run.thread.start()
    return run


@pytest.fixture
def receivers():
    started: list[RunningReceiver] = []

    def factory(identity: Identity, root: Path, **cfg: Any) -> RunningReceiver:
        r = start_receiver(identity, root, **cfg)
        started.append(r)
        return r

    yield factory
    for r in started:
        r.stop()


def ledger_records(ledger_dir: Path, key_id: str) -> list[str]:
    path = ledger_dir / f"{key_id}.ledger"
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines()[1:] if line.startswith("A ")]


# ----------------------------------------------------------------------------- fault relay
class Relay:
    """A TCP relay on 127.0.0.1 in front of ``target_port`` that can misbehave.

    chunk:        forward at most this many bytes per send (1 = one-byte segments)
    cut_after:    after this many client->server bytes, close both sides (reset=True: RST)
    hole_after:   after this many client->server bytes, stop forwarding both ways, keep sockets open
    close_delay:  hold a half-close this many seconds before passing it on
    delay/jitter: hold each forwarded burst delay ± jitter seconds (userspace latency)
    rate:         forward at most this many bytes per second in each direction
    up_delay:     hold each client->server burst this many seconds (the server's answers are not held)
    """

    def __init__(self, target_port: int, *, chunk: int | None = None, cut_after: int | None = None,
                 reset: bool = False, hole_after: int | None = None, close_delay: float = 0.0,
                 delay: float = 0.0, jitter: float = 0.0, rate: float | None = None, up_delay: float = 0.0) -> None:
        self.target_port = target_port
        self.chunk, self.cut_after, self.reset = chunk, cut_after, reset
        self.hole_after, self.close_delay = hole_after, close_delay
        self.delay, self.jitter, self.rate, self.up_delay = delay, jitter, rate, up_delay
        self._rng = random.Random(7)
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind((LOOPBACK, 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.to = f"{LOOPBACK}:{self.port}"
        self.up_bytes = 0
        self.cut = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            r, _, _ = select.select([self.lsock], [], [], 0.1)
            if not r:
                continue
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            server = socket.create_connection((LOOPBACK, self.target_port))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _kill(self, a: socket.socket, b: socket.socket) -> None:
        self.cut.set()
        for s in (a, b):
            with contextlib.suppress(OSError):
                if self.reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while not self._stop.is_set():
                if self.cut.is_set() and self.hole_after is not None:
                    time.sleep(0.05)  # black hole: hold everything, forward nothing
                    continue
                r, _, _ = select.select([src], [], [], 0.1)
                if not r:
                    continue
                data = src.recv(65536)
                if not data:
                    if self.close_delay:
                        time.sleep(self.close_delay)
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                if upstream:
                    limit = self.cut_after if self.cut_after is not None else self.hole_after
                    if limit is not None and self.up_bytes + len(data) >= limit:
                        data = data[: max(0, limit - self.up_bytes)]
                        self._send(dst, data)
                        self.up_bytes += len(data)
                        if self.cut_after is not None:
                            self._kill(src, dst)
                            return
                        self.cut.set()
                        continue
                    self.up_bytes += len(data)
                    if self.up_delay:
                        time.sleep(self.up_delay)
                self._send(dst, data)
        except (OSError, ValueError):  # ValueError: the other pump closed src (fd -1) under select
            with contextlib.suppress(OSError):
                dst.close()

    def _send(self, dst: socket.socket, data: bytes) -> None:
        if self.delay or self.jitter:
            time.sleep(max(0.0, self.delay + self._rng.uniform(-self.jitter, self.jitter)))
        if self.rate:
            time.sleep(len(data) / self.rate)
        if not self.chunk:
            dst.sendall(data)
            return
        for i in range(0, len(data), self.chunk):
            dst.sendall(data[i : i + self.chunk])

    def close(self) -> None:
        self._stop.set()
        for s in [self.lsock, *self._socks]:
            with contextlib.suppress(OSError):
                s.close()


# ----------------------------------------------------------------------------- subprocesses
def muser_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "muser_cli.commands", *args]


def env_for(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["MUSER_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    tests_dir = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
    return env


LISTEN_RE = re.compile(r'listening on ([^\s"]+)')  # a text line, or a --json line's message


def spawn_receiver(home: Path, *args: str, stdout=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """Start ``muser receive --listen 127.0.0.1:0 ...``; return (process, HOST:PORT it bound)."""
    proc = subprocess.Popen(
        muser_cmd("receive", "--listen", f"{LOOPBACK}:0", *args), env=env_for(home),
        stdout=stdout, stderr=subprocess.PIPE, text=False,
    )
    assert proc.stderr is not None
    return proc, wait_listening(proc, "receive --listen", HANG_S)


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen) -> Iterator[None]:
    """Each of ``procs`` still running when the block ends (however it ends) is killed; each is reaped."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(HANG_S)


def port_of(run) -> int:
    """The port a running receiver listens on."""
    return int(run.to.rsplit(":", 1)[1])


def wait_for(pred, timeout: float = 5.0) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds pass; its last value. The short
    default suits a negative check (``assert not wait_for(...)``); a positive wait passes HANG_S."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


class ServiceProcess:
    """A resident muser command started on port 0 (``env_for(home)``, and ``extra_env``); its
    stderr lines collected on a thread, its address read from the line ``listen_re`` matches
    (group 1)."""

    what = "service"

    def __init__(self, home: Path, argv: list[str], listen_re: re.Pattern,
                 extra_env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, env={**env_for(home), **(extra_env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.address: str | None = None
        got = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for raw in self.proc.stderr:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                m = listen_re.search(line)
                if m and self.address is None:
                    self.address = m.group(1)
                    got.set()
            got.set()

        threading.Thread(target=pump, daemon=True).start()
        got.wait(HANG_S)
        if self.address is None:
            self.proc.kill()
            raise AssertionError(f"{self.what} did not start: {''.join(self.lines)}")

    def events(self, kind: str = "request") -> list[dict]:
        out = []
        for line in list(self.lines):
            if line.startswith("{"):
                obj = json.loads(line)
                if obj.get("event") == kind:
                    out.append(obj)
        return out

    def wait_events(self, n: int, kind: str = "request", timeout: float = HANG_S) -> list[dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end and len(self.events(kind)) < n:
            time.sleep(0.05)
        return self.events(kind)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(HANG_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


class Producer(ServiceProcess):
    """``muser prefill --serve 127.0.0.1:0 --json``; its stderr lines collected on a thread."""

    what = "producer"

    def __init__(self, home: Path, *args: str) -> None:
        super().__init__(home, muser_cmd("prefill", "--serve", "127.0.0.1:0", "--json", *args), LISTEN_RE)


# ----------------------------------------------------------------------------- the pull lane
LANE_PROMPT = ("The committee met on a grey Tuesday to decide where the new bridge would go. "
               "After a long debate about costs, traffic and the river's spring floods, they chose "
               "the northern site, close to the old mill and the school.")
LANE_CHUNK = 8


def lane_flags(model) -> list[str]:
    """The model flags both ends of a test lane run with: ``-m MODEL``, one thread, float32."""
    return ["-m", str(model), "--threads", "1", "--dtype", "float32"]


@contextlib.contextmanager
def serving(home: Path, *args: str, check_exit: bool = True) -> Iterator[Producer]:
    """A resident producer (``prefill --serve``, :class:`Producer`) under ``home``, started and
    listening when the block begins; stopped by SIGTERM when it ends, its exit status 0
    asserted unless ``check_exit`` is false."""
    producer = Producer(home, *args)
    try:
        yield producer
    finally:
        status = producer.stop()
        assert status == 0 or not check_exit, "".join(producer.lines)


@contextlib.contextmanager
def pull_lane(root: Path, model, *producer_args: str, prompt: str | None = None, common: list[str] | None = None,
              check_exit: bool = True) -> Iterator[dict[str, Any]]:
    """The pull lane a test module (or one test) runs on: a consumer and a producer that joined
    it under ``root`` (:func:`make_nodes`), ``prompt`` (if any) written to ``root/doc.txt``, and
    a resident producer under the producer's home, serving with ``common`` (default
    :func:`lane_flags` of ``model``) and ``producer_args`` (:func:`serving`: stopped, and its
    exit status checked, when the block ends).

    Yields a dict the tests add to: ``root``, ``nodes``, ``model`` (a string), ``common``,
    ``producer`` and, with a prompt, ``prompt`` (its path)."""
    nodes = make_nodes(root)
    model = str(model)
    lane: dict[str, Any] = {"root": root, "nodes": nodes, "model": model,
                            "common": lane_flags(model) if common is None else common}
    if prompt is not None:
        lane["prompt"] = root / "doc.txt"
        lane["prompt"].write_text(prompt)
    with serving(nodes.producer_home, *lane["common"], *producer_args, check_exit=check_exit) as producer:
        lane["producer"] = producer
        yield lane


def without_store(src: Path, dst: Path) -> Path:
    """A copy of the home ``src`` at ``dst`` with nothing in its store (what earlier tests kept there gone)."""
    copy_home(src, dst)
    shutil.rmtree(dst / "data" / "store", ignore_errors=True)
    return dst


def prefill_stored(env: dict[str, str], prompt: Path, out: Path, *flags: str) -> None:
    """``muser prefill PROMPT FLAGS --store -o OUT`` in ``env``: the prompt's rows kept in that
    home's store, for a later request to continue from. Its exit status 0 asserted."""
    stored = subprocess.run(muser_cmd("prefill", str(prompt), *flags, "--store", "-o", str(out)), env=env,
                            capture_output=True, timeout=HANG_S)
    assert stored.returncode == 0, stored.stderr


def local_decode(home: Path, *args: str) -> dict:
    """``muser decode ARGS`` (``--json`` among them) under ``home``, nothing on stdin: the local
    answer a lane's is compared with. Its exit status 0 asserted; its JSON returned."""
    r = subprocess.run(muser_cmd("decode", *args), env=env_for(home), input=b"", capture_output=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def signed_request(lane: dict[str, Any], prompt: str = LANE_PROMPT, chunk: int = LANE_CHUNK):
    """The lane's consumer identity and a freshly signed request for ``prompt`` (what ``receive
    --from`` would send for the lane's document), to speak the protocol by hand. ``lane`` needs
    ``nodes`` and ``model``."""
    from muser_cli.handoff.pull.client import key_for
    from muser_cli.handoff.wire.pull_protocol import PullRequest, Request, new_request_id, sign_request
    from muser_cli.consumer.pull import ask_for

    with home_env(lane["nodes"].consumer_home):
        ident = load_identity(keys_dir_of(lane["nodes"].consumer_home))
        ask = ask_for(prompt, model=lane["model"], chat=False, chunk_tokens=chunk, dtype="float32", engine="torch")
    key = key_for(ident, "gx10")
    req = PullRequest(key.key_id, new_request_id(), int(time.time() * 1000), ident.name, tuple(ask.token_ids),
                      ask.tokenizer_fingerprint, ask.model_fingerprint, chunk, "float32")
    raw, mac = sign_request(req, key.secret)
    return ident, Request(raw, mac, req)
