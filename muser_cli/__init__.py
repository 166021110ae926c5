"""muser: move a language model's KV cache honestly.

The library never prints and never exits; it raises :class:`muser_cli.errors.MuserError`
subclasses, and the command layer (``muser_cli.commands``) turns them into exit statuses.
"""

from muser_cli.about import STARTED_AT, STARTED_UNIX, __version__  # noqa: F401 (the package's own names)


def to_transformers(pack, model, **kw):
    """A kvpack as a transformers ``DynamicCache`` (see :mod:`muser_cli.interop.transformers`)."""
    from muser_cli.interop.transformers import (
        to_transformers as _to,  # lazy: a real cycle (the package root runs before every module below it)
    )

    return _to(pack, model, **kw)


def from_transformers(cache, token_ids, model, **kw):
    """A transformers ``DynamicCache`` as a kvpack (see :mod:`muser_cli.interop.transformers`)."""
    from muser_cli.interop.transformers import (
        from_transformers as _from,  # lazy: a real cycle (the package root runs before every module below it)
    )

    return _from(cache, token_ids, model, **kw)


def export_mlx_lm(src, out, **kw):
    """A kvpack as an mlx-lm prompt cache (see :mod:`muser_cli.interop.mlx_lm`)."""
    from muser_cli.interop.mlx_lm import (
        export_mlx_lm as _export,  # lazy: a real cycle (the package root runs before every module below it)
    )

    return _export(src, out, **kw)


def import_mlx_lm(src, out, **kw):
    """An mlx-lm prompt cache as a kvpack (see :mod:`muser_cli.interop.mlx_lm`)."""
    from muser_cli.interop.mlx_lm import (
        import_mlx_lm as _import,  # lazy: a real cycle (the package root runs before every module below it)
    )

    return _import(src, out, **kw)
