"""Reuse and delta handoff: a local store of verified kvpacks found by chained prefix
hashes, the "have" manifest, delta packs and their merge. Specified in docs/reuse.md.

    chain.py     scope and chain hashes (which rows are interchangeable, exactly)
    manifest.py  the have manifest and a delta pack's ``base``
    store.py     the store: packs on disk + an SQLite index, LRU cap, verified reads
    delta.py     cut a pack to a delta, merge a delta with the stored prefix, resume points
    api.py       the verbs of ``muser reuse``
"""

from muser_cli.reuse.chain import Scope, chain_at, chain_points
from muser_cli.reuse.delta import BaseNotHeld, Resume, find_resume, resolve_delta
from muser_cli.reuse.manifest import HaveManifest
from muser_cli.reuse.store import CorruptEntry, Entry, Store, parse_size

__all__ = [
    "BaseNotHeld", "CorruptEntry", "Entry", "HaveManifest", "Resume", "Scope", "Store", "chain_at", "chain_points",
    "find_resume", "parse_size", "resolve_delta",
]
