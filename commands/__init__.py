"""The ``muser`` command line: one thin Typer module per subcommand.

Each module in :data:`COMMAND_MODULES` defines ``register(app)``.

Where it lives and how it installs: this folder sits at the repository's root (the project's
agreed top level is pyproject.toml, muser_cli/, commands/, tests/, completions/, man/, so the
command layer is visibly apart from the library), and pyproject.toml's ``package-dir`` installs
it as ``muser_cli.commands``; no top-level ``commands`` package lands in site-packages, and all
code, tests included, imports it by that name.

What it may import (tests/test_layers.py checks it): any library module of ``muser_cli``, and
of its own folder only ``_common`` (option parsing, the one error-to-exit-status mapping, output)
and ``_examples`` (each command's examples); ``man`` also reads ``_gendocs``, where the manual
pages are made. Commands never import each other, and the library never imports a command. A
command's library imports that would slow ``muser --help`` stay inside the command's function.
"""

from __future__ import annotations

import importlib
import sys

import typer

from muser_cli.about import __version__
from muser_cli.errors import ExitStatus

COMMAND_MODULES = [
    "prefill",
    "pack",
    "verify",
    "decode",
    "send",
    "receive",
    "probe_link",
    "node",
    "reuse",
    "batch",
    "bench",
    "model",
    "man",
]

from muser_cli.commands._common import OneLineErrors, set_globals  # noqa: E402

app = typer.Typer(
    cls=OneLineErrors,
    name="muser",
    help="Move a language model's KV cache honestly: prefill here, verify and decode there.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Examples (a shell pipeline is the lane; `muser man COMMAND` has every option):\n\n"
           "  muser prefill -m default doc.txt | muser pack > doc.kvpack\n\n"
           "  muser verify -m default --prompt doc.txt doc.kvpack\n\n"
           "  muser decode -m default doc.kvpack -n 64\n\n"
           "  muser decode -m default --prompt doc.txt -n 64 < /dev/null   # no pack: local prefill, same text",
)


def _plain_flags_show_no_type() -> None:
    """Typer 0.29 writes ``<bool>`` after every on/off flag in --help (``--debug <bool>``), as if
    it took a value; a flag takes none, so its type column stays empty."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self, ctx):  # type: ignore[no-untyped-def]
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return shown(self, ctx)

    if not getattr(shown, "_muser", False):
        display_type_rich._muser = True  # type: ignore[attr-defined]
        TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_plain_flags_show_no_type()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"muser {__version__}")
        raise typer.Exit(ExitStatus.OK)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress or notes on stderr."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    set_globals(debug=debug, quiet=quiet)


for _name in COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}").register(app)


def main() -> None:
    try:
        app()
    except SystemExit as done:
        _leave_without_teardown(done.code)
        raise
    _leave_without_teardown(ExitStatus.OK)


def _leave_without_teardown(code: object) -> None:
    """A process that loaded MLX leaves by ``os._exit`` once its output is flushed: MLX's C++
    teardown at interpreter exit aborts now and then ("terminate called without an active
    exception", status -6) after its streams were used from several threads -- a served
    answer's thread, the batched decode's stepper -- although everything of muser's was
    closed and written. Measured on mlx 0.32.4: 2 of 8 ``decode --serve --engine mlx`` runs
    with four concurrent requests. Every command closes (and fsyncs) what it writes itself, so
    the interpreter's own teardown has nothing left to do for muser."""
    if "mlx.core" not in sys.modules:
        return
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a closed stream
            pass
    if code is None:
        status = int(ExitStatus.OK)
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): Python prints it and exits 1
        sys.stderr.write(f"{code}\n")
        sys.stderr.flush()
        status = int(ExitStatus.ERROR)
    os._exit(status)
