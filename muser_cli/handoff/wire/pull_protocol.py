"""The pull lane's request/answer core: a consumer asks a resident producer for a prompt's KV.
No I/O whatsoever (like :mod:`muser_cli.handoff.wire.protocol`).

Over one TLS 1.3 connection (ALPN ``muser-pull/1``; the CONSUMER dials, the PRODUCER
listens; both present certificates from the consumer's private CA):

  * the consumer sends one ``Request`` frame: ``MAC ‖ request JSON`` where
    ``MAC = HMAC-SHA256(secret[key_id], "muser-pull-v1-request\\x00" ‖ request_bytes)``;
    the request names the prompt (token ids, or ``prompt`` ``{"text", "chat"}``: text the
    producer tokenizes, with its chat template or not; either way the consumer's own
    tokenization is authoritative: it refuses a pack whose token ids differ), the tokenizer
    fingerprint, the model fingerprint it expects, chunk size and
    dtype, and carries a fresh ``issued_at_ms`` and a new 128-bit ``request_id``;
    optionally ``have`` ``{"held_tokens": N, "chain": C}``: the consumer's store holds the
    prompt's first N rows on that schedule (C = their chain hash, docs/reuse.md), so the
    producer answers with a delta pack from position N (it refuses a chain that is not
    this prompt's);
  * or, to measure the link (``muser probe-link``, ``node check``), one ``Probe`` frame:
    ``MAC ‖ probe JSON`` (its own MAC context ``"muser-pull-v1-probe\x00"``; the same
    key id, issued-at, request id and replay ledger as a request, and ``probe_ms``, the
    longest the consumer will measure each way); once admitted the V3 roles are swapped
    for the probe: the PRODUCER is the V3 receiver (it sends ``Ready`` and answers
    ``ProbeUp``/``ProbeDown`` as ``receive --listen`` does), the consumer the sender;
  * optionally ``budget_ms`` (issue #39): the consumer wants the pack's last frame to have left
    within that many milliseconds of the producer reading the request (relative: no clock is
    compared); the producer answers such a request, before any ``Queued``/``Serving``, with one
    ``Promise`` (when it expects to start, its compute estimate, its queue and prefill rate by
    depth), and when it cannot make it that ``Promise`` then ``Reject(late)`` at once (what it
    expects, so the consumer learns its queue from a refusal too). A request without it gets neither
    (an older consumer never sees either frame);
  * the producer answers ``Reject`` (busy, auth, replay, stale, model, too_large, late, ...),
    or ``Queued {"place": N}`` (zero or more times, while another request computes),
    then ``Serving {}``;
  * after ``Serving`` the same connection carries one Handoff V3 session with the roles
    of docs/handoff.md: the consumer is the RECEIVER (it sends ``Ready``, verifies the
    MAC'd header, ``Go``, every frame, the MAC'd trailer, records the handoff id in its
    own ledger, ``Ack``), the producer the SENDER. No byte follows ``Serving`` until the
    consumer's ``Ready``, so the bytes after ``Serving`` belong to the V3 connection.

The frame layout is V3's (``type u8 | length u32 BE | body``); each type's maximum body
is checked at the 5-byte prefix, before one body byte is buffered.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any, Union

from muser_cli.errors import AuthError, ProtocolError
from muser_cli.handoff.wire.header import MAC_BYTES, canonical, strict_json
from muser_cli.strict import loads
from muser_cli.handoff.wire.protocol import (
    MAX_CONTROL_BYTES, NEED_DATA, PREFIX, REJECT_CODES, ConnectionClosed, FrameMachine, LocalProtocolError,
    Reject, NeedData, decode_body, encode_event, take_frame,
)

ALPN_PULL = "muser-pull/1"
PULL_VERSION = 1
MAC_CONTEXT = b"muser-pull-v1-request\x00"
PROBE_MAC_CONTEXT = b"muser-pull-v1-probe\x00"
MAX_PROBE_BYTES = 1024
MAX_PROBE_MS = 60_000
MAX_REQUEST_BYTES = 4 << 20  # JSON; ~400k token ids
MAX_TOKENS = 1 << 20
DTYPES = ("float32", "bfloat16", "float16")
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9.-]{1,253}$")
_FP_RE = re.compile(r"^[\x21-\x7e]{1,256}$")
_KEYS = {"v", "key_id", "request_id", "issued_at_ms", "consumer", "tokenizer_fingerprint",
         "model_fingerprint", "chunk_tokens", "dtype"}  # and exactly one of "token_ids", "prompt"
_PROMPT_KEYS = {"text", "chat"}
_ENGINE_RE = re.compile(r"^[a-z0-9_-]{1,32}$")
_HAVE_KEYS = {"held_tokens", "chain"}
MAX_BUDGET_MS = 3_600_000
MAX_PROMISE_BYTES = 1024
_PROMISE_KEYS = {"start_ms", "compute_ms", "queued", "rates"}
_PROBE_KEYS = {"v", "key_id", "request_id", "issued_at_ms", "consumer", "probe_ms"}


# ----------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class PullRequest:
    key_id: str
    request_id: str
    issued_at_ms: int
    consumer: str  # the consumer's node name = its certificate's CN
    token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    model_fingerprint: str
    chunk_tokens: int
    dtype: str
    have_tokens: int = 0  # the consumer holds rows [0, have_tokens): answer with a delta from there
    have_chain: str | None = None  # their chain hash (on this request's schedule)
    #: the engine the consumer decodes on (optional): a producer on the same engine may leave
    #: the sliding history out (that consumer runs no numeric gate); None: unknown, send it
    engine: str | None = None
    text: str | None = None  # text mode: the producer tokenizes this (token_ids empty until it did) ...
    chat: bool = False  # ... as one user turn of its chat template, or as is
    #: the consumer's budget (optional, issue #39): the pack's last frame out within this many ms of
    #: the producer reading the request; it is answered with a Promise (then Reject(late) at once if missed)
    budget_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": PULL_VERSION, "key_id": self.key_id, "request_id": self.request_id,
            "issued_at_ms": self.issued_at_ms, "consumer": self.consumer,
            "tokenizer_fingerprint": self.tokenizer_fingerprint, "model_fingerprint": self.model_fingerprint,
            "chunk_tokens": self.chunk_tokens, "dtype": self.dtype}
        if self.text is not None:
            out["prompt"] = {"text": self.text, "chat": self.chat}
        else:
            out["token_ids"] = list(self.token_ids)
        if self.have_tokens:
            out["have"] = {"held_tokens": self.have_tokens, "chain": self.have_chain}
        if self.engine is not None:
            out["engine"] = self.engine
        if self.budget_ms is not None:
            out["budget_ms"] = self.budget_ms
        return out


def new_request_id() -> str:
    return secrets.token_hex(16)


def _int(obj: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = obj.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"request field {key!r} must be an integer in {lo}..{hi}")
    return v


def _str(obj: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not pattern.match(v):
        raise ProtocolError(f"request field {key!r} is malformed")
    return v


def parse_request(raw: bytes) -> PullRequest:
    """Parse canonical request JSON; every malformation is a :class:`ProtocolError`."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"pull request of {len(raw)} bytes exceeds {MAX_REQUEST_BYTES}")
    obj = loads(raw, "pull request", limit=MAX_REQUEST_BYTES, error=ProtocolError)
    if not isinstance(obj, dict):
        raise ProtocolError("pull request is not a JSON object")
    rest = set(obj) - _KEYS - {"have", "engine", "budget_ms"}
    if not _KEYS <= set(obj) or rest not in ({"token_ids"}, {"prompt"}):
        raise ProtocolError(f"pull request keys differ from {sorted(_KEYS)}, one of 'token_ids' or 'prompt', "
                            "and an optional 'have', 'engine' and 'budget_ms'")
    if obj["v"] != PULL_VERSION or type(obj["v"]) is not int:
        raise ProtocolError(f"pull request version {obj['v']!r} is not {PULL_VERSION}")
    text, chat = None, False
    if "prompt" in obj:
        prompt = obj["prompt"]
        if (not isinstance(prompt, dict) or set(prompt) != _PROMPT_KEYS or not isinstance(prompt["text"], str)
                or not prompt["text"] or type(prompt["chat"]) is not bool):
            raise ProtocolError("request field 'prompt' must be {\"text\": non-empty string, \"chat\": true|false}")
        text, chat, ids = prompt["text"], prompt["chat"], []
    else:
        ids = obj["token_ids"]
        if (not isinstance(ids, list) or not 2 <= len(ids) <= MAX_TOKENS
                or any(type(t) is not int or not 0 <= t < 1 << 32 for t in ids)):
            raise ProtocolError("request field 'token_ids' must be 2 or more token ids")
    dtype = obj["dtype"]
    if dtype not in DTYPES:
        raise ProtocolError(f"request dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    req = PullRequest(
        key_id=_str(obj, "key_id", _KEY_ID_RE), request_id=_str(obj, "request_id", _ID_RE),
        issued_at_ms=_int(obj, "issued_at_ms", 0, 1 << 53), consumer=_str(obj, "consumer", _NAME_RE),
        token_ids=tuple(ids), tokenizer_fingerprint=_str(obj, "tokenizer_fingerprint", _FP_RE),
        model_fingerprint=_str(obj, "model_fingerprint", _FP_RE), chunk_tokens=_int(obj, "chunk_tokens", 1, 1 << 20),
        dtype=dtype, text=text, chat=chat,
    )
    if "have" in obj:
        have = obj["have"]
        if not isinstance(have, dict) or set(have) != _HAVE_KEYS:
            raise ProtocolError(f"request field 'have' must be an object with keys {sorted(_HAVE_KEYS)}")
        # text mode: the producer checks it against its own tokenization's length
        held = _int(have, "held_tokens", 1, len(ids) - 1 if text is None else MAX_TOKENS)
        chain = _str(have, "chain", _FP_RE)
        req = replace(req, have_tokens=held, have_chain=chain)
    if "engine" in obj:
        req = replace(req, engine=_str(obj, "engine", _ENGINE_RE))
    if "budget_ms" in obj:
        req = replace(req, budget_ms=_int(obj, "budget_ms", 1, MAX_BUDGET_MS))
    if canonical(obj) != raw:
        raise ProtocolError("pull request bytes are not canonical JSON")
    return req


def sign_request(req: PullRequest, secret: bytes) -> tuple[bytes, bytes]:
    raw = canonical(req.to_json())
    if len(raw) > MAX_REQUEST_BYTES:
        raise LocalProtocolError(f"request of {len(raw)} bytes exceeds {MAX_REQUEST_BYTES}")
    return raw, hmac.new(secret, MAC_CONTEXT + raw, hashlib.sha256).digest()


def verify_request_mac(secret: bytes, raw: bytes, mac: bytes, *, context: bytes = MAC_CONTEXT) -> None:
    want = hmac.new(secret, context + raw, hashlib.sha256).digest()
    if not hmac.compare_digest(want, mac):
        what = "pull request" if context == MAC_CONTEXT else "link probe request"
        raise AuthError(f"{what} MAC does not verify")


# ----------------------------------------------------------------------------- the link probe
@dataclass(frozen=True)
class ProbeRequest:
    """Ask the producer to answer a link probe (no prefill): authenticated like a request."""

    key_id: str
    request_id: str
    issued_at_ms: int
    consumer: str
    probe_ms: int  # the consumer measures at most this long each way; the producer may cap it

    def to_json(self) -> dict[str, Any]:
        return {"v": PULL_VERSION, "key_id": self.key_id, "request_id": self.request_id,
                "issued_at_ms": self.issued_at_ms, "consumer": self.consumer, "probe_ms": self.probe_ms}


def parse_probe(raw: bytes) -> ProbeRequest:
    """Parse canonical probe-request JSON; every malformation is a :class:`ProtocolError`."""
    obj = strict_json(raw, "probe request")
    if not isinstance(obj, dict) or set(obj) != _PROBE_KEYS:
        raise ProtocolError(f"probe request keys differ from {sorted(_PROBE_KEYS)}")
    if obj["v"] != PULL_VERSION or type(obj["v"]) is not int:
        raise ProtocolError(f"probe request version {obj['v']!r} is not {PULL_VERSION}")
    req = ProbeRequest(key_id=_str(obj, "key_id", _KEY_ID_RE), request_id=_str(obj, "request_id", _ID_RE),
                       issued_at_ms=_int(obj, "issued_at_ms", 0, 1 << 53), consumer=_str(obj, "consumer", _NAME_RE),
                       probe_ms=_int(obj, "probe_ms", 1, MAX_PROBE_MS))
    if canonical(obj) != raw:
        raise ProtocolError("probe request bytes are not canonical JSON")
    return req


def sign_probe(req: ProbeRequest, secret: bytes) -> tuple[bytes, bytes]:
    raw = canonical(req.to_json())
    return raw, hmac.new(secret, PROBE_MAC_CONTEXT + raw, hashlib.sha256).digest()


def check_fresh(req: PullRequest | ProbeRequest, *, now_ms: int, window_s: float) -> None:
    skew = abs(now_ms - req.issued_at_ms) / 1000
    if skew > window_s:
        raise AuthError(f"request issued {skew:.0f} s away from this producer's clock (window ±{window_s:g} s)")


# ----------------------------------------------------------------------------- frames
@dataclass(frozen=True)
class Request:
    raw: bytes
    mac: bytes
    request: PullRequest | None = None


@dataclass(frozen=True)
class Queued:
    place: int


@dataclass(frozen=True)
class Serving:
    pass


@dataclass(frozen=True)
class Promise:
    """The producer's answer to a request with a budget (issue #39): it expects to start computing
    it in ``start_ms`` and to take ``compute_ms``; ``queued`` requests wait before it;
    ``rates``: its prefill rate, tokens per second, by depth (the end position's power-of-two
    bucket, as a string key), as it has measured them."""

    start_ms: int
    compute_ms: int
    queued: int
    rates: dict[str, float]


def _promise_body(p: Promise) -> bytes:
    rates = {str(k): round(float(v), 3) for k, v in list(p.rates.items())[:32]}
    return canonical({"start_ms": int(p.start_ms), "compute_ms": int(p.compute_ms), "queued": int(p.queued),
                      "rates": rates})


def _parse_promise(body: bytes) -> Promise:
    obj = strict_json(body, "Promise")
    if not isinstance(obj, dict) or set(obj) != _PROMISE_KEYS:
        raise ProtocolError(f"Promise keys differ from {sorted(_PROMISE_KEYS)}")
    for key in ("start_ms", "compute_ms", "queued"):
        if type(obj[key]) is not int or not 0 <= obj[key] <= 1 << 40:
            raise ProtocolError(f"Promise field {key!r} must be a non-negative integer")
    rates = obj["rates"]
    if (not isinstance(rates, dict) or len(rates) > 32
            or any(not isinstance(k, str) or not k.isdigit() or len(k) > 9 or type(v) not in (int, float)
                   or not 0 < v < 1e12 for k, v in rates.items())):
        raise ProtocolError("Promise field 'rates' must map depths to positive token rates")
    return Promise(obj["start_ms"], obj["compute_ms"], obj["queued"], {k: float(v) for k, v in rates.items()})


@dataclass(frozen=True)
class Probe:
    raw: bytes
    mac: bytes
    probe: ProbeRequest | None = None


PullEvent = Union[Request, Probe, Queued, Serving, Promise, Reject]
FRAME_TYPES: dict[type, int] = {Request: 0x50, Queued: 0x51, Serving: 0x52, Probe: 0x53, Promise: 0x54, Reject: 0x3F}
_BY_CODE = {code: cls for cls, code in FRAME_TYPES.items()}
MAX_BODY: dict[type, int] = {Request: MAC_BYTES + MAX_REQUEST_BYTES, Queued: 64, Serving: 2,
                             Probe: MAC_BYTES + MAX_PROBE_BYTES, Promise: MAX_PROMISE_BYTES, Reject: MAX_CONTROL_BYTES}


class Side(enum.Enum):
    CONSUMER = "consumer"
    PRODUCER = "producer"


class PullState(enum.Enum):
    START = "start"  # the consumer owes its Request
    REQUESTED = "requested"  # the producer owes Queued*, then Serving or Reject
    SERVING = "serving"  # hand the connection over to a V3 Connection
    CLOSED = "closed"


C, P = Side.CONSUMER, Side.PRODUCER
TRANSITIONS: dict[tuple[PullState, Side, type], PullState] = {
    (PullState.START, C, Request): PullState.REQUESTED,
    (PullState.START, C, Probe): PullState.REQUESTED,
    (PullState.REQUESTED, P, Queued): PullState.REQUESTED,
    (PullState.REQUESTED, P, Promise): PullState.REQUESTED,
    (PullState.REQUESTED, P, Serving): PullState.SERVING,
}


def encode(event: PullEvent) -> bytes:
    if isinstance(event, Reject):
        return encode_event(event)
    if isinstance(event, (Request, Probe)):
        if len(event.mac) != MAC_BYTES:
            raise LocalProtocolError("MAC must be 32 bytes")
        body = event.mac + event.raw
    elif isinstance(event, Queued):
        body = canonical({"place": int(event.place)})
    elif isinstance(event, Serving):
        body = b"{}"
    elif isinstance(event, Promise):
        body = _promise_body(event)
    else:
        raise LocalProtocolError(f"not a pull event: {event!r}")
    if len(body) > MAX_BODY[type(event)]:
        raise LocalProtocolError(f"{type(event).__name__} body too large")
    return PREFIX.pack(FRAME_TYPES[type(event)], len(body)) + body


def _decode(cls: type, body: bytes) -> PullEvent:
    if cls is Reject:
        ev = decode_body(Reject, body)
        assert isinstance(ev, Reject)
        return ev
    if cls is Request:
        if len(body) <= MAC_BYTES:
            raise ProtocolError("Request frame too short")
        raw = body[MAC_BYTES:]
        return Request(raw=raw, mac=body[:MAC_BYTES], request=parse_request(raw))
    if cls is Probe:
        if len(body) <= MAC_BYTES:
            raise ProtocolError("Probe frame too short")
        raw = body[MAC_BYTES:]
        return Probe(raw=raw, mac=body[:MAC_BYTES], probe=parse_probe(raw))
    if cls is Queued:
        obj = strict_json(body, "Queued")
        if not isinstance(obj, dict) or set(obj) != {"place"} or type(obj["place"]) is not int or obj["place"] < 0:
            raise ProtocolError("malformed Queued frame")
        return Queued(obj["place"])
    if cls is Promise:
        return _parse_promise(body)
    if body != b"{}":
        raise ProtocolError("malformed Serving frame")
    return Serving()


class PullConnection(FrameMachine):
    """One side of the request/answer exchange. Bytes in, events out, bytes out."""

    table, ended, closed, noun = TRANSITIONS, (PullState.SERVING, PullState.CLOSED), PullState.CLOSED, "exchange"

    def __init__(self, side: Side) -> None:
        super().__init__(side, P if side is C else C, PullState.START)
        self.side = side

    def send(self, event: PullEvent) -> bytes:
        data = encode(event)
        self._advance(self.our_role, event, LocalProtocolError)
        return data

    def send_parts(self, event: PullEvent) -> list[bytes]:
        return [self.send(event)]

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
        else:
            self._buf += data

    def body_view(self) -> None:
        """Pull frames are small: none is read in place (see ``Connection.body_view``)."""
        return None

    def next_event(self) -> PullEvent | ConnectionClosed | NeedData:
        if self.state in (PullState.SERVING, PullState.CLOSED):
            return NEED_DATA  # what follows is not ours to parse
        frame = take_frame(self._buf, self._eof, _BY_CODE, MAX_BODY, "pull frame", self._admit)
        if not isinstance(frame, tuple):
            return frame
        event = _decode(*frame)
        self._advance(self.their_role, event, ProtocolError)
        return event

    def leftover(self) -> bytes:
        """Bytes after ``Serving``: they belong to the V3 connection that follows."""
        data, self._buf = bytes(self._buf), bytearray()
        return data


__all__ = [
    "ALPN_PULL", "MAX_REQUEST_BYTES", "PROBE_MAC_CONTEXT", "Probe", "ProbeRequest", "Promise", "PullConnection", "PullRequest",
    "PullState", "Queued", "REJECT_CODES", "Request", "Serving", "Side", "check_fresh", "encode", "new_request_id",
    "parse_probe", "parse_request", "sign_probe", "sign_request", "verify_request_mac",
]
