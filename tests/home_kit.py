"""What a MUSER_HOME holds, for the tests of issue #29: a fingerprint of the whole tree (a
refused command must leave it byte-identical) and a walk that finds any file holding a
secret that group or others could read. Holds no tests itself."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from pathlib import Path

PRIVATE_MARK = b"PRIVATE KEY"  # PEM private keys (node.key, ca.key, a bundle's "key")


# A memo of a pure function of a model's files (muser_cli.model.resolve.fingerprints), filled by
# whatever resolves a model, refused or not: a cache, not state a refusal leaves behind.
MEMO_DIRS = ("cache", "cache/fingerprints")


def home_tree(root: Path, *, memos: bool = False) -> dict[str, tuple]:
    """Every path under ``root`` (``root`` included): its kind, mode bits and, for a file,
    the SHA-256 of its bytes. Equal trees: nothing was added, removed, changed or chmodded.
    The model-fingerprint memo (:data:`MEMO_DIRS`) is left out unless ``memos``."""
    root = Path(root)
    if not root.exists():
        return {}
    out: dict[str, tuple] = {".": (stat.S_IFMT(root.stat().st_mode), stat.S_IMODE(root.stat().st_mode), "")}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if not memos and (rel in MEMO_DIRS or rel.startswith("cache/fingerprints/")):
                continue
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), digest)
    return out


def hmac_secrets(*homes: Path) -> list[bytes]:
    """Every HMAC secret (as base64, the way files hold it) in the keyrings under ``homes``."""
    found: list[bytes] = []
    for home in homes:
        for ring in Path(home).rglob("keys.json"):
            for key in json.loads(ring.read_text())["keys"]:
                found.append(key["secret"].encode("ascii"))
                found.append(base64.b64decode(key["secret"]))
    return found


def holds_a_secret(path: Path, secrets: list[bytes]) -> bool:
    data = path.read_bytes()
    return (PRIVATE_MARK in data or path.suffix == ".ledger" or path.name in ("keys.json", "peers.json")
            or any(s in data for s in secrets))


def readable_secrets(*paths: Path, secrets: list[bytes]) -> list[str]:
    """Files under (or at) ``paths`` that hold a secret (a private key, an HMAC secret, a
    replay ledger, a keyring) and whose mode lets group or others read or write them; and
    folders holding such files that others may enter or list."""
    bad: list[str] = []
    for top in paths:
        top = Path(top)
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()] if top.exists() else []
        for p in files:
            if holds_a_secret(p, secrets):
                mode = stat.S_IMODE(p.stat().st_mode)
                if mode & 0o077:
                    bad.append(f"{p} {mode:o}")
                if top.is_dir() and p.parent != top.parent:
                    dmode = stat.S_IMODE(p.parent.stat().st_mode)
                    if p.parent.name in ("node", "ledger", "serve") and dmode & 0o077:
                        bad.append(f"{p.parent}/ {dmode:o}")
    return sorted(set(bad))
