"""``tests/mpi/worker_elastic_inprocess.py`` (mode ``one``) with its victim cut off, not killed.

    mpirun --with-ft ulfm ... python worker_elastic_ulfm_cut.py OUT_DIR

The in-process worker's rank 2 kills itself (SIGKILL) at step 3. Here that call
marks ``cut`` instead (``jaxsync.cluster.mark``) and the process stays alive and
silent (it sleeps): the cluster's fault ``LinkDown(2, after="cut")`` cuts its host's
link for good, so the survivors learn of it only from a failure detector (Open MPI's
heartbeats), never from a closed connection. Everything else is that worker's.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import jaxsync.cluster

_kill = os.kill


def _cut_off(pid, sig):
    if pid == os.getpid() and sig == signal.SIGKILL:
        jaxsync.cluster.mark("cut")
        time.sleep(600)  # alive, unreachable; the run's end takes it
    _kill(pid, sig)


os.kill = _cut_off
worker = Path(__file__).resolve().parents[1] / "mpi" / "worker_elastic_inprocess.py"
sys.argv = [str(worker), *sys.argv[1:]]
runpy.run_path(str(worker), run_name="__main__")
