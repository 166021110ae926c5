"""muser node: onboarding (private CA, certificates, HMAC keys), revocation, ledger repair."""

from __future__ import annotations

from typing import List, Optional

import typer

from muser_cli.commands._common import complete_model, default_threads, emit_json, err, guarded, info, open_input
from muser_cli.errors import UsageError
from muser_cli.fsio import atomic_writer, make_private

node_app = typer.Typer(help="Node identity: init, export a producer bundle, join, list, revoke, check a producer.",
                       no_args_is_help=True)


@node_app.command("init")
def init_cmd(
    name: Optional[str] = typer.Option(None, "--name", help="This node's name (default: host name)."),
    host: List[str] = typer.Option([], "--host", help="Extra name or address producers dial (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing identity."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Create a private CA, this node's certificate and an HMAC key with a key id."""
    from muser_cli.handoff.api import node_init  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        res = node_init(name=name, hosts=host, force=force)
        if as_json:
            emit_json(res)
        else:
            info(f"node: {res['name']} ready in {res['directory']} (key id {res['key_id']}; "
                 f"names {', '.join(res['hosts'])})")


@node_app.command("export")
def export_cmd(
    producer: str = typer.Option(..., "--producer", help="The producer's name (its certificate's name)."),
    host: List[str] = typer.Option([], "--host", help="Extra name for the producer's certificate."),
    output: str = typer.Option("-", "--output", "-o", help="Bundle file (written 0600), - for stdout (a file there is made 0600)."),
) -> None:
    """Issue a certificate and an HMAC key for a producer; print the bundle it joins with."""
    from muser_cli.handoff.api import node_export  # lazy: kept out of `muser --help` (startup)

    with guarded():
        if output in ("-", None):  # checked before a key is issued: a refusal leaves nothing behind
            _, res = node_export(producer=producer, hosts=host, deliver=_bundle_to_stdout(producer))
        else:
            with atomic_writer(output, mode=0o600) as out:
                _, res = node_export(producer=producer, hosts=host, deliver=out.write)
        info(f"node: bundle for {res['producer']} (key id {res['key_id']}); it holds secrets: move it privately")


def _bundle_to_stdout(producer: str):
    """The bundle's writer to stdout: never a terminal; a file there is made 0600 first."""
    import sys


    hint = f"write it to a file: muser node export --producer {producer} -o {producer}.bundle"
    if sys.stdout.isatty():
        raise UsageError("refusing to print the bundle on a terminal: it holds the producer's private key and "
                         "HMAC secret", hint=hint)

    def deliver(data: bytes) -> None:
        sys.stdout.flush()
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):  # not a file descriptor (an in-process test runner)
            fd = None
        if fd is not None:
            make_private(fd, "stdout", hint=hint)
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    return deliver


@node_app.command("join")
def join_cmd(
    bundle: str = typer.Argument(..., help="Bundle made by `muser node export`, or -."),
    force: bool = typer.Option(False, "--force", help="Replace the identity this bundle's consumer already has here "
                                                      "(or a consumer's own identity)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Install a producer bundle on this node; a producer that joined other consumers adds this one."""
    from muser_cli.handoff.api import node_join  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        with open_input(bundle) as f:
            res = node_join(f.read(1 << 20), force=force)
        if as_json:
            emit_json(res)
        else:
            info(f"node: joined {res['consumer']} as {res['name']} (key id {res['key_id']})")


@node_app.command("ls")
def ls_cmd(
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
    connected: Optional[str] = typer.Option(None, "--connected", metavar="HOST:PORT", help="Instead: who is connected now to the resident producer whose `prefill --serve --metrics` is HOST:PORT (consumer, address, state, bytes sent)."),
) -> None:
    """Show this node's identity, keys (never secrets) and peers: each one's role and when it last authenticated here."""
    from muser_cli.handoff.api import node_ls  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        if connected is not None:
            _ls_connected(connected, as_json)
            return
        res = node_ls()
        if as_json:
            emit_json(res)
            return
        typer.echo(f"node {res['name']} ({res['role']}, consumer {res['consumer']}) in {res['directory']}")
        c = res["cert"]
        typer.echo(f"cert {c['serial']} valid {c['not_before']} .. {c['not_after']} names {' '.join(c['names'])}")
        sending = {res["send_key"], *(c["send_key"] for c in res.get("consumers", []))}
        for c in res.get("consumers", []):
            typer.echo(f"consumer {c['consumer']:<20} as {c['name']}  cert {c['cert']['serial']}  "
                       f"key {c['send_key']}")
        for k in res["keys"]:
            mark = "*" if k["key_id"] in sending else " "
            state = f"revoked {k['revoked']}" if k["revoked"] else "active"
            typer.echo(f"{mark} {k['key_id']}  peer {k['peer']:<20} {state}")
        for p in res.get("peers", []):
            seen = (f"last seen {p['last_seen']} from {p['address']} ({p['via']})" if p["last_seen"]
                    else "never seen")
            typer.echo(f"peer {p['name']:<20} {p['role']:<8}  {seen}")


def _ls_connected(address: str, as_json: bool) -> None:
    from muser_cli.pulllane.metrics import read_connections  # lazy: kept out of `muser --help` (startup)

    conns = read_connections(address)
    if as_json:
        emit_json({"address": address, "connections": conns})
        return
    if not conns:
        typer.echo(f"no connection open at the producer behind {address}")
    for c in conns:
        f = {k: "".join(ch if " " <= ch <= "~" else "?" for ch in str(c.get(k, ""))) for k in
             ("consumer", "state", "peer", "age_s", "bytes_sent")}  # another machine's text: printable only
        typer.echo(f"connected {f['consumer'] or '(handshake)':<20} {f['state']:<10} from {f['peer']}  "
                   f"for {f['age_s']} s  {f['bytes_sent']} bytes sent")


@node_app.command("revoke")
def revoke_cmd(key_id: str = typer.Argument(..., help="Key id to revoke (see `muser node ls`).")) -> None:
    """Revoke a key id and the certificate issued with it; receivers refuse them at once."""
    from muser_cli.handoff.api import node_revoke  # lazy: kept out of `muser --help` (startup)

    with guarded():
        res = node_revoke(key_id)
        info(f"node: key {res['key_id']} of {res['peer']} revoked at {res['revoked']}")


@node_app.command("repair-ledger")
def repair_cmd(key_id: str = typer.Argument(..., help="Key id whose replay ledger is torn.")) -> None:
    """Cut a torn last record off a replay ledger (it was never acknowledged)."""
    from muser_cli.handoff.api import repair_ledger  # lazy: kept out of `muser --help` (startup)

    with guarded():
        res = repair_ledger(key_id)
        err(f"node: ledger {res['path']}: {res['records']} records kept, {res['dropped_bytes']} torn bytes removed")


@node_app.command("check")
def check_cmd(
    producer: str = typer.Argument(..., help="The producer's HOST:PORT (`prefill --serve`)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="This consumer's model (default: the default model)."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for the producer's answer."),
    threads: int = typer.Option(0, "--threads", help="Compute threads for the spot-check (0 = default)."),
    probe_seconds: float = typer.Option(1.0, "--probe-seconds", help="Seconds per direction of the link-rate probe (0: not measured)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of the table."),
) -> None:
    """On a consumer: is this producer ready to serve me? One table, one exit status.

    Reachable, mutual authentication, a signed test request, clock skew against the issued-at
    window, the producer serves this consumer's model, the link rate both ways (MB/s), and one
    tiny test prefill whose KV is spot-checked here. Exit status: the first failed check's
    (75, 77, 65, ...), else 0.
    """
    from muser_cli.consumer.node_check import check_producer  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        if probe_seconds < 0:
            raise UsageError("--probe-seconds must be >= 0")
        report = check_producer(producer, model=model, timeout=timeout, threads=threads or default_threads(),
                                probe_s=probe_seconds)
        if as_json:  # the report is the one object; its exit_status is the command's
            emit_json(report.to_json())
            if report.error is not None:
                raise typer.Exit(report.error.exit_status)
        else:
            width = max(len(r.name) for r in report.rows)
            typer.echo(f"node check {report.producer}")
            for r in report.rows:
                mark = "ok" if r.ok else ("FAIL" if r.ok is False else "-")
                typer.echo(f"  {r.name:<{width}}  {mark:<4}  {r.detail}")
        if report.error is not None:
            raise report.error


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")
