"""Run a command and print its wall seconds and peak resident bytes as JSON.

    python bench/peak_rss.py [--stdout FILE] COMMAND...

Linux keeps a process's peak RSS across fork and exec, so a command started straight from a large
process (the benchmark, holding models and datasets) would report at least that process's size.
Started from this small process instead, the command's own peak is what is reported: the largest of
its processes (a launcher's workers included, since it waits for them). The command's output is
dropped, or kept in FILE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

command, kept = sys.argv[1:], os.devnull
if command[:1] == ["--stdout"]:
    kept, command = command[1], command[2:]
began = time.perf_counter()
with open(kept, "w") as stdout:
    process = subprocess.Popen(command, stdout=stdout)
    _, status, usage = os.wait4(process.pid, 0)
print(json.dumps({"seconds": time.perf_counter() - began, "peak_rss_bytes": usage.ru_maxrss * 1024}))
sys.exit(os.waitstatus_to_exitcode(status))
