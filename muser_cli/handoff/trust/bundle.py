"""The producer bundle: everything one producer needs, issued by the consumer's CA
(JSON with PEM strings, no pickle), with a checksum over its content. :func:`parse_bundle`
validates one completely before anything is stored.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from muser_cli.errors import DataError
from muser_cli.handoff.trust.nodedir import parse_key_entry
from muser_cli.strict import canonical_json, loads

BUNDLE_FORMAT = "muser-node-bundle"
# Bundle version 2 carries a checksum over its content (version 1 had none: refused, see parse_bundle).
BUNDLE_VERSION = 2
MAX_BUNDLE_BYTES = 64 * 1024

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

    obj = loads(data, "bundle", limit=MAX_BUNDLE_BYTES)
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
    entry = parse_key_entry({**hm, "peer": obj["producer"], "created": obj.get("created", "")}, "bundle")
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
