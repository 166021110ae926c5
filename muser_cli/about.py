"""What this muser is: its version (written into every pack's header as the producer's) and the
moment it was imported (the origin of the ``*_s`` timings that say "since muser started").

A leaf: it imports nothing of muser's, so every layer may read it without an arrow back up to the
package root."""

import time as _time

__version__ = "0.1.0"

#: perf_counter when muser was imported: the origin of the ``*_s`` timings that say
#: "since muser started" (``decode --json``'s first_byte_s and last_frame_s).
STARTED_AT = _time.perf_counter()
#: the same moment as a Unix time, so timings of two processes (a lane) line up.
STARTED_UNIX = _time.time()
