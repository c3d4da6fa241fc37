"""Start worker scripts as two real processes joined by jax.distributed (gloo)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker: Path, n: int = 2, timeout: float = 180) -> list[dict]:
    """Run ``python WORKER I PORT RESULTS`` for I in 0..n-1; the JSON lines they
    write to their RESULTS file.

    Results go to a file, not stdout: gloo's C++ threads print to the same
    stdout ("[Gloo] Rank 0 is connected ..."), unsynchronised with Python's
    writes, and one such line once split a result line in two. A worker that
    fails, or runs past ``timeout`` seconds, fails the test (the others are
    killed): a hang never blocks the suite.
    """
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"worker{i}.jsonl" for i in range(n)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), str(i), port, str(files[i])],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        try:
            for p in procs:
                _, err = p.communicate(timeout=timeout)
                assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate()  # reaps it and closes its pipes (else a warning, later)
        return [json.loads(line) for f in files for line in f.read_text().splitlines()]
