"""Worker for the launcher's own test: C-level writes to stdout around results.

Run as ``python worker_noisy.py PROCESS_ID PORT RESULTS``. It writes to file
descriptor 1 as gloo's C++ threads do (no Python buffer, no newline yet), so a
result printed to stdout in between would land inside that line.
"""

import json
import os
import sys

pid, results = int(sys.argv[1]), open(sys.argv[3], "w")  # noqa: SIM115 (closed at exit)
for k in range(3):
    os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. ")
    print(json.dumps({"pid": pid, "k": k}), file=results, flush=True)
    print(json.dumps({"pid": pid, "k": k}), flush=True)  # what the old launcher read
    os.write(1, b"Expected number of connected peer ranks is : 1\n")
