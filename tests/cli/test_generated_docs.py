"""Completions, man pages and docs/cli.md are generated from the app; fail when stale."""

from muser_cli.commands import _gendocs


def test_generated_files_are_current():
    stale = _gendocs.stale()
    assert not stale, f"regenerate with `python -m muser_cli.commands._gendocs`: {stale}"


def test_every_command_has_a_man_page():
    pages = _gendocs.man_pages()
    cli = _gendocs._cli()
    for name in cli.commands:
        assert f"man/muser-{name}.1" in pages
