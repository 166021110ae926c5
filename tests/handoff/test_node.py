"""Node onboarding: private CA, node certificates, HMAC key ids, bundles, revocation."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from typer.testing import CliRunner

from muser_cli.commands import app
from muser_cli.errors import ConfigError, DataError, UsageError
from muser_cli.handoff.trust import node

from handoff_kit import keys_dir_of


@pytest.fixture
def runner():
    return CliRunner()


def cli(runner, home, *args, input=None):
    return runner.invoke(app, list(args), env={"MUSER_HOME": str(home)}, input=input)


def sans(cert) -> set[str]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in ext.get_values_for_type(x509.DNSName)} | {
        str(v) for v in ext.get_values_for_type(x509.IPAddress)
    }


def test_init_makes_ca_cert_and_key(tmp_path):
    d = tmp_path / "n"
    res = node.init_node(d, name="consumer", hosts=["consumer.lan", "10.0.0.7"])
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert {f.name for f in d.iterdir()} == {"ca.key", "ca.pem", "node.key", "node.pem", "keys.json", "node.json"}
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((d / "node.pem").read_bytes())
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca and bc.path_length == 0
    cert.verify_directly_issued_by(ca)
    names = sans(cert)
    assert {"consumer", "consumer.lan", "localhost", "127.0.0.1", "::1", "10.0.0.7"} <= names
    assert socket.gethostname().lower() in names
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    ipaddress.ip_address("::1")
    ident = node.load_identity(d)
    key = ident.signing_key()
    assert key.key_id == res["key_id"] and len(key.secret) == 32 and key.peer == "consumer"


def test_init_refuses_to_overwrite(tmp_path):
    node.init_node(tmp_path / "n", name="a")
    with pytest.raises(UsageError, match="already exists"):
        node.init_node(tmp_path / "n", name="a")
    node.init_node(tmp_path / "n", name="b", force=True)
    assert node.load_identity(tmp_path / "n").name == "b"


def test_export_join_and_keyring(tmp_path):
    c, p = tmp_path / "c", tmp_path / "p"
    node.init_node(c, name="consumer")
    bundle, summary = node.export_producer(c, producer="gx10", hosts=["gx10.lan"])
    obj = json.loads(bundle)
    assert obj["format"] == "muser-node-bundle" and obj["producer"] == "gx10"
    assert "PRIVATE KEY" in obj["key"]
    ca_key_body = "".join((c / "ca.key").read_text().splitlines()[1:-1])
    assert ca_key_body not in bundle.decode().replace("\\n", "")
    assert obj["ca_cert"] == (c / "ca.pem").read_text()  # the CA key itself never leaves
    keys = node.load_identity(c).keyring()
    assert keys[summary["key_id"]].peer == "gx10" and keys[summary["key_id"]].cert_serial
    res = node.join_node(p, bundle)
    ident = node.load_identity(p)
    assert ident.name == "gx10" and ident.role == "member" and ident.send_key == summary["key_id"] == res["key_id"]
    assert not (p / "ca.key").exists()
    assert {"gx10", "gx10.lan", "localhost"} <= sans(x509.load_pem_x509_certificate((p / "node.pem").read_bytes()))
    assert ident.signing_key().secret == keys[summary["key_id"]].secret
    with pytest.raises(ConfigError, match="CA key"):
        node.export_producer(p, producer="other")


@pytest.mark.parametrize(
    "tamper, match",
    [
        (lambda o, other: o.update(cert=other["cert"]), "not signed|does not match"),
        (lambda o, other: o.update(ca_cert=other["ca_cert"]), "not signed"),
        (lambda o, other: o.update(key=other["key"]), "does not match"),
        (lambda o, other: o.update(version=9), "version"),
        (lambda o, other: o.update(version=1), "version 1 carries no checksum"),
        (lambda o, other: o.update(extra=1), "fields"),
        (lambda o, other: o["hmac"].update(key_id="bad id!"), "key id"),
        (lambda o, other: o["hmac"].update(secret="c2hvcnQ="), "shorter"),
        (lambda o, other: o.update(cert="not a pem"), "malformed"),
    ],
)
def test_join_refuses_tampered_bundles(tmp_path, tamper, match):
    node.init_node(tmp_path / "c", name="consumer")
    node.init_node(tmp_path / "x", name="elsewhere")
    good = json.loads(node.export_producer(tmp_path / "c", producer="gx10")[0])
    other = json.loads(node.export_producer(tmp_path / "x", producer="gx10")[0])
    tamper(good, other)
    # re-sealed (a checksum that fits the edit): the deeper checks must still refuse it
    with pytest.raises((DataError, ConfigError), match=match):
        node.join_node(tmp_path / "p", json.dumps(node.seal_bundle(good)).encode())
    assert not (tmp_path / "p" / "node.json").exists()


def _flip(text: str, at: int) -> str:
    """Change one character (staying in the same alphabet, so the field stays well-formed)."""
    c = text[at]
    return text[:at] + ("B" if c != "B" else "C") + text[at + 1 :]


@pytest.mark.parametrize("field", ["secret", "key_id", "consumer", "created"])
def test_join_refuses_a_damaged_bundle_by_its_checksum(tmp_path, runner, field):
    """One changed character that every other check would accept (the HMAC secret still
    base64 of 32 bytes, the key id still a key id) is refused at join, exit 65, one line."""
    node.init_node(tmp_path / "c", name="consumer")
    obj = json.loads(node.export_producer(tmp_path / "c", producer="gx10")[0])
    assert obj["version"] == 2 and obj["checksum"] == node.bundle_checksum(obj)
    if field in ("secret", "key_id"):
        obj["hmac"][field] = _flip(obj["hmac"][field], 3)
    else:
        obj[field] = _flip(obj[field], 1)
    damaged = tmp_path / "gx10.bundle"
    damaged.write_text(json.dumps(obj, indent=1, sort_keys=True))
    with pytest.raises(DataError, match="checksum mismatch"):
        node.join_node(tmp_path / "p", damaged.read_bytes())
    ph = tmp_path / "p-home"
    r = cli(runner, ph, "node", "join", str(damaged))
    assert r.exit_code == 65 and r.stderr.count("\n") == 1, r.output
    assert "checksum mismatch" in r.stderr and "internal error" not in r.stderr
    assert not list(ph.rglob("node.json"))  # nothing installed
    # the undamaged bundle, reformatted (whitespace only), still joins: the checksum is over the content
    good = json.loads(node.export_producer(tmp_path / "c", producer="gx10")[0])
    node.join_node(tmp_path / "p", json.dumps(good, separators=(",", ":")).encode())
    assert node.load_identity(tmp_path / "p").signing_key().key_id == good["hmac"]["key_id"]


def test_join_refuses_duplicate_keys_and_non_json(tmp_path):
    node.init_node(tmp_path / "c", name="consumer")
    bundle = node.export_producer(tmp_path / "c", producer="gx10")[0]
    with pytest.raises(DataError, match="duplicate"):
        node.join_node(tmp_path / "p", bundle.rstrip()[:-1] + b', "producer": "evil"}')
    with pytest.raises(DataError, match="JSON"):
        node.join_node(tmp_path / "p", b"\x80\x04\x95pickle")
    with pytest.raises(DataError, match="limit"):
        node.join_node(tmp_path / "p", b" " * (node.MAX_BUNDLE_BYTES + 1))


def test_revoke(tmp_path):
    node.init_node(tmp_path / "c", name="consumer")
    _, s = node.export_producer(tmp_path / "c", producer="gx10")
    entry = node.revoke_key(tmp_path / "c", s["key_id"])
    assert entry.revoked
    ident = node.load_identity(tmp_path / "c")
    assert ident.key(s["key_id"]).revoked and s["cert_serial"] in ident.revoked_serials()
    with pytest.raises(UsageError, match="no key"):
        node.revoke_key(tmp_path / "c", "nope")


def test_lax_permissions_refused(tmp_path):
    node.init_node(tmp_path / "c", name="consumer")
    os.chmod(tmp_path / "c" / "node.key", 0o644)
    with pytest.raises(ConfigError, match="readable by others") as exc:
        node.load_identity(tmp_path / "c")
    assert "chmod 600" in exc.value.hint


def test_missing_identity_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no node identity") as exc:
        node.load_identity(tmp_path / "nothing")
    assert exc.value.exit_status == 78 and "muser node init" in exc.value.hint


# ----------------------------------------------------------------------------- CLI
def test_cli_onboarding_round_trip(runner, tmp_path):
    ch, ph = tmp_path / "consumer", tmp_path / "producer"
    r = cli(runner, ch, "node", "init", "--name", "consumer", "--host", "consumer.lan", "--json")
    assert r.exit_code == 0, r.output
    init = json.loads(r.stdout)
    assert "consumer.lan" in init["hosts"]
    bundle_path = tmp_path / "gx10.bundle"
    r = cli(runner, ch, "node", "export", "--producer", "gx10", "-o", str(bundle_path))
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(bundle_path.stat().st_mode) == 0o600
    r = cli(runner, ph, "node", "join", str(bundle_path), "--json")
    assert r.exit_code == 0, r.output
    joined = json.loads(r.stdout)
    assert joined["name"] == "gx10" and joined["consumer"] == "consumer"
    r = cli(runner, ch, "node", "ls", "--json")
    listing = json.loads(r.stdout)
    assert [k["peer"] for k in listing["keys"]] == ["consumer", "gx10"]
    assert "secret" not in r.stdout
    assert keys_dir_of(ch) == tmp_path / "consumer" / "config" / "node"
    r = cli(runner, ch, "node", "revoke", joined["key_id"])
    assert r.exit_code == 0 and "revoked" in r.stderr
    r = cli(runner, ch, "node", "ls")
    assert "revoked" in r.stdout and "gx10" in r.stdout


def test_cli_export_to_stdout_and_join_from_stdin(runner, tmp_path):
    ch, ph = tmp_path / "consumer", tmp_path / "producer"
    assert cli(runner, ch, "node", "init", "--name", "consumer").exit_code == 0
    r = cli(runner, ch, "node", "export", "--producer", "gx10")
    assert r.exit_code == 0 and r.stdout.startswith("{")
    r2 = cli(runner, ph, "node", "join", "-", input=r.stdout)
    assert r2.exit_code == 0, r2.output


def test_cli_errors_have_exit_statuses(runner, tmp_path):
    r = cli(runner, tmp_path / "none", "node", "ls")
    assert r.exit_code == 78 and r.stderr.count("\n") == 1
    r = cli(runner, tmp_path / "none", "node", "join", str(tmp_path / "missing.bundle"))
    assert r.exit_code == 66
    (tmp_path / "junk").write_bytes(b"{}")
    r = cli(runner, tmp_path / "none", "node", "join", str(tmp_path / "junk"))
    assert r.exit_code == 65
    assert cli(runner, tmp_path / "c", "node", "init").exit_code == 0
    assert cli(runner, tmp_path / "c", "node", "init").exit_code == 2
    assert cli(runner, tmp_path / "c", "node", "revoke", "nope").exit_code == 2
