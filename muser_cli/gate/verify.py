"""``verify``: integrity, identity (model, tokenizer, tokens), structure — before any decode."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import BinaryIO

from muser_cli.engines.registry import get_consumer
from muser_cli.errors import DataError, KVPackError, SpotCheckFailed, UsageError
from muser_cli.gate import sampled
from muser_cli.gate.audit import audit as run_audit
from muser_cli.gate.audit import diagnose
from muser_cli.gate.sampled import new_seed
from muser_cli.gate.state import state_check
from muser_cli.kvpack import EndEvent, FrameEvent, HeaderEvent, KVPack, PackReader, read_pack
from muser_cli.kvpack.format import CODEC_NAMES
from muser_cli.kvpack.reader import read_step
from muser_cli.kvpack.summary import summarize, summarize_header
from muser_cli.model.binding import Check, identity_checks
from muser_cli.model.resolve import resolve_model
from muser_cli.model.tokens import encode_prompt
from muser_cli.reuse import Store, resolve_delta


@dataclass
class VerifyReport:
    checks: list[Check]
    pack: KVPack | None
    seconds: float
    summary: dict = field(default_factory=dict)
    spool: BinaryIO | None = None  # the exact input bytes, when asked to keep them

    def copy_verified(self, out: BinaryIO) -> int:
        """Write the exact verified input bytes to ``out`` (only for a passing report)."""
        if not self.ok or self.spool is None:
            raise UsageError("nothing verified to pass on")
        self.spool.seek(0)
        n = 0
        while True:
            block = self.spool.read(1 << 20)
            if not block:
                return n
            out.write(block)
            n += len(block)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def to_json(self) -> dict:
        return {"ok": self.ok, "checks": [c.to_json() for c in self.checks], "summary": self.summary,
                "seconds": round(self.seconds, 6)}


def verify(
    src: BinaryIO,
    *,
    model: str | None = None,
    prompt: str | None = None,
    chat: bool = False,
    audit: int = 0,
    engine: str = "torch",
    threads: int = 1,
    keep_bytes: bool = False,
) -> VerifyReport:
    t0 = time.perf_counter()
    spool = None
    if keep_bytes:
        spool = tempfile.SpooledTemporaryFile(max_size=256 << 20)
        src = _Tee(src, spool)
    try:
        pack = read_pack(src)
    except KVPackError as exc:
        return VerifyReport([Check("integrity", False, str(exc))], None, time.perf_counter() - t0)
    h = pack.header
    checks = [Check("integrity", True, f"{len(list(h.frame_plan()))} frames, root digest {pack.root_digest.hex()[:16]}…, "
                                       f"codec {h.codec.get('name', CODEC_NAMES[0])}")]
    info = resolve_model(model)
    prompt_ids = encode_prompt(info, prompt, chat=chat) if prompt is not None else None
    checks += identity_checks(h, info, prompt_ids=prompt_ids)
    summary = summarize(pack)
    if h.rows_start > 0:
        check, merged = _check_base(pack)
        checks.append(check)
        if merged is not None:
            summary["base"] = dict(h.base or {}, entry=merged[1])
            pack = KVPack(header=replace(h, rows_start=0, base=None), layers=merged[0], root_digest=pack.root_digest,
                          total_bytes=pack.total_bytes, stored_bytes=pack.stored_bytes)
    if audit < 0:
        raise UsageError("--audit must be >= 0")
    if audit and all(c.ok for c in checks):
        eng = get_consumer(engine, info, dtype=h.dtype, threads=threads, doing="recompute rows for --audit")
        if any(spec.kind == "state" for spec in h.layers):  # recurrent state: from the pack's own checkpoints
            checks.append(_state_audit(pack, eng, audit, summary))
            return VerifyReport(checks, pack, time.perf_counter() - t0, summary, spool)
        rep = run_audit(pack, eng, audit)
        worst = rep.worst or {}
        detail = (f"{rep.mode} of positions [{rep.positions[0]}, {rep.positions[1]}) on {engine}: worst layer "
                  f"{worst.get('layer')} rel {worst.get('rel_max', 0):.3g} (tolerance {rep.tolerance:.3g})")
        if not rep.ok:
            detail = diagnose(rep, pack) + "; " + detail
        summary["audit"] = rep.to_json()
        ok = rep.ok
        if rep.mode == "suffix":  # a full recomputation compared every position already
            sampled_ok, note = _sampled(pack, eng, summary["audit"])
            ok, detail = ok and sampled_ok, f"{detail}; {note}"
        checks.append(Check("audit", ok, detail))
    elif audit:
        checks.append(Check("audit", False, "not run: identity checks failed"))
    return VerifyReport(checks, pack, time.perf_counter() - t0, summary, spool)


def _state_audit(pack: KVPack, eng, spans: int, summary: dict) -> Check:
    """``--audit N`` on a pack with state layers: N chunk spans (the last one always) recomputed
    from the pack's own snapshot checkpoints (:mod:`muser_cli.gate.state`)."""

    seed = new_seed()
    try:
        ends, tol, layers, seconds = state_check(pack.header, list(pack.layers), eng, count=spans, seed=seed)
    except SpotCheckFailed as exc:
        summary["audit"] = {"ok": False, "mode": "state-checkpoint", "error": str(exc)}
        return Check("audit", False, str(exc))
    worst = max(layers, key=lambda l: l["rel_max"] / (l["tolerance"] or 1.0))
    summary["audit"] = {"ok": True, "mode": "state-checkpoint", "seed": seed, "span_ends": ends, "layers": layers,
                        "tolerance": tol, "ms": round(seconds * 1e3, 3)}
    return Check("audit", True, f"state-checkpoint of {len(ends)} chunk spans ending at {ends} on {eng.name}: worst "
                                f"layer {worst['layer']} rel {worst['rel_max']:.3g} (tolerance {worst['tolerance']:.3g})")


def _sampled(pack: KVPack, eng, record: dict) -> tuple[bool, str]:
    """The decode gate's positions sampled across the whole prompt, besides the suffix
    (``record["sampled"]``: what it compared); whether it passed, and one line."""

    try:
        res = sampled.sample_check(pack.header, list(pack.layers), eng)
    except SpotCheckFailed as exc:
        record["sampled"] = {"ok": False, "error": str(exc)}
        return False, str(exc)
    record["sampled"] = res.to_json()
    w = res.worst
    return True, (f"{len(res.positions)} positions sampled across the prompt (seed {res.seed}): worst layer "
                  f"{w.get('layer')} at position {w.get('worst_position')} rel {w.get('rel_max', 0):.3g}")


def verify_stream(
    src: BinaryIO,
    out: BinaryIO,
    *,
    model: str | None = None,
    prompt: str | None = None,
    chat: bool = False,
) -> VerifyReport:
    """Verify a full pack while passing it on: the header's bytes go to ``out`` once the
    identity checks pass, each frame's once it verified against the chain, and the end
    frame's only once the root digest verified and the input ended right after it. On the
    first failure nothing more is written, so ``out`` never ends in something decodable.

    A delta pack (whose base must be merged from the store) is checked whole: its bytes are
    spooled, verified by :func:`verify`, and passed on only if every check passed. Audits
    need the whole pack too: use :func:`verify` with ``keep_bytes``.
    """
    t0 = time.perf_counter()
    verdict_only = out is DISCARD
    start = src.tell() if verdict_only and _rewinds(src) else None  # where a delta is read again from
    info = resolve_model(model)
    prompt_ids = encode_prompt(info, prompt, chat=chat) if prompt is not None else None
    reader = PackReader()
    pending: list[memoryview] = []
    checks: list[Check] = []
    end: EndEvent | None = None
    frames = stored = 0
    try:
        while True:
            # Exactly what the parser needs next (so each frame arrives in one piece), in a
            # buffer of its own that grows with the bytes that arrive, not with declared lengths.
            chunk = read_step(src, reader)
            if not len(chunk):
                break
            if end is not None:
                raise KVPackError("bytes after the end frame")
            pending.append(chunk)
            for ev in reader.feed(chunk, owned=True):
                if isinstance(ev, HeaderEvent):
                    if ev.header.rows_start > 0:
                        if start is not None:  # only a verdict: read whole, in place (mapped)
                            src.seek(start)
                            return verify(src, model=model, prompt=prompt, chat=chat)
                        return _verify_whole(b"".join(pending), src, out, model=model, prompt=prompt, chat=chat)
                    checks += identity_checks(ev.header, info, prompt_ids=prompt_ids)
                    # passing it on stops here; a verdict reads on, for the integrity and the summary
                    if not all(c.ok for c in checks) and not verdict_only:
                        return VerifyReport([Check("integrity", True, "header verified"), *checks], None,
                                            time.perf_counter() - t0)
                elif isinstance(ev, FrameEvent):
                    frames += 1
                    stored += ev.stored_bytes
                elif isinstance(ev, EndEvent):
                    end = ev
                    continue  # held back until the input is seen to end here
                out.write(b"".join(pending))
                out.flush()
                pending.clear()
        reader.finish()
    except KVPackError as exc:
        return VerifyReport([Check("integrity", False, f"{exc} (after {frames} verified frames)"), *checks], None,
                            time.perf_counter() - t0)
    assert end is not None and reader.header is not None
    out.write(b"".join(pending))
    out.flush()
    h = reader.header
    head = Check("integrity", True, f"{frames} frames, root digest {end.root_digest.hex()[:16]}…, "
                                    f"codec {h.codec.get('name', CODEC_NAMES[0])}, streamed")
    summary = summarize_header(h, total_bytes=end.total_bytes, stored_bytes=stored, root_digest=end.root_digest)
    return VerifyReport([head, *checks], None, time.perf_counter() - t0, summary)


class _Discard:
    """A sink that keeps nothing: :func:`verify_only`'s output."""

    def write(self, data) -> int:
        return len(data)

    def flush(self) -> None:
        return None


DISCARD = _Discard()


def _rewinds(src: BinaryIO) -> bool:
    try:
        return src.seekable() and src.tell() >= 0
    except (AttributeError, OSError, ValueError):
        return False


def verify_only(src: BinaryIO, *, model: str | None = None, prompt: str | None = None,
                chat: bool = False) -> VerifyReport:
    """The verdict on a pack without keeping it: frame by frame in a buffer of a few frames,
    whatever the pack's size (:func:`verify` reads a file whole, mapped, and builds its arrays:
    at 131k tokens twice the pack in memory, where this holds the same as at 8k). A delta,
    whose base is merged to be checked, is read whole (in place when ``src`` can rewind)."""
    return verify_stream(src, DISCARD, model=model, prompt=prompt, chat=chat)


def _verify_whole(head: bytes, src: BinaryIO, out: BinaryIO, **kw) -> VerifyReport:
    """Spool ``head`` + the rest of ``src``, verify it whole, pass it on only if it passed."""
    spool = tempfile.SpooledTemporaryFile(max_size=256 << 20)
    spool.write(head)
    while block := src.read(1 << 20):
        spool.write(block)
    spool.seek(0)
    if out is DISCARD:  # a verdict only: the spool is read once, nothing kept to pass on
        return verify(spool, **kw)
    report = verify(spool, keep_bytes=True, **kw)
    if report.ok:
        report.copy_verified(out)
        out.flush()
    return report


def _check_base(pack: KVPack) -> tuple[Check, tuple | None]:
    """A delta pack: is its base consistent, and does this machine's store hold it?
    Returns the check and, when held, (the merged layers, the entry id)."""

    try:
        layers, entry = resolve_delta(pack, Store())
    except DataError as exc:  # BaseNotHeld included
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        return Check("base", False, f"{exc}{hint}"), None
    return Check("base", True, f"delta from position {pack.header.rows_start}: prefix held by store entry "
                               f"{entry[:12]}"), (layers, entry)


class _Tee:
    def __init__(self, src: BinaryIO, copy: BinaryIO) -> None:
        self.src, self.copy = src, copy

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        if data:
            self.copy.write(data)
        return data
