"""Run a command with this process's stdin/stdout/stderr and write its peak RSS (KiB) to a file.

    python tests/peak_rss.py OUT.txt -- muser pack ...
"""

import resource
import subprocess
import sys

out, sep, *cmd = sys.argv[1:]
assert sep == "--" and cmd
rc = subprocess.call(cmd)
with open(out, "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
