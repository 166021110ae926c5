"""The handoff header and trailer (V3): canonical JSON, strict parsing, HMAC-SHA256, window.

Rules (docs/handoff.md is the normative text):
  * the header and the trailer are JSON objects with exactly the keys of
    :data:`HEADER_KEYS` / :data:`TRAILER_KEYS`, encoded canonically (sorted keys, no
    spaces, ASCII); received bytes that differ from the canonical encoding of what they
    parse to are refused;
  * the header is sent before the payload exists: it binds the kvpack header digest
    (model, tokenizer, token ids, layer specs) and an upper bound on the payload size;
  * header MAC = HMAC-SHA256(secret[key_id], MAC_CONTEXT || header bytes); the key id is
    inside the MAC'd bytes, so changing it breaks the MAC;
  * trailer MAC = HMAC-SHA256(secret[key_id], TRAILER_CONTEXT || header MAC || trailer
    bytes): it binds the exact payload size and the kvpack root digest, and, through the
    header MAC, the header it closes;
  * the receiver looks up exactly the named key id (no other key is tried), then compares
    MACs with :func:`hmac.compare_digest`, then checks the window and the replay ledger.
Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from muser_cli.errors import AuthError, ProtocolError
from muser_cli.strict import canonical_json, loads

HEADER_VERSION = 3
MAC_CONTEXT = b"muser-handoff-v3\x00"
TRAILER_CONTEXT = b"muser-handoff-v3-trailer\x00"
MAC_BYTES = 32
MAX_HEADER_BYTES = 8 * 1024
MAX_TRAILER_BYTES = 1024
MAX_STRICT_BYTES = 1 << 20  # no JSON body the protocol carries is larger (a Data frame's limit)
DEFAULT_WINDOW_S = 120.0
MAX_PAYLOAD_BYTES = 1 << 40

_HEX_RE = re.compile(r"^[0-9a-f]+$")
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_TEXT_RE = re.compile(r"^[\x20-\x7e]{0,256}$")


@dataclass(frozen=True)
class HandoffHeader:
    """What the sender asserts about one handoff before its payload exists, MAC'd as a whole."""

    key_id: str
    handoff_id: str  # 32 lowercase hex (128 random bits)
    issued_at_ms: int  # sender's Unix time in milliseconds
    size_bound: int  # upper bound on the payload's bytes (computed from the kvpack header)
    pack_header_digest: str  # hex d_header of the kvpack (docs/kvpack.md 2.3): binds the first bytes
    model_fingerprint: str
    tokenizer_fingerprint: str
    token_digest: str
    rows_start: int  # first position carried (0 unless a delta)
    sender: str  # the sender's node name (must match its certificate)
    v: int = HEADER_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> bytes:
        return canonical(self.to_json())


HEADER_KEYS = frozenset(HandoffHeader.__dataclass_fields__)


@dataclass(frozen=True)
class HandoffTrailer:
    """What the sender asserts once the payload is complete, MAC'd together with the header's MAC."""

    handoff_id: str
    payload_size: int  # exact bytes of the kvpack that was streamed
    root_digest: str  # hex root digest of its end frame: commits to every payload byte
    v: int = HEADER_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> bytes:
        return canonical(self.to_json())


TRAILER_KEYS = frozenset(HandoffTrailer.__dataclass_fields__)
_DIGEST_RE = re.compile(r"^[0-9a-f]{32,128}$")


def canonical(obj: Any) -> bytes:
    """Canonical JSON (muser_cli.strict): what the MAC covers."""
    return canonical_json(obj)


def strict_json(data: bytes, what: str) -> Any:
    """Parse JSON refusing duplicate keys, NaN/Infinity, non-UTF-8 and runaway nesting
    (muser_cli.strict.loads; frames are bounded by the protocol before they get here)."""
    return loads(data, what, limit=MAX_STRICT_BYTES, error=ProtocolError)


def new_handoff_id() -> str:
    return secrets.token_hex(16)


def _int(obj: dict, key: str, lo: int, hi: int) -> int:
    v = obj[key]
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"handoff header: {key} must be an integer in [{lo}, {hi}]")
    return v


def _str(obj: dict, key: str, pattern: re.Pattern[str]) -> str:
    v = obj[key]
    if not isinstance(v, str) or not pattern.match(v):
        raise ProtocolError(f"handoff header: malformed {key}")
    return v


def parse_header(raw: bytes) -> HandoffHeader:
    """Strictly parse header bytes; any deviation is a :class:`ProtocolError`."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"handoff header is {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    obj = strict_json(raw, "handoff header")
    if not isinstance(obj, dict):
        raise ProtocolError("handoff header is not a JSON object")
    if set(obj) != HEADER_KEYS:
        extra, missing = sorted(set(obj) - HEADER_KEYS), sorted(HEADER_KEYS - set(obj))
        raise ProtocolError(f"handoff header keys differ (unknown {extra}, missing {missing})")
    if obj["v"] != HEADER_VERSION or type(obj["v"]) is not int:
        raise ProtocolError(f"handoff header version {obj['v']!r} is not {HEADER_VERSION}")
    header = HandoffHeader(
        key_id=_str(obj, "key_id", _KEY_ID_RE),
        handoff_id=_str(obj, "handoff_id", _ID_RE),
        issued_at_ms=_int(obj, "issued_at_ms", 0, 1 << 53),
        size_bound=_int(obj, "size_bound", 1, MAX_PAYLOAD_BYTES),
        pack_header_digest=_str(obj, "pack_header_digest", _DIGEST_RE),
        model_fingerprint=_str(obj, "model_fingerprint", _TEXT_RE),
        tokenizer_fingerprint=_str(obj, "tokenizer_fingerprint", _TEXT_RE),
        token_digest=_str(obj, "token_digest", _TEXT_RE),
        rows_start=_int(obj, "rows_start", 0, 1 << 31),
        sender=_str(obj, "sender", re.compile(r"^[A-Za-z0-9.-]{1,253}$")),
    )
    if header.encode() != raw:
        raise ProtocolError("handoff header is not in canonical form")
    return header


def parse_trailer(raw: bytes) -> HandoffTrailer:
    """Strictly parse trailer bytes; any deviation is a :class:`ProtocolError`."""
    if len(raw) > MAX_TRAILER_BYTES:
        raise ProtocolError(f"handoff trailer is {len(raw)} bytes, over the {MAX_TRAILER_BYTES}-byte limit")
    obj = strict_json(raw, "handoff trailer")
    if not isinstance(obj, dict):
        raise ProtocolError("handoff trailer is not a JSON object")
    if set(obj) != TRAILER_KEYS:
        extra, missing = sorted(set(obj) - TRAILER_KEYS), sorted(TRAILER_KEYS - set(obj))
        raise ProtocolError(f"handoff trailer keys differ (unknown {extra}, missing {missing})")
    if obj["v"] != HEADER_VERSION or type(obj["v"]) is not int:
        raise ProtocolError(f"handoff trailer version {obj['v']!r} is not {HEADER_VERSION}")
    trailer = HandoffTrailer(
        handoff_id=_str(obj, "handoff_id", _ID_RE),
        payload_size=_int(obj, "payload_size", 1, MAX_PAYLOAD_BYTES),
        root_digest=_str(obj, "root_digest", _DIGEST_RE),
    )
    if trailer.encode() != raw:
        raise ProtocolError("handoff trailer is not in canonical form")
    return trailer


def compute_mac(secret: bytes, raw: bytes) -> bytes:
    return hmac.new(secret, MAC_CONTEXT + raw, hashlib.sha256).digest()


def sign(header: HandoffHeader, secret: bytes) -> tuple[bytes, bytes]:
    """(header bytes, MAC)."""
    raw = header.encode()
    return raw, compute_mac(secret, raw)


def verify_mac(secret: bytes, raw: bytes, mac: bytes) -> None:
    """Constant-time comparison; raises :class:`AuthError` on mismatch."""
    expected = compute_mac(secret, raw)
    if len(mac) != MAC_BYTES or not hmac.compare_digest(expected, mac):
        raise AuthError("handoff header MAC does not verify (wrong key or altered header)")


def compute_trailer_mac(secret: bytes, header_mac: bytes, raw: bytes) -> bytes:
    return hmac.new(secret, TRAILER_CONTEXT + header_mac + raw, hashlib.sha256).digest()


def sign_trailer(trailer: HandoffTrailer, secret: bytes, header_mac: bytes) -> tuple[bytes, bytes]:
    """(trailer bytes, MAC), chained to the MAC of the header it closes."""
    raw = trailer.encode()
    return raw, compute_trailer_mac(secret, header_mac, raw)


def verify_trailer_mac(secret: bytes, header_mac: bytes, raw: bytes, mac: bytes) -> None:
    """Constant-time comparison; raises :class:`AuthError` on mismatch."""
    expected = compute_trailer_mac(secret, header_mac, raw)
    if len(mac) != MAC_BYTES or not hmac.compare_digest(expected, mac):
        raise AuthError("handoff trailer MAC does not verify (altered trailer, or not the header's key)")


def check_window(header: HandoffHeader, *, now_ms: int, window_s: float) -> None:
    skew_ms = header.issued_at_ms - now_ms
    if abs(skew_ms) > window_s * 1000:
        raise AuthError(
            f"handoff issued {skew_ms / 1000:+.1f} s from now, outside the ±{window_s:g} s window",
            hint="check both clocks (NTP)",
        )
