"""Shared set-up of the single-process test modules (8 fake devices, see conftest).

Reliability rows. Test comments cite "row N" of this table (it replaces a
design document that is not part of the repository):

====  ==========================================================  =========================
row   requirement                                                 tests
====  ==========================================================  =========================
1     processes with different tree structures: the same error    mpi/worker_agree.py
2     ... different leaf shapes: the same error, naming the leaf  mpi/worker_agree.py
3     ... different dtypes or options: the same error             mpi/worker_agree.py
4     tracing on one process never blocks (agreement in-step)     mpi/worker_harden.py
5     float0 leaves pass through a sync                           test_transforms.py
6     unbound or missing mapped axes raise at trace time          test_transforms.py,
                                                                  test_harden.py
7     bad arguments raise at factory time, naming the argument,   test_transforms.py,
      what was expected, what was given and a fix                 test_harden.py
8     a wrong optimizer state raises a TypeError                  test_transforms.py
9     a process that dies ends the job (no hang)                  mpi/worker_death.py
10    a straggler is reported by the watchdog; result unchanged   mpi/worker_watchdog.py
11    exit right after dispatching syncs is clean (device and     mpi/worker_death.py,
      host staging; communicators freed, watchdogs stopped)       mpi/worker_harden.py
12    many buckets and several syncs in one step: no deadlock,    test_strategies.py,
      no recompilation                                            mpi/worker_buckets.py
13    integer-valued gradients: exact closed form                 test_strategies.py,
                                                                  mpi/worker_exact.py
14    random data within a ULP bound of a float64 reference;      test_strategies.py,
      MPI and mesh backends bitwise equal                         mpi/test_mpi.py
15    determinism: replicas and reruns bit-identical              test_strategies.py
16    float16 overflow avoided by the predivide                   test_transforms.py,
                                                                  mpi/worker_harden.py
17    NaN/Inf on one replica; check_finite                        test_transforms.py,
                                                                  mpi/worker_harden.py
18    eager == jit                                                test_transforms.py
====  ==========================================================  =========================
"""

import jax
import numpy as np
from jax.sharding import Mesh

N = 8
STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node"]
INTER = [s for s in STRATEGIES if s != "single_node"]  # have an inter-process stage
MESH1 = Mesh(np.array(jax.devices()[:N]), ("i",))
MESH2 = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("host", "local"))
HL = ("host", "local")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The raw bits of an array, for bitwise comparisons."""
    a = np.asarray(x)
    return a.view(_UINT[a.dtype.itemsize])
