"""Start worker scripts as two real processes joined by jax.distributed (gloo)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker: Path, n: int = 2, timeout: float = 180) -> list[dict]:
    """Run ``python WORKER I PORT`` for I in 0..n-1; the JSON lines they print.

    A worker that fails, or runs past ``timeout`` seconds, fails the test (the
    others are killed): a hang never blocks the suite.
    """
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
