"""Node identity and onboarding: a private CA, this node's certificate, HMAC keys with ids.

Roles:
  * the node that runs :func:`init_node` owns a private CA (its key never leaves the node),
    a certificate for itself, and a local HMAC key (so a lane on one host works at once);
  * :func:`export_producer` issues, for one named producer, a certificate signed by that CA
    and a fresh HMAC key with its own key id, records the key in the local keyring, and
    returns everything the producer needs as one bundle (JSON with PEM strings, no pickle);
  * :func:`join_node` installs such a bundle on the producer;
  * :func:`revoke_key` marks a key id (and the certificate issued with it) revoked.

Layout of the node directory (``muser_cli.paths.keys_dir()``; mode 0700, files 0600):

    node.json   {"format": "muser-node", "version": 1, "name", "role": "ca"|"member",
                 "send_key", "consumer", "created"}
    ca.pem      the private CA certificate: the only trust anchor TLS uses
    ca.key      the CA private key (only where ``init`` ran)
    node.pem    this node's certificate        node.key   its private key
    keys.json   {"format": "muser-keyring", "version": 1, "keys": [KeyEntry...]}

The library never prints; every failure is a :class:`~muser_cli.errors.MuserError`.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from muser_cli.errors import ConfigError, DataError, UsageError
from muser_cli.fsio import write_bytes_atomic
from muser_cli.strict import canonical_json, loads
from muser_cli.handoff.certs import (  # noqa: F401 - re-exported for callers and tests
    NAME_RE, cert_pem, issue_cert, key_pem, make_ca, peer_common_name, peer_serial_hex, serial_hex,
)

NODE_FORMAT = "muser-node"
KEYRING_FORMAT = "muser-keyring"
BUNDLE_FORMAT = "muser-node-bundle"
FORMAT_VERSION = 1
# Bundle version 2 carries a checksum over its content (version 1 had none: refused, see parse_bundle).
BUNDLE_VERSION = 2
DEFAULT_CA_DAYS = 3650
DEFAULT_CERT_DAYS = 825
SECRET_BYTES = 32
MAX_BUNDLE_BYTES = 64 * 1024
MAX_KEYRING_BYTES = 4 * 1024 * 1024
KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")

_HINT_INIT = "run `muser node init` on the consumer, or `muser node join BUNDLE` on a producer"


# ----------------------------------------------------------------------------- data types
@dataclass(frozen=True)
class KeyEntry:
    """One HMAC key. ``secret`` is never shown by ``ls``."""

    key_id: str
    secret: bytes
    peer: str  # the node name whose certificate must present this key
    created: str
    cert_serial: str | None = None  # hex serial of the certificate issued with the key
    revoked: str | None = None  # ISO time of revocation

    def to_json(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "secret": base64.b64encode(self.secret).decode("ascii"),
            "peer": self.peer,
            "created": self.created,
            "cert_serial": self.cert_serial,
            "revoked": self.revoked,
        }

    def public(self) -> dict[str, Any]:
        out = self.to_json()
        del out["secret"]
        return out


@dataclass(frozen=True)
class Identity:
    """What the transport needs: file paths for TLS and the keyring (reloaded on demand)."""

    directory: Path
    name: str
    role: str
    send_key: str | None
    consumer: str | None = None

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def cert_path(self) -> Path:
        return self.directory / "node.pem"

    @property
    def key_path(self) -> Path:
        return self.directory / "node.key"

    def keyring(self) -> dict[str, KeyEntry]:
        """Read the keyring now (so a revocation made by another process takes effect)."""
        return _read_keyring(self.directory)

    def key(self, key_id: str) -> KeyEntry | None:
        """Exactly one lookup by id: no other key is ever tried."""
        return self.keyring().get(key_id)

    def revoked_serials(self) -> set[str]:
        return {e.cert_serial for e in self.keyring().values() if e.revoked and e.cert_serial}

    def signing_key(self, key_id: str | None = None) -> KeyEntry:
        wanted = key_id or self.send_key
        if not wanted:
            raise ConfigError("this node has no HMAC key to sign handoffs with", hint=_HINT_INIT)
        entry = self.key(wanted)
        if entry is None:
            raise ConfigError(f"no HMAC key with id {wanted!r} on this node", hint="see `muser node ls`")
        if entry.revoked:
            raise ConfigError(f"HMAC key {wanted!r} is revoked", hint="join with a fresh bundle")
        return entry


# ----------------------------------------------------------------------------- helpers
def _now(now: dt.datetime | None) -> dt.datetime:
    return (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)


def _iso(t: dt.datetime) -> str:
    return t.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _strict_json(data: bytes, what: str, limit: int) -> Any:
    return loads(data, what, limit=limit)


def _check_name(name: str, what: str = "node name") -> str:
    if not NAME_RE.match(name):
        raise UsageError(f"bad {what} {name!r}: use letters, digits, dots and dashes")
    return name


def _host_name() -> str | None:
    """This machine's host name, if it is usable in a certificate."""
    try:
        host = socket.gethostname()
    except OSError:
        return None
    return host if host and NAME_RE.match(host) else None


def default_hosts(name: str, extra: Iterable[str] = ()) -> list[str]:
    names = [name, *extra, *LOCAL_NAMES, _host_name() or ""]
    return [n for n in names if n]


def _new_key_id() -> str:
    return secrets.token_hex(8)


# ----------------------------------------------------------------------------- storage
def _ensure_private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    write_bytes_atomic(path, data, mode=0o600)


def _read_private(path: Path, what: str) -> bytes:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"no {what} at {path}", hint=_HINT_INIT) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o})", hint=f"chmod 600 {path}"
        )
    return path.read_bytes()


def _read_keyring(directory: Path) -> dict[str, KeyEntry]:
    path = directory / "keys.json"
    if not path.exists():
        return {}
    obj = _strict_json(_read_private(path, "keyring"), "keyring", MAX_KEYRING_BYTES)
    if not isinstance(obj, dict) or obj.get("format") != KEYRING_FORMAT or obj.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a muser keyring (version {FORMAT_VERSION})")
    out: dict[str, KeyEntry] = {}
    for item in obj.get("keys", []):
        entry = _parse_key_entry(item, str(path))
        out[entry.key_id] = entry
    return out


def _parse_key_entry(item: Any, where: str) -> KeyEntry:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: a key entry is not an object")
    key_id, secret, peer = item.get("key_id"), item.get("secret"), item.get("peer")
    if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
        raise ConfigError(f"{where}: bad key id {key_id!r}")
    if not isinstance(peer, str) or not isinstance(secret, str):
        raise ConfigError(f"{where}: key {key_id} lacks a peer or secret")
    try:
        raw = base64.b64decode(secret.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ConfigError(f"{where}: key {key_id} secret is not base64") from None
    if len(raw) < 16:
        raise ConfigError(f"{where}: key {key_id} secret is shorter than 16 bytes")
    serial, revoked, created = item.get("cert_serial"), item.get("revoked"), item.get("created", "")
    for v in (serial, revoked):
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{where}: key {key_id} has a malformed field")
    return KeyEntry(key_id, raw, peer, str(created), serial, revoked)


def _write_keyring(directory: Path, keys: dict[str, KeyEntry]) -> None:
    body = {"format": KEYRING_FORMAT, "version": FORMAT_VERSION, "keys": [k.to_json() for k in keys.values()]}
    _write_private(directory / "keys.json", json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))


def _write_node_json(directory: Path, meta: dict[str, Any]) -> None:
    body = {"format": NODE_FORMAT, "version": FORMAT_VERSION, **meta}
    _write_private(directory / "node.json", json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))


def load_identity(directory: Path) -> Identity:
    """This node's identity, or :class:`ConfigError` saying how to make one."""
    path = directory / "node.json"
    if not path.exists():
        raise ConfigError(f"no node identity in {directory}", hint=_HINT_INIT)
    meta = _strict_json(_read_private(path, "node identity"), "node.json", 64 * 1024)
    if not isinstance(meta, dict) or meta.get("format") != NODE_FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a muser node file (version {FORMAT_VERSION})")
    for name in ("ca.pem", "node.pem", "node.key"):
        if not (directory / name).exists():
            raise ConfigError(f"node identity is incomplete: {directory / name} is missing", hint=_HINT_INIT)
    _read_private(directory / "node.key", "node key")
    return Identity(
        directory=directory,
        name=str(meta.get("name", "")),
        role=str(meta.get("role", "")),
        send_key=meta.get("send_key"),
        consumer=meta.get("consumer"),
    )


def _load_ca(directory: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key_path = directory / "ca.key"
    if not key_path.exists():
        raise ConfigError(
            "this node holds no CA key: only the node that ran `muser node init` can export bundles"
        )
    key = serialization.load_pem_private_key(_read_private(key_path, "CA key"), password=None)
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    return key, cert


# ----------------------------------------------------------------------------- verbs
def init_node(
    directory: Path,
    *,
    name: str | None = None,
    hosts: Iterable[str] = (),
    force: bool = False,
    ca_days: int = DEFAULT_CA_DAYS,
    cert_days: int = DEFAULT_CERT_DAYS,
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """Create the private CA, this node's certificate and a local HMAC key."""
    if (directory / "node.json").exists() and not force:
        raise UsageError(f"a node identity already exists in {directory}", hint="pass --force to replace it")
    name = _check_name(name or _host_name() or "muser-node")
    t = _now(now)
    ca_key, ca_cert = make_ca(name, not_before=t - dt.timedelta(minutes=5), not_after=t + dt.timedelta(days=ca_days))
    all_hosts = default_hosts(name, hosts)
    node_key, node_cert = issue_cert(
        ca_key, ca_cert, name, all_hosts,
        not_before=t - dt.timedelta(minutes=5), not_after=t + dt.timedelta(days=cert_days),
    )
    key = KeyEntry(_new_key_id(), secrets.token_bytes(SECRET_BYTES), name, _iso(t))
    _ensure_private_dir(directory)
    _write_private(directory / "ca.key", key_pem(ca_key))
    _write_private(directory / "ca.pem", cert_pem(ca_cert))
    _write_private(directory / "node.key", key_pem(node_key))
    _write_private(directory / "node.pem", cert_pem(node_cert))
    _write_keyring(directory, {key.key_id: key})
    _write_node_json(directory, {"name": name, "role": "ca", "send_key": key.key_id, "consumer": name, "created": _iso(t)})
    return {"name": name, "directory": str(directory), "hosts": _dedupe(all_hosts), "key_id": key.key_id}


def _dedupe(items: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for i in items:
        if i.lower() not in seen:
            seen.append(i.lower())
    return seen


def export_producer(
    directory: Path,
    *,
    producer: str,
    hosts: Iterable[str] = (),
    cert_days: int = DEFAULT_CERT_DAYS,
    now: dt.datetime | None = None,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Issue a certificate and an HMAC key for ``producer``; return (bundle bytes, summary).

    The key is recorded in this node's keyring, bound to the producer's name, before
    the bundle is returned.
    """
    identity = load_identity(directory)
    producer = _check_name(producer, "producer name")
    ca_key, ca_cert = _load_ca(directory)
    t = _now(now)
    nb = not_before or t - dt.timedelta(minutes=5)
    na = not_after or t + dt.timedelta(days=cert_days)
    key, cert = issue_cert(ca_key, ca_cert, producer, [producer, *hosts, *LOCAL_NAMES], not_before=nb, not_after=na)
    entry = KeyEntry(_new_key_id(), secrets.token_bytes(SECRET_BYTES), producer, _iso(t), serial_hex(cert))
    keys = _read_keyring(directory)
    keys[entry.key_id] = entry
    _write_keyring(directory, keys)
    bundle = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "consumer": identity.name,
        "producer": producer,
        "created": _iso(t),
        "ca_cert": cert_pem(ca_cert).decode("ascii"),
        "cert": cert_pem(cert).decode("ascii"),
        "key": key_pem(key).decode("ascii"),
        "hmac": {"key_id": entry.key_id, "secret": base64.b64encode(entry.secret).decode("ascii")},
    }
    data = json.dumps(seal_bundle(bundle), indent=1, sort_keys=True).encode("utf-8") + b"\n"
    return data, {"producer": producer, "consumer": identity.name, "key_id": entry.key_id, "cert_serial": entry.cert_serial}


_BUNDLE_KEYS = {"format", "version", "consumer", "producer", "created", "ca_cert", "cert", "key", "hmac", "checksum"}
_REEXPORT = "export a fresh bundle on the consumer: muser node export --producer NAME"


def bundle_checksum(obj: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of every bundle field but ``checksum`` itself.

    An integrity check against damage in transit (a changed character of the HMAC secret
    or key id, which nothing else in the bundle could reveal), not a signature: the
    bundle travels over a channel the operator trusts, because it carries secrets."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    canonical = canonical_json(body)
    return "sha256:" + hashlib.sha256(b"muser-node-bundle-v2\0" + canonical).hexdigest()


def seal_bundle(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with its checksum (re)computed."""
    return {**{k: v for k, v in obj.items() if k != "checksum"}, "checksum": bundle_checksum(obj)}


def parse_bundle(data: bytes) -> dict[str, Any]:
    """Validate a bundle completely (checksum, structure, PEMs, chain, key match) before anything is stored.

    Version 1 bundles (no checksum) are refused: a damaged secret in one could not be
    told from a good one, and would surface only as a refused first handoff."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    obj = _strict_json(data, "bundle", MAX_BUNDLE_BYTES)
    if not isinstance(obj, dict) or obj.get("format") != BUNDLE_FORMAT:
        raise DataError("not a muser node bundle")
    if obj.get("version") == 1:
        raise DataError("bundle version 1 carries no checksum, so damage to its HMAC key cannot be detected",
                        hint=_REEXPORT)
    if obj.get("version") != BUNDLE_VERSION:
        raise DataError(f"bundle version {obj.get('version')!r} is not supported (this muser reads {BUNDLE_VERSION})")
    checksum = obj.get("checksum")
    if not isinstance(checksum, str) or not hmac.compare_digest(checksum.encode("ascii", "replace"),
                                                                bundle_checksum(obj).encode("ascii")):
        raise DataError("bundle checksum mismatch: the bundle was damaged or edited after export",
                        hint="copy it again byte for byte, or " + _REEXPORT)
    if set(obj) != _BUNDLE_KEYS:
        raise DataError(f"bundle fields differ from the expected set: {sorted(set(obj) ^ _BUNDLE_KEYS)}")
    for k in ("consumer", "producer", "ca_cert", "cert", "key"):
        if not isinstance(obj[k], str):
            raise DataError(f"bundle field {k!r} is not a string")
    hm = obj["hmac"]
    if not isinstance(hm, dict) or set(hm) != {"key_id", "secret"}:
        raise DataError("bundle hmac must hold exactly key_id and secret")
    entry = _parse_key_entry({**hm, "peer": obj["producer"], "created": obj.get("created", "")}, "bundle")
    try:
        ca = x509.load_pem_x509_certificate(obj["ca_cert"].encode("ascii"))
        cert = x509.load_pem_x509_certificate(obj["cert"].encode("ascii"))
        key = serialization.load_pem_private_key(obj["key"].encode("ascii"), password=None)
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise DataError(f"bundle holds a malformed certificate or key ({exc})") from None
    try:
        bc = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise DataError("bundle CA certificate is not a CA")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as exc:  # InvalidSignature has no common base
        raise DataError(f"bundle certificate is not signed by its CA ({type(exc).__name__})") from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, pub) != cert.public_key().public_bytes(
        serialization.Encoding.DER, pub
    ):
        raise DataError("bundle private key does not match its certificate")
    return {"obj": obj, "entry": entry, "cert": cert}


def join_node(directory: Path, data: bytes, *, force: bool = False, now: dt.datetime | None = None) -> dict[str, Any]:
    """Install a producer bundle made by :func:`export_producer` on the consumer."""
    parsed = parse_bundle(data)
    obj, entry = parsed["obj"], parsed["entry"]
    if (directory / "node.json").exists() and not force:
        raise UsageError(f"a node identity already exists in {directory}", hint="pass --force to replace it")
    _ensure_private_dir(directory)
    for stale in ("ca.key",):
        if (directory / stale).exists():
            (directory / stale).unlink()
    _write_private(directory / "ca.pem", obj["ca_cert"].encode("ascii"))
    _write_private(directory / "node.key", obj["key"].encode("ascii"))
    _write_private(directory / "node.pem", obj["cert"].encode("ascii"))
    _write_keyring(directory, {entry.key_id: entry})
    _write_node_json(
        directory,
        {"name": obj["producer"], "role": "member", "send_key": entry.key_id, "consumer": obj["consumer"],
         "created": _iso(_now(now))},
    )
    return {"name": obj["producer"], "consumer": obj["consumer"], "key_id": entry.key_id, "directory": str(directory)}


def describe_node(directory: Path) -> dict[str, Any]:
    """A summary for ``node ls``: identity, certificate, keys (never secrets)."""
    from cryptography import x509

    identity = load_identity(directory)
    cert = x509.load_pem_x509_certificate(identity.cert_path.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(v) for v in san.get_values_for_type(x509.DNSName)]
        names += [str(v) for v in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        names = []
    return {
        "name": identity.name,
        "role": identity.role,
        "consumer": identity.consumer,
        "directory": str(directory),
        "send_key": identity.send_key,
        "holds_ca_key": (directory / "ca.key").exists(),
        "cert": {
            "serial": serial_hex(cert),
            "names": names,
            "not_before": _iso(cert.not_valid_before_utc),
            "not_after": _iso(cert.not_valid_after_utc),
        },
        "keys": [e.public() for e in identity.keyring().values()],
    }


def revoke_key(directory: Path, key_id: str, *, now: dt.datetime | None = None) -> KeyEntry:
    """Mark ``key_id`` revoked; a running receiver refuses it (and its certificate) from now on."""
    load_identity(directory)
    keys = _read_keyring(directory)
    entry = keys.get(key_id)
    if entry is None:
        raise UsageError(f"no key with id {key_id!r}", hint="see `muser node ls`")
    if entry.revoked:
        return entry
    revoked = KeyEntry(entry.key_id, entry.secret, entry.peer, entry.created, entry.cert_serial, _iso(_now(now)))
    keys[key_id] = revoked
    _write_keyring(directory, keys)
    return revoked


__all__ = [
    "Identity", "KeyEntry", "describe_node", "export_producer", "init_node", "issue_cert", "join_node",
    "load_identity", "make_ca", "parse_bundle", "peer_common_name", "peer_serial_hex", "revoke_key",
]
