"""X.509 for muser nodes: a private CA and node certificates (EC P-256, SHA-256).

Pure functions over ``cryptography`` objects; storage and policy live in :mod:`node`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from typing import Iterable

from muser_cli.errors import UsageError

NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def san_entries(hosts: Iterable[str]):
    from cryptography import x509

    out, seen = [], set()
    for host in hosts:
        host = host.strip().lower()
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not NAME_RE.match(host):
                raise UsageError(f"bad host name {host!r} for a certificate") from None
            out.append(x509.DNSName(host))
    return out


def key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(name: str, *, not_before: dt.datetime, not_after: dt.datetime):
    """A private CA: EC P-256 key and a self-signed certificate (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"muser CA {name}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue_cert(ca_key, ca_cert, name: str, hosts: Iterable[str], *, not_before: dt.datetime, not_after: dt.datetime):
    """A node certificate (server and client auth) for ``name`` with SANs ``hosts``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(san_entries(hosts)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def serial_hex(cert) -> str:
    return format(cert.serial_number, "X")


def peer_serial_hex(der: bytes) -> str:
    """Serial of a DER certificate as ``node ls`` prints it."""
    from cryptography import x509

    return serial_hex(x509.load_der_x509_certificate(der))


def peer_common_name(der: bytes) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""
