"""Run a command and print its wall seconds and peak resident bytes as JSON.

    python bench/peak_rss.py COMMAND...

Linux keeps a process's peak RSS across fork and exec, so a command started straight from a large
process (the benchmark, holding models and datasets) would report at least that process's size.
Started from this small process instead, the command's own peak is what is reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

began = time.perf_counter()
process = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(process.pid, 0)
print(json.dumps({"seconds": time.perf_counter() - began, "peak_rss_bytes": usage.ru_maxrss * 1024}))
sys.exit(os.waitstatus_to_exitcode(status))
