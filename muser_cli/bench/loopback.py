"""Two enrolled nodes on one host and a real ``muser receive`` process between them.

The consumer node (a private CA, a receiver certificate) and the producer node (joined
from the consumer's bundle) live in their own ``MUSER_HOME`` folders under a temporary
work folder; the receiver is a separate process listening on 127.0.0.1 with mutual TLS.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from muser_cli.bench.common import Pinning
from muser_cli.errors import TempFailure
from muser_cli.handoff.trust import node

MUSER = [sys.executable, "-m", "muser_cli.commands"]


@dataclass
class Nodes:
    work: Path
    consumer_home: Path
    producer_home: Path
    producer: object  # muser_cli.handoff.trust.node.Identity


def make_nodes(work: Path) -> Nodes:
    consumer_home, producer_home = work / "consumer", work / "producer"
    node.init_node(consumer_home / "config" / "node", name="consumer")
    bundle, _ = node.export_producer(consumer_home / "config" / "node", producer="producer")
    node.join_node(producer_home / "config" / "node", bundle)
    producer = node.load_identity(producer_home / "config" / "node")
    return Nodes(work, consumer_home, producer_home, producer)


def node_env(home: Path, *, threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ, MUSER_HOME=str(home), PYTHONUNBUFFERED="1")
    if threads is not None:
        env.update(MUSER_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    return env


def stderr_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
    """One line of ``proc``'s stderr read straight from its descriptor, a byte at a time (b"" at
    end of file, None at ``deadline``). Nothing is read past the newline, so a line the child
    wrote in the same burst as the one before is not left in a buffer that ``select`` cannot
    see, and whoever reads the pipe next gets the rest."""
    assert proc.stderr is not None
    fd, got = proc.stderr.fileno(), bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], min(left, 0.5))[0]:
            if left <= 0:
                return None
            continue
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            return bytes(got + byte)
        got += byte


def wait_listening(proc: subprocess.Popen, what: str, timeout: float = 120.0) -> str:
    """The address a starting ``muser receive`` prints on stderr ("listening on HOST:PORT")."""
    deadline = time.monotonic() + timeout
    seen = []
    while (raw := stderr_line(proc, deadline)) is not None:
        line = raw.decode(errors="replace")
        m = re.search(r"listening on (\S+)", line)
        if m:
            return m.group(1)
        if not raw:
            break
        seen.append(line.strip())
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()
    tail = " / ".join(seen[-2:])
    raise TempFailure(f"{what}: the receiver did not start" + (f": {tail}" if tail else ""))


@contextlib.contextmanager
def receiver(nodes: Nodes, out_dir: Path, pin: Pinning):
    """A resident ``muser receive --listen 127.0.0.1:0 -o OUT_DIR`` on the consumer's core; yields its address."""
    with receiver_process(nodes, out_dir, pin) as (addr, _proc):
        yield addr


@contextlib.contextmanager
def receiver_process(nodes: Nodes, out_dir: Path, pin: Pinning):
    """As :func:`receiver`, yielding (address, the process) for those who watch its CPU."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = pin.command("consumer", [*MUSER, "receive", "--listen", "127.0.0.1:0", "-o", str(out_dir)])
    proc = subprocess.Popen(argv, env=node_env(nodes.consumer_home), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        addr = wait_listening(proc, "bench")
        drain_in_background(proc)
        yield addr, proc
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        with contextlib.suppress(OSError, ValueError):
            proc.stderr.close()


def drain_in_background(proc: subprocess.Popen) -> None:
    """Keep reading a child's stderr so a chatty process never blocks on a full pipe."""
    import threading

    def drain() -> None:
        with contextlib.suppress(OSError, ValueError):
            while proc.stderr.read(65536):
                pass

    threading.Thread(target=drain, daemon=True).start()


@dataclass
class Pushed:
    """One push through a resident ``receive --once | decode``: exit statuses, what the
    consumer's decode wrote, the producer's stderr (when kept) and when the producer started."""
    prefill: int
    send: int
    decode: int
    out: bytes
    err: bytes
    prefill_err: str
    t0: float

    @property
    def failed(self) -> bool:
        return bool(self.prefill or self.send or self.decode)


def push_once(recv_argv: list[str], dec_argv: list[str], pre_argv: list[str], send_argv: Callable[[str], list[str]],
              *, cons_env: dict[str, str], prod_env: dict[str, str], settle: float, what: str,
              keep_prefill_err: bool = False) -> Pushed:
    """The consumer's ``receive | decode`` first (resident: ``settle`` seconds to load its
    model), then the producer's ``prefill | send`` to the address receive printed."""
    recv = subprocess.Popen(recv_argv, env=cons_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    dec = subprocess.Popen(dec_argv, env=cons_env, stdin=recv.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    recv.stdout.close()
    try:
        addr = wait_listening(recv, what)
        time.sleep(settle)
        t0 = time.time()
        pre = subprocess.Popen(pre_argv, env=prod_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE if keep_prefill_err else subprocess.DEVNULL)
        snd = subprocess.run(send_argv(addr), env=prod_env, stdin=pre.stdout, capture_output=True)
        pre.stdout.close()
        pre_err = pre.stderr.read().decode(errors="replace") if keep_prefill_err else ""
        pre.wait()
        out, err = dec.communicate(timeout=600)
        recv.wait(timeout=60)
    finally:
        for proc in (recv, dec):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Pushed(pre.returncode, snd.returncode, dec.returncode, out, err, pre_err, t0)
