"""Shared plumbing of the command layer: inputs/outputs, exit statuses, rendering.

This is the only place that turns library errors into exit statuses (docs/cli-contract.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import typer

from muser_cli.commands._examples import epilog
from muser_cli.errors import DataError, ExitStatus, MissingInput, MuserError, UsageError
from muser_cli.fsio import atomic_writer
from muser_cli.threads import default_threads  # noqa: F401  (the commands' default, re-exported)
from muser_cli.units import plural, rate_text, size_text, utc_stamp  # noqa: F401  (the commands' words for counts)

_state = {"debug": False, "quiet": False, "json_log": False}


def set_globals(*, debug: bool, quiet: bool) -> None:
    _state["debug"] = debug
    _state["quiet"] = quiet
    if not _state.get("convert_note"):
        from muser_cli.model.resolve import on_convert  # lazy: kept out of `muser --help` (startup)

        _state["convert_note"] = on_convert(ConvertNote())


def quiet() -> bool:
    return bool(_state["quiet"])


def err(message: str) -> None:
    """One line on stderr (with :func:`json_log` on: a JSON line, ``{"event": "message", "message"}``)."""
    if _state["json_log"]:
        log_json({"event": "message", "message": message.rstrip("\n")})
        return
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()


def complete_model(incomplete: str) -> list[str]:
    """Shell completion of ``-m``: the names muser knows (``muser model ls``: default,
    smollm2-135m, gemma3-270m), then the folders and ``.gguf`` files the typed path starts."""
    from muser_cli.model.resolve import NAMED_MODELS  # lazy: kept out of `muser --help` (startup)

    out = [name for name in NAMED_MODELS if name.startswith(incomplete)]
    head, _, stem = incomplete.rpartition("/")
    folder = Path(os.path.expanduser(head + "/" if head else "."))
    try:
        entries = sorted(folder.iterdir())
    except OSError:  # no such folder (yet), not readable: only the names
        return out
    for entry in entries:
        if not entry.name.startswith(stem) or (entry.name.startswith(".") and not stem.startswith(".")):
            continue
        typed = f"{head}/{entry.name}" if head else entry.name
        if entry.is_dir():
            out.append(typed + "/")
        elif entry.name.endswith(".gguf"):
            out.append(typed)
    return out


def log_json(record: dict[str, Any]) -> None:
    """One JSON line on stderr, with its UTC ``ts`` (a service's log line)."""
    sys.stderr.write(json.dumps({"ts": utc_stamp(), **record}, sort_keys=True, default=str) + "\n")
    sys.stderr.flush()


def json_log() -> None:
    """A service run with ``--json``: from now on every stderr line is a JSON object (a log
    shipper reads them), the notes, warnings and errors that are text lines elsewhere included:
    a note is ``{"event": "message", "message"}``, a Python warning ``{"event": "warning"}``, an
    error ``{"event": "error", "error", "hint", "exit_status"}``."""
    import warnings

    _state["json_log"] = True

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' hook
        log_json({"event": "warning", "warning": f"{category.__name__}: {message}", "where": f"{filename}:{lineno}"})

    warnings.showwarning = show


def info(message: str) -> None:
    if not _state["quiet"]:
        err(message)


def trouble_line(who: str, kind: str, f: dict) -> str | None:
    """The line of a listener's ``error`` event (a connection thread that failed) or ``warning``
    event (bookkeeping that failed, an event callback that raised), so neither goes unread."""
    if kind == "error":
        return f"{who}: error: a connection from {f.get('peer') or '?'} failed: {f.get('error', '')}"
    if kind == "warning":
        return f"{who}: warning: {f.get('warning', '')}"
    return None


def fail(exc: BaseException, *, as_json: bool = False) -> "typer.Exit":
    """Report ``exc`` as one line (plus hint) and return the Exit to raise."""
    if isinstance(exc, MuserError):
        status = exc.exit_status
        message = str(exc)
        hint = exc.hint
    elif isinstance(exc, KeyboardInterrupt):
        status, message, hint = ExitStatus.INTERRUPTED, "interrupted", None
    elif isinstance(exc, BrokenPipeError):
        status, message, hint = ExitStatus.ERROR, "broken pipe: the reader went away", None
    elif isinstance(exc, OSError):
        status, message, hint = _os_error(exc)
    elif isinstance(exc, MemoryError):
        status, message, hint = ExitStatus.ERROR, "out of memory", "free memory, or use a smaller input or model"
    else:
        status = ExitStatus.ERROR
        message = f"internal error: {type(exc).__name__}: {exc}"
        hint = "rerun with --debug for a traceback, and please report it"
    line = f"muser: error: {message}"
    if hint:
        line += f" (hint: {hint})"
    if _state["json_log"]:
        log_json({"event": "error", "error": message, "hint": hint, "exit_status": int(status)})
    else:
        err(line)
    if _state["debug"]:
        traceback.print_exception(exc)
    if as_json:
        emit_json({"ok": False, "error": message, "hint": hint, "exit_status": status})
    return typer.Exit(status)


def _os_error(exc: OSError) -> tuple[int, str, str | None]:
    """An OS error no library layer named: one line with the file and reason, never 'internal error'."""
    import errno

    what = exc.strerror or str(exc) or type(exc).__name__
    where = f": {exc.filename}" if exc.filename else ""
    if isinstance(exc, FileNotFoundError):
        return MissingInput.exit_status, f"no such file or folder{where}", None
    if isinstance(exc, PermissionError):
        return ExitStatus.ERROR, f"permission denied{where}", None
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return ExitStatus.ERROR, f"no space left on device{where}", "free some space and rerun"
    return ExitStatus.ERROR, f"I/O error: {what}{where}", None


@contextmanager
def guarded(*, as_json: bool = False) -> Iterator[None]:
    """Run a command body; map any error to its exit status with a one-line message."""
    try:
        yield
    except typer.Exit:
        raise
    except BaseException as exc:  # noqa: BLE001 - this is the one mapping point
        if isinstance(exc, SystemExit):
            raise
        raise fail(exc, as_json=as_json) from None


def emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def _input_file(path: str) -> Path:
    """``path`` as an input file: MissingInput when there is none, UsageError for a directory."""
    p = Path(path)
    if not p.exists():
        raise MissingInput(f"no such file: {path}")
    if p.is_dir():
        raise UsageError(f"{path} is a directory, not a file")
    return p


def open_input(path: str | None) -> BinaryIO:
    """Open a binary input: a file path, or stdin for ``-``/None."""
    if path in (None, "-"):
        return sys.stdin.buffer
    p = _input_file(path)
    try:
        return open(p, "rb")
    except PermissionError:
        raise MissingInput(f"cannot read {path}: permission denied") from None


def read_text_input(path: str | None) -> str:
    if path in (None, "-"):
        data = sys.stdin.buffer.read()
    else:
        p = _input_file(path)
        try:
            data = p.read_bytes()
        except PermissionError:
            raise MissingInput(f"cannot read {path}: permission denied") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"prompt is not UTF-8 text (byte {exc.start})") from None


def binary_stdout() -> BinaryIO:
    """stdout for binary data; refuses a terminal."""
    if sys.stdout.isatty():
        raise UsageError(
            "refusing to write binary data to a terminal",
            hint="redirect to a file or pipe, or use -o FILE",
        )
    return sys.stdout.buffer


@contextmanager
def binary_output(path: str | None) -> Iterator[BinaryIO]:
    """A binary output: ``-``/None is stdout (not a terminal); a path is written atomically."""
    if path in (None, "-"):
        out = binary_stdout()
        yield out
        out.flush()
        end_stdout()
        return

    with atomic_writer(Path(path)) as handle:
        yield handle


def end_stdout() -> None:
    """The kvpack on stdout is complete: close the pipe now, so the next stage sees its end
    at once instead of when this process has finished tearing down (seconds with torch
    loaded). Later writes to stdout go to /dev/null."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def progress_callback() -> Callable[[str, int, int], None] | None:
    """A rich progress callback on stderr, only when stderr is a terminal and not --quiet."""
    if _state["quiet"] or not sys.stderr.isatty():
        return None
    from rich.console import Console

    console = Console(stderr=True)
    last = {"stage": None}

    def report(stage: str, done: int, total: int) -> None:
        if stage != last["stage"] or done == total or done % 4 == 0:
            console.print(f"[dim]{stage}[/dim] {done}/{total}", end="\r")
            last["stage"] = stage
        if done >= total:
            console.print("")

    return report


class ConvertNote:
    """One stderr line for a model's one-time GGUF conversion (``models.on_convert``): on a
    terminal a spinner with the seconds so far, else the line is finished when it is done.
    Nothing under --quiet; later runs convert nothing and so print nothing."""

    SPIN = "|/-\\"

    def __init__(self) -> None:
        self.head: str | None = None
        self.stop: Any = None
        self.thread: Any = None

    def __call__(self, event: str, fields: dict) -> None:
        if event == "start":
            self.begin(fields)
        elif event == "wait":
            self.begin(fields, waiting=True)
        elif self.head is not None:
            self.end(event, fields)

    def begin(self, fields: dict, *, waiting: bool = False) -> None:
        if _state["quiet"]:
            return
        from muser_cli.model.resolve import DEFAULT_GGUF  # lazy: kept out of `muser --help` (startup)

        name = Path(fields["source"]).name
        about = ", about 20-45 s" if name == DEFAULT_GGUF else ""
        if waiting:  # another process holds the conversion's lock: its result is ours
            self.head, tail = f"muser: another process is converting {name}; waiting for it", " ..."
        else:
            self.head, tail = f"muser: converting {name} once{about}", " (later runs skip this) ..."
        if _state["json_log"]:  # one JSON line at the end
            return
        if not sys.stderr.isatty():
            sys.stderr.write(self.head + tail)
            sys.stderr.flush()
            return
        import threading
        import time

        self.stop = threading.Event()
        started = time.monotonic()

        def spin() -> None:
            turn = 0
            while not self.stop.wait(0.25):
                self.show(f"{self.SPIN[turn % 4]} {time.monotonic() - started:.0f} s")
                turn += 1

        self.show("")
        self.thread = threading.Thread(target=spin, name="muser-convert-note", daemon=True)
        self.thread.start()

    def show(self, tail: str) -> None:
        import shutil

        room = shutil.get_terminal_size((80, 24)).columns - 2 - len(tail)  # one line, or \r cannot redraw it
        sys.stderr.write("\r\x1b[K" + f"{self.head[:max(room, 0)]} {tail}".rstrip())
        sys.stderr.flush()

    def end(self, event: str, fields: dict) -> None:
        word = {"done": "done", "waited": "ready"}.get(event, "failed")
        outcome = f"{word} in {fields.get('seconds', 0):.0f} s"
        if _state["json_log"]:
            err(f"{self.head}: {outcome}")
            self.head = None
            return
        if self.stop is not None:
            self.stop.set()
            self.thread.join(timeout=1)
            sys.stderr.write(f"\r\x1b[K{self.head}: {outcome}\n")  # the last redraw: it may wrap
        else:
            sys.stderr.write(f" {outcome}\n")
        sys.stderr.flush()
        self.head = self.stop = None


# --------------------------------------------------------------------------- usage errors
def _command_path(ctx: Any) -> str:
    """``muser decode`` (however the program was started: console script or ``python -m``)."""
    names: list[str] = []
    while ctx is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    names.reverse()
    return " ".join(["muser", *[n for n in names[1:] if n]])


def _path_from_args(root: Any, args: list[str]) -> str:
    """The subcommand path the arguments name (for errors raised without a context)."""
    names, cmd = ["muser"], root
    for token in args:
        if token.startswith("-"):
            continue  # the root's own options take no values
        sub = getattr(cmd, "commands", {}).get(token)
        if sub is None:
            break
        names.append(token)
        cmd = sub
    return " ".join(names)


def usage_line(exc: Any, *, root: Any = None, args: list[str] | None = None) -> str:
    """One line for a click usage error: the message and a hint naming the command's --help."""
    message = " ".join(str(exc.format_message()).split())  # click messages may span lines
    ctx = getattr(exc, "ctx", None)
    path = _command_path(ctx) if ctx is not None else "muser"
    if path == "muser" and root is not None and args:
        path = _path_from_args(root, args)
    return f"muser: error: {message} (hint: {path} --help)"


def _click_classes(name: str) -> tuple[type, ...]:
    """``name`` from Typer's own click (typer >= 0.20 vendors it as ``typer._click``) and from click."""
    import importlib

    found = []
    for module in ("typer._click.exceptions", "click.exceptions", "typer.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def _set_quiet(ctx: Any, param: Any, value: bool) -> bool:
    if value:
        _state["quiet"] = True
    return value


def paragraphs(text: str | None) -> str | None:
    """Help text as paragraphs: a docstring's hard line breaks inside a paragraph become spaces
    (Rich would otherwise keep them and wrap each line again, breaking sentences mid-way);
    blank lines still separate paragraphs, and one that starts with ``\\b`` is kept as written."""
    if not text:
        return text
    import inspect

    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        out.append(para.lstrip("\b").strip("\n") if para.startswith("\b") else " ".join(para.split()))
    return "\n\n".join(p for p in out if p)


def _finish_commands(group: Any) -> None:
    """Every command's help as paragraphs, its examples as the epilog (:mod:`muser_cli.commands._examples`), and
    ``-q/--quiet`` after the subcommand too (``muser decode -q ...``): a copy of the root's option."""
    import copy


    root = next((p for p in group.params if p.name == "quiet"), None)

    def walk(cmd: Any, path: str) -> None:
        cmd.help = paragraphs(cmd.help)
        cmd.epilog = cmd.epilog or epilog(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())
        taken = {name for p in cmd.params for name in getattr(p, "opts", [])}
        if root is not None and cmd is not group and not getattr(cmd, "commands", None) and not {"-q", "--quiet"} & taken:
            option = copy.copy(root)
            option.expose_value, option.is_eager, option.callback = False, True, _set_quiet
            cmd.params.append(option)

    walk(group, "")


def _one_line_group_class():
    from typer.core import TyperGroup

    no_args = _click_classes("NoArgsIsHelpError")
    usage = _click_classes("UsageError")
    click_error = _click_classes("ClickException")
    abort = _click_classes("Abort")

    class OneLineErrors(TyperGroup):
        """The root command: click's usage errors as one line plus a ``--help`` hint, exit 2.

        Runs click in non-standalone mode and renders what it raises itself, so an unknown
        option or a missing argument never prints click's framed usage panel."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            _finish_commands(self)

        def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
            if not standalone_mode:
                return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            try:
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            except BaseException as exc:  # noqa: BLE001 - only click's own kinds are rendered here
                if no_args and isinstance(exc, no_args):  # `muser` / `muser reuse` alone: the help
                    exc.show()
                    sys.exit(exc.exit_code)
                if usage and isinstance(exc, usage):
                    err(usage_line(exc, root=self, args=list(sys.argv[1:] if args is None else args)))
                    sys.exit(exc.exit_code)
                if click_error and isinstance(exc, click_error):
                    err(f"muser: error: {' '.join(str(exc.format_message()).split())}")
                    sys.exit(exc.exit_code)
                if abort and isinstance(exc, abort):
                    err("muser: error: aborted")
                    sys.exit(ExitStatus.ERROR)
                raise
            sys.exit(rv if isinstance(rv, int) else ExitStatus.OK)

    return OneLineErrors


OneLineErrors = _one_line_group_class()


# --- SIGTERM and SIGHUP for the resident commands (`receive --listen`, `prefill --serve`).
# The first one asks the command to drain: accept nothing new, finish what is in flight,
# print one summary line and exit 0. Its handler then restores the default action, so a
# second SIGTERM or SIGHUP ends the process at once (143 or 129), as an operator expects.
# A signal the process was started ignoring (SIGHUP under `nohup`) stays ignored.

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def drain_on_signals(on_signal=None) -> tuple[threading.Event, dict[str, str]]:
    """An event the first SIGTERM or SIGHUP sets; ``got["signal"]`` then names it, and
    ``on_signal(name)`` (a service's "draining" line) is called once."""
    stop = threading.Event()
    got: dict[str, str] = {}

    def handler(signum: int, _frame) -> None:
        got.setdefault("signal", signal.Signals(signum).name)
        if on_signal is not None and not stop.is_set():
            on_signal(got["signal"])
        stop.set()
        for s in DRAIN_SIGNALS:  # a second one: the default action, at once
            signal.signal(s, signal.SIG_DFL)

    for s in DRAIN_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:  # `nohup muser ...` keeps ignoring SIGHUP
            signal.signal(s, handler)
    return stop, got
