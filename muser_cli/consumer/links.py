"""The link rates ``muser probe-link`` measured to each producer, kept in the data directory so
that a consumer predicts the wire with them before its pulls have measured the link (issue #39).
A cache: a file that is missing or damaged counts as no probe, one that cannot be written is
not kept."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any

from muser_cli import paths
from muser_cli.strict import loads

#: The link rates ``muser probe-link`` measured, by producer address, in the data dir: ``{"v": 1,
#: "links": {"HOST:PORT": {"down_Bps": float, "up_Bps": float, "at": unix seconds}}}``.
LINKS_FILE = "links.json"
_LINKS_LOCK = threading.Lock()


def link_key(address: str) -> str:
    """``address`` as the links file keys it (host lower-cased; a bad address as given)."""
    host, sep, port = address.strip().rpartition(":")
    return f"{host.lower()}:{port}" if sep and host else address.strip()


def _read_links() -> dict[str, Any]:
    path = paths.data_dir() / LINKS_FILE
    try:
        obj = loads(path.read_bytes(), str(path), limit=1 << 20)
    except Exception:  # noqa: BLE001 - missing or damaged: no probe known
        return {}
    links = obj.get("links") if isinstance(obj, dict) and obj.get("v") == 1 else None
    return links if isinstance(links, dict) else {}


def probed_link(address: str) -> float | None:
    """The rate (bytes per second, producer to this machine) ``muser probe-link`` last measured
    to ``address``; None: never probed, or the file is missing or damaged (read each time:
    a probe run while a service runs counts from its next prediction)."""
    entry = _read_links().get(link_key(address))
    rate = entry.get("down_Bps") if isinstance(entry, dict) else None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0 and math.isfinite(rate):
        return float(rate)
    return None


def note_link(address: str, *, down_Bps: float, up_Bps: float | None = None) -> bool:
    """Keep a probe's rates to ``address`` in ``<data dir>/links.json`` (written whole or not at
    all; a damaged file is replaced). False: it could not be written (a cache: nothing fails)."""
    if not (isinstance(down_Bps, (int, float)) and down_Bps > 0 and math.isfinite(down_Bps)):
        return False
    path = paths.data_dir() / LINKS_FILE
    with _LINKS_LOCK:
        links = _read_links()
        links[link_key(address)] = {"down_Bps": float(down_Bps), "at": round(time.time(), 3),
                                    **({"up_Bps": float(up_Bps)} if up_Bps else {})}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
            part.write_bytes(json.dumps({"v": 1, "links": links}, sort_keys=True).encode())
            os.replace(part, path)
        except OSError:
            return False
    return True


__all__ = ["LINKS_FILE", "link_key", "note_link", "probed_link"]
