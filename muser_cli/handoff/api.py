"""The verbs the commands call, with muser's default locations filled in.

Every path comes from :mod:`muser_cli.paths`, so ``MUSER_HOME`` isolates a whole node:
identity in ``keys_dir()``, replay ledgers in ``data_dir()/ledger``. (Handoff V3
streams: ``send`` never spools its input and ``receive`` to stdout writes nothing to
disk but the ledger; ``inbox_dir``/``spool_dir`` remain for callers that name them.)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable

from muser_cli import paths
from muser_cli.errors import UsageError
from muser_cli.fsio import check_output_path
from muser_cli.strict import parse_size as strict_parse_size
from muser_cli.handoff.trust.ledger import repair
from muser_cli.handoff.link import parse_hostport
from muser_cli.handoff.trust.node import describe_node, export_producer, init_node, join_node, load_identity, revoke_key
from muser_cli.handoff.trust.nodedir import identity_for
from muser_cli.handoff.push.receiver import Destination, ReceiveConfig, receive as receive_
from muser_cli.handoff.push.sender import probe_link as probe_, send as send_
from muser_cli.strict import parse_rate


def ledger_dir() -> Path:
    return paths.data_dir() / "ledger"


def inbox_dir() -> Path:
    return paths.data_dir() / "inbox"


def spool_dir() -> Path:
    return paths.cache_dir() / "spool"


def parse_size(text: str) -> int:
    """Bytes from ``64G``, ``512M``, ``1048576`` (muser_cli.strict's one size grammar)."""
    return strict_parse_size(text)


# ----------------------------------------------------------------------------- node
def node_init(*, name: str | None, hosts: list[str], force: bool) -> dict[str, Any]:

    return init_node(paths.keys_dir(), name=name, hosts=hosts, force=force)


def node_export(*, producer: str, hosts: list[str],
                deliver: Callable[[bytes], None] | None = None) -> tuple[bytes, dict[str, Any]]:
    """``deliver`` writes the bundle before its key is recorded (nothing is recorded if it raises)."""
    return export_producer(paths.keys_dir(), producer=producer, hosts=hosts, deliver=deliver)


def node_join(data: bytes, *, force: bool) -> dict[str, Any]:

    return join_node(paths.keys_dir(), data, force=force)


def node_ls() -> dict[str, Any]:

    out = describe_node(paths.keys_dir())
    out["ledger_dir"] = str(ledger_dir())
    return out


def node_revoke(key_id: str) -> dict[str, Any]:

    return revoke_key(paths.keys_dir(), key_id).public()


def repair_ledger(key_id: str) -> dict[str, Any]:

    return repair(ledger_dir(), key_id)


# ----------------------------------------------------------------------------- wire
def send(stream: BinaryIO, *, to: str, rate: str | None, key_id: str | None, timeout: float,
         connect_timeout: float, idle_timeout: float, progress=None) -> dict[str, Any]:

    rate_bps = parse_rate(rate) if rate else None
    identity = identity_for(paths.keys_dir(), host=parse_hostport(to)[0], key_id=key_id)  # which consumer
    result = send_(stream, to=to, identity=identity, rate=rate_bps, key_id=key_id,
                   connect_s=connect_timeout, idle_s=idle_timeout, total_s=timeout, progress=progress)
    return result.to_json()


def receive(*, listen: str, once: bool, timeout: float | None, output: str | None,
            out_stream: BinaryIO | None, max_size: str, window: float, idle_timeout: float,
            handshake_timeout: float, queue: int, on_event: Callable[[str, dict], None] | None,
            on_accept: Callable[[dict], None] | None, drain: threading.Event | None = None) -> list[dict[str, Any]]:
    """``drain`` set (SIGTERM): finish what streams, start nothing new, return (an event ``drained``)."""
    host, port = parse_hostport(listen, listen=True)
    destination: Destination | None
    if output in (None, "-"):
        if not once:
            raise UsageError("without --once, receive needs -o DIR", hint="add --once, or -o DIR")
        destination = None  # streamed to out_stream, frame by frame as each verifies
    elif Path(output).is_dir():
        destination = Destination(directory=Path(output))
        out_stream = None
    else:
        if not once:
            raise UsageError(f"without --once, -o must be an existing directory (got {output})")
        check_output_path(output)  # before listening: a refusal leaves nothing behind
        destination = Destination(file=Path(output))
        out_stream = None
    config = ReceiveConfig(
        host=host, port=port, once=once, timeout=timeout, max_payload=parse_size(max_size), window_s=window,
        idle_s=idle_timeout, handshake_s=handshake_timeout, queue=queue,
    )
    identity = load_identity(paths.keys_dir())
    done = receive_(
        identity, config, ledger_dir=ledger_dir(), destination=destination, out_stream=out_stream,
        on_event=on_event, on_accept=(lambda a: on_accept(a.to_json())) if on_accept else None, drain=drain,
    )
    return [a.to_json() for a in done]


def probe_link(*, to: str, seconds: float, floor: str | None, connect_timeout: float) -> dict[str, Any]:

    identity = load_identity(paths.keys_dir())
    floor_bps = parse_rate(floor) if floor else None
    return probe_(to, identity, seconds=seconds, floor=floor_bps, connect_s=connect_timeout).to_json()
