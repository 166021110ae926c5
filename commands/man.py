"""muser man: the manual pages, generated from the commands themselves (pip installs none)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from muser_cli.commands._common import guarded, info
from muser_cli.errors import UsageError
from muser_cli.fsio import write_bytes_atomic


def register(app: typer.Typer) -> None:
    @app.command("man")
    def man_cmd(
        command: Optional[str] = typer.Argument(None, help="The command whose page to show (default: muser(1))."),
        install: Optional[str] = typer.Option(None, "--install", help="Write every page into DIR/man1/ instead (e.g. ~/.local/share/man; then `man muser-decode` works where DIR is on the manual path)."),
    ) -> None:
        """Show a manual page (through `man` on a terminal, as roff on a pipe), or install them all."""
        import shutil
        import subprocess
        import sys

        from muser_cli.commands._gendocs import man_pages  # lazy: kept out of `muser --help` (startup)
        from muser_cli.paths import ensure_dir  # lazy: kept out of `muser --help` (startup)

        with guarded():
            pages = {Path(k).name: v for k, v in man_pages().items()}
            if install is not None:
                if command is not None:
                    raise UsageError("--install writes every page; give no command with it")
                folder = ensure_dir(Path(install).expanduser() / "man1", mode=0o755)
                for name, text in sorted(pages.items()):
                    write_bytes_atomic(folder / name, text.encode(), mode=0o644)
                info(f"man: {len(pages)} pages written to {folder}; `man muser` reads them where "
                     f"{folder.parent} is on the manual path (MANPATH, or ~/.local/share/man)")
                return
            name = "muser.1" if command in (None, "muser") else f"muser-{command}.1"
            if name not in pages:
                known = ", ".join(sorted(p[len("muser-"):-2] for p in pages if p != "muser.1"))
                raise UsageError(f"no manual page for {command!r}", hint=f"one of: {known}")
            text = pages[name]
            if sys.stdout.isatty() and shutil.which("man"):
                subprocess.run(["man", "-l", "-"], input=text.encode(), check=False)
                return
            sys.stdout.write(text)
            sys.stdout.flush()
