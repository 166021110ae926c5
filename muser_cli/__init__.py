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
