"""A node directory on disk: its files (private: mode 0700, files 0600), its keyring of HMAC
keys, and the :class:`Identity` loaded from it (what the transport needs).

Layout (``muser_cli.paths.keys_dir()``):

    node.json   {"format": "muser-node", "version": 1, "name", "role": "ca"|"member",
                 "send_key", "consumer", "created"}
    ca.pem      the private CA certificate: the only trust anchor TLS uses
    ca.key      the CA private key (only where ``init`` ran)
    node.pem    this node's certificate        node.key   its private key
    keys.json   {"format": "muser-keyring", "version": 1, "keys": [KeyEntry...]}

Every failure is a :class:`~muser_cli.errors.ConfigError`. The verbs that make and change
a node directory are in :mod:`muser_cli.handoff.node`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muser_cli.errors import ConfigError
from muser_cli.fsio import write_bytes_atomic
from muser_cli.strict import loads

NODE_FORMAT = "muser-node"
KEYRING_FORMAT = "muser-keyring"
FORMAT_VERSION = 1
MAX_KEYRING_BYTES = 4 * 1024 * 1024
KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

HINT_INIT = "run `muser node init` on the consumer, or `muser node join BUNDLE` on a producer"


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
        return read_keyring(self.directory)

    def key(self, key_id: str) -> KeyEntry | None:
        """Exactly one lookup by id: no other key is ever tried."""
        return self.keyring().get(key_id)

    def revoked_serials(self) -> set[str]:
        return {e.cert_serial for e in self.keyring().values() if e.revoked and e.cert_serial}

    def signing_key(self, key_id: str | None = None) -> KeyEntry:
        wanted = key_id or self.send_key
        if not wanted:
            raise ConfigError("this node has no HMAC key to sign handoffs with", hint=HINT_INIT)
        entry = self.key(wanted)
        if entry is None:
            raise ConfigError(f"no HMAC key with id {wanted!r} on this node", hint="see `muser node ls`")
        if entry.revoked:
            raise ConfigError(f"HMAC key {wanted!r} is revoked", hint="join with a fresh bundle")
        return entry


def ensure_private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)


def write_private(path: Path, data: bytes) -> None:
    write_bytes_atomic(path, data, mode=0o600)


def read_private(path: Path, what: str) -> bytes:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"no {what} at {path}", hint=HINT_INIT) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o})", hint=f"chmod 600 {path}"
        )
    return path.read_bytes()


def read_keyring(directory: Path) -> dict[str, KeyEntry]:
    path = directory / "keys.json"
    if not path.exists():
        return {}
    obj = loads(read_private(path, "keyring"), "keyring", limit=MAX_KEYRING_BYTES)
    if not isinstance(obj, dict) or obj.get("format") != KEYRING_FORMAT or obj.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a muser keyring (version {FORMAT_VERSION})")
    out: dict[str, KeyEntry] = {}
    for item in obj.get("keys", []):
        entry = parse_key_entry(item, str(path))
        out[entry.key_id] = entry
    return out


def parse_key_entry(item: Any, where: str) -> KeyEntry:
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


def write_keyring(directory: Path, keys: dict[str, KeyEntry]) -> None:
    body = {"format": KEYRING_FORMAT, "version": FORMAT_VERSION, "keys": [k.to_json() for k in keys.values()]}
    write_private(directory / "keys.json", json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))


def write_node_json(directory: Path, meta: dict[str, Any]) -> None:
    body = {"format": NODE_FORMAT, "version": FORMAT_VERSION, **meta}
    write_private(directory / "node.json", json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))


def load_identity(directory: Path) -> Identity:
    """This node's identity, or :class:`ConfigError` saying how to make one."""
    path = directory / "node.json"
    if not path.exists():
        raise ConfigError(f"no node identity in {directory}", hint=HINT_INIT)
    meta = loads(read_private(path, "node identity"), "node.json", limit=64 * 1024)
    if not isinstance(meta, dict) or meta.get("format") != NODE_FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a muser node file (version {FORMAT_VERSION})")
    for name in ("ca.pem", "node.pem", "node.key"):
        if not (directory / name).exists():
            raise ConfigError(f"node identity is incomplete: {directory / name} is missing", hint=HINT_INIT)
    read_private(directory / "node.key", "node key")
    return Identity(
        directory=directory,
        name=str(meta.get("name", "")),
        role=str(meta.get("role", "")),
        send_key=meta.get("send_key"),
        consumer=meta.get("consumer"),
    )
