"""muser reuse: the local prefix store (have, put, get, ls, rm, gc)."""

from __future__ import annotations

import time
from typing import List, Optional

import typer

from muser_cli.commands._common import (
    binary_output, complete_model, emit_json, err, guarded, info, open_input, plural, read_text_input,
)
from muser_cli.fsio import write_bytes_atomic

reuse_app = typer.Typer(help="The prefix store: what KV this machine holds, for warm starts and delta handoffs.",
                        no_args_is_help=True)


def _notes(store) -> None:
    for line in getattr(store, "problems", []):
        err(f"reuse: {line}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@reuse_app.command("have")
def have_cmd(
    prompt: str = typer.Argument("-", help="Prompt text file, or - for stdin."),
    model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="Model folder, .gguf file, or 'default'."),
    chat: bool = typer.Option(False, "--chat", help="The prompt uses the chat template."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Only entries of this dtype."),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="Only entries of this chunk size."),
    output: str = typer.Option("-", "--output", "-o", help="Write the manifest here (default stdout)."),
) -> None:
    """Print the have manifest (JSON): how many of the prompt's tokens the store holds, and where."""
    from muser_cli.reuse import api  # lazy: kept out of `muser --help` (startup)

    with guarded():
        store = api.Store()
        manifest = api.have(read_text_input(prompt), model=model, chat=chat, dtype=dtype, chunk_tokens=chunk,
                            store=store)
        _notes(store)
        text = manifest.dumps()
        if output in ("-", None):
            typer.echo(text, nl=False)
        else:
            write_bytes_atomic(output, text.encode())
        need = manifest.prompt_tokens - 1  # a pack holds prompt[:-1]: the consumer runs the last token
        info(f"reuse: the store holds {manifest.held_tokens} of the {plural(need, 'row')} this prompt needs"
             + (" (all: no producer needed)" if manifest.complete else ""))


@reuse_app.command("put")
def put_cmd(
    src: str = typer.Argument("-", help="kvpack to store (a delta is merged with its stored base), or -."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", autocompletion=complete_model,
        help="The pack's model (checked); without it, the model this machine knows by the pack's fingerprint."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Verify a kvpack and store it (content-addressed by its root digest).

    Every token id is checked against the model's vocabulary; a pack whose model is
    neither given nor known here is refused (exit 65).
    """
    from muser_cli.reuse import api  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        store = api.Store()
        with open_input(src) as inp:
            res = api.put(inp, store=store, model=model)
        _notes(store)
        e = res.entry
        if as_json:
            emit_json(res.to_json())
        else:
            info(f"reuse: {'stored' if res.new else 'already held'} {e.id[:12]} ({e.tokens} tokens, {_size(e.bytes)}, "
                 f"chunk {e.chunk_tokens}, {e.dtype})" + (f"; evicted {len(res.evicted)}" if res.evicted else ""))


@reuse_app.command("get")
def get_cmd(
    entry: str = typer.Argument(..., help="Entry id (or a unique prefix, see `muser reuse ls`)."),
    output: str = typer.Option("-", "--output", "-o", help="Output kvpack, or - for stdout."),
) -> None:
    """Write a stored kvpack, verified, byte for byte."""
    from muser_cli.reuse import api  # lazy: kept out of `muser --help` (startup)

    with guarded():
        store = api.Store()
        with binary_output(output) as out:
            api.get(entry, out, store=store)
        _notes(store)


@reuse_app.command("ls")
def ls_cmd(
    model: Optional[str] = typer.Option(None, "--model", "-m", autocompletion=complete_model, help="Only this model's entries."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """List entries: id, model, tokens, bytes, schedule, last use (most recent first)."""
    from muser_cli.reuse import api  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        store = api.Store()
        entries = api.ls(model=model, store=store)
        _notes(store)
        if as_json:
            emit_json(api.listing(entries))
            return
        typer.echo(f"{'ENTRY':<12}  {'MODEL':<24} {'TOKENS':>7} {'BYTES':>10} {'CHUNK':>5} {'DTYPE':<8} LAST USE")
        for e in entries:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
            typer.echo(f"{e.id[:12]}  {e.model_name[:24]:<24} {e.tokens:>7} {_size(e.bytes):>10} {e.chunk_tokens:>5} "
                       f"{e.dtype:<8} {used}")
        info(f"reuse: {plural(len(entries), 'entry', 'entries')}, {_size(sum(e.bytes for e in entries))}")


@reuse_app.command("rm")
def rm_cmd(
    entries: List[str] = typer.Argument(None, help="Entry ids (or unique prefixes)."),
    everything: bool = typer.Option(False, "--all", help="Remove every entry."),
) -> None:
    """Remove entries from the store."""
    from muser_cli.reuse import api  # lazy: kept out of `muser --help` (startup)

    with guarded():
        gone = api.rm(entries or [], everything=everything)
        info(f"reuse: removed {plural(len(gone), 'entry', 'entries')}")


@reuse_app.command("gc")
def gc_cmd(
    max_size: Optional[str] = typer.Option(None, "--max-size", help="Evict least recently used entries down to SIZE (20G, 512M)."),
    verify: bool = typer.Option(False, "--verify", help="Re-verify every pack; remove the corrupt."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Rebuild the index from the pack files."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Sweep leftovers and orphans, optionally verify or rebuild, then evict to the size cap."""
    from muser_cli.reuse import api  # lazy: kept out of `muser --help` (startup)

    with guarded(as_json=as_json):
        store = api.Store()
        res = api.gc(max_size=max_size, verify=verify, rebuild=rebuild, store=store)
        _notes(store)
        if as_json:
            emit_json(res.to_json())
        else:
            info(f"reuse: {plural(res.entries, 'entry', 'entries')} kept, {_size(res.bytes)}; evicted "
                 f"{len(res.evicted)}, removed {len(res.removed)} broken and {plural(res.tmp_removed, 'temporary file')}")


def register(app: typer.Typer) -> None:
    app.add_typer(reuse_app, name="reuse")
