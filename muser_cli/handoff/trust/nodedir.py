"""A node directory on disk: its files (private: mode 0700, files 0600), its keyring of HMAC
keys, and the :class:`Identity` loaded from it (what the transport needs).

Layout (``muser_cli.paths.keys_dir()``):

    node.json   {"format": "muser-node", "version": 1, "name", "role": "ca"|"member",
                 "send_key", "consumer", "created"}
    ca.pem      the private CA certificate: the only trust anchor TLS uses
    ca.key      the CA private key (only where ``init`` ran)
    node.pem    this node's certificate        node.key   its private key
    keys.json   {"format": "muser-keyring", "version": 1, "keys": [KeyEntry...]}
    consumers/CONSUMER/   on a producer that joined more than one consumer: each further
                consumer's node directory (the same files), one per bundle; the top level is
                the first consumer joined (:func:`load_identities`)
    peers.json  {"format": "muser-peers", "version": 1, "peers": {NAME: {"role", "last_seen",
                 "address", "key_id", "via"}}}: when each peer last authenticated to this node
                 (:func:`record_peer`; read by :func:`peer_table` for ``node ls``)

Every failure is a :class:`~muser_cli.errors.ConfigError`. The verbs that make and change
a node directory are in :mod:`muser_cli.handoff.trust.node`.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muser_cli.errors import ConfigError, MuserError
from muser_cli.fsio import write_bytes_atomic
from muser_cli.strict import loads

NODE_FORMAT = "muser-node"
KEYRING_FORMAT = "muser-keyring"
PEERS_FORMAT = "muser-peers"
MAX_PEERS_BYTES = 1024 * 1024
PEER_ROLES = ("consumer", "producer")
_PEERS_LOCK = threading.Lock()  # the threads of one process; flock on peers.lock between processes
FORMAT_VERSION = 1
MAX_KEYRING_BYTES = 4 * 1024 * 1024
KEY_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

CONSUMERS_DIR = "consumers"
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


# ----------------------------------------------------------------------------- peers
def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def read_peers(directory: Path) -> dict[str, dict[str, Any]]:
    """When each peer last authenticated to this node: ``{name: {"role", "last_seen", ...}}``."""
    path = directory / "peers.json"
    if not path.exists():
        return {}
    obj = loads(read_private(path, "peer record"), "peers.json", limit=MAX_PEERS_BYTES)
    if (not isinstance(obj, dict) or obj.get("format") != PEERS_FORMAT or obj.get("version") != FORMAT_VERSION
            or not isinstance(obj.get("peers"), dict)):
        raise ConfigError(f"{path} is not a muser peer record (version {FORMAT_VERSION})",
                          hint=f"remove {path}: it only records when peers were last seen")
    out: dict[str, dict[str, Any]] = {}
    for name, rec in obj["peers"].items():
        if not isinstance(rec, dict) or rec.get("role") not in PEER_ROLES or not isinstance(rec.get("last_seen"), str):
            raise ConfigError(f"{path}: the record of peer {name!r} is malformed",
                              hint=f"remove {path}: it only records when peers were last seen")
        out[str(name)] = rec
    return out


def record_peer(directory: Path, name: str, *, role: str, address: str | None = None, key_id: str | None = None,
                via: str = "pull", now: str | None = None) -> dict[str, Any]:
    """Note that peer ``name`` (its certificate's name) just authenticated to this node as a
    ``role`` ("consumer": its request verified here; "producer": its answer verified here).
    Read, update and replace ``peers.json`` atomically (fsynced, 0600), serialised between the
    threads of a process and between processes (an flock on ``peers.lock``)."""
    import fcntl

    if role not in PEER_ROLES:
        raise ValueError(f"peer role {role!r} is not one of {PEER_ROLES}")
    rec: dict[str, Any] = {"role": role, "last_seen": now or _utc_now(), "address": address, "key_id": key_id,
                           "via": via}
    with _PEERS_LOCK:
        fd = os.open(directory / "peers.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                peers = read_peers(directory)
            except ConfigError:  # a damaged record only loses sightings: start it again
                peers = {}
            peers[name] = rec
            body = {"format": PEERS_FORMAT, "version": FORMAT_VERSION, "peers": peers}
            write_private(directory / "peers.json", json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    return rec


def note_peer(identity: "Identity", name: str, **fields: Any) -> str | None:
    """:func:`record_peer` for a live lane: never fails it (a sighting is bookkeeping); the
    reason when it could not be written, else None."""
    try:
        record_peer(identity.directory, name, **fields)
    except (OSError, MuserError, ValueError) as exc:  # e.g. a directory at peers.json: a usage error
        return str(exc)
    return None


def peer_table(directory: Path, identity: "Identity") -> list[dict[str, Any]]:
    """Every peer of this node, with its role and when it was last seen (``None``: never).

    The peers are those of the keyring (on a consumer: each producer it exported a bundle for;
    on a producer: the consumer of this identity, see :func:`load_identities`) and any other seen."""
    seen = read_peers(directory)
    names: dict[str, str] = {}
    if identity.consumer and identity.consumer != identity.name:
        names[identity.consumer] = "consumer"
    for key in read_keyring(directory).values():
        if key.peer != identity.name:
            names.setdefault(key.peer, "producer")
    for name, rec in seen.items():
        names.setdefault(name, rec["role"])
    out = []
    for name, role in names.items():
        rec = seen.get(name, {})
        out.append({"name": name, "role": rec.get("role", role), "last_seen": rec.get("last_seen"),
                    "address": rec.get("address"), "key_id": rec.get("key_id"), "via": rec.get("via")})
    return sorted(out, key=lambda r: r["name"])


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


def consumer_dirs(directory: Path) -> list[Path]:
    """The node directories of the further consumers a producer joined (sorted by name)."""
    root = directory / CONSUMERS_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "node.json").exists())


def load_identities(directory: Path) -> list[Identity]:
    """Every identity of this node: the top level first, then one per further consumer joined."""
    return [load_identity(directory), *(load_identity(d) for d in consumer_dirs(directory))]


def identities_stamp(directory: Path) -> tuple:
    """What :func:`load_identities` would read, as file sizes and change times: equal stamps,
    the same identities. A running producer compares it to see a ``node join`` (or a ``--force``
    re-join) made since it started, without reading any key."""
    out: list[tuple] = []
    for home in (directory, *consumer_dirs(directory)):
        for name in ("node.json", "ca.pem", "node.pem", "node.key"):
            try:
                st = (home / name).stat()
            except OSError:
                out.append((str(home), name, None))
                continue
            out.append((str(home), name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def identity_for(directory: Path, *, host: str | None = None, key_id: str | None = None) -> Identity:
    """The identity a producer that joined several consumers dials one with (``send --to``,
    ``probe-link``): the one whose keyring holds ``key_id``; else the one whose consumer is
    named ``host``; else the first consumer joined. A node of one identity: that one."""
    identities = load_identities(directory)
    for ident in identities if key_id else ():
        if key_id in ident.keyring():
            return ident
    for ident in identities if host and not key_id else ():
        if (ident.consumer or "").lower() == host.lower().rstrip("."):
            return ident
    return identities[0]
