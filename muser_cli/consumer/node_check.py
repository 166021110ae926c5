"""``muser node check HOST:PORT``: is this resident producer ready to serve me?

Run on a consumer after a producer joined it. Each check runs only if the ones before it
passed (a later one would only repeat the first failure), in this order:

  reachable   a TCP connection to HOST:PORT opens (else 75)
  mutual auth TLS 1.3 with ALPN ``muser-pull/1``: the producer's certificate is from this
              consumer's CA and names the host dialled, ours is accepted (else 77)
  request     a signed test request is accepted: key id, MAC, replay ledger (else 77)
  clock       the producer's clock, as its handoff header states it, is within the
              issued-at window of ours (a producer refusing our issued-at as stale: 77)
  model       the producer serves this consumer's model and tokenizer (fingerprints; else 65)
  link        the link rate both ways, MB/s: a signed link probe answered by the producer
              (``muser probe-link``'s, ``probe_s`` seconds each way; a failure: its status,
              75 for a cut or a busy producer)
  audit       one tiny test prefill: its pack verified on the wire, then spot-checked
              numerically here (the last position recomputed on this machine's engine; else 65)

The result is one table and one exit status: that of the first failed check.
"""

from __future__ import annotations

import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muser_cli import paths
from muser_cli.consumer.pull import ask_for, pull_prompt
from muser_cli.engines.registry import get_engine
from muser_cli.errors import AuthError, DataError, ExitStatus, MuserError
from muser_cli.gate.audit import spot_check
from muser_cli.handoff.link import format_hostport, map_error, parse_hostport
from muser_cli.handoff.probe_link import probe_peer
from muser_cli.handoff.pull.client import connect
from muser_cli.handoff.trust.certs import peer_common_name
from muser_cli.handoff.trust.node import load_identity
from muser_cli.handoff.wire.header import DEFAULT_WINDOW_S
from muser_cli.kvpack import read_pack
from muser_cli.model.resolve import resolve_model

TEST_PROMPT = ("muser node check: a short test prompt whose KV cache the consumer recomputes and compares, "
               "position by position, before it trusts this producer.")


@dataclass
class Row:
    name: str
    ok: bool | None  # None: not run (an earlier check failed)
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.name, "ok": self.ok, "detail": self.detail, **self.data}


@dataclass
class CheckReport:
    producer: str
    rows: list[Row]
    error: MuserError | None = None  # the first failure (its exit status is the command's)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"producer": self.producer, "ok": self.ok, "exit_status": ExitStatus.OK if self.ok else self.error.exit_status,
                "error": None if self.ok else str(self.error), "checks": [r.to_json() for r in self.rows]}


NAMES = ("reachable", "mutual auth", "request", "clock", "model", "link", "audit")


class _Failed(Exception):
    """A check failed: its name, the error (its exit status is the command's) and the line shown."""

    def __init__(self, name: str, error: MuserError, detail: str | None = None) -> None:
        super().__init__(name)
        self.name, self.error, self.detail = name, error, detail or str(error)


@dataclass
class _Run:
    """What the checks share: the producer dialled, this node's identity, the rows so far."""
    host: str
    port: int
    where: str
    identity: Any
    timeout: float
    rows: list[Row] = field(default_factory=list)

    @property
    def connect_s(self) -> float:
        return min(self.timeout, 10.0)

    def passed(self, name: str, detail: str, data: dict[str, Any] | None = None) -> None:
        self.rows.append(Row(name, True, detail, data or {}))


def check_producer(producer: str, *, model: str | None = None, timeout: float = 30.0, threads: int = 1,
                   chunk_tokens: int | None = None, probe_s: float = 1.0) -> CheckReport:
    """Run the checks of the module doc against ``producer`` (HOST:PORT); never raises for a
    failed check: the report holds it."""

    host, port = parse_hostport(producer)  # a bad address is a usage error, raised
    where = format_hostport(host, port)
    run = _Run(host, port, where, load_identity(paths.keys_dir()), timeout)
    report = CheckReport(where, run.rows)
    try:
        _check_reachable(run)
        _check_mutual_auth(run)
        with tempfile.TemporaryDirectory(prefix="muser-check-") as tmp:
            out = Path(tmp) / "check.kvpack"
            ask = _check_request(run, out, model=model, chunk_tokens=chunk_tokens)
            _check_link(run, probe_s)
            try:
                spot = _audit(out, model=model, threads=threads)
            except MuserError as exc:
                raise _Failed("audit", exc) from None
        run.passed("audit", f"{len(ask.token_ids)}-token test prefill: positions {spot['positions'][0]}.."
                            f"{spot['positions'][1]} recomputed here, worst layer {spot['worst_layer']} rel "
                            f"{spot['worst_rel']:.3g} <= {spot['tolerance']:.3g}", {"spot_check": spot})
    except _Failed as failed:
        run.rows.append(Row(failed.name, False, failed.detail))
        for rest in NAMES[len(run.rows):]:
            run.rows.append(Row(rest, None, "not run"))
        report.error = failed.error
    return report


def _check_reachable(run: _Run) -> None:
    t0 = time.monotonic()
    try:
        socket.create_connection((run.host, run.port), timeout=run.connect_s).close()
    except OSError as exc:
        raise _Failed("reachable", map_error(exc, f"connecting to {run.where}")) from None
    run.passed("reachable", f"TCP connect in {(time.monotonic() - t0) * 1000:.1f} ms",
               {"connect_ms": round((time.monotonic() - t0) * 1000, 3)})


def _check_mutual_auth(run: _Run) -> None:
    """A handshake alone: the producer sees a connection that sends no request."""

    try:
        sock, _ = connect(run.where, run.identity, run.connect_s)
    except MuserError as exc:
        raise _Failed("mutual auth", exc) from None
    try:
        der = sock.getpeercert(binary_form=True) or b""
        cn = peer_common_name(der) if der else ""
        version = sock.version()
        try:
            sock.settimeout(2.0)
            sock.unwrap()  # close_notify: the producer sees a clean end, not a failed request
        except (OSError, ValueError):
            pass
    finally:
        sock.close()
    run.passed("mutual auth", f"{version}, producer certificate {cn!r} from this node's CA",
               {"producer_name": cn, "tls": version})


_AUTHENTICATED = "signed request authenticated (key id, MAC)"


def _check_request(run: _Run, out: Path, *, model: str | None, chunk_tokens: int | None) -> Any:
    """The test request, pulled into ``out``: the request, clock and model rows. Returns the ask."""

    try:
        ask = ask_for(TEST_PROMPT, model=model, chat=False, chunk_tokens=chunk_tokens, dtype=None, engine="torch")
    except MuserError as exc:
        raise _Failed("request", exc, f"this consumer cannot make the test request: {exc}") from None
    seen: dict[str, Any] = {}

    def on_event(kind: str, f: dict[str, Any]) -> None:
        if kind == "header":
            seen.update(f)

    t1 = time.monotonic()
    try:
        got = pull_prompt(run.where, ask, output=out, timeout=run.timeout, on_event=on_event)
    except MuserError as exc:
        raise _request_failed(run, exc, bool(seen)) from None
    pull_s = time.monotonic() - t1
    run.passed("request", f"signed request authenticated and served ({got['payload_bytes']} bytes "
                          f"in {pull_s * 1000:.0f} ms)", {"bytes": got["payload_bytes"], "pull_s": round(pull_s, 6)})
    skew_s = (seen["issued_at_ms"] - seen["received_ms"]) / 1000 if seen else 0.0
    run.passed("clock", f"producer clock {skew_s:+.3f} s from ours (window ±{DEFAULT_WINDOW_S:g} s)",
               {"skew_s": round(skew_s, 3), "window_s": DEFAULT_WINDOW_S})
    fp = ask.model_fingerprint
    run.passed("model", f"serves this consumer's model {fp[:23]}... and tokenizer",
               {"model_fingerprint": fp, "tokenizer_fingerprint": ask.tokenizer_fingerprint})
    return ask


def _request_failed(run: _Run, exc: MuserError, header_seen: bool) -> _Failed:
    """Which check a failed test pull fails (the rows before it passed)."""
    text = str(exc)
    if "refused: stale" in text:
        run.passed("request", _AUTHENTICATED)
        return _Failed("clock", exc, f"the producer refused our issued-at: clocks differ by more than "
                                     f"its window ({text})")
    if "refused: model" in text:
        run.passed("request", _AUTHENTICATED)
        run.passed("clock", "issued-at accepted by the producer (within its window)")
        return _Failed("model", exc)  # the one refusal table: another model is mismatched data (65)
    if not header_seen:
        return _Failed("request", exc)
    run.passed("request", _AUTHENTICATED)
    return _Failed("clock" if "issued" in text and isinstance(exc, AuthError) else "audit", exc)


def _check_link(run: _Run, probe_s: float) -> None:
    if not probe_s > 0:
        run.rows.append(Row("link", None, "not measured (probe seconds 0)"))
        return

    try:
        rate = probe_peer(run.where, run.identity, seconds=probe_s, connect_s=run.connect_s)
    except MuserError as exc:
        raise _Failed("link", exc) from None
    up, down = rate["up_Bps"] / 1e6, rate["down_Bps"] / 1e6
    run.passed("link", f"consumer->producer {up:,.1f} MB/s, producer->consumer {down:,.1f} MB/s "
                       f"({probe_s:g} s each way)",
               {"consumer_to_producer_MBps": round(up, 3), "producer_to_consumer_MBps": round(down, 3),
                "probe_s": probe_s})


def _audit(path: Path, *, model: str | None, threads: int) -> dict[str, Any]:
    """Spot-check the test pack on this machine's engine (its last position recomputed)."""

    with open(path, "rb") as f:
        pack = read_pack(f)
    info = resolve_model(model)
    eng = get_engine("torch", info, dtype=pack.header.dtype, threads=threads)
    res = spot_check(pack, eng, reason="node check")
    if not res.ok:  # spot_check raises SpotCheckFailed itself; this is belt and braces
        raise DataError(f"the producer's KV disagrees with this machine's recomputation: {res.to_json()}")
    return res.to_json()


__all__ = ["CheckReport", "Row", "TEST_PROMPT", "check_producer"]
