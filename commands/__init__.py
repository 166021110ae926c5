"""The ``muser`` command line: one thin Typer module per subcommand.

Each module in :data:`COMMAND_MODULES` defines ``register(app)``.
Installed as ``muser_cli.commands`` (see pyproject.toml), so no top-level
``commands`` package lands in site-packages.
"""

from __future__ import annotations

import importlib

import typer

from muser_cli import __version__
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
]

from muser_cli.commands._common import OneLineErrors  # noqa: E402

app = typer.Typer(
    cls=OneLineErrors,
    name="muser",
    help="Move a language model's KV cache honestly: prefill here, verify and decode there.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


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
    from muser_cli.commands._common import set_globals

    set_globals(debug=debug, quiet=quiet)


for _name in COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}").register(app)


def main() -> None:
    app()
