"""Elastic training: survive a lost rank or host (``python -m jaxsync elastic``).

Two paths, docs/elastic.md ("When a host is lost"):

* the supervisor (any MPI, the mpich wheel included): ``python -m jaxsync elastic
  --min-np A --max-np B -- python train.py`` runs the job under mpirun and, when it
  fails, restarts it on the capacity left from the training script's last checkpoint;
  the script reads :func:`world` (restart count, world size) from the environment;
* in-process recovery with ULFM (Open MPI 5's ``mpirun --with-ft ulfm``):
  :func:`ulfm_status` says whether the MPI that jaxsync links can recover in process;
  :func:`run` and :class:`State` recover on the survivors (``comm="auto"`` follows
  them; ``sharded`` state is kept by a ring copy, :class:`SlicesLost` when two
  neighbours are lost together); docs/elastic.md says what is not covered yet.

Not imported by ``import jaxsync``; imports only the standard library at import time.
"""

from __future__ import annotations

from ._run import State, run
from ._shards import SlicesLost
from ._supervise import ElasticWorld, world
from ._ulfm import ulfm_status

__all__ = ["ElasticWorld", "SlicesLost", "State", "run", "ulfm_status", "world"]
