"""Node identity and onboarding: a private CA, this node's certificate, HMAC keys with ids.

Roles:
  * the node that runs :func:`init_node` owns a private CA (its key never leaves the node),
    a certificate for itself, and a local HMAC key (so a lane on one host works at once);
  * :func:`export_producer` issues, for one named producer, a certificate signed by that CA
    and a fresh HMAC key with its own key id, records the key in the local keyring, and
    returns everything the producer needs as one bundle (JSON with PEM strings, no pickle);
  * :func:`join_node` installs such a bundle on the producer;
  * :func:`revoke_key` marks a key id (and the certificate issued with it) revoked.

The node directory (its files, keyring and :class:`Identity`) is described in
:mod:`~muser_cli.handoff.trust.nodedir`, the bundle in :mod:`~muser_cli.handoff.trust.bundle`; their
names are importable from here.

The library never prints; every failure is a :class:`~muser_cli.errors.MuserError`.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any, Callable, Iterable

from muser_cli.errors import ConfigError, UsageError
from muser_cli.handoff.trust.bundle import (  # noqa: F401 - importable from here
    BUNDLE_FORMAT, BUNDLE_VERSION, MAX_BUNDLE_BYTES, bundle_checksum, parse_bundle, seal_bundle,
)
from muser_cli.handoff.trust.certs import (  # noqa: F401 - re-exported for callers and tests
    NAME_RE, cert_pem, issue_cert, key_pem, make_ca, peer_common_name, peer_serial_hex, serial_hex,
)
from muser_cli.handoff.trust.nodedir import (  # noqa: F401 - importable from here
    CONSUMERS_DIR, FORMAT_VERSION, HINT_INIT, KEY_ID_RE, KEYRING_FORMAT, MAX_KEYRING_BYTES, NODE_FORMAT, Identity,
    KeyEntry, consumer_dirs, ensure_private_dir, load_identities, load_identity, peer_table, read_keyring,
    read_private, write_keyring, write_node_json, write_private,
)

DEFAULT_CA_DAYS = 3650
DEFAULT_CERT_DAYS = 825
SECRET_BYTES = 32
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


# ----------------------------------------------------------------------------- helpers
def _now(now: dt.datetime | None) -> dt.datetime:
    return (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)


def _iso(t: dt.datetime) -> str:
    return t.replace(microsecond=0).isoformat().replace("+00:00", "Z")


#: The longest node name: its CA certificate's common name is "muser CA NAME", at most 64 characters.
MAX_NAME = 64 - len("muser CA ")


def _check_name(name: str, what: str = "node name") -> str:
    if not NAME_RE.match(name):
        raise UsageError(f"bad {what} {name!r}: use letters, digits, dots and dashes")
    if len(name) > MAX_NAME:
        raise UsageError(f"bad {what}: {len(name)} characters, at most {MAX_NAME} are allowed "
                         f"(a certificate's common name holds 64)")
    return name


def _same_name_but_case(a: str | None, b: str) -> bool:
    """Node names are compared without case where TLS compares them (server names): two that
    differ only in case would shadow each other."""
    return bool(a) and a != b and a.lower() == b.lower()


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


def _load_ca(directory: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key_path = directory / "ca.key"
    if not key_path.exists():
        raise ConfigError(
            "this node holds no CA key: only the node that ran `muser node init` can export bundles"
        )
    key = serialization.load_pem_private_key(read_private(key_path, "CA key"), password=None)
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
    ensure_private_dir(directory)
    write_private(directory / "ca.key", key_pem(ca_key))
    write_private(directory / "ca.pem", cert_pem(ca_cert))
    write_private(directory / "node.key", key_pem(node_key))
    write_private(directory / "node.pem", cert_pem(node_cert))
    write_keyring(directory, {key.key_id: key})
    write_node_json(directory, {"name": name, "role": "ca", "send_key": key.key_id, "consumer": name, "created": _iso(t)})
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
    deliver: Callable[[bytes], None] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Issue a certificate and an HMAC key for ``producer``; return (bundle bytes, summary).

    Every precondition (identity, CA key, name, a readable keyring) is checked before
    anything changes. ``deliver`` (optional) is handed the bundle first -- written to its
    destination; if it raises, nothing was recorded. Then the key is recorded in this
    node's keyring, bound to the producer's name, and the bundle is returned.
    """
    identity = load_identity(directory)
    producer = _check_name(producer, "producer name")
    ca_key, ca_cert = _load_ca(directory)
    keys = read_keyring(directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot record a new key: {directory} is not writable", hint=f"chmod 700 {directory}")
    t = _now(now)
    nb = not_before or t - dt.timedelta(minutes=5)
    na = not_after or t + dt.timedelta(days=cert_days)
    key, cert = issue_cert(ca_key, ca_cert, producer, [producer, *hosts, *LOCAL_NAMES], not_before=nb, not_after=na)
    entry = KeyEntry(_new_key_id(), secrets.token_bytes(SECRET_BYTES), producer, _iso(t), serial_hex(cert))
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
    if deliver is not None:
        deliver(data)
    keys[entry.key_id] = entry
    write_keyring(directory, keys)
    return data, {"producer": producer, "consumer": identity.name, "key_id": entry.key_id, "cert_serial": entry.cert_serial}


def join_node(directory: Path, data: bytes, *, force: bool = False, now: dt.datetime | None = None) -> dict[str, Any]:
    """Install a producer bundle made by :func:`export_producer` on the producer.

    An empty home takes it as its identity. A producer home that joined other consumers adds
    it (``consumers/CONSUMER/``: its own certificate, key, CA and keyring); a bundle of a
    consumer already joined, or any bundle in a consumer's home, needs ``force`` to replace."""
    parsed = parse_bundle(data)
    obj = parsed["obj"]
    target = _join_target(directory, obj["consumer"], force, ca_cert=obj["ca_cert"])
    _install_bundle(target, parsed, now)
    if target == directory:  # replacing the top level of a consumer's home: it is a producer's now
        for stale in ("ca.key",):
            if (directory / stale).exists():
                (directory / stale).unlink()
    return {"name": obj["producer"], "consumer": obj["consumer"], "key_id": parsed["entry"].key_id,
            "directory": str(target)}


def _join_target(directory: Path, consumer: str, force: bool, *, ca_cert: str | None = None) -> Path:
    """Where a bundle of ``consumer`` goes in this home (module doc of :func:`join_node`);
    ``ca_cert``: the bundle's CA, which tells the consumer joined already from another one of
    the same name."""
    if not (directory / "node.json").exists():
        return directory
    try:
        current = load_identity(directory)
    except ConfigError:
        if force:
            return directory
        raise
    if current.role != "member" or current.consumer == consumer:
        if not force:
            if current.role == "member":
                raise _already_joined(directory, consumer, ca_cert)
            raise UsageError(f"a node identity already exists in {directory}", hint="pass --force to replace it")
        return directory
    _check_name(consumer, "consumer name")
    for other in [current.consumer, *(d.name for d in consumer_dirs(directory))]:
        if _same_name_but_case(other, consumer):
            raise UsageError(f"a consumer named {other!r} already joined this producer; {consumer!r} differs "
                             "only in case, and server names are compared without case",
                             hint="give that consumer another name (`muser node init --name`) and export its bundle again")
    sub = directory / CONSUMERS_DIR / consumer
    if (sub / "node.json").exists() and not force:
        raise _already_joined(sub, consumer, ca_cert)
    ensure_private_dir(directory / CONSUMERS_DIR)
    return sub


def _already_joined(where: Path, consumer: str, ca_cert: str | None) -> UsageError:
    """A bundle of ``consumer`` where a consumer of that name joined already (its identity in
    ``where``): the same consumer (its CA) enrolling again, which ``--force`` replaces, or another
    one that took the same name -- a second consumer on one host, as ``node init`` names a node
    after its host -- which needs a name of its own: ``--force`` would take the first one's place."""
    try:
        same = ca_cert is None or (where / "ca.pem").read_text(encoding="ascii") == ca_cert
    except (OSError, UnicodeDecodeError):
        same = False
    if same:
        return UsageError(f"a node identity for consumer {consumer!r} already exists in {where}",
                          hint="this bundle comes from that consumer again: pass --force to replace its identity here")
    return UsageError(f"a consumer named {consumer!r} already joined this producer ({where}), with another "
                      "identity (its own CA): this bundle comes from a second consumer of the same name (`muser node "
                      "init` names a node after its host unless given --name)",
                      hint=f"on the new consumer: `muser node init --name OTHER-NAME --force`, then `muser node export "
                           f"--producer NAME` again and join that bundle; --force here replaces the first {consumer!r} "
                           "(right only if it is that consumer, initialised again)")


def _install_bundle(target: Path, parsed: dict[str, Any], now: dt.datetime | None) -> None:
    obj, entry = parsed["obj"], parsed["entry"]
    ensure_private_dir(target)
    write_private(target / "ca.pem", obj["ca_cert"].encode("ascii"))
    write_private(target / "node.key", obj["key"].encode("ascii"))
    write_private(target / "node.pem", obj["cert"].encode("ascii"))
    write_keyring(target, {entry.key_id: entry})
    write_node_json(
        target,
        {"name": obj["producer"], "role": "member", "send_key": entry.key_id, "consumer": obj["consumer"],
         "created": _iso(_now(now))},
    )


def _cert_summary(path: Path) -> dict[str, Any]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(v) for v in san.get_values_for_type(x509.DNSName)]
        names += [str(v) for v in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        names = []
    return {"serial": serial_hex(cert), "names": names, "not_before": _iso(cert.not_valid_before_utc),
            "not_after": _iso(cert.not_valid_after_utc)}


def describe_node(directory: Path) -> dict[str, Any]:
    """A summary for ``node ls``: identity, certificate, keys (never secrets); on a producer
    that joined several consumers, ``consumers`` has one entry per consumer (the first too)."""
    identity = load_identity(directory)
    others = [load_identity(d) for d in consumer_dirs(directory)]
    out = {
        "name": identity.name,
        "role": identity.role,
        "consumer": identity.consumer,
        "directory": str(directory),
        "send_key": identity.send_key,
        "holds_ca_key": (directory / "ca.key").exists(),
        "cert": _cert_summary(identity.cert_path),
        "keys": [e.public() for e in identity.keyring().values()],
        "peers": peer_table(directory, identity),  # role and when each last authenticated here
    }
    if others:
        out["consumers"] = [_consumer_summary(i) for i in (identity, *others)]
        for other in others:
            out["keys"] += [e.public() for e in other.keyring().values()]
            out["peers"] += peer_table(other.directory, other)
        out["peers"].sort(key=lambda r: r["name"])
    return out


def _consumer_summary(identity: Identity) -> dict[str, Any]:
    return {"consumer": identity.consumer, "name": identity.name, "directory": str(identity.directory),
            "send_key": identity.send_key, "cert": _cert_summary(identity.cert_path),
            "keys": [e.public() for e in identity.keyring().values()]}


def revoke_key(directory: Path, key_id: str, *, now: dt.datetime | None = None) -> KeyEntry:
    """Mark ``key_id`` revoked; a running receiver refuses it (and its certificate) from now on.
    On a producer that joined several consumers, the key is looked up in each one's keyring."""
    load_identity(directory)
    for home in (directory, *consumer_dirs(directory)):
        keys = read_keyring(home)
        entry = keys.get(key_id)
        if entry is None:
            continue
        if entry.revoked:
            return entry
        revoked = KeyEntry(entry.key_id, entry.secret, entry.peer, entry.created, entry.cert_serial, _iso(_now(now)))
        keys[key_id] = revoked
        write_keyring(home, keys)
        return revoked
    raise UsageError(f"no key with id {key_id!r}", hint="see `muser node ls`")


__all__ = [
    "Identity", "KeyEntry", "describe_node", "export_producer", "init_node", "issue_cert", "join_node",
    "load_identity", "make_ca", "parse_bundle", "peer_common_name", "peer_serial_hex", "revoke_key",
]
