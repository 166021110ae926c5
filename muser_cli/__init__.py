"""muser: move a language model's KV cache honestly.

The library never prints and never exits; it raises :class:`muser_cli.errors.MuserError`
subclasses, and the command layer (``muser_cli.commands``) turns them into exit statuses.
"""

import time as _time

__version__ = "0.1.0"

#: perf_counter when muser was imported: the origin of the ``*_s`` timings that say
#: "since muser started" (``decode --json``'s first_byte_s and last_frame_s).
STARTED_AT = _time.perf_counter()
#: the same moment as a Unix time, so timings of two processes (a lane) line up.
STARTED_UNIX = _time.time()


def to_transformers(pack, model, **kw):
    """A kvpack as a transformers ``DynamicCache`` (see :mod:`muser_cli.interop.transformers`)."""
    from muser_cli.interop.transformers import to_transformers as _to

    return _to(pack, model, **kw)


def from_transformers(cache, token_ids, model, **kw):
    """A transformers ``DynamicCache`` as a kvpack (see :mod:`muser_cli.interop.transformers`)."""
    from muser_cli.interop.transformers import from_transformers as _from

    return _from(cache, token_ids, model, **kw)


def export_mlx_lm(src, out, **kw):
    """A kvpack as an mlx-lm prompt cache (see :mod:`muser_cli.interop.mlx_lm`)."""
    from muser_cli.interop.mlx_lm import export_mlx_lm as _export

    return _export(src, out, **kw)


def import_mlx_lm(src, out, **kw):
    """An mlx-lm prompt cache as a kvpack (see :mod:`muser_cli.interop.mlx_lm`)."""
    from muser_cli.interop.mlx_lm import import_mlx_lm as _import

    return _import(src, out, **kw)
