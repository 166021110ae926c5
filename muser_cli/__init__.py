"""muser: move a language model's KV cache honestly.

The library never prints and never exits; it raises :class:`muser_cli.errors.MuserError`
subclasses, and the command layer (``muser_cli.commands``) turns them into exit statuses.
"""

__version__ = "0.1.0"
